//! Compose a config as Hydra does: parse overrides, build the defaults list, merge configs in order,
//! then apply value overrides under struct mode and fill in the `hydra` node.
//!
//! Merge rules are OmegaConf's: dicts merge key by key (existing keys keep their place, new keys go last),
//! everything else (lists included) replaces, and a `???` source value never replaces an existing one.

use crate::defaults::{self, DefaultsError, DefaultsList, GroupOverrides, GroupValue};
use crate::hydra::conf::{self as hydra_conf, SchemaError};
use crate::hydra::{self, RuntimeInfo};
use crate::interpolate::{self, InterpolationError, ResolveContext};
use crate::node::{Dict, Key, Node, Origin, Value};
use crate::overrides::{
    self as ovr, Element, GroupChoice, Override, OverrideError, OverrideKind, OverrideValue,
};
use crate::scalar::Scalar;
use crate::search_path::ObjectType;
use crate::search_path::{Repository, SearchPathError, Source};

/// Run (one job) or multirun (sweeps allowed, `???` group defaults skipped).
pub use crate::overrides::RunMode;

/// A composition error, worded as Hydra words it.
#[derive(Debug, thiserror::Error)]
pub enum ComposeError {
    #[error(transparent)]
    Override(Box<OverrideError>),
    #[error(transparent)]
    Defaults(Box<DefaultsError>),
    #[error(transparent)]
    SearchPath(#[from] SearchPathError),
    #[error(transparent)]
    Interpolation(#[from] InterpolationError),
    #[error("hydra.searchpath must be a list of strings. Got: {got}")]
    SearchPathNotList { got: String },
    #[error("primary config '{config_name}' must be a DictConfig, got ListConfig")]
    PrimaryNotDict { config_name: String },
    #[error(
        "In '{config_path}': Overriding hydra.searchpath is only supported from the primary config"
    )]
    SearchPathOutsidePrimary { config_path: String },
    #[error("In '{config_path}': ConfigTypeError raised while composing config:\n{message}")]
    Merge {
        config_path: String,
        message: String,
    },
    #[error(
        "Override {input} looks like a config group override, but config group '{key}' does not exist."
    )]
    NotAGroup { input: String, key: String },
    #[error("Could not delete from config. '{key}' does not exist.")]
    DeleteMissing { key: String },
    #[error("Could not delete from config. The value of '{key}' is {actual} and not {expected}.")]
    DeleteValueMismatch {
        key: String,
        actual: String,
        expected: String,
    },
    #[error(
        "Could not append to config. An item is already at '{key}'.\nEither remove + prefix: '{without_plus}'\nOr add a second + to add or override '{key}': '+{input}'"
    )]
    AppendExisting {
        key: String,
        without_plus: String,
        input: String,
    },
    #[error(
        "Could not override '{key}'.\nTo append to your config use +{input}{}",
        did_you_mean.as_ref().map(|s| format!("\ndid you mean {s}?")).unwrap_or_default()
    )]
    OverrideMissingKey {
        key: String,
        input: String,
        /// The existing key the override most likely meant (a typo of one segment).
        did_you_mean: Option<String>,
    },
    #[error("Error merging override {input}\n{message}")]
    MergeOverride { input: String, message: String },
    /// A config sets a `hydra.*` value that Hydra's schema (HydraConf, JobConf, …) refuses.
    #[error("In '{config_path}': {} raised while composing config:\n{error}", .error.class)]
    HydraSchema {
        config_path: String,
        error: SchemaError,
    },
    /// A user `hydra/config.yaml` shadows Hydra's own, whose ConfigStore schema has a defaults list.
    #[error(
        "'{config_path}' is validated against ConfigStore schema with the same name.\nThis behavior is deprecated in Hydra 1.1 and will be removed in Hydra 1.2.\nIn addition, the automatically matched schema contains a defaults list.\nThis combination is no longer supported.\nSee https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/automatic_schema_matching for migration instructions."
    )]
    SchemaWithDefaults { config_path: String },
}

// The two large error types are boxed so every `Result<_, ComposeError>` stays small.
impl From<OverrideError> for ComposeError {
    fn from(err: OverrideError) -> ComposeError {
        ComposeError::Override(Box::new(err))
    }
}

impl From<DefaultsError> for ComposeError {
    fn from(err: DefaultsError) -> ComposeError {
        ComposeError::Defaults(Box::new(err))
    }
}

