//! Sweep values (`a=1,2`, `choice`, `range`, `interval`, `glob`) and their enumeration for `--multirun`.

use std::collections::BTreeSet;

use rand::seq::SliceRandom;

use super::OverrideError;
use super::decimal;
use super::element::Element;
use crate::node::python_float_repr;
use crate::scalar::Scalar;

/// Most values a `range()` may enumerate; Python would happily try more, and never finish.
pub const MAX_RANGE_LEN: usize = 1_000_000;

/// A Python number as `range()` and `interval()` hold it (bools are ints there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    Int(i64),
    Float(f64),
}

impl Number {
    pub fn as_f64(self) -> f64 {
        match self {
            Number::Int(i) => i as f64,
            Number::Float(f) => f,
        }
    }

    /// Python's `str()` of the number.
    pub fn python_str(self) -> String {
        match self {
            Number::Int(i) => i.to_string(),
            Number::Float(f) => python_float_repr(f),
        }
    }

    pub(super) fn add(self, other: Number) -> Number {
        match (self, other) {
            (Number::Int(a), Number::Int(b)) => a
                .checked_add(b)
                .map_or(Number::Float(a as f64 + b as f64), Number::Int),
            (a, b) => Number::Float(a.as_f64() + b.as_f64()),
        }
    }

    pub(super) fn sub(self, other: Number) -> Number {
        self.add(other.neg())
    }

    pub(super) fn neg(self) -> Number {
        match self {
            Number::Int(i) => i
                .checked_neg()
                .map_or(Number::Float(-(i as f64)), Number::Int),
            Number::Float(f) => Number::Float(-f),
        }
    }

    pub(super) fn abs(self) -> Number {
        if self.lt(Number::Int(0)) {
            self.neg()
        } else {
            self
        }
    }

    pub(super) fn lt(self, other: Number) -> bool {
        match (self, other) {
            (Number::Int(a), Number::Int(b)) => a < b,
            (a, b) => a.as_f64() < b.as_f64(),
        }
    }
}

/// `choice(a,b)` or the simple form `a,b`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceSweep {
    pub items: Vec<Element>,
    /// `a,b` rather than `choice(a,b)`: without `--multirun` Hydra calls it ambiguous.
    pub simple_form: bool,
    pub shuffle: bool,
    pub tags: BTreeSet<String>,
    /// Python type name of a sweep given as an item (`1,choice(2,3)`): Hydra parses it and refuses it
    /// without `--multirun`, but cannot enumerate it. Such items are not in `items`; `expand` fails.
    pub nested_sweep: Option<&'static str>,
}

/// `range(start, stop, step)`: ints when all three are ints, else floats stepped in decimal.
#[derive(Debug, Clone, PartialEq)]
pub struct RangeSweep {
    pub start: Number,
    pub stop: Number,
    pub step: Number,
    pub shuffle: bool,
    pub tags: BTreeSet<String>,
}

/// `interval(start, end)`: a continuous range, only for sweepers that sample.
#[derive(Debug, Clone, PartialEq)]
pub struct IntervalSweep {
    pub start: Number,
    pub end: Number,
    pub tags: BTreeSet<String>,
}

/// `glob(include, exclude)`: the options of a config group that match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobSweep {
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Sweep {
    Choice(ChoiceSweep),
    Range(RangeSweep),
    Interval(IntervalSweep),
    Glob(GlobSweep),
}

impl Sweep {
    /// `a=1,2` (Hydra's `SIMPLE_CHOICE_SWEEP`).
    pub fn is_simple_choice(&self) -> bool {
        matches!(self, Sweep::Choice(c) if c.simple_form)
    }

