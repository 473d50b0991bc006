//! The built-in resolvers: OmegaConf's `oc.*`, Hydra's `now` and `hydra`, and RLinf's arithmetic ones.
//!
//! Each behaves like the Python function it replaces, including its argument checking (Python's
//! `TypeError` wording) and the exceptions it raises, which `resolve_parse_tree` then wraps.

use super::ErrorKind;
use super::eval::{Engine, Memo, Res};
use super::grammar;
use super::py::{self, Py, PyErr};
use super::tree::{Body, Id, SlotKey};
use crate::node::Value;
use crate::scalar::{Scalar, python_repr_str};

/// A Python function signature: its name (as Python prints it), required and optional parameters.
struct Sig {
    name: &'static str,
    required: &'static [&'static str],
    optional: &'static [&'static str],
}

impl Sig {
    /// Python's arity errors (`f() missing 1 required positional argument: 'key'`, `takes 2 ... but 3`).
    fn check(&self, n: usize) -> Result<(), ErrorKind> {
        let (req, opt) = (self.required.len(), self.optional.len());
        if n < req {
            let missing = &self.required[n..];
            let names: Vec<String> = missing.iter().map(|m| format!("'{m}'")).collect();
            let list = match names.as_slice() {
                [one] => one.clone(),
                [init @ .., last] => format!("{} and {last}", init.join(", ")),
                [] => String::new(),
            };
            let plural = if missing.len() == 1 {
                "argument"
            } else {
                "arguments"
            };
            return Err(type_error(format!(
                "{}() missing {} required positional {plural}: {list}",
                self.name,
                missing.len()
            )));
        }
        if n > req + opt {
            let takes = if opt == 0 {
                format!(
                    "{req} positional argument{}",
                    if req == 1 { "" } else { "s" }
                )
            } else {
                format!("from {req} to {} positional arguments", req + opt)
            };
            let given = if n == 1 { "was" } else { "were" };
            return Err(type_error(format!(
                "{}() takes {takes} but {n} {given} given",
                self.name
            )));
        }
        Ok(())
    }
}

fn type_error(msg: String) -> ErrorKind {
    ErrorKind::Python(PyErr::type_error(msg))
}

fn py_err(class: &'static str, msg: impl Into<String>) -> ErrorKind {
    ErrorKind::Python(PyErr::new(class, msg))
}

const LAMBDA: &str = "<lambda>";

impl Engine<'_, '_> {
    /// `_evaluate_custom_resolver`: `owner` is OmegaConf's `_parent_`, `node` its `_node_`.
    pub fn call_resolver(
        &mut self,
        name: &str,
        owner: Id,
        node: Id,
        args: Vec<Py>,
    ) -> Result<Py, ErrorKind> {
        let sig = |name, required, optional| Sig {
            name,
            required,
            optional,
        };
        let n = args.len();
        let arg = |i: usize| args.get(i).cloned();
        match name {
            "oc.env" => {
                sig("env", &["key"], &["default"]).check(n)?;
                self.oc_env(arg(0).unwrap_or(Py::NONE), arg(1))
            }
            "oc.select" => {
                sig("select", &["key"], &["default"]).check(n)?;
                self.oc_select(owner, arg(0).unwrap_or(Py::NONE), arg(1))
            }
            "oc.decode" => {
                sig("decode", &["expr"], &[]).check(n)?;
                self.oc_decode(owner, node, arg(0).unwrap_or(Py::NONE))
            }
            "oc.create" => {
                sig("create", &["obj"], &[]).check(n)?;
                self.oc_create(owner, arg(0).unwrap_or(Py::NONE))
            }
            "oc.deprecated" => {
                sig("deprecated", &["key"], &["message"]).check(n)?;
                self.oc_deprecated(owner, node, arg(0).unwrap_or(Py::NONE), arg(1))
            }
            "oc.dict.keys" => {
                sig("keys", &["key"], &[]).check(n)?;
                self.oc_dict_keys(owner, arg(0).unwrap_or(Py::NONE))
            }
            "oc.dict.values" => {
                sig("values", &["key"], &[]).check(n)?;
                self.oc_dict_values(owner, arg(0).unwrap_or(Py::NONE))
            }
            "now" => {
                sig(LAMBDA, &["pattern"], &[]).check(n)?;
                match arg(0) {
                    Some(Py::Scalar(Scalar::Str(pattern))) => {
                        Ok(Py::string(strftime(&self.ctx.now, &pattern)))
                    }
                    other => Err(type_error(format!(
                        "strftime() argument 1 must be str, not {}",
                        other.unwrap_or(Py::NONE).type_name(&self.tree)
                    ))),
                }
            }
            "hydra" => {
                sig(LAMBDA, &["path"], &[]).check(n)?;
                self.hydra_select(arg(0).unwrap_or(Py::NONE))
            }
            "multiply" | "int_div" | "subtract" => {
                sig(LAMBDA, &["x", "y"], &[]).check(n)?;
                let (x, y) = (arg(0).unwrap_or(Py::NONE), arg(1).unwrap_or(Py::NONE));
                let out = match name {
                    "multiply" => py::multiply(&x, &y, &self.tree),
                    "int_div" => py::floor_div(&x, &y, &self.tree),
                    _ => py::subtract(&x, &y, &self.tree),
                };
                out.map_err(ErrorKind::Python)
            }
            "not" => {
                sig(LAMBDA, &["x"], &[]).check(n)?;
                Ok(Py::Scalar(Scalar::Bool(
                    !arg(0).unwrap_or(Py::NONE).truthy(&self.tree),
                )))
            }
            other => Err(ErrorKind::UnsupportedResolver {
                name: other.to_owned(),
            }),
        }
    }