/// What to compose.
#[derive(Debug, Clone)]
pub struct ComposeRequest<'a> {
    pub config_name: &'a str,
    pub overrides: &'a [String],
    pub mode: RunMode,
    /// The entry point name, which becomes `hydra.job.name` unless the config sets it.
    pub job_name: &'a str,
}

/// A composed config: the whole tree (with its `hydra` node) plus the defaults list it came from.
#[derive(Debug, Clone)]
pub struct Composed {
    pub config: Node,
    pub defaults: DefaultsList,
}

/// Parse every override (Hydra reports the first bad one).
pub(crate) fn parse_overrides(overrides: &[String]) -> Result<Vec<Override>, ComposeError> {
    overrides
        .iter()
        .map(|o| ovr::parse_override(o).map_err(ComposeError::from))
        .collect()
}

/// The override's `key[@pkg]` without its `+`/`++`/`~` prefix (how group choices and deletions are keyed).
fn group_key(o: &Override) -> String {
    match &o.package {
        Some(p) => format!("{}@{}", o.key_or_group, p),
        None => o.key_or_group.clone(),
    }
}

/// Hydra's checks on sweep overrides for the given mode.
pub(crate) fn validate_sweeps(overrides: &[Override], mode: RunMode) -> Result<(), ComposeError> {
    for o in overrides {
        o.validate_sweep(mode)?;
    }
    Ok(())
}

/// Add the primary config's (or the command line's) `hydra.searchpath` entries to the repository.
/// Entries may use interpolations (`file://${oc.env:EMBODIED_PATH}/config`); directories that do not exist
/// are kept but never match, as in Hydra.
fn process_search_path(
    repo: &mut Repository,
    config_name: &str,
    overrides: &[Override],
) -> Result<(), ComposeError> {
    let from_cli = overrides
        .iter()
        .find(|o| o.key_element() == "hydra.searchpath");
    let (root, provider): (Node, &str) = match from_cli.and_then(|o| o.element().map(|e| (o, e))) {
        Some((o, e)) => {
            let mut searchpath = Dict::new();
            searchpath.insert(Key::from("searchpath"), e.to_node_from(&o.input));
            let mut root = Dict::new();
            root.insert(Key::from("hydra"), Node::new(Value::Dict(searchpath)));
            (
                Node::new(Value::Dict(root)),
                "hydra.searchpath in command-line",
            )
        }
        None => {
            let Some(primary) = repo.load(config_name)? else {
                return Ok(());
            };
            if primary.root.as_list().is_some() {
                return Err(ComposeError::PrimaryNotDict {
                    config_name: config_name.into(),
                });
            }
            (primary.root.clone(), "hydra.searchpath in main")
        }
    };
    let Some(entries) = root.get_path("hydra.searchpath") else {
        return Ok(());
    };
    let items = match &entries.value {
        Value::Scalar(Scalar::None) => return Ok(()),
        Value::List(items) => items,
        _ => {
            return Err(ComposeError::SearchPathNotList {
                got: entries.value.python_str(),
            });
        }
    };
    let ctx = ResolveContext::new();
    let mut sources = Vec::with_capacity(items.len());
    for idx in 0..items.len() {
        let entry = interpolate::resolve_at(&root, &format!("hydra.searchpath.{idx}"), &ctx)?;
        let Value::Scalar(Scalar::Str(text)) = &entry.value else {
            return Err(ComposeError::SearchPathNotList {
                got: entries.value.python_str(),
            });
        };
        sources.push(Source::from_search_path_entry(provider, text)?);
    }
    repo.append_before_structured(sources);
    Ok(())
}