    /// Hydra's `ValueType` name of the sweep.
    pub fn value_type_name(&self) -> &'static str {
        match self {
            Sweep::Choice(c) if c.simple_form => "SIMPLE_CHOICE_SWEEP",
            Sweep::Choice(_) => "CHOICE_SWEEP",
            Sweep::Range(_) => "RANGE_SWEEP",
            Sweep::Interval(_) => "INTERVAL_SWEEP",
            Sweep::Glob(_) => "GLOB_CHOICE_SWEEP",
        }
    }

    pub fn tags(&self) -> Option<&BTreeSet<String>> {
        match self {
            Sweep::Choice(c) => Some(&c.tags),
            Sweep::Range(r) => Some(&r.tags),
            Sweep::Interval(i) => Some(&i.tags),
            Sweep::Glob(_) => None,
        }
    }

    /// The values a `--multirun` sweeps over, as Hydra's basic sweeper enumerates them. `group_options`
    /// are the options of the config group the override names (`None` when it names no group: a glob
    /// then matches nothing, as in Hydra). Shuffled sweeps come out in a random order.
    pub fn expand(&self, group_options: Option<&[String]>) -> Result<Vec<Element>, OverrideError> {
        match self {
            Sweep::Choice(c) => {
                if let Some(sweep_type) = c.nested_sweep {
                    return Err(OverrideError::NestedSweepInChoice { sweep_type });
                }
                let mut items = c.items.clone();
                if c.shuffle {
                    items.shuffle(&mut rand::thread_rng());
                }
                Ok(items)
            }
            Sweep::Range(r) => {
                let mut items = expand_range(r)?;
                if r.shuffle {
                    items.shuffle(&mut rand::thread_rng());
                }
                Ok(items)
            }
            Sweep::Interval(_) => Err(OverrideError::IntervalNotEnumerable),
            Sweep::Glob(g) => {
                let options = group_options.unwrap_or_default();
                Ok(g.filter(options).into_iter().map(Element::str).collect())
            }
        }
    }
}

impl GlobSweep {
    /// The names that match an include pattern and no exclude pattern (Python's `fnmatch`).
    pub fn filter(&self, names: &[String]) -> Vec<String> {
        let matches_any = |name: &str, globs: &[String]| globs.iter().any(|g| fnmatch(name, g));
        names
            .iter()
            .filter(|n| matches_any(n, &self.include) && !matches_any(n, &self.exclude))
            .cloned()
            .collect()
    }
}

fn expand_range(r: &RangeSweep) -> Result<Vec<Element>, OverrideError> {
    match (r.start, r.stop, r.step) {
        (Number::Int(start), Number::Int(stop), Number::Int(step)) => {
            if step == 0 {
                return Err(OverrideError::ZeroIntRangeStep);
            }
            let span = if step > 0 {
                i128::from(stop) - i128::from(start)
            } else {
                i128::from(start) - i128::from(stop)
            };
            let step_abs = i128::from(step).abs();
            let len = if span <= 0 {
                0
            } else {
                (span + step_abs - 1) / step_abs
            };
            if len > MAX_RANGE_LEN as i128 {
                return Err(OverrideError::RangeTooLong {
                    limit: MAX_RANGE_LEN,
                });
            }
            Ok((0..len)
                .map(|k| {
                    Element::Scalar(Scalar::Int(
                        (i128::from(start) + k * i128::from(step)) as i64,
                    ))
                })
                .collect())
        }
        (start, stop, step) => {
            let names = || (start.python_str(), stop.python_str(), step.python_str());
            let values =
                decimal::float_range(start.as_f64(), stop.as_f64(), step.as_f64(), MAX_RANGE_LEN);
            match values {
                Ok(v) => Ok(v
                    .into_iter()
                    .map(|f| Element::Scalar(Scalar::Float(f)))
                    .collect()),
                Err(decimal::RangeError::ZeroStep) => {
                    let (start, stop, step) = names();
                    Err(OverrideError::ZeroFloatRangeStep { start, stop, step })
                }
                Err(decimal::RangeError::NonFinite) => {
                    let (start, stop, step) = names();
                    Err(OverrideError::NonFiniteRange { start, stop, step })
                }
                Err(decimal::RangeError::TooLong) => Err(OverrideError::RangeTooLong {
                    limit: MAX_RANGE_LEN,
                }),
            }
        }
    }
}