    fn oc_env(&self, key: Py, default: Option<Py>) -> Result<Py, ErrorKind> {
        let Py::Scalar(Scalar::Str(key)) = key else {
            return Err(type_error(format!(
                "str expected, not {}",
                key.type_name(&self.tree)
            )));
        };
        if let Some(v) = (self.ctx.env)(&key) {
            return Ok(Py::string(v));
        }
        match default {
            Some(Py::NONE) => Ok(Py::NONE),
            Some(d) => Ok(Py::string(d.str(&self.tree))),
            // `str(KeyError(msg))` is the repr of the message.
            None => Err(py_err(
                "KeyError",
                python_repr_str(&format!("Environment variable '{key}' not found")),
            )),
        }
    }

    /// `select_value(_parent_, key, absolute_key=True, default=...)`.
    fn oc_select(&mut self, owner: Id, key: Py, default: Option<Py>) -> Result<Py, ErrorKind> {
        let Py::Scalar(Scalar::Str(key)) = key else {
            return Err(py_err(
                "AttributeError",
                format!(
                    "'{}' object has no attribute 'startswith'",
                    key.type_name(&self.tree)
                ),
            ));
        };
        match self.select_node(owner, &key, false)? {
            Some(Res::Node(id)) if matches!(self.tree.leaf(id), Some(Value::Missing)) => {
                Ok(default.unwrap_or(Py::NONE))
            }
            Some(r) => Ok(self.value_of(&r)),
            None => Ok(default.unwrap_or(Py::NONE)),
        }
    }

    /// `select_node(cfg, key, absolute_key=True)`: a `ConfigTypeError` counts as "not found".
    fn select_node(
        &mut self,
        owner: Id,
        key: &str,
        throw_on_missing: bool,
    ) -> Result<Option<Res>, ErrorKind> {
        Ok(self
            .select_node_raw(owner, key, throw_on_missing)?
            .map(|(_, r)| r))
    }

    fn select_node_raw(
        &mut self,
        owner: Id,
        key: &str,
        throw_on_missing: bool,
    ) -> Result<Option<(Id, Res)>, ErrorKind> {
        let (root, rest) = self.key_and_root(owner, key).map_err(|_| {
            ErrorKind::Python(PyErr::new(
                "ConfigKeyError",
                format!("Error resolving key '{key}'"),
            ))
        })?;
        match self.select_impl(root, &rest, throw_on_missing, &mut Memo::off()) {
            Err(ErrorKind::NotAContainer { .. }) => Ok(None),
            other => other,
        }
    }

    fn oc_decode(&mut self, owner: Id, node: Id, expr: Py) -> Result<Py, ErrorKind> {
        let s = match expr {
            Py::NONE => return Ok(Py::NONE),
            Py::Scalar(Scalar::Str(s)) => s,
            other => {
                return Err(type_error(format!(
                    "`oc.decode` can only take strings or None as input, but `{}` is of type {}",
                    other.str(&self.tree),
                    other.type_name(&self.tree)
                )));
            }
        };
        let after_ws = s.trim_start_matches([' ', '\t']);
        if after_ws.starts_with('}') {
            // The first token pops the lexer's empty mode stack while OmegaConf sets up its parser, outside
            // the `try` that turns ANTLR's "Empty Stack" into a GrammarParseError.
            return Err(py_err("Exception", "Empty Stack"));
        }
        if after_ws.is_empty() && !s.is_empty() {
            // One WS token is a primitive OmegaConf's visitor refuses.
            return Err(py_err("AssertionError", "WS should never be reached"));
        }
        let el = grammar::parse_element(&s).map_err(|e| py_err("GrammarParseError", e.detail))?;
        self.visit_element(owner, node, &el, &mut Memo::off())
            .map_err(ErrorKind::wrap)
    }