/// Split overrides into group overrides (for the defaults list) and value overrides (applied after merging).
fn classify(
    repo: &Repository,
    overrides: &[Override],
) -> Result<(GroupOverrides, Vec<Override>), ComposeError> {
    let mut groups = GroupOverrides::default();
    let mut values = Vec::new();
    for o in overrides {
        if o.is_sweep() {
            continue;
        }
        let element = o.element();
        let is_dict = matches!(element, Some(Element::Dict(_)));
        if is_dict || !repo.group_exists(&o.key_or_group) {
            values.push(o.clone());
            continue;
        }
        match o.kind {
            OverrideKind::ForceAdd => {
                return Err(DefaultsError::ForceAddGroup {
                    input: o.input.clone(),
                }
                .into());
            }
            OverrideKind::Delete => {
                let name = match element.map(Element::as_str) {
                    None => None,
                    Some(Some(value)) => Some(value.to_owned()),
                    Some(None) => {
                        return Err(OverrideError::GroupDeletionValueType {
                            input: o.input.clone(),
                        }
                        .into());
                    }
                };
                groups.deletions.push((group_key(o), name));
            }
            OverrideKind::Add | OverrideKind::Change => {
                let value = match element.map(Element::group_choice).transpose()? {
                    Some(GroupChoice::One(name)) => GroupValue::Name(Some(name)),
                    Some(GroupChoice::Many(names)) => GroupValue::Options(names),
                    None => {
                        return Err(OverrideError::GroupValueType {
                            type_name: "NoneType",
                        }
                        .into());
                    }
                };
                if o.kind == OverrideKind::Add {
                    groups
                        .appends
                        .push((o.key_or_group.clone(), o.package.clone(), value));
                } else {
                    if let Some(e) = element {
                        groups.shown.push((group_key(o), e.python_str()));
                    }
                    groups.choices.push((group_key(o), value));
                }
            }
        }
    }
    Ok((groups, values))
}

/// The defaults list only, as `--info defaults` computes it (no value overrides, no sweep checks).
pub(crate) fn compute_defaults(
    repo: &mut Repository,
    config_name: &str,
    overrides: &[String],
) -> Result<DefaultsList, ComposeError> {
    let parsed = parse_overrides(overrides)?;
    process_search_path(repo, config_name, &parsed)?;
    let (groups, _) = classify(repo, &parsed)?;
    Ok(defaults::create_defaults_list(
        repo,
        config_name,
        &groups,
        true,
        false,
    )?)
}

/// Compose the full config (job config plus `hydra` node).
pub fn compose(repo: &mut Repository, req: &ComposeRequest<'_>) -> Result<Composed, ComposeError> {
    let parsed = parse_overrides(req.overrides)?;
    process_search_path(repo, req.config_name, &parsed)?;
    validate_sweeps(&parsed, req.mode)?;
    let (groups, value_overrides) = classify(repo, &parsed)?;
    let defaults_list = defaults::create_defaults_list(
        repo,
        req.config_name,
        &groups,
        true,
        req.mode == RunMode::Multirun,
    )?;

    let mut cfg = Node::empty_dict();
    // Once Hydra's structured `hydra/config` is merged, the `hydra` node is typed by its schema.
    let mut hydra_typed = false;
    for d in &defaults_list.defaults {
        let Some(loaded) = repo.load(&d.config_path)? else {
            continue;
        };
        let is_hydra_config = d.config_path == "hydra/config";
        if is_hydra_config && !loaded.file.starts_with("structured://") {
            return Err(ComposeError::SchemaWithDefaults {
                config_path: d.config_path.clone(),
            });
        }
        let mut config = loaded.root.clone();
        if let Some(dict) = config.as_dict_mut() {
            dict.shift_remove(&Key::from("defaults"));
        }
        // Hydra checks the config placed at its package: `hydra.searchpath` in a config of group `g` lands
        // at `g.hydra.searchpath`, which is allowed.
        let embedded = embed(config, &d.package);
        if !d.primary
            && d.config_path != "hydra/config"
            && embedded
                .get_path("hydra.searchpath")
                .is_some_and(|n| !matches!(n.value, Value::NULL | Value::Missing))
        {
            return Err(ComposeError::SearchPathOutsidePrimary {
                config_path: d.config_path.clone(),
            });
        }
        let mut embedded = embedded;
        let schema_error = |error| ComposeError::HydraSchema {
            config_path: d.config_path.clone(),
            error,
        };
        if hydra_typed
            && let Some(src) = embedded
                .as_dict_mut()
                .and_then(|e| e.get_mut(&Key::from("hydra")))
        {
            hydra_conf::conform_merge(src, cfg.get("hydra")).map_err(schema_error)?;
        }
        merge(&mut cfg, embedded).map_err(|message| ComposeError::Merge {
            config_path: d.config_path.clone(),
            message,
        })?;
        if is_hydra_config {
            hydra_typed = true;
            if let Some(node) = cfg
                .as_dict_mut()
                .and_then(|c| c.get_mut(&Key::from("hydra")))
            {
                hydra_conf::conform_after_schema(node).map_err(schema_error)?;
            }
        }
    }
    for o in &value_overrides {
        apply_override(&mut cfg, o)?;
    }
    let (hydra_overrides, task_overrides): (Vec<&Override>, Vec<&Override>) =
        parsed.iter().partition(|o| o.is_hydra_override());
    // The override lines are stored in `hydra.overrides.{hydra,task}` as strings, and OmegaConf checks the
    // syntax of any `${` in them when they are appended.
    check_override_lines(&hydra_overrides, &task_overrides)?;
    let info = RuntimeInfo {
        job_name: req.job_name,
        config_name: req.config_name,
        hydra_overrides: hydra_overrides.iter().map(|o| o.input.clone()).collect(),
        task_overrides: task_overrides
            .iter()
            .map(|o| (o.key_or_group.clone(), o.input.clone()))
            .collect(),
        choices: &defaults_list.known_choices,
        sources: repo.sources(),
    };
    hydra::fill_runtime(&mut cfg, &info);
    Ok(Composed {
        config: cfg,
        defaults: defaults_list,
    })
}

