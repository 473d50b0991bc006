//! Re-indent continuation lines that saphyr (YAML 1.2) refuses but PyYAML reads: lines inside flow
//! collections and quoted scalars that sit left of the enclosing block's indentation. Leading
//! whitespace on such lines means nothing in either YAML version, so indenting them keeps the meaning;
//! [`LineShifts`] maps positions back to the original text.

use super::Pos;

/// Which lines to indent, and to which column (0-based, in the text as it is now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Repair {
    /// The continuation lines of the quoted scalar whose opening quote is at `line`/`col`.
    Quoted { line: usize, col: usize },
    /// One line inside a flow collection.
    Flow { line: usize, target: usize },
}

/// Spaces added at the start of each line (1-based) by repairs, so positions can be reported in the
/// original text.
#[derive(Default)]
pub(super) struct LineShifts(Vec<usize>);

impl LineShifts {
    fn added(&self, line: usize) -> usize {
        self.0.get(line).copied().unwrap_or(0)
    }

    pub(super) fn pos(&self, line: usize, col: usize) -> Pos {
        Pos::from_marker(line, col.saturating_sub(self.added(line)))
    }

    fn add(&mut self, line: usize, spaces: usize) {
        if self.0.len() <= line {
            self.0.resize(line + 1, 0);
        }
        if let Some(slot) = self.0.get_mut(line) {
            *slot += spaces;
        }
    }
}

/// `text` with the lines `repair` names indented; `None` when the repair does not apply.
pub(super) fn reindent(text: &str, repair: Repair, shifts: &mut LineShifts) -> Option<String> {
    // Lines are counted by `\n`; a lone `\r` line break would make the count wrong.
    if text.replace("\r\n", "").contains('\r') {
        return None;
    }
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let (first, last, target) = match repair {
        Repair::Flow { line, target } => (line, line, target),
        Repair::Quoted { line, col } => {
            let end = quoted_scalar_end_line(&lines, line, col)?;
            (line + 1, end, col)
        }
    };
    let mut out = String::with_capacity(text.len() + 64);
    let mut changed = false;
    for (i, l) in lines.iter().enumerate() {
        let line_no = i + 1;
        let indent = l.chars().take_while(|&c| c == ' ').count();
        if (first..=last).contains(&line_no) && indent < target && !l.trim().is_empty() {
            out.extend(std::iter::repeat_n(' ', target - indent));
            shifts.add(line_no, target - indent);
            changed = true;
        }
        out.push_str(l);
    }
    changed.then_some(out)
}

/// The node starting at `line` (1-based) / `col` (0-based) is a flow collection: after any anchor and
/// tag on the same line comes `[` or `{`.
pub(super) fn starts_flow_collection(text: &str, line: usize, col: usize) -> bool {
    let Some(rest) = line.checked_sub(1).and_then(|i| text.split('\n').nth(i)) else {
        return false;
    };
    let mut rest: String = rest.chars().skip(col).collect();
    loop {
        let trimmed = rest.trim_start_matches([' ', '\t']);
        if trimmed.starts_with(['&', '!']) {
            rest = trimmed
                .chars()
                .skip_while(|c| !matches!(c, ' ' | '\t'))
                .collect();
        } else {
            return trimmed.starts_with(['[', '{']);
        }
    }
}

/// The line holding the closing quote of the quoted scalar opening at `line`/`col` (1-based line,
/// 0-based column), or the last line if it never closes.
fn quoted_scalar_end_line(lines: &[&str], line: usize, col: usize) -> Option<usize> {
    let mut chars = lines
        .iter()
        .enumerate()
        .skip(line.checked_sub(1)?)
        .flat_map(|(i, l)| l.chars().map(move |c| (i + 1, c)));
    let quote = chars
        .nth(col)
        .map(|(_, c)| c)
        .filter(|c| *c == '"' || *c == '\'')?;
    let mut last = line;
    while let Some((at, c)) = chars.next() {
        last = at;
        if quote == '"' && c == '\\' {
            chars.next();
        } else if c == quote {
            // In single quotes `''` is an escaped quote, not the end.
            if quote == '\'' && chars.clone().next().is_some_and(|(_, n)| n == '\'') {
                chars.next();
            } else {
                return Some(at);
            }
        }
    }
    Some(last)
}