    /// `OmegaConf.create(obj, parent=_parent_)`.
    fn oc_create(&mut self, owner: Id, obj: Py) -> Result<Py, ErrorKind> {
        match obj {
            Py::NONE => Ok(Py::NONE),
            Py::Dict(_) | Py::List(_) | Py::Config(_) => {
                Ok(Py::Config(self.build(&obj, Some(owner), None)?))
            }
            // A string is YAML, loaded the way `OmegaConf.create(str)` does (`a` → `{a: null}`).
            Py::Scalar(Scalar::Str(text)) => {
                let node = crate::yaml::load_str(&text, "<oc.create>")
                    .map_err(|e| py_err("YAMLError", e.to_string()))?;
                let id = self.tree.insert_node(&node, Some(owner), None);
                self.check_created(id)?;
                Ok(Py::Config(id))
            }
            other => Err(py_err(
                "ValidationError",
                format!(
                    "Object of unsupported type: '{}'",
                    other.type_name(&self.tree)
                ),
            )),
        }
    }

    /// `OmegaConf.create` validates every interpolation string it stores.
    fn check_created(&self, id: Id) -> Result<(), ErrorKind> {
        match self.tree.body(id) {
            Body::Dict(d) => d.values().try_for_each(|&c| self.check_created(c)),
            Body::List(l) => l.iter().try_for_each(|&c| self.check_created(c)),
            Body::Leaf(_) => match self.tree.interpolation(id) {
                Some(s) => {
                    grammar::validate_value(s).map_err(|e| ErrorKind::Grammar { detail: e.detail })
                }
                None => Ok(()),
            },
        }
    }

    fn oc_deprecated(
        &mut self,
        owner: Id,
        node: Id,
        key: Py,
        message: Option<Py>,
    ) -> Result<Py, ErrorKind> {
        let Py::Scalar(Scalar::Str(key)) = key else {
            return Err(type_error(format!(
                "oc.deprecated: interpolation key type is not a string ({})",
                key.type_name(&self.tree)
            )));
        };
        let message = match message {
            None => {
                "'$OLD_KEY' is deprecated. Change your code and config to use '$NEW_KEY'".to_owned()
            }
            Some(Py::Scalar(Scalar::Str(m))) => m,
            Some(other) => {
                return Err(type_error(format!(
                    "oc.deprecated: interpolation message type is not a string ({})",
                    other.type_name(&self.tree)
                )));
            }
        };
        let full_key = self.tree.full_key(node);
        let Some((raw, target)) = self.select_node_raw(owner, &key, false)? else {
            return Err(py_err(
                "ConfigKeyError",
                format!("In oc.deprecated resolver at '{full_key}': Key not found: '{key}'"),
            ));
        };
        let new_key = self.tree.full_key(raw);
        let msg = message
            .replace("$OLD_KEY", &full_key)
            .replace("$NEW_KEY", &new_key);
        tracing::warn!("{msg}");
        Ok(self.value_of(&target))
    }

    /// The dict `oc.dict.keys` / `oc.dict.values` read (`_get_and_validate_dict_input`).
    fn dict_input(
        &mut self,
        owner: Id,
        key: &Py,
        resolver: &str,
    ) -> Result<(String, Id), ErrorKind> {
        let Py::Scalar(Scalar::Str(key)) = key else {
            return Err(type_error(format!(
                "`{resolver}` requires a string as input, but obtained `{}` of type: {}",
                key.str(&self.tree),
                key.type_name(&self.tree)
            )));
        };
        let found = match self.select_node(owner, key, true) {
            Err(ErrorKind::Missing { key }) => {
                return Err(py_err(
                    "MissingMandatoryValue",
                    format!("Missing mandatory value: {key}"),
                ));
            }
            other => other?,
        };
        let Some(r) = found else {
            return Err(py_err("ConfigKeyError", format!("Key not found: '{key}'")));
        };
        match self.value_of(&r) {
            Py::Config(id) if matches!(self.tree.body(id), Body::Dict(_)) => Ok((key.clone(), id)),
            other => Err(type_error(format!(
                "`{resolver}` cannot be applied to objects of type: {}",
                other.type_name(&self.tree)
            ))),
        }
    }

    fn oc_dict_keys(&mut self, owner: Id, key: Py) -> Result<Py, ErrorKind> {
        let (_, dict) = self.dict_input(owner, &key, "oc.dict.keys")?;
        let keys: Vec<Py> = match self.tree.body(dict) {
            Body::Dict(d) => d.keys().map(Py::from_key).collect(),
            _ => Vec::new(),
        };
        Ok(Py::Config(self.build(
            &Py::List(keys),
            Some(owner),
            None,
        )?))
    }