/// Validate the override lines as OmegaConf does when Hydra appends them to `hydra.overrides.*`.
fn check_override_lines(
    hydra_overrides: &[&Override],
    task_overrides: &[&Override],
) -> Result<(), InterpolationError> {
    let lines = |list: &[&Override]| {
        Node::new(Value::List(
            list.iter().map(|o| Node::str(o.input.clone())).collect(),
        ))
    };
    let mut overrides = Dict::new();
    overrides.insert(Key::from("hydra"), lines(hydra_overrides));
    overrides.insert(Key::from("task"), lines(task_overrides));
    let mut hydra = Dict::new();
    hydra.insert(Key::from("overrides"), Node::new(Value::Dict(overrides)));
    let mut root = Dict::new();
    root.insert(Key::from("hydra"), Node::new(Value::Dict(hydra)));
    interpolate::validate_tree(&Node::new(Value::Dict(root)))
}

/// Put `config` under a dotted package (`a.b` → `{a: {b: config}}`); empty package = at the root.
fn embed(config: Node, package: &str) -> Node {
    if package.is_empty() {
        return config;
    }
    package.rsplit('.').fold(config, |inner, key| {
        let mut dict = Dict::new();
        dict.insert(Key::from(key), inner);
        Node::new(Value::Dict(dict))
    })
}

/// OmegaConf's merge of `src` into `dest`. The error text is OmegaConf's.
pub(crate) fn merge(dest: &mut Node, src: Node) -> Result<(), String> {
    match (&mut dest.value, src.value) {
        (Value::Dict(d), Value::Dict(s)) => {
            for (key, value) in s {
                match d.get_mut(&key) {
                    Some(existing) => {
                        if matches!(value.value, Value::Missing) {
                            continue;
                        }
                        if existing.as_dict().is_some() && value.as_dict().is_some() {
                            merge(existing, value)?;
                        } else if existing.as_dict().is_some() && value.as_list().is_some()
                            || existing.as_list().is_some() && value.as_dict().is_some()
                        {
                            return Err("Cannot merge DictConfig with ListConfig".into());
                        } else {
                            *existing = value;
                        }
                    }
                    None => {
                        d.insert(key, value);
                    }
                }
            }
            Ok(())
        }
        (Value::Dict(_), Value::List(_)) | (Value::List(_), Value::Dict(_)) => {
            Err("Cannot merge DictConfig with ListConfig".into())
        }
        (_, Value::Missing) => Ok(()),
        (_, value) => {
            dest.value = value;
            dest.origin = src.origin;
            Ok(())
        }
    }
}

