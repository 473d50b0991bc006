//! Hydra's own schema for the `hydra` node: the dataclasses of `hydra/conf/__init__.py` (HydraConf, JobConf,
//! …) and of the basic launcher and sweeper, as field types and key sets, with OmegaConf's conversions and
//! error texts when a config file or a command-line override sets a `hydra.*` value.
//!
//! A structured config refuses keys it does not declare (`Key 'env' not in 'JobConf'`) and converts what it
//! stores to the declared type (`env_set: Dict[str, str]` stores `1` as `'1'`). Interpolations and `???`
//! are stored as they are, whatever the type.

use crate::node::{Key, Node, Value};
use crate::scalar::Scalar;

/// A declared field type.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ty {
    Str {
        optional: bool,
    },
    Bool {
        optional: bool,
    },
    Int {
        optional: bool,
    },
    /// `Optional[RunMode]`: `RUN` or `MULTIRUN`.
    Mode,
    Any,
    /// `Dict[str, Any]`.
    DictAny,
    /// `Dict[str, str]`.
    DictStr {
        optional: bool,
    },
    /// `List[str]`.
    ListStr,
    Struct(&'static Schema),
}

/// One dataclass: its name and fields.
#[derive(Debug)]
pub(crate) struct Schema {
    pub name: &'static str,
    fields: &'static [(&'static str, Ty)],
}

const STR: Ty = Ty::Str { optional: false };

static HELP: Schema = Schema {
    name: "HelpConf",
    fields: &[
        ("app_name", STR),
        ("header", STR),
        ("footer", STR),
        ("template", STR),
    ],
};
static HYDRA_HELP: Schema = Schema {
    name: "HydraHelpConf",
    fields: &[("hydra_help", STR), ("template", STR)],
};
static RUN_DIR: Schema = Schema {
    name: "RunDir",
    fields: &[("dir", STR)],
};
static SWEEP_DIR: Schema = Schema {
    name: "SweepDir",
    fields: &[("dir", STR), ("subdir", STR)],
};
static OVERRIDES: Schema = Schema {
    name: "OverridesConf",
    fields: &[("hydra", Ty::ListStr), ("task", Ty::ListStr)],
};
static OVERRIDE_DIRNAME: Schema = Schema {
    name: "OverrideDirname",
    fields: &[
        ("kv_sep", STR),
        ("item_sep", STR),
        ("exclude_keys", Ty::ListStr),
    ],
};
static JOB_CONFIG: Schema = Schema {
    name: "JobConfig",
    fields: &[("override_dirname", Ty::Struct(&OVERRIDE_DIRNAME))],
};
static JOB: Schema = Schema {
    name: "JobConf",
    fields: &[
        ("name", STR),
        ("chdir", Ty::Bool { optional: true }),
        ("override_dirname", STR),
        ("id", STR),
        ("num", Ty::Int { optional: false }),
        ("config_name", Ty::Str { optional: true }),
        ("env_set", Ty::DictStr { optional: false }),
        ("env_copy", Ty::ListStr),
        ("config", Ty::Struct(&JOB_CONFIG)),
    ],
};
static RUNTIME: Schema = Schema {
    name: "RuntimeConf",
    fields: &[
        ("version", STR),
        ("version_base", STR),
        ("cwd", STR),
        ("config_sources", Ty::Any),
        ("output_dir", STR),
        ("choices", Ty::DictAny),
    ],
};
/// `hydra/config`.
pub(crate) static HYDRA_CONF: Schema = Schema {
    name: "HydraConf",
    fields: &[
        ("defaults", Ty::Any),
        ("mode", Ty::Mode),
        ("searchpath", Ty::ListStr),
        ("run", Ty::Struct(&RUN_DIR)),
        ("sweep", Ty::Struct(&SWEEP_DIR)),
        ("hydra_logging", Ty::DictAny),
        ("job_logging", Ty::DictAny),
        ("sweeper", Ty::Any),
        ("launcher", Ty::Any),
        ("callbacks", Ty::DictAny),
        ("help", Ty::Struct(&HELP)),
        ("hydra_help", Ty::Struct(&HYDRA_HELP)),
        ("output_subdir", Ty::Str { optional: true }),
        ("overrides", Ty::Struct(&OVERRIDES)),
        ("job", Ty::Struct(&JOB)),
        ("runtime", Ty::Struct(&RUNTIME)),
        ("verbose", Ty::Any),
    ],
};
/// `hydra/launcher/basic`.
static BASIC_LAUNCHER: Schema = Schema {
    name: "BasicLauncherConf",
    fields: &[("_target_", STR)],
};
/// `hydra/sweeper/basic`.
static BASIC_SWEEPER: Schema = Schema {
    name: "BasicSweeperConf",
    fields: &[
        ("_target_", STR),
        ("max_batch_size", Ty::Int { optional: true }),
        ("params", Ty::DictStr { optional: true }),
    ],
};
const BASIC_LAUNCHER_TARGET: &str = "hydra._internal.core_plugins.basic_launcher.BasicLauncher";
const BASIC_SWEEPER_TARGET: &str = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper";