    fn oc_dict_values(&mut self, owner: Id, key: Py) -> Result<Py, ErrorKind> {
        let (key, dict) = self.dict_input(owner, &key, "oc.dict.values")?;
        // The list adds a level of nesting, so a relative key needs one more dot.
        let base = if key.starts_with('.') {
            format!(".{key}")
        } else {
            key
        };
        let keys: Vec<String> = match self.tree.body(dict) {
            Body::Dict(d) => d.keys().map(|k| k.to_string()).collect(),
            _ => Vec::new(),
        };
        let list = self
            .tree
            .add(Some(owner), None, Body::List(Vec::new()), None);
        let items = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let leaf = Body::Leaf(Value::str(format!("${{{base}.{k}}}")));
                self.tree
                    .add(Some(list), Some(SlotKey::Index(i)), leaf, None)
            })
            .collect();
        self.tree.replace_body(list, Body::List(items));
        Ok(Py::Config(list))
    }

    /// Hydra's `OmegaConf.select(HydraConfig.get(), path)`.
    fn hydra_select(&mut self, path: Py) -> Result<Py, ErrorKind> {
        let Some(hydra) = self.hydra else {
            return Err(py_err("ValueError", "HydraConfig was not set"));
        };
        let Py::Scalar(Scalar::Str(path)) = path else {
            return Err(py_err(
                "AttributeError",
                format!(
                    "'{}' object has no attribute 'startswith'",
                    path.type_name(&self.tree)
                ),
            ));
        };
        // `select` without `absolute_key` reads keys relative to the node it is given.
        let rel = if path.starts_with('.') {
            path
        } else {
            format!(".{path}")
        };
        match self.select_node(hydra, &rel, false)? {
            Some(Res::Node(id)) if matches!(self.tree.leaf(id), Some(Value::Missing)) => {
                Ok(Py::NONE)
            }
            Some(r) => Ok(self.value_of(&r)),
            None => Ok(Py::NONE),
        }
    }
}

/// Python's `datetime.strftime` on a naive local time. Unknown directives are kept as written (glibc).
pub fn strftime(now: &chrono::NaiveDateTime, pattern: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let spec = match d {
            // Python's %f is microseconds; naive times have no zone, so %z/%Z are empty.
            'f' => "%6f".to_owned(),
            'z' | 'Z' => continue,
            'a' | 'A' | 'w' | 'd' | 'b' | 'B' | 'm' | 'y' | 'Y' | 'H' | 'I' | 'p' | 'M' | 'S'
            | 'j' | 'U' | 'W' | 'c' | 'x' | 'X' | '%' | 'e' | 'G' | 'g' | 'V' | 'u' | 'C' | 'D'
            | 'F' | 'T' | 'R' | 'n' | 't' | 'h' | 'k' | 'l' | 's' | 'P' | 'r' => format!("%{d}"),
            other => {
                out.push('%');
                out.push(other);
                continue;
            }
        };
        if write!(out, "{}", now.format(&spec)).is_err() {
            out.push_str(&spec);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arity_errors_use_python_wording() {
        let env = Sig {
            name: "env",
            required: &["key"],
            optional: &["default"],
        };
        let msg = |r: Result<(), ErrorKind>| r.err().map(|e| e.to_string());
        assert_eq!(
            msg(env.check(0)).as_deref(),
            Some("env() missing 1 required positional argument: 'key'")
        );
        assert_eq!(
            msg(env.check(3)).as_deref(),
            Some("env() takes from 1 to 2 positional arguments but 3 were given")
        );
        assert!(env.check(2).is_ok());
        let lam = Sig {
            name: LAMBDA,
            required: &["x", "y"],
            optional: &[],
        };
        assert_eq!(
            msg(lam.check(0)).as_deref(),
            Some("<lambda>() missing 2 required positional arguments: 'x' and 'y'")
        );
        assert_eq!(
            msg(lam.check(3)).as_deref(),
            Some("<lambda>() takes 2 positional arguments but 3 were given")
        );
    }

    #[test]
    fn strftime_matches_python() {
        let t = chrono::NaiveDate::from_ymd_opt(2024, 3, 9)
            .and_then(|d| d.and_hms_micro_opt(7, 5, 3, 42))
            .expect("valid date");
        assert_eq!(strftime(&t, "%Y-%m-%d/%H-%M-%S"), "2024-03-09/07-05-03");
        assert_eq!(strftime(&t, "%f|%j|%%|%Q|%"), "000042|069|%|%Q|%");
        assert_eq!(strftime(&t, "%A %b"), "Saturday Mar");
    }
}