/// Python's `fnmatch.fnmatch` on POSIX: `*`, `?`, `[seq]`, `[!seq]`, case-sensitive.
pub(super) fn fnmatch(name: &str, pattern: &str) -> bool {
    let name: Vec<char> = name.chars().collect();
    let pattern: Vec<char> = pattern.chars().collect();
    // Iterative matcher with one backtrack point for the last `*` (no exponential blow-up).
    let (mut n, mut p) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, n));
                p += 1;
                continue;
            }
            Some('?') => {
                n += 1;
                p += 1;
                continue;
            }
            Some('[') => {
                if let Some((matched, next_p)) = match_class(&pattern, p, name[n]) {
                    if matched {
                        n += 1;
                        p = next_p;
                        continue;
                    }
                } else if name[n] == '[' {
                    n += 1;
                    p += 1;
                    continue;
                }
            }
            Some(&c) if c == name[n] => {
                n += 1;
                p += 1;
                continue;
            }
            _ => {}
        }
        match star {
            Some((sp, sn)) => {
                p = sp + 1;
                n = sn + 1;
                star = Some((sp, sn + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|c| *c == '*')
}

/// A `[...]` class at `p`: whether `c` is in it and where the pattern continues; `None` if the class
/// is not closed (then `[` is a literal, as in Python).
fn match_class(pattern: &[char], p: usize, c: char) -> Option<(bool, usize)> {
    let mut i = p + 1;
    let negate = pattern.get(i) == Some(&'!');
    if negate {
        i += 1;
    }
    let start = i;
    let mut hit = false;
    loop {
        let cur = *pattern.get(i)?;
        if cur == ']' && i > start {
            return Some((hit != negate, i + 1));
        }
        if pattern.get(i + 1) == Some(&'-') && pattern.get(i + 2).is_some_and(|e| *e != ']') {
            let end = pattern[i + 2];
            hit |= cur <= c && c <= end;
            i += 3;
        } else {
            hit |= cur == c;
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: Number, stop: Number, step: Number) -> Sweep {
        Sweep::Range(RangeSweep {
            start,
            stop,
            step,
            shuffle: false,
            tags: BTreeSet::new(),
        })
    }

    fn expand(s: &Sweep) -> Vec<Element> {
        s.expand(None).unwrap_or_default()
    }

    #[test]
    fn int_ranges_follow_python() {
        use Number::Int;
        let ints = |v: &[i64]| -> Vec<Element> {
            v.iter()
                .copied()
                .map(|i| Element::Scalar(Scalar::Int(i)))
                .collect()
        };
        assert_eq!(expand(&range(Int(1), Int(10), Int(3))), ints(&[1, 4, 7]));
        assert_eq!(expand(&range(Int(9), Int(0), Int(-4))), ints(&[9, 5, 1]));
        assert_eq!(expand(&range(Int(5), Int(0), Int(1))), ints(&[]));
        assert_eq!(
            range(Int(0), Int(3), Int(0)).expand(None),
            Err(OverrideError::ZeroIntRangeStep)
        );
        assert!(matches!(
            range(Int(0), Int(i64::MAX), Int(1)).expand(None),
            Err(OverrideError::RangeTooLong { .. })
        ));
    }

    #[test]
    fn float_ranges_step_in_decimal() {
        use Number::{Float, Int};
        // Python's values are checked in `decimal`; here: any float bound takes that path, even with
        // int bounds (a float loop would give 0.30000000000000004, Hydra's decimal steps give 0.3).
        let want = decimal::float_range(0.0, 1.0, 0.1, MAX_RANGE_LEN).unwrap_or_default();
        assert_eq!((want.len(), want.get(3)), (10, Some(&0.3)));
        let want: Vec<Element> = want
            .into_iter()
            .map(|f| Element::Scalar(Scalar::Float(f)))
            .collect();
        assert_eq!(expand(&range(Int(0), Int(1), Float(0.1))), want);
        assert!(matches!(
            range(Float(0.0), Float(1.0), Float(0.0)).expand(None),
            Err(OverrideError::ZeroFloatRangeStep { .. })
        ));
    }

    #[test]
    fn glob_filters_group_options() {
        let glob = Sweep::Glob(GlobSweep {
            include: vec!["a*".into(), "b?".into()],
            exclude: vec!["*x".into()],
        });
        let options: Vec<String> = ["ab", "ax", "b1", "b12", "c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let names: Vec<String> = glob
            .expand(Some(&options))
            .unwrap_or_default()
            .iter()
            .filter_map(|e| e.as_str().map(str::to_owned))
            .collect();
        assert_eq!(names, vec!["ab", "b1"]);
        assert_eq!(glob.expand(None), Ok(vec![]));
    }

    #[test]
    fn fnmatch_cases() {
        let cases = [
            ("abc", "*", true),
            ("abc", "a*c", true),
            ("abc", "a?c", true),
            ("abc", "a[bx]c", true),
            ("abc", "a[!b]c", false),
            ("a-c", "a[a-z]c", false),
            ("abc", "a[a-z]c", true),
            ("a[c", "a[c", true),
            ("aXbXc", "a*b*c", true),
            ("abd", "a*c", false),
            ("", "*", true),
            ("x", "", false),
        ];
        for (name, pattern, want) in cases {
            assert_eq!(
                fnmatch(name, pattern),
                want,
                "fnmatch({name:?}, {pattern:?})"
            );
        }
    }

    #[test]
    fn interval_cannot_be_enumerated() {
        let s = Sweep::Interval(IntervalSweep {
            start: Number::Float(0.0),
            end: Number::Float(1.0),
            tags: BTreeSet::new(),
        });
        assert_eq!(s.expand(None), Err(OverrideError::IntervalNotEnumerable));
    }
}