impl Schema {
    /// The type of field `key`; `hydra` is the current `hydra` node (the launcher and sweeper are typed
    /// by the basic plugins' schemas only while those are selected).
    fn field(&'static self, key: &str, hydra: Option<&Node>) -> Option<Ty> {
        let ty = self.fields.iter().find(|(name, _)| *name == key)?.1;
        if std::ptr::eq(self, &HYDRA_CONF) {
            let target = |node: &str| {
                hydra
                    .and_then(|h| h.get_path(&format!("{node}._target_")))
                    .and_then(Node::as_str)
                    .map(str::to_owned)
            };
            if key == "launcher" && target("launcher").as_deref() == Some(BASIC_LAUNCHER_TARGET) {
                return Some(Ty::Struct(&BASIC_LAUNCHER));
            }
            if key == "sweeper" && target("sweeper").as_deref() == Some(BASIC_SWEEPER_TARGET) {
                return Some(Ty::Struct(&BASIC_SWEEPER));
            }
        }
        Some(ty)
    }
}

/// Where a value is being stored: OmegaConf words a few errors differently for a merge and an assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Setting {
    /// A config file merged into the composed config.
    Merge,
    /// A command-line override (`OmegaConf.update`).
    Override,
}

/// An OmegaConf validation error with its key lines.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}\n    full_key: {full_key}{}\n    object_type={object_type}",
    .reference_type.map(|r| format!("\n    reference_type={r}")).unwrap_or_default())]
pub struct SchemaError {
    /// The Python exception class (`ValidationError`, `ConfigKeyError`).
    pub class: &'static str,
    pub message: String,
    pub full_key: String,
    pub reference_type: Option<&'static str>,
    pub object_type: &'static str,
}

/// The struct that owns a value, for the key lines of an error.
#[derive(Clone, Copy)]
struct Owner {
    object_type: &'static str,
    reference_type: Option<&'static str>,
}

const DICT_OWNER: Owner = Owner {
    object_type: "dict",
    reference_type: None,
};

fn is_interpolation(node: &Node) -> bool {
    matches!(&node.value, Value::Scalar(Scalar::Str(s)) if s.contains("${"))
        || matches!(node.value, Value::Missing)
}

/// Python's `int(str)`: surrounding whitespace, a sign, digits with single underscores between them.
fn python_int(text: &str) -> Option<i64> {
    let t = text.trim();
    let (neg, digits) = match t.as_bytes().first()? {
        b'-' => (true, &t[1..]),
        b'+' => (false, &t[1..]),
        _ => (false, t),
    };
    if digits.is_empty()
        || digits.starts_with('_')
        || digits.ends_with('_')
        || digits.contains("__")
        || !digits.bytes().all(|b| b.is_ascii_digit() || b == b'_')
    {
        return None;
    }
    let n: i64 = digits.replace('_', "").parse().ok()?;
    Some(if neg { -n } else { n })
}

struct Walk<'h> {
    setting: Setting,
    hydra: Option<&'h Node>,
}

