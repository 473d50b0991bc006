//! Hydra's float `range()` steps in Python `decimal` (28 significant digits, half-even); this replays it.

use std::cmp::Ordering;

/// Python's default decimal context precision.
const PRECISION: usize = 28;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RangeError {
    ZeroStep,
    NonFinite,
    TooLong,
}

/// `list(FloatRange(start, stop, step))` as Hydra computes it, or an error instead of an endless loop.
pub(super) fn float_range(
    start: f64,
    stop: f64,
    step: f64,
    max_len: usize,
) -> Result<Vec<f64>, RangeError> {
    if !(start.is_finite() && stop.is_finite() && step.is_finite()) {
        return Err(RangeError::NonFinite);
    }
    let ascending = match step.partial_cmp(&0.0) {
        Some(Ordering::Greater) => true,
        Some(Ordering::Less) => false,
        _ => return Err(RangeError::ZeroStep),
    };
    // Refuse hopeless ranges up front instead of stepping a million times in big decimals.
    if (stop - start) / step > max_len as f64 {
        return Err(RangeError::TooLong);
    }
    let (stop, step) = (Dec::exact(stop), Dec::exact(step));
    let mut cur = Dec::exact(start);
    let mut out = Vec::new();
    loop {
        let go_on = if ascending {
            cur.cmp(&stop) == Ordering::Less
        } else {
            cur.cmp(&stop) == Ordering::Greater
        };
        if !go_on {
            return Ok(out);
        }
        if out.len() >= max_len {
            return Err(RangeError::TooLong);
        }
        out.push(cur.to_f64());
        cur = cur.add(&step).rounded();
    }
}

/// `±digits × 10^exp`; `digits` most significant first, without leading zeros (empty for zero).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dec {
    negative: bool,
    digits: Vec<u8>,
    exp: i64,
}

impl Dec {
    /// The exact decimal value of a finite double (as Python's `Decimal(float)`).
    fn exact(v: f64) -> Dec {
        // 1100 fractional digits hold every double's exact expansion (at most 767 significant digits).
        let text = format!("{:.1100e}", v.abs());
        let (mantissa, exp) = text.split_once('e').unwrap_or((&text, "0"));
        let exp: i64 = exp.parse().unwrap_or(0);
        let digits: Vec<u8> = mantissa
            .bytes()
            .filter(u8::is_ascii_digit)
            .map(|b| b - b'0')
            .collect();
        let exp = exp - (digits.len() as i64 - 1);
        Dec {
            negative: v.is_sign_negative(),
            digits,
            exp,
        }
        .normalized()
    }

    fn normalized(mut self) -> Dec {
        let lead = self.digits.iter().take_while(|d| **d == 0).count();
        self.digits.drain(..lead);
        while self.digits.last() == Some(&0) {
            self.digits.pop();
            self.exp += 1;
        }
        if self.digits.is_empty() {
            self.negative = false;
            self.exp = 0;
        }
        self
    }

    /// The digits scaled to exponent `exp` (which must not exceed `self.exp`).
    fn scaled(&self, exp: i64) -> Vec<u8> {
        let mut d = self.digits.clone();
        d.extend(std::iter::repeat_n(0, (self.exp - exp) as usize));
        d
    }

    fn cmp_magnitude(&self, other: &Dec) -> Ordering {
        match (self.digits.is_empty(), other.digits.is_empty()) {
            (true, true) => return Ordering::Equal,
            (true, false) => return Ordering::Less,
            (false, true) => return Ordering::Greater,
            _ => {}
        }
        let adjusted = |d: &Dec| d.exp + d.digits.len() as i64;
        adjusted(self).cmp(&adjusted(other)).then_with(|| {
            let n = self.digits.len().max(other.digits.len());
            let at = |d: &Dec, i: usize| d.digits.get(i).copied().unwrap_or(0);
            (0..n)
                .map(|i| at(self, i).cmp(&at(other, i)))
                .find(|o| *o != Ordering::Equal)
                .unwrap_or(Ordering::Equal)
        })
    }

    fn cmp(&self, other: &Dec) -> Ordering {
        match (self.negative, other.negative) {
            (false, true) => Ordering::Greater,
            (true, false) => Ordering::Less,
            (false, false) => self.cmp_magnitude(other),
            (true, true) => other.cmp_magnitude(self),
        }
    }

    /// The exact sum.
    fn add(&self, other: &Dec) -> Dec {
        let exp = self.exp.min(other.exp);
        let (a, b) = (self.scaled(exp), other.scaled(exp));
        if self.negative == other.negative {
            return Dec {
                negative: self.negative,
                digits: add_digits(&a, &b),
                exp,
            }
            .normalized();
        }
        let (big, small, negative) = match self.cmp_magnitude(other) {
            Ordering::Less => (b, a, other.negative),
            _ => (a, b, self.negative),
        };
        Dec {
            negative,
            digits: sub_digits(&big, &small),
            exp,
        }
        .normalized()
    }