/// Follow a dotted key (list indices as numbers) without resolving anything. `None` if absent.
fn select<'n>(root: &'n Node, key: &str) -> Option<&'n Node> {
    let mut cur = root;
    for part in split_key(key) {
        cur = match &cur.value {
            Value::Dict(d) => d.get(&Key::from(part))?,
            Value::List(l) => l.get(part.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// `a.b[0].c` → `["a", "b", "0", "c"]`.
fn split_key(key: &str) -> Vec<String> {
    let mut parts = Vec::new();
    for dotted in key.split('.') {
        let mut rest = dotted;
        if let Some(idx) = rest.find('[') {
            parts.push(rest[..idx].to_owned());
            rest = &rest[idx..];
            while let Some(inner) = rest.strip_prefix('[') {
                let Some(end) = inner.find(']') else { break };
                parts.push(inner[..end].to_owned());
                rest = &inner[end + 1..];
            }
        } else {
            parts.push(rest.to_owned());
        }
    }
    parts
}

/// Apply one value override to the composed config (Hydra's `_apply_overrides_to_config`).
fn apply_override(cfg: &mut Node, o: &Override) -> Result<(), ComposeError> {
    if o.package.is_some() {
        return Err(ComposeError::NotAGroup {
            input: o.input.clone(),
            key: o.key_or_group.clone(),
        });
    }
    let key = o.key_or_group.as_str();
    let origin = Origin::Override(o.input.as_str().into());
    let value = o.element().map(|e| e.to_node(&origin));
    if let Some(value) = &value {
        // OmegaConf checks keys and interpolation syntax when it wraps the value, before anything else.
        let invalid = |message: String| ComposeError::MergeOverride {
            input: o.input.clone(),
            message,
        };
        if has_null_key(value) {
            return Err(invalid("Incompatible key type 'NoneType'".into()));
        }
        interpolate::validate_tree(value).map_err(|e| invalid(e.to_string()))?;
    }
    // `hydra.*` values are typed by Hydra's schema (env_set: Dict[str, str], chdir: Optional[bool], …).
    let hydra_path: Option<Vec<String>> = if key == "hydra" {
        Some(Vec::new())
    } else {
        key.strip_prefix("hydra.").map(split_key)
    };
    let schema_error = |e: SchemaError| ComposeError::MergeOverride {
        input: o.input.clone(),
        message: e.to_string(),
    };
    let mut value = value;
    if let (Some(path), Some(v), false) =
        (&hydra_path, value.as_mut(), o.kind == OverrideKind::Delete)
    {
        hydra_conf::conform_override(path, v, cfg.get("hydra")).map_err(schema_error)?;
    }
    let existing = select(cfg, key).filter(|n| !matches!(n.value, Value::NULL | Value::Missing));
    match o.kind {
        OverrideKind::Delete => {
            let Some(raw) = existing else {
                return Err(ComposeError::DeleteMissing { key: key.into() });
            };
            // Hydra compares with `OmegaConf.select(cfg, key)`: a leaf comes back resolved (a failure fails
            // the override), a container as it is (its str() unresolved, its == resolved).
            let refused = hydra_path
                .as_deref()
                .and_then(|path| hydra_conf::deletion_refused(path, cfg.get("hydra")));
            let refuse = |message: String| ComposeError::MergeOverride {
                input: o.input.clone(),
                message,
            };
            if raw.value.is_container() && value.is_none() {
                if let Some(message) = refused {
                    return Err(refuse(message));
                }
                delete(cfg, key);
                return Ok(());
            }
            let resolved =
                interpolate::resolve_at(cfg, key, &ResolveContext::new()).map_err(|e| {
                    ComposeError::MergeOverride {
                        input: o.input.clone(),
                        message: e.kind().to_string(),
                    }
                })?;
            if matches!(resolved.value, Value::NULL) {
                return Err(ComposeError::DeleteMissing { key: key.into() });
            }
            if let Some(expected) = &value
                && !python_eq(&resolved.value, &expected.value)
            {
                let shown = if raw.value.is_container() {
                    raw
                } else {
                    &resolved
                };
                return Err(ComposeError::DeleteValueMismatch {
                    key: key.into(),
                    actual: shown.value.python_str(),
                    expected: expected.value.python_str(),
                });
            }
            if let Some(message) = refused {
                return Err(refuse(message));
            }
            delete(cfg, key);
            Ok(())
        }
        OverrideKind::Add => {
            let value = value.unwrap_or_else(|| Node::new(Value::NULL));
            if existing.is_some() && !value.value.is_container() {
                return Err(ComposeError::AppendExisting {
                    key: key.into(),
                    without_plus: o.input.get(1..).unwrap_or("").into(),
                    input: o.input.clone(),
                });
            }
            update(cfg, key, value, true).map_err(|e| e.into_compose(o))
        }
        OverrideKind::ForceAdd => update(
            cfg,
            key,
            value.unwrap_or_else(|| Node::new(Value::NULL)),
            true,
        )
        .map_err(|e| e.into_compose(o)),
        OverrideKind::Change => update(
            cfg,
            key,
            value.unwrap_or_else(|| Node::new(Value::NULL)),
            false,
        )
        .map_err(|e| match e.into_compose(o) {
            ComposeError::OverrideMissingKey { key, input, .. } => {
                ComposeError::OverrideMissingKey {
                    did_you_mean: did_you_mean(cfg, &key),
                    key,
                    input,
                }
            }
            other => other,
        }),
    }
}

enum UpdateError {
    /// Struct mode refused a new key.
    MissingKey,
    /// Any other OmegaConf failure.
    Other(String),
}

impl UpdateError {
    fn into_compose(self, o: &Override) -> ComposeError {
        match self {
            UpdateError::MissingKey => ComposeError::OverrideMissingKey {
                key: o.key_or_group.clone(),
                input: o.input.clone(),
                did_you_mean: None,
            },
            UpdateError::Other(message) => ComposeError::MergeOverride {
                input: o.input.clone(),
                message,
            },
        }
    }
}

/// The existing key closest to `key` when one segment of it is a typo: the first segment that is not in its
/// dict is replaced by the nearest key there (`actor.optim.lrr` → `actor.optim.lr`).
fn did_you_mean(cfg: &Node, key: &str) -> Option<String> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = cfg;
    for (i, part) in parts.iter().enumerate() {
        let dict = node.as_dict()?;
        match node.get(part) {
            Some(child) => node = child,
            None => {
                let known: Vec<String> = dict
                    .keys()
                    .filter_map(|k| k.as_str())
                    .map(str::to_owned)
                    .collect();
                let known: Vec<&str> = known.iter().map(String::as_str).collect();
                let near = crate::did_you_mean::closest(part, &known)?;
                let mut fixed: Vec<&str> = parts.clone();
                fixed[i] = &near;
                let candidate = fixed.join(".");
                // Only a key that exists (the rest of the path included) is worth suggesting.
                return cfg.get_path(&candidate).map(|_| candidate.clone());
            }
        }
    }
    None
}

/// OmegaConf.update(cfg, key, value, merge=True) under struct mode; `force_add` lifts struct mode.
fn update(cfg: &mut Node, key: &str, value: Node, force_add: bool) -> Result<(), UpdateError> {
    let parts = split_key(key);
    let Some((last, path)) = parts.split_last() else {
        return Err(UpdateError::MissingKey);
    };
    let mut root = cfg;
    for part in path {
        root = match &mut root.value {
            Value::Dict(d) => {
                let k = Key::from(part.clone());
                if !d.contains_key(&k) && !force_add {
                    return Err(UpdateError::MissingKey);
                }
                let child = d.entry(k).or_insert_with(Node::empty_dict);
                // A scalar on the way is replaced by an empty dict, as OmegaConf does.
                if !child.value.is_container() {
                    *child = Node::empty_dict();
                }
                child
            }
            Value::List(l) => {
                let idx: usize = part.parse().map_err(|_| {
                    UpdateError::Other(format!(
                        "ListConfig indices must be integers or slices, not str: '{part}'"
                    ))
                })?;
                let len = l.len();
                let child = l.get_mut(idx).ok_or_else(|| {
                    UpdateError::Other(format!("list index {idx} out of range (size {len})"))
                })?;
                if !child.value.is_container() {
                    *child = Node::empty_dict();
                }
                child
            }
            _ => return Err(UpdateError::MissingKey),
        };
    }
    match &mut root.value {
        Value::Dict(d) => {
            let k = Key::from(last.clone());
            match d.get_mut(&k) {
                Some(existing) if existing.value.is_container() && value.value.is_container() => {
                    merge_struct(existing, value, force_add)
                }
                Some(existing) => {
                    *existing = value;
                    Ok(())
                }
                None if force_add => {
                    d.insert(k, value);
                    Ok(())
                }
                None => Err(UpdateError::MissingKey),
            }
        }
        Value::List(l) => {
            let idx: usize = last.parse().map_err(|_| {
                UpdateError::Other(format!(
                    "ListConfig indices must be integers or slices, not str: '{last}'"
                ))
            })?;
            let len = l.len();
            let slot = l.get_mut(idx).ok_or_else(|| {
                UpdateError::Other(format!("list index {idx} out of range (size {len})"))
            })?;
            if slot.value.is_container() && value.value.is_container() {
                return merge_struct(slot, value, force_add);
            }
            *slot = value;
            Ok(())
        }
        _ => Err(UpdateError::MissingKey),
    }
}

/// Merge an override's dict/list value into an existing container; new dict keys need `force_add`.
fn merge_struct(dest: &mut Node, src: Node, force_add: bool) -> Result<(), UpdateError> {
    if !force_add {
        check_struct(dest, &src)?;
    }
    merge(dest, src).map_err(UpdateError::Other)
}

fn check_struct(dest: &Node, src: &Node) -> Result<(), UpdateError> {
    if let (Value::Dict(d), Value::Dict(s)) = (&dest.value, &src.value) {
        for (key, value) in s {
            match d.get(key) {
                None => return Err(UpdateError::MissingKey),
                Some(existing) => check_struct(existing, value)?,
            }
        }
    }
    Ok(())
}

fn delete(cfg: &mut Node, key: &str) {
    let parts = split_key(key);
    let Some((last, path)) = parts.split_last() else {
        return;
    };
    let mut cur = cfg;
    for part in path {
        let next = match &mut cur.value {
            Value::Dict(d) => d.get_mut(&Key::from(part.clone())),
            Value::List(l) => part.parse::<usize>().ok().and_then(|i| l.get_mut(i)),
            _ => None,
        };
        let Some(next) = next else { return };
        cur = next;
    }
    match &mut cur.value {
        Value::Dict(d) => {
            d.shift_remove(&Key::from(last.clone()));
        }
        Value::List(l) => {
            if let Some(idx) = last.parse::<usize>().ok().filter(|i| *i < l.len()) {
                l.remove(idx);
            }
        }
        _ => {}
    }
}

/// OmegaConf refuses `None` as a dict key anywhere in a value.
fn has_null_key(node: &Node) -> bool {
    match &node.value {
        Value::Dict(d) => d
            .iter()
            .any(|(k, v)| *k == Key(Scalar::None) || has_null_key(v)),
        Value::List(items) => items.iter().any(has_null_key),
        _ => false,
    }
}

/// Python `==` between config values (`1 == 1.0`, `True == 1`).
fn python_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| python_eq(&p.value, &q.value))
        }
        (Value::Dict(x), Value::Dict(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| python_eq(&v.value, &w.value)))
        }
        (Value::Scalar(x), Value::Scalar(y)) => x.num_eq(y).unwrap_or_else(|| x == y),
        _ => a == b,
    }
}