impl Walk<'_> {
    fn err(
        &self,
        class: &'static str,
        message: String,
        full_key: &str,
        owner: Owner,
    ) -> SchemaError {
        SchemaError {
            class,
            message,
            full_key: full_key.to_owned(),
            reference_type: owner.reference_type,
            object_type: owner.object_type,
        }
    }

    /// A value's type name as OmegaConf shows it: a merged container is a `DictConfig`/`ListConfig`.
    fn container_name(&self, node: &Node) -> &'static str {
        match (&node.value, self.setting) {
            (Value::List(_), Setting::Merge) => "ListConfig",
            (Value::Dict(_), Setting::Merge) => "DictConfig",
            (value, _) => value.type_name(),
        }
    }

    fn none_error(&self, type_name: &str, full_key: &str, owner: Owner) -> SchemaError {
        let message = match self.setting {
            Setting::Merge => format!("Incompatible value 'None' for field of type '{type_name}'"),
            Setting::Override => format!("field '{full_key}' is not Optional"),
        };
        self.err("ValidationError", message, full_key, owner)
    }

    /// Convert `node` to type `ty` in place, or fail as OmegaConf does.
    fn value(
        &self,
        ty: Ty,
        node: &mut Node,
        full_key: &str,
        owner: Owner,
    ) -> Result<(), SchemaError> {
        if is_interpolation(node) {
            return Ok(());
        }
        let shown = node.value.python_str();
        match ty {
            Ty::Any => Ok(()),
            Ty::Str { optional } => match &node.value {
                Value::Scalar(Scalar::None) if optional => Ok(()),
                Value::Scalar(Scalar::None) => Err(self.none_error("str", full_key, owner)),
                Value::Scalar(Scalar::Str(_)) => Ok(()),
                Value::List(_) | Value::Dict(_) => Err(self.err(
                    "ValidationError",
                    format!(
                        "Cannot convert '{}' to string: '{shown}'",
                        self.container_name(node)
                    ),
                    full_key,
                    owner,
                )),
                _ => {
                    node.value = Value::str(shown);
                    Ok(())
                }
            },
            Ty::Bool { optional } => {
                let invalid = || {
                    self.err(
                        "ValidationError",
                        format!(
                            "Value '{shown}' is not a valid bool (type {})",
                            node.value.type_name()
                        ),
                        full_key,
                        owner,
                    )
                };
                let converted = match &node.value {
                    Value::Scalar(Scalar::None) if optional => return Ok(()),
                    Value::Scalar(Scalar::None) => {
                        return Err(self.none_error("bool", full_key, owner));
                    }
                    Value::Scalar(Scalar::Bool(b)) => *b,
                    Value::Scalar(Scalar::Int(i)) => *i != 0,
                    Value::Scalar(Scalar::BigInt(_)) => true,
                    Value::Scalar(Scalar::Str(s)) => match python_int(s) {
                        Some(i) => i != 0,
                        None => match s.to_lowercase().as_str() {
                            "yes" | "y" | "on" | "true" => true,
                            "no" | "n" | "off" | "false" => false,
                            _ => return Err(invalid()),
                        },
                    },
                    _ => return Err(invalid()),
                };
                node.value = Value::bool(converted);
                Ok(())
            }
            Ty::Int { optional } => {
                let converted = match &node.value {
                    Value::Scalar(Scalar::None) if optional => return Ok(()),
                    Value::Scalar(Scalar::None) => {
                        return Err(self.none_error("int", full_key, owner));
                    }
                    Value::Scalar(Scalar::Int(_)) | Value::Scalar(Scalar::BigInt(_)) => {
                        return Ok(());
                    }
                    Value::Scalar(Scalar::Str(s)) => python_int(s),
                    _ => None,
                };
                match converted {
                    Some(i) => {
                        node.value = Value::int(i);
                        Ok(())
                    }
                    None => Err(self.err(
                        "ValidationError",
                        format!(
                            "Value '{shown}' of type '{}' could not be converted to Integer",
                            self.container_name(node)
                        ),
                        full_key,
                        owner,
                    )),
                }
            }
            Ty::Mode => {
                let name = match &node.value {
                    Value::Scalar(Scalar::None) => return Ok(()),
                    Value::Scalar(Scalar::Int(1)) => Some("RUN"),
                    Value::Scalar(Scalar::Int(2)) => Some("MULTIRUN"),
                    Value::Scalar(Scalar::Str(s)) => {
                        match s.strip_prefix("RunMode.").unwrap_or(s) {
                            "RUN" => Some("RUN"),
                            "MULTIRUN" => Some("MULTIRUN"),
                            _ => None,
                        }
                    }
                    _ => None,
                };
                match name {
                    Some(name) => {
                        node.value = Value::str(name);
                        Ok(())
                    }
                    None => Err(self.err(
                        "ValidationError",
                        format!("Invalid value '{shown}', expected one of [RUN, MULTIRUN]"),
                        full_key,
                        owner,
                    )),
                }
            }
            Ty::DictAny | Ty::DictStr { .. } => {
                let optional = matches!(ty, Ty::DictStr { optional: true });
                let typing = match ty {
                    Ty::DictAny => "Dict[str, Any]",
                    _ => "Dict[str, str]",
                };
                match &mut node.value {
                    Value::Scalar(Scalar::None) if optional || ty_is_any_dict(ty) => Ok(()),
                    Value::Dict(d) => {
                        if let Ty::DictStr { .. } = ty {
                            for (key, child) in d.iter_mut() {
                                let key = format!("{full_key}.{key}");
                                self.element_str(child, &key)?;
                            }
                        }
                        Ok(())
                    }
                    _ => Err(self.err(
                        "ValidationError",
                        format!("Cannot assign {} to {typing}", node.value.type_name()),
                        full_key,
                        owner,
                    )),
                }
            }
            Ty::ListStr => {
                if let Value::List(items) = &mut node.value {
                    for (idx, item) in items.iter_mut().enumerate() {
                        self.element_str(item, &format!("{full_key}[{idx}]"))?;
                    }
                }
                Ok(())
            }
            Ty::Struct(schema) => match &mut node.value {
                Value::Dict(_) => self.fields(schema, node, full_key, Some(schema.name)),
                Value::Scalar(Scalar::None) => Ok(()),
                _ => {
                    let message = match self.setting {
                        Setting::Merge => format!(
                            "Merge error: {} is not a subclass of {}. value: {shown}",
                            node.value.type_name(),
                            schema.name
                        ),
                        Setting::Override => format!(
                            "Invalid type assigned: {} is not a subclass of {}. value: {shown}",
                            node.value.type_name(),
                            schema.name
                        ),
                    };
                    Err(self.err("ValidationError", message, full_key, owner))
                }
            },
        }
    }

    /// An element of a `Dict[str, str]` or `List[str]`: converted to str; a container stays as merged
    /// (OmegaConf keeps it), but an override cannot assign one.
    fn element_str(&self, node: &mut Node, full_key: &str) -> Result<(), SchemaError> {
        if node.value.is_container() && self.setting == Setting::Merge {
            return Ok(());
        }
        if matches!(node.value, Value::NULL) {
            return Err(self.err(
                "ValidationError",
                format!("field '{full_key}' is not Optional"),
                full_key,
                DICT_OWNER,
            ));
        }
        self.value(STR, node, full_key, DICT_OWNER)
    }

    /// The keys of a dict stored in a struct of type `schema`.
    fn fields(
        &self,
        schema: &'static Schema,
        node: &mut Node,
        full_key: &str,
        reference_type: Option<&'static str>,
    ) -> Result<(), SchemaError> {
        let owner = Owner {
            object_type: schema.name,
            reference_type,
        };
        let Value::Dict(dict) = &mut node.value else {
            return Ok(());
        };
        for (key, child) in dict.iter_mut() {
            let key_text = key.to_string();
            let child_key = format!("{full_key}.{key_text}");
            let ty = match key {
                Key(Scalar::Str(k)) => schema.field(k, self.hydra),
                _ => None,
            };
            let Some(ty) = ty else {
                return Err(self.err(
                    "ConfigKeyError",
                    format!("Key '{key_text}' not in '{}'", schema.name),
                    &child_key,
                    owner,
                ));
            };
            self.value(ty, child, &child_key, owner)?;
        }
        Ok(())
    }
}