    /// Rounded to the context precision, half to even.
    fn rounded(mut self) -> Dec {
        if self.digits.len() <= PRECISION {
            return self;
        }
        let dropped = self.digits.split_off(PRECISION);
        self.exp += dropped.len() as i64;
        let first = dropped[0];
        let rest_nonzero = dropped[1..].iter().any(|d| *d != 0);
        let last_odd = self.digits.last().is_some_and(|d| d % 2 == 1);
        if first > 5 || (first == 5 && (rest_nonzero || last_odd)) {
            self.digits = add_digits(&self.digits, &[1]);
        }
        self.normalized()
    }

    fn to_f64(&self) -> f64 {
        if self.digits.is_empty() {
            return 0.0;
        }
        let digits: String = self.digits.iter().map(|d| char::from(b'0' + d)).collect();
        let sign = if self.negative { "-" } else { "" };
        format!("{sign}{digits}e{}", self.exp)
            .parse()
            .unwrap_or(f64::NAN)
    }
}

fn add_digits(a: &[u8], b: &[u8]) -> Vec<u8> {
    let n = a.len().max(b.len());
    let at = |d: &[u8], i: usize| if i < d.len() { d[d.len() - 1 - i] } else { 0 };
    let mut out = Vec::with_capacity(n + 1);
    let mut carry = 0;
    for i in 0..n {
        let s = at(a, i) + at(b, i) + carry;
        out.push(s % 10);
        carry = s / 10;
    }
    if carry > 0 {
        out.push(carry);
    }
    out.reverse();
    out
}

/// `a - b` for `a >= b`, both aligned to the same exponent.
fn sub_digits(a: &[u8], b: &[u8]) -> Vec<u8> {
    let at = |d: &[u8], i: usize| if i < d.len() { d[d.len() - 1 - i] } else { 0 };
    let mut out = Vec::with_capacity(a.len());
    let mut borrow = 0;
    for i in 0..a.len() {
        let (x, y) = (at(a, i), at(b, i) + borrow);
        if x >= y {
            out.push(x - y);
            borrow = 0;
        } else {
            out.push(x + 10 - y);
            borrow = 1;
        }
    }
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_expansion_of_a_double() {
        let d = Dec::exact(0.1);
        let digits: String = d.digits.iter().map(|x| char::from(b'0' + x)).collect();
        assert_eq!(
            digits,
            "1000000000000000055511151231257827021181583404541015625"
        );
        assert_eq!(d.exp, -55);
        assert_eq!(Dec::exact(0.0).digits, Vec::<u8>::new());
        assert_eq!(Dec::exact(-2.5).to_f64(), -2.5);
    }

    #[test]
    fn matches_python_decimal_ranges() {
        // Each expectation printed by Python: list(hydra.core.override_parser.types.FloatRange(...)).
        let cases: [(f64, f64, f64, &[f64]); 4] = [
            (
                0.0,
                1.0,
                0.1,
                &[
                    0.0,
                    0.1,
                    0.2,
                    0.3,
                    0.4,
                    0.5,
                    0.6,
                    0.7000000000000001,
                    0.8,
                    0.9,
                ],
            ),
            (1.5, -0.5, -0.5, &[1.5, 1.0, 0.5, 0.0]),
            (0.1, 0.5, 0.1, &[0.1, 0.2, 0.30000000000000004, 0.4]),
            (
                1e20,
                1e20 + 1e6,
                1.5e5,
                &[
                    1e20,
                    1.0000000000000015e20,
                    1.000000000000003e20,
                    1.0000000000000044e20,
                    1.000000000000006e20,
                    1.0000000000000075e20,
                    1.000000000000009e20,
                ],
            ),
        ];
        for (start, stop, step, want) in cases {
            assert_eq!(
                float_range(start, stop, step, 1000).as_deref(),
                Ok(want),
                "range({start}, {stop}, {step})"
            );
        }
        let tiny = float_range(1e-30, 1e-29, 1e-31, 1000).unwrap_or_default();
        assert_eq!(
            &tiny[..4],
            &[
                1e-30,
                1.1000000000000001e-30,
                1.2000000000000001e-30,
                1.3000000000000001e-30
            ]
        );
    }

    #[test]
    fn degenerate_ranges() {
        assert_eq!(float_range(0.0, 1.0, 0.0, 10), Err(RangeError::ZeroStep));
        assert_eq!(
            float_range(0.0, f64::INFINITY, 1.0, 10),
            Err(RangeError::NonFinite)
        );
        assert_eq!(float_range(0.0, 100.0, 1.0, 10), Err(RangeError::TooLong));
        assert_eq!(float_range(1.0, 0.0, 0.5, 10), Ok(vec![]));
    }
}