/// The jobs of a multirun (Hydra's BasicSweeper): the cartesian product of every sweep's values, in
/// command-line order, each job getting every override as `key=value` (one value per sweep). A key given
/// twice keeps its first position and its last value, as the sweeper's ordered dict does.
pub(crate) fn sweep_combinations(
    repo: &Repository,
    overrides: &[String],
) -> Result<SweepProduct, ComposeError> {
    let parsed = parse_overrides(overrides)?;
    let mut lists: indexmap::IndexMap<String, Vec<String>> = indexmap::IndexMap::new();
    for o in &parsed {
        let key = o.key_element();
        let items = match &o.value {
            Some(OverrideValue::Sweep(sweep)) => {
                let options = repo
                    .group_exists(&o.key_or_group)
                    .then(|| repo.group_options(&o.key_or_group, ObjectType::Config));
                sweep
                    .expand(options.as_deref())?
                    .iter()
                    .map(|e| format!("{key}={}", e.to_override_text()))
                    .collect()
            }
            Some(OverrideValue::Element(e)) => vec![format!("{key}={}", e.to_override_text())],
            None => vec![format!("{key}=null")],
        };
        lists.insert(key, items);
    }
    Ok(SweepProduct::new(lists.into_values().collect()))
}

/// The cartesian product of a sweep's override lists, produced one job at a time (a sweep of 10^8 jobs costs
/// the memory of its lists, not of its jobs). The first override varies slowest, as in Hydra.
#[derive(Debug, Clone)]
pub(crate) struct SweepProduct {
    lists: Vec<Vec<String>>,
    /// Index into each list of the next job; `None` once every job was produced.
    next: Option<Vec<usize>>,
}