fn ty_is_any_dict(ty: Ty) -> bool {
    matches!(ty, Ty::DictAny)
}

/// Check and convert the `hydra` subtree of a config merged after Hydra's own `hydra/config`.
/// `hydra` is the composed `hydra` node so far.
pub(crate) fn conform_merge(src: &mut Node, hydra: Option<&Node>) -> Result<(), SchemaError> {
    let walk = Walk {
        setting: Setting::Merge,
        hydra,
    };
    walk.fields(&HYDRA_CONF, src, "hydra", None)
}

/// The declared type at `path` (the parts after `hydra`), if the schema declares one.
pub(crate) fn type_at(
    path: &[String],
    hydra: Option<&Node>,
) -> Option<(Ty, Option<&'static Schema>)> {
    let mut ty = Ty::Struct(&HYDRA_CONF);
    let mut owner = None;
    for part in path {
        ty = match ty {
            Ty::Struct(schema) => {
                owner = Some(schema);
                schema.field(part, hydra)?
            }
            Ty::DictStr { .. } => {
                owner = None;
                STR
            }
            Ty::ListStr if part.parse::<usize>().is_ok() => {
                owner = None;
                STR
            }
            _ => return None,
        };
    }
    Some((ty, owner))
}

/// Convert the value of a command-line override of `hydra.<path>` to its declared type.
pub(crate) fn conform_override(
    path: &[String],
    value: &mut Node,
    hydra: Option<&Node>,
) -> Result<(), SchemaError> {
    let Some((ty, owner)) = type_at(path, hydra) else {
        return Ok(());
    };
    let walk = Walk {
        setting: Setting::Override,
        hydra,
    };
    let full_key = std::iter::once("hydra")
        .chain(path.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(".");
    let owner = match owner {
        Some(schema) => Owner {
            object_type: schema.name,
            reference_type: (!std::ptr::eq(schema, &HYDRA_CONF)).then_some(schema.name),
        },
        None => DICT_OWNER,
    };
    if owner.object_type == "dict" && matches!(value.value, Value::NULL) {
        return Err(walk.err(
            "ValidationError",
            format!("field '{full_key}' is not Optional"),
            &full_key,
            owner,
        ));
    }
    walk.value(ty, value, &full_key, owner)
}

/// Deleting a field a struct declares fails (`HydraConf (DictConfig) does not support deletion`).
pub(crate) fn deletion_refused(path: &[String], hydra: Option<&Node>) -> Option<String> {
    let (parent, _) = path.split_last().map(|(_, p)| (p, ()))?;
    let (ty, _) = type_at(parent, hydra)?;
    let Ty::Struct(schema) = ty else {
        return None;
    };
    let last = path.last()?;
    schema
        .field(last, hydra)
        .map(|_| format!("{} (DictConfig) does not support deletion", schema.name))
}

/// The `hydra` node as Hydra's `hydra/config` merge leaves it: values that earlier configs stored are
/// converted to the declared types (keys the schema does not declare stay).
pub(crate) fn conform_after_schema(hydra: &mut Node) -> Result<(), SchemaError> {
    let snapshot = hydra.clone();
    let walk = Walk {
        setting: Setting::Merge,
        hydra: Some(&snapshot),
    };
    let Value::Dict(dict) = &mut hydra.value else {
        return Ok(());
    };
    for (key, child) in dict.iter_mut() {
        let Key(Scalar::Str(k)) = key else { continue };
        let Some(ty) = HYDRA_CONF.field(k, Some(&snapshot)) else {
            continue;
        };
        lenient(&walk, ty, child, &format!("hydra.{k}"))?;
    }
    Ok(())
}

/// Convert known fields; keep undeclared keys. A `Dict[str, str]` value that is not a string fails as
/// OmegaConf's validation of a merged typed dict does.
fn lenient(walk: &Walk<'_>, ty: Ty, node: &mut Node, full_key: &str) -> Result<(), SchemaError> {
    if is_interpolation(node) {
        return Ok(());
    }
    match (ty, &mut node.value) {
        (Ty::Struct(schema), Value::Dict(dict)) => {
            for (key, child) in dict.iter_mut() {
                let Key(Scalar::Str(k)) = key else { continue };
                if let Some(ty) = schema.field(k, walk.hydra) {
                    lenient(walk, ty, child, &format!("{full_key}.{k}"))?;
                }
            }
            Ok(())
        }
        (Ty::DictStr { .. }, Value::Dict(dict)) => {
            for (_, child) in dict.iter() {
                if is_interpolation(child) || matches!(child.value, Value::Scalar(Scalar::Str(_))) {
                    continue;
                }
                return Err(SchemaError {
                    class: "ValidationError",
                    message: format!(
                        "Value {} ({}) is incompatible with type hint 'str'",
                        child.value.python_repr(),
                        child.value.type_name()
                    ),
                    full_key: String::new(),
                    reference_type: None,
                    object_type: "dict",
                });
            }
            Ok(())
        }
        (Ty::Struct(_) | Ty::DictAny | Ty::DictStr { .. }, _) => Ok(()),
        _ => walk.value(ty, node, full_key, DICT_OWNER),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::Dict;

    fn dict(entries: &[(&str, Node)]) -> Node {
        let mut d = Dict::new();
        for (k, v) in entries {
            d.insert(Key::from(*k), v.clone());
        }
        Node::new(Value::Dict(d))
    }

    fn path(p: &str) -> Vec<String> {
        p.split('.').map(str::to_owned).collect()
    }

    // Expectations from hydra-core 1.3.8 (`--cfg hydra` and the error texts of the oracle).
    #[test]
    fn merge_refuses_undeclared_keys_with_omegaconf_text() {
        let mut src = dict(&[("job", dict(&[("env", dict(&[]))]))]);
        let err = conform_merge(&mut src, None).expect_err("env is not a JobConf field");
        assert_eq!(err.class, "ConfigKeyError");
        assert_eq!(
            err.to_string(),
            "Key 'env' not in 'JobConf'\n    full_key: hydra.job.env\n    reference_type=JobConf\n    object_type=JobConf"
        );
        let mut src = dict(&[("foo", Node::new(Value::int(1)))]);
        let err = conform_merge(&mut src, None).expect_err("foo");
        assert_eq!(
            err.to_string(),
            "Key 'foo' not in 'HydraConf'\n    full_key: hydra.foo\n    object_type=HydraConf"
        );
    }

    #[test]
    fn merge_converts_to_declared_types() {
        let mut src = dict(&[(
            "job",
            dict(&[
                (
                    "env_set",
                    dict(&[
                        ("X", Node::new(Value::int(1))),
                        ("Y", Node::new(Value::bool(true))),
                    ]),
                ),
                ("chdir", Node::str("yes")),
                ("num", Node::str("3")),
                ("name", Node::new(Value::int(5))),
            ]),
        )]);
        conform_merge(&mut src, None).expect("valid");
        let want = dict(&[(
            "job",
            dict(&[
                (
                    "env_set",
                    dict(&[("X", Node::str("1")), ("Y", Node::str("True"))]),
                ),
                ("chdir", Node::new(Value::bool(true))),
                ("num", Node::new(Value::int(3))),
                ("name", Node::str("5")),
            ]),
        )]);
        assert_eq!(src, want);
        let mut src = dict(&[("job", dict(&[("num", Node::new(Value::float(1.0)))]))]);
        assert_eq!(
            conform_merge(&mut src, None).map_err(|e| e.message),
            Err("Value '1.0' of type 'float' could not be converted to Integer".into())
        );
        let mut src = dict(&[("mode", Node::str("run"))]);
        assert_eq!(
            conform_merge(&mut src, None).map_err(|e| e.message),
            Err("Invalid value 'run', expected one of [RUN, MULTIRUN]".into())
        );
        let mut src = dict(&[("job", Node::new(Value::int(5)))]);
        assert_eq!(
            conform_merge(&mut src, None).map_err(|e| e.message),
            Err("Merge error: int is not a subclass of JobConf. value: 5".into())
        );
        let mut src = dict(&[("job", dict(&[("name", Node::new(Value::NULL))]))]);
        assert_eq!(
            conform_merge(&mut src, None).map_err(|e| e.message),
            Err("Incompatible value 'None' for field of type 'str'".into())
        );
    }

    #[test]
    fn overrides_convert_or_fail_like_omegaconf_update() {
        let mut v = Node::new(Value::int(1));
        conform_override(&path("job.env_set.X"), &mut v, None).expect("str");
        assert_eq!(v, Node::str("1"));
        let mut v = Node::str("abc");
        let err = conform_override(&path("job.chdir"), &mut v, None).expect_err("bool");
        assert_eq!(
            err.to_string(),
            "Value 'abc' is not a valid bool (type str)\n    full_key: hydra.job.chdir\n    reference_type=JobConf\n    object_type=JobConf"
        );
        let mut v = Node::new(Value::NULL);
        let err = conform_override(&path("job.name"), &mut v, None).expect_err("not optional");
        assert_eq!(err.message, "field 'hydra.job.name' is not Optional");
        let mut v = Node::new(Value::int(5));
        let err = conform_override(&path("run"), &mut v, None).expect_err("struct");
        assert_eq!(
            err.message,
            "Invalid type assigned: int is not a subclass of RunDir. value: 5"
        );
        let mut v = Node::new(Value::List(vec![Node::new(Value::int(1))]));
        let err = conform_override(&path("run.dir"), &mut v, None).expect_err("list");
        assert_eq!(err.message, "Cannot convert 'list' to string: '[1]'");
        let mut v = Node::new(Value::int(1));
        conform_override(&path("foo.bar"), &mut v, None).expect("undeclared keys are not typed");
        assert_eq!(
            deletion_refused(&path("job"), None).as_deref(),
            Some("HydraConf (DictConfig) does not support deletion")
        );
        assert_eq!(deletion_refused(&path("job.env_set.X"), None), None);
    }

    #[test]
    fn python_int_follows_python() {
        for (text, want) in [
            ("3", Some(3)),
            (" -3 ", Some(-3)),
            ("+1_000", Some(1000)),
            ("1__0", None),
            ("_1", None),
            ("0x10", None),
            ("", None),
            ("1.5", None),
        ] {
            assert_eq!(python_int(text), want, "{text}");
        }
    }
}