impl SweepProduct {
    pub fn new(lists: Vec<Vec<String>>) -> SweepProduct {
        let next = (!lists.iter().any(Vec::is_empty)).then(|| vec![0; lists.len()]);
        SweepProduct { lists, next }
    }

    /// The number of jobs in the whole sweep (saturating).
    pub fn total(&self) -> u128 {
        self.lists
            .iter()
            .fold(1u128, |n, l| n.saturating_mul(l.len() as u128))
    }
}

impl Iterator for SweepProduct {
    type Item = Vec<String>;

    fn next(&mut self) -> Option<Vec<String>> {
        let index = self.next.as_mut()?;
        let job = index
            .iter()
            .zip(&self.lists)
            .map(|(&i, list)| list[i].clone())
            .collect();
        // Odometer: the last list turns fastest.
        let mut pos = index.len();
        loop {
            if pos == 0 {
                self.next = None;
                break;
            }
            pos -= 1;
            index[pos] += 1;
            if index[pos] < self.lists[pos].len() {
                break;
            }
            index[pos] = 0;
        }
        Some(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(json: &str) -> Node {
        fn conv(v: serde_json::Value) -> Node {
            Node::new(match v {
                serde_json::Value::Null => Value::NULL,
                serde_json::Value::Bool(b) => Value::bool(b),
                serde_json::Value::Number(n) => n
                    .as_i64()
                    .map_or_else(|| Value::float(n.as_f64().unwrap_or(0.0)), Value::int),
                serde_json::Value::String(s) if s == "???" => Value::Missing,
                serde_json::Value::String(s) => Value::str(s),
                serde_json::Value::Array(a) => Value::List(a.into_iter().map(conv).collect()),
                serde_json::Value::Object(o) => Value::Dict(
                    o.into_iter()
                        .map(|(k, v)| (Key::from(k), conv(v)))
                        .collect(),
                ),
            })
        }
        conv(serde_json::from_str(json).unwrap_or(serde_json::Value::Null))
    }

    #[test]
    fn merge_follows_omegaconf() {
        let check = |dest: &str, src: &str, want: Result<&str, ()>| {
            let mut d = node(dest);
            let got = merge(&mut d, node(src)).map(|_| d);
            match want {
                Ok(w) => assert_eq!(got.ok(), Some(node(w)), "{dest} <- {src}"),
                Err(()) => assert!(got.is_err(), "{dest} <- {src}"),
            }
        };
        check(r#"{"x":1}"#, r#"{"x":"???"}"#, Ok(r#"{"x":1}"#));
        check(r#"{"x":"???"}"#, r#"{"x":{"a":1}}"#, Ok(r#"{"x":{"a":1}}"#));
        check(
            r#"{"x":{"a":1,"b":2}}"#,
            r#"{"x":{"b":3,"c":4}}"#,
            Ok(r#"{"x":{"a":1,"b":3,"c":4}}"#),
        );
        check(r#"{"x":[1,2]}"#, r#"{"x":[3]}"#, Ok(r#"{"x":[3]}"#));
        check(r#"{"x":{"a":1}}"#, r#"{"x":null}"#, Ok(r#"{"x":null}"#));
        check(r#"{"x":[1]}"#, r#"{"x":{"a":1}}"#, Err(()));
    }

    #[test]
    fn keys_split_on_dots_and_brackets() {
        assert_eq!(split_key("a.b[0].c"), ["a", "b", "0", "c"]);
        assert_eq!(split_key("a"), ["a"]);
    }

    #[test]
    fn update_respects_struct_mode() {
        let mut cfg = node(r#"{"a":1,"nested":{"b":2}}"#);
        assert!(matches!(
            update(&mut cfg, "x", node("1"), false),
            Err(UpdateError::MissingKey)
        ));
        assert!(matches!(
            update(&mut cfg, "nested", node(r#"{"c":1}"#), false),
            Err(UpdateError::MissingKey)
        ));
        assert!(update(&mut cfg, "nested.b", node("5"), false).is_ok());
        assert!(update(&mut cfg, "x.y", node("1"), true).is_ok());
        assert_eq!(cfg, node(r#"{"a":1,"nested":{"b":5},"x":{"y":1}}"#));
    }
}
