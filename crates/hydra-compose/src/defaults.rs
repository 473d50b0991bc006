//! Hydra defaults lists: parse `defaults:` entries, build the defaults tree, and flatten it to the ordered list.
//!
//! A faithful port of Hydra 1.3's `defaults_list.py` and `default_element.py` with `version_base="1.1"`
//! (so `_group_`/`_name_` package keywords and `hydra/` defaults without `override` still behave as in 1.1).
//! The walk visits each defaults list back to front, as Hydra does: that order decides which override wins,
//! the order of `hydra.runtime.choices`, and the error reported first.

use std::collections::{BTreeSet, HashMap};

use indexmap::IndexMap;

use crate::interpolate::{self, ResolveContext};
use crate::node::{Dict, Key, Node, Value};
use crate::scalar::Scalar;
use crate::search_path::{ObjectType, Repository, SearchPathError};

/// A config or group option that no source of the search path has ([`DefaultsError::NotFound`]).
#[derive(Debug)]
pub struct NotFound {
    pub parent: Option<String>,
    pub config_path: String,
    pub group: Option<String>,
    /// The group's options, when it is a group.
    pub options: Vec<String>,
    pub search_path: String,
    /// The program composing, named by the needs-Python line.
    pub program: &'static str,
}

/// A defaults-list composition error, worded as Hydra words it.
#[derive(Debug, thiserror::Error)]
pub enum DefaultsError {
    #[error(transparent)]
    SearchPath(#[from] SearchPathError),
    #[error(
        "Cannot find primary config '{config_path}'. Check that it's in your config search path.\n{search_path}{}",
        needs_python_hint(program, config_path, None, &[])
    )]
    MissingPrimary {
        config_path: String,
        search_path: String,
        /// The program composing, named by the needs-Python line.
        program: &'static str,
    },
    #[error(
        "{}{}{}{}",
        in_parent(&.0.parent),
        not_found_body(&.0.config_path, .0.group.as_deref(), &.0.options),
        .0.search_path,
        needs_python_hint(.0.program, &.0.config_path, .0.group.as_deref(), &.0.options)
    )]
    NotFound(Box<NotFound>),
    #[error(
        "You must specify '{key}', e.g, {key}=<OPTION>\nAvailable options:\n{}",
        tab_list(options)
    )]
    MustSpecify { key: String, options: Vec<String> },
    #[error("Missing ConfigDefault is not supported : {path}")]
    MissingConfigDefault { path: String },
    #[error("{}", override_not_used(key, value, containing.as_deref(), choices, *external))]
    OverrideNotUsed {
        key: String,
        value: String,
        containing: Option<String>,
        choices: Vec<String>,
        external: bool,
    },
    #[error("Could not delete '{desc}'. No match in the defaults list")]
    DeletionNotUsed { desc: String },
    #[error("Multiple values for {key}. To override a value use 'override {key}: {prev}'")]
    MultipleValues { key: String, prev: String },
    #[error("Duplicate _self_ defined in {config_path}")]
    DuplicateSelf { config_path: String },
    #[error("_self_@PACKAGE is not supported")]
    SelfWithPackage,
    #[error(
        "In {parent}: Override '{okey} : {oval}' is defined before '{key}: {name}'.\nOverrides must be at the end of the defaults list"
    )]
    OverrideNotLast {
        parent: String,
        okey: String,
        oval: String,
        key: String,
        name: String,
    },
    #[error(
        "{parent}: Default List Overrides are not allowed in the subtree\nof an in interpolated config group (override {key}={name})."
    )]
    OverrideInInterpolatedSubtree {
        parent: String,
        key: String,
        name: String,
    },
    #[error("In '{path}': Defaults List interpolation is not supported in options list items")]
    InterpolationInOptions { path: String },
    #[error("Error resolving interpolation '{value}'{}", if keys.is_empty() { String::new() } else { format!(", possible interpolation keys: {}", keys.join(", ")) })]
    Interpolation { value: String, keys: Vec<String> },
    #[error("defaults list cycle: {chain}")]
    Cycle { chain: String },
    #[error("{key} appears more than once in the final defaults list")]
    Duplicate { key: String },
    #[error("force-add of config groups is not supported: '{input}'")]
    ForceAddGroup { input: String },
    #[error("Config group override deletion value must be a string : {input}")]
    DeletionValueNotString { input: String },
    #[error("Config group override must be a string or a list. Got {type_name}")]
    GroupValueType { type_name: String },
    #[error("Invalid defaults list in '{config_path}', defaults must be a list (got {got})")]
    NotAList { config_path: String, got: String },
    #[error("In {config_path}: Too many keys in default item {item}")]
    TooManyKeys { config_path: String, item: String },
    #[error("In {config_path}: Missing group name in {item}")]
    MissingGroupName { config_path: String, item: String },
    #[error("Unsupported item value in defaults : {type_name}. Supported: string or list")]
    UnsupportedItemValue { type_name: String },
    #[error("Unsupported item value in defaults : {type_name}, nested list items must be strings")]
    UnsupportedNestedValue { type_name: String },
    #[error("Unsupported type in defaults : {type_name}")]
    UnsupportedItemType { type_name: String },
}

fn in_parent(parent: &Option<String>) -> String {
    parent
        .as_ref()
        .map(|p| format!("In '{p}': "))
        .unwrap_or_default()
}

fn tab_list(options: &[String]) -> String {
    options
        .iter()
        .map(|o| format!("\t{o}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn not_found_body(config_path: &str, group: Option<&str>, options: &[String]) -> String {
    match group {
        Some(group) if !options.is_empty() => {
            format!(
                "Could not find '{config_path}'\n\nAvailable options in '{group}':\n{}",
                tab_list(options)
            )
        }
        Some(_) => format!("Could not find '{config_path}'\n"),
        None => format!("Could not load '{config_path}'.\n"),
    }
}

/// After Hydra's text, a line for configs that only Python code could have provided: a Hydra plugin's option
/// (`hydra/launcher/joblib`), or a config or group option an app registers with `ConfigStore` (a structured
/// config schema). Empty for a group option whose group has YAML options (most likely a typo; Hydra's list of
/// options says it).
fn needs_python_hint(
    program: &str,
    config_path: &str,
    group: Option<&str>,
    options: &[String],
) -> String {
    match group {
        Some(g) if g == "hydra" || g.starts_with("hydra/") => format!(
            "\nneeds Python: '{config_path}' would come from a Hydra plugin (a `hydra_plugins` package: Python \
             code); {program} has only Hydra's built-in options of '{g}'"
        ),
        Some(_) if !options.is_empty() => String::new(),
        Some(g) => format!(
            "\nneeds Python: if your app registers '{config_path}' with ConfigStore \
             (`cs.store(group=\"{g}\", name=...)`), that is Python code {program} does not run; write it as \
             {config_path}.yaml in a config directory"
        ),
        None => format!(
            "\nneeds Python: if your app registers '{config_path}' with ConfigStore \
             (`cs.store(name=\"{config_path}\", node=...)`, a structured config schema), that is Python code \
             {program} does not run; write it as {config_path}.yaml in a config directory"
        ),
    }
}

fn override_not_used(
    key: &str,
    value: &str,
    containing: Option<&str>,
    choices: &[String],
    external: bool,
) -> String {
    let mut msg = match choices {
        [] => format!("Could not override '{key}'. No match in the defaults list."),
        [one] => format!("Could not override '{key}'.\nDid you mean to override {one}?"),
        many => format!(
            "Could not override '{key}'.\nDid you mean to override one of {}?",
            many.join(", ")
        ),
    };
    if let Some(path) = containing {
        msg = format!("In '{path}': {msg}");
    }
    if external {
        msg.push_str(&format!(
            "\nTo append to your default list use +{key}={value}"
        ));
    }
    msg
}

/// The value of a group default: a config name (or null), or a list of names.
#[derive(Debug, Clone, PartialEq)]
pub enum GroupValue {
    Name(Option<String>),
    Options(Vec<String>),
}

impl GroupValue {
    /// How Python's `str()` shows the value (for "To append ... use +key=value").
    pub(crate) fn python_str(&self) -> String {
        match self {
            GroupValue::Name(Some(n)) => n.clone(),
            GroupValue::Name(None) => "None".into(),
            GroupValue::Options(o) => format!(
                "[{}]",
                o.iter()
                    .map(|x| format!("'{x}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// What kind of defaults-list element this is.
#[derive(Debug, Clone, PartialEq)]
pub enum DefaultKind {
    /// The virtual root holding `hydra/config` and the primary config.
    Virtual,
    /// A config path (`db/mysql`, `_self_`, `/abs/path`).
    Config { path: String },
    /// A group default (`db: mysql`).
    Group {
        group: String,
        value: GroupValue,
        is_override: bool,
        external_append: bool,
    },
}

/// One element of a defaults list (Hydra's `InputDefault`).
#[derive(Debug, Clone, PartialEq)]
pub struct InputDefault {
    pub kind: DefaultKind,
    pub package: Option<String>,
    parent_base_dir: Option<String>,
    parent_package: Option<String>,
    package_header: Option<String>,
    pub primary: bool,
    pub optional: bool,
    pub deleted: bool,
}

impl InputDefault {
    fn new(kind: DefaultKind, package: Option<String>, optional: bool) -> InputDefault {
        // `_here_` means "the parent's package".
        let package = package.map(|p| if p == "_here_" { String::new() } else { p });
        InputDefault {
            kind,
            package,
            parent_base_dir: None,
            parent_package: None,
            package_header: None,
            primary: false,
            optional,
            deleted: false,
        }
    }

    pub fn config(
        path: &str,
        package: Option<String>,
        optional: bool,
    ) -> Result<InputDefault, DefaultsError> {
        if path == "_self_" && package.is_some() {
            return Err(DefaultsError::SelfWithPackage);
        }
        Ok(InputDefault::new(
            DefaultKind::Config { path: path.into() },
            package,
            optional,
        ))
    }

    pub fn group(
        group: &str,
        value: GroupValue,
        package: Option<String>,
        optional: bool,
        is_override: bool,
    ) -> InputDefault {
        InputDefault::new(
            DefaultKind::Group {
                group: group.into(),
                value,
                is_override,
                external_append: false,
            },
            package,
            optional,
        )
    }

    fn virtual_root() -> InputDefault {
        InputDefault::new(DefaultKind::Virtual, None, false)
    }

    pub(crate) fn is_virtual(&self) -> bool {
        matches!(self.kind, DefaultKind::Virtual)
    }

    pub(crate) fn is_self(&self) -> bool {
        match &self.kind {
            DefaultKind::Config { path } => path == "_self_",
            DefaultKind::Group {
                value: GroupValue::Name(Some(n)),
                ..
            } => n == "_self_",
            _ => false,
        }
    }

    pub(crate) fn is_override(&self) -> bool {
        matches!(
            self.kind,
            DefaultKind::Group {
                is_override: true,
                ..
            }
        )
    }

    fn is_external_append(&self) -> bool {
        matches!(
            self.kind,
            DefaultKind::Group {
                external_append: true,
                ..
            }
        )
    }

    fn is_group(&self) -> bool {
        matches!(self.kind, DefaultKind::Group { .. })
    }

    fn base_dir(&self) -> &str {
        self.parent_base_dir.as_deref().unwrap_or("")
    }

    fn update_parent(&mut self, parent_base_dir: Option<&str>, parent_package: Option<&str>) {
        self.parent_base_dir = parent_base_dir.map(str::to_owned);
        self.parent_package = parent_package.map(str::to_owned);
        if let Some(pkg) = &self.package
            && pkg.contains("_group_")
        {
            let resolved = pkg.replace("_group_", &self.default_package());
            self.package = Some(format!("_global_.{resolved}"));
        }
    }

    /// The group this element belongs to, relative to the config tree root.
    pub(crate) fn group_path(&self) -> String {
        match &self.kind {
            DefaultKind::Virtual => String::new(),
            DefaultKind::Config { path } => {
                let (path, absolute) = strip_abs(path);
                let group = path.rfind('/').map_or("", |idx| &path[..idx]);
                if absolute || self.base_dir().is_empty() {
                    group.to_owned()
                } else if group.is_empty() {
                    self.base_dir().to_owned()
                } else {
                    format!("{}/{group}", self.base_dir())
                }
            }
            DefaultKind::Group { group, .. } => {
                let (group, absolute) = strip_abs(group);
                if absolute || self.base_dir().is_empty() {
                    group.to_owned()
                } else {
                    format!("{}/{group}", self.base_dir())
                }
            }
        }
    }

    /// The config name (`mysql`); `None` for a null group default.
    pub fn name(&self) -> Option<String> {
        match &self.kind {
            DefaultKind::Virtual => None,
            DefaultKind::Config { path } => Some(
                path.rfind('/')
                    .map_or(path.as_str(), |idx| &path[idx + 1..])
                    .to_owned(),
            ),
            DefaultKind::Group {
                value: GroupValue::Name(n),
                ..
            } => n.clone(),
            DefaultKind::Group {
                value: GroupValue::Options(_),
                ..
            } => None,
        }
    }

    pub(crate) fn config_path(&self) -> String {
        match &self.kind {
            DefaultKind::Virtual => "<root>".into(),
            DefaultKind::Config { path } => {
                let (path, absolute) = strip_abs(path);
                if absolute || self.base_dir().is_empty() {
                    path.to_owned()
                } else {
                    format!("{}/{path}", self.base_dir())
                }
            }
            DefaultKind::Group { .. } => {
                format!(
                    "{}/{}",
                    self.group_path(),
                    self.name().unwrap_or_else(|| "None".into())
                )
            }
        }
    }

    fn default_package(&self) -> String {
        self.group_path().replace('/', ".")
    }

    fn relative_group_path(&self) -> String {
        match &self.kind {
            DefaultKind::Virtual => String::new(),
            DefaultKind::Config { path } => {
                let (path, _) = strip_abs(path);
                path.rfind('/').map_or("", |idx| &path[..idx]).to_owned()
            }
            DefaultKind::Group { group, .. } => strip_abs(group).0.to_owned(),
        }
    }

    fn get_package(&self, default_to_header: bool) -> Option<String> {
        if self.package.is_none() && default_to_header {
            self.package_header.clone()
        } else {
            self.package.clone()
        }
    }

    /// The package this element's config is merged into (`db`, `hydra.launcher`, empty for global).
    pub(crate) fn final_package(&self, default_to_header: bool) -> String {
        let name = match &self.kind {
            DefaultKind::Group {
                value: GroupValue::Options(_),
                ..
            } => None,
            _ => self.name(),
        };
        let parent_package = self.parent_package.as_deref().unwrap_or("");
        let mut package = self
            .get_package(default_to_header)
            .unwrap_or_else(|| self.relative_group_path().replace('/', "."));
        if let Some(name) = name
            && package.contains("_name_")
        {
            package = package.replace("_name_", &name);
        }
        let joined = if parent_package.is_empty() {
            package
        } else if package.is_empty() {
            parent_package.to_owned()
        } else {
            format!("{parent_package}.{package}")
        };
        match joined.rfind("_global_") {
            None => joined,
            Some(idx) => joined
                .get(idx + "_global_".len() + 1..)
                .unwrap_or("")
                .to_owned(),
        }
    }

    fn set_package_header(&mut self, header: Option<&str>) {
        let Some(header) = header else { return };
        if header == "_group_" {
            return;
        }
        let mut header = if header == "_global_" || header.starts_with("_global_.") {
            header.to_owned()
        } else if header.is_empty() {
            "_global_".to_owned()
        } else {
            format!("_global_.{header}")
        };
        header = header.replace("_group_", &self.default_package());
        self.package_header = Some(header);
    }

    /// `group[@package]` as the user writes it on the command line to override this default.
    pub(crate) fn override_key(&self) -> String {
        let default_pkg = self.default_package();
        let mut final_pkg = self.final_package(false);
        let key = self.group_path();
        if default_pkg != final_pkg {
            if final_pkg.is_empty() {
                final_pkg = "_global_".into();
            }
            return format!("{key}@{final_pkg}");
        }
        key
    }

    fn is_interpolation(&self) -> bool {
        match &self.kind {
            DefaultKind::Config { .. } => is_interpolation(&self.config_path()),
            DefaultKind::Group {
                value: GroupValue::Name(Some(n)),
                ..
            } => is_interpolation(n),
            _ => false,
        }
    }

    fn is_missing(&self) -> bool {
        match &self.kind {
            DefaultKind::Config { .. } => self.name().as_deref() == Some("???"),
            DefaultKind::Group {
                value: GroupValue::Name(Some(n)),
                ..
            } => n == "???",
            _ => false,
        }
    }

    /// How `--info defaults-tree` shows the element.
    pub(crate) fn tree_label(&self) -> String {
        match &self.kind {
            DefaultKind::Group { .. } => format!(
                "{}: {}",
                self.override_key(),
                self.name().unwrap_or_else(|| "null".into())
            ),
            _ => self.config_path(),
        }
    }
}

fn strip_abs(path: &str) -> (&str, bool) {
    match path.strip_prefix('/') {
        Some(rest) => (rest, true),
        None => (path, false),
    }
}

/// True if `text` is an OmegaConf interpolation (contains `${`), as Hydra decides for defaults.
fn is_interpolation(text: &str) -> bool {
    text.contains("${")
}

/// A node of the defaults tree.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeNode {
    pub node: InputDefault,
    /// `None` for a leaf that was never expanded.
    pub children: Option<Vec<Child>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Child {
    Leaf(InputDefault),
    Tree(TreeNode),
}

/// One entry of the flat defaults list: a config to merge, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultDefault {
    pub config_path: String,
    pub parent: Option<String>,
    pub package: String,
    pub is_self: bool,
    pub primary: bool,
    pub override_key: Option<String>,
}

/// Group overrides from the command line, already told apart from value overrides.
#[derive(Debug, Clone, Default)]
pub(crate) struct GroupOverrides {
    /// `group[@pkg]=value` in command-line order (the key includes `@pkg`).
    pub choices: Vec<(String, GroupValue)>,
    /// How Python's `str()` shows each choice's value as typed (`[1, 2, 3]`: a list of ints), by key, for
    /// Hydra's "To append to your default list use +key=value" hint.
    pub shown: Vec<(String, String)>,
    /// `+group[@pkg]=value`.
    pub appends: Vec<(String, Option<String>, GroupValue)>,
    /// `~group[@pkg][=value]` (the key includes `@pkg`).
    pub deletions: Vec<(String, Option<String>)>,
}

/// The outcome of defaults processing.
#[derive(Debug, Clone)]
pub struct DefaultsList {
    pub defaults: Vec<ResultDefault>,
    pub tree: TreeNode,
    /// `override key → chosen option`, in Hydra's order (becomes `hydra.runtime.choices`).
    pub known_choices: IndexMap<String, Option<String>>,
}

#[derive(Debug, Clone)]
struct OverrideMeta {
    external: bool,
    containing: Option<String>,
    used: bool,
    /// The value as the command line typed it, in Python's `str()` (see [`GroupOverrides::shown`]).
    shown: Option<String>,
}

#[derive(Debug)]
struct Overrides {
    choices: IndexMap<String, GroupValue>,
    meta: IndexMap<String, OverrideMeta>,
    appends: Vec<InputDefault>,
    known_choices: IndexMap<String, Option<String>>,
    known_per_group: HashMap<String, BTreeSet<String>>,
    deletions: IndexMap<String, (Option<String>, bool)>,
}

impl Overrides {
    fn new(input: &GroupOverrides) -> Overrides {
        let mut choices = IndexMap::new();
        let mut meta = IndexMap::new();
        for (key, value) in &input.choices {
            choices.insert(key.clone(), value.clone());
            let shown = input
                .shown
                .iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone());
            meta.insert(
                key.clone(),
                OverrideMeta {
                    external: true,
                    containing: None,
                    used: false,
                    shown,
                },
            );
        }
        let appends = input
            .appends
            .iter()
            .map(|(group, package, value)| {
                let mut d =
                    InputDefault::group(group, value.clone(), package.clone(), false, false);
                if let DefaultKind::Group {
                    external_append, ..
                } = &mut d.kind
                {
                    *external_append = true;
                }
                d
            })
            .collect();
        let deletions = input
            .deletions
            .iter()
            .map(|(k, v)| (k.clone(), (v.clone(), false)))
            .collect();
        Overrides {
            choices,
            meta,
            appends,
            known_choices: IndexMap::new(),
            known_per_group: HashMap::new(),
            deletions,
        }
    }

    fn add_override(&mut self, parent_config_path: &str, d: &InputDefault) {
        let key = d.override_key();
        if self.choices.contains_key(&key) {
            return;
        }
        if let DefaultKind::Group { value, .. } = &d.kind {
            self.choices.insert(key.clone(), value.clone());
            self.meta.insert(
                key,
                OverrideMeta {
                    external: false,
                    containing: Some(parent_config_path.into()),
                    used: false,
                    shown: None,
                },
            );
        }
    }

    fn is_overridden(&self, d: &InputDefault) -> bool {
        d.is_group() && self.choices.contains_key(&d.override_key())
    }

    fn override_default_option(&mut self, d: &mut InputDefault) {
        let key = d.override_key();
        if let Some(value) = self.choices.get(&key) {
            if let DefaultKind::Group { value: v, .. } = &mut d.kind {
                *v = value.clone();
            }
            if let Some(meta) = self.meta.get_mut(&key) {
                meta.used = true;
            }
        }
    }

    fn set_known_choice(&mut self, d: &InputDefault) -> Result<(), DefaultsError> {
        if !d.is_group() {
            return Ok(());
        }
        let key = d.override_key();
        let name = d.name();
        match self.known_choices.get(&key) {
            None => {
                self.known_choices.insert(key.clone(), name);
            }
            Some(prev) if *prev != name => {
                return Err(DefaultsError::MultipleValues {
                    key,
                    prev: prev.clone().unwrap_or_else(|| "None".into()),
                });
            }
            Some(_) => {}
        }
        self.known_per_group
            .entry(d.group_path())
            .or_default()
            .insert(key);
        Ok(())
    }

    fn is_deleted(&self, d: &InputDefault) -> bool {
        if !d.is_group() {
            return false;
        }
        match self.deletions.get(&d.override_key()) {
            None => false,
            Some((None, _)) => true,
            Some((Some(name), _)) => d.name().as_deref() == Some(name.as_str()),
        }
    }

    fn delete(&mut self, d: &mut InputDefault) {
        d.deleted = true;
        if let Some(entry) = self.deletions.get_mut(&d.override_key()) {
            entry.1 = true;
        }
    }

    fn ensure_used(&self) -> Result<(), DefaultsError> {
        for (key, meta) in &self.meta {
            if meta.used {
                continue;
            }
            let group = key.split('@').next().unwrap_or(key);
            let choices: Vec<String> = self
                .known_per_group
                .get(group)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            let value = meta.shown.clone().unwrap_or_else(|| {
                self.choices
                    .get(key)
                    .map(GroupValue::python_str)
                    .unwrap_or_default()
            });
            return Err(DefaultsError::OverrideNotUsed {
                key: key.clone(),
                value,
                containing: meta.containing.clone(),
                choices,
                external: meta.external,
            });
        }
        for (key, (name, used)) in &self.deletions {
            if !used {
                let desc = match name {
                    Some(n) => format!("{key}={n}"),
                    None => key.clone(),
                };
                return Err(DefaultsError::DeletionNotUsed { desc });
            }
        }
        Ok(())
    }
}

/// Parse the `defaults` entry of a loaded config into elements (Hydra's `_create_defaults_list`).
pub(crate) fn parse_defaults(
    config_path: &str,
    root: &Node,
) -> Result<Vec<InputDefault>, DefaultsError> {
    let Some(raw) = root.get("defaults") else {
        return Ok(Vec::new());
    };
    let items = match &raw.value {
        Value::List(items) => items,
        Value::Dict(_) => {
            return Err(DefaultsError::NotAList {
                config_path: config_path.into(),
                got: "mapping".into(),
            });
        }
        other => {
            return Err(DefaultsError::NotAList {
                config_path: config_path.into(),
                got: python_type(other).into(),
            });
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        out.push(parse_item(config_path, item)?);
    }
    Ok(out)
}

fn parse_item(config_path: &str, item: &Node) -> Result<InputDefault, DefaultsError> {
    match &item.value {
        Value::Scalar(Scalar::Str(text)) => {
            let (path, package) = split_group(text);
            InputDefault::config(path, package, false)
        }
        Value::Dict(dict) => {
            let mut entries: Vec<(&Key, &Node)> = dict.iter().collect();
            // version_base 1.1: `optional: true` beside the group key is the legacy spelling of `optional`.
            let mut legacy_optional = None;
            if entries.len() > 1
                && let Some(pos) = entries
                    .iter()
                    .position(|(k, _)| k.as_str() == Some("optional"))
            {
                legacy_optional = Some(matches!(
                    entries[pos].1.value,
                    Value::Scalar(Scalar::Bool(true))
                ));
                entries.remove(pos);
            }
            let (key, node) = match entries.as_slice() {
                [] => {
                    return Err(DefaultsError::MissingGroupName {
                        config_path: config_path.into(),
                        item: Value::python_repr(&item.value),
                    });
                }
                [one] => *one,
                _ => {
                    return Err(DefaultsError::TooManyKeys {
                        config_path: config_path.into(),
                        item: Value::python_repr(&item.value),
                    });
                }
            };
            let key = key.to_string();
            let (group_with_keywords, package) = split_group(&key);
            let mut words: Vec<&str> = group_with_keywords.split(' ').collect();
            let group = words.pop().unwrap_or("");
            let (mut optional, mut is_override) = (false, false);
            for word in words {
                match word {
                    "optional" => optional = true,
                    "override" => is_override = true,
                    _ => break,
                }
            }
            if !optional {
                optional = legacy_optional.unwrap_or(false);
            }
            let value = match &node.value {
                Value::Scalar(Scalar::None) => GroupValue::Name(None),
                Value::Scalar(Scalar::Str(s)) => GroupValue::Name(Some(s.clone())),
                Value::Missing => GroupValue::Name(Some("???".into())),
                Value::List(items) => {
                    let mut names = Vec::with_capacity(items.len());
                    for v in items {
                        match &v.value {
                            Value::Scalar(Scalar::Str(s)) => names.push(s.clone()),
                            other => {
                                return Err(DefaultsError::UnsupportedNestedValue {
                                    type_name: python_type(other).into(),
                                });
                            }
                        }
                    }
                    GroupValue::Options(names)
                }
                other => {
                    return Err(DefaultsError::UnsupportedItemValue {
                        type_name: python_type(other).into(),
                    });
                }
            };
            Ok(InputDefault::group(
                group,
                value,
                package,
                optional,
                is_override,
            ))
        }
        other => Err(DefaultsError::UnsupportedItemType {
            type_name: python_type(other).into(),
        }),
    }
}

/// `group@pkg` → (group, pkg); a `:pkg2` rename suffix is dropped as Hydra 1.1+ does.
fn split_group(text: &str) -> (&str, Option<String>) {
    match text.split_once('@') {
        None => (text, None),
        Some((group, package)) => {
            let package = package.split_once(':').map_or(package, |(p, _)| p);
            (group, Some(package.to_owned()))
        }
    }
}

/// OmegaConf's class of a node's value (containers are `ListConfig`/`DictConfig`, `???` a string).
fn python_type(value: &Value) -> &'static str {
    match value {
        Value::List(_) => "ListConfig",
        Value::Dict(_) => "DictConfig",
        Value::Missing => "str",
        Value::Scalar(s) => s.type_name(),
    }
}

struct Builder<'a> {
    repo: &'a mut Repository,
    overrides: Overrides,
    skip_missing: bool,
    /// Config paths being expanded, outermost first (a config that includes itself would never end).
    ancestors: Vec<String>,
}

impl Builder<'_> {
    fn search_path_dump(&self) -> String {
        let lines: Vec<String> = self
            .repo
            .sources()
            .iter()
            .map(|s| format!("\t{}", s.describe()))
            .collect();
        format!("\nConfig search path:\n{}", lines.join("\n"))
    }

    fn not_found(&self, node: &InputDefault, parent: Option<&str>) -> DefaultsError {
        if node.primary {
            return DefaultsError::MissingPrimary {
                config_path: node.config_path(),
                search_path: self.search_path_dump(),
                program: self.repo.program(),
            };
        }
        let (group, options) = if node.is_group() {
            let group = node.group_path();
            let options = self.repo.group_options(&group, ObjectType::Config);
            (Some(group), options)
        } else {
            (None, Vec::new())
        };
        DefaultsError::NotFound(Box::new(NotFound {
            parent: parent.map(str::to_owned),
            config_path: node.config_path(),
            group,
            options,
            search_path: self.search_path_dump(),
            program: self.repo.program(),
        }))
    }

    fn expand_virtual_root(&mut self, mut root: TreeNode) -> Result<TreeNode, DefaultsError> {
        let Some(children) = root.children.take() else {
            return Ok(root);
        };
        let mut out = Vec::with_capacity(children.len());
        for child in children.into_iter().rev() {
            let Child::Leaf(mut d) = child else { continue };
            d.update_parent(Some(""), Some(""));
            let primary = d.primary;
            let subtree = self.build(
                TreeNode {
                    node: d,
                    children: None,
                },
                Some("<root>"),
                primary,
                false,
            )?;
            out.push(if subtree.children.is_none() {
                Child::Leaf(subtree.node)
            } else {
                Child::Tree(subtree)
            });
        }
        out.reverse();
        root.children = Some(out);
        Ok(root)
    }

    /// Hydra's `_create_defaults_tree_impl`, refusing a config that (indirectly) includes itself.
    fn build(
        &mut self,
        root: TreeNode,
        parent_path: Option<&str>,
        is_root_config: bool,
        interpolated: bool,
    ) -> Result<TreeNode, DefaultsError> {
        let path = root.node.config_path();
        if !root.node.is_virtual() && self.ancestors.contains(&path) {
            let mut chain = self.ancestors.clone();
            chain.push(path);
            return Err(DefaultsError::Cycle {
                chain: chain.join(" -> "),
            });
        }
        self.ancestors.push(path);
        let result = self.build_node(root, parent_path, is_root_config, interpolated);
        self.ancestors.pop();
        result
    }

    /// Hydra's `_create_defaults_tree_impl`. `parent_path` is the config path of the tree node above `root`.
    fn build_node(
        &mut self,
        mut root: TreeNode,
        parent_path: Option<&str>,
        is_root_config: bool,
        interpolated: bool,
    ) -> Result<TreeNode, DefaultsError> {
        if root.node.is_virtual() {
            return if is_root_config {
                self.expand_virtual_root(root)
            } else {
                Ok(root)
            };
        }
        if is_root_config {
            root.node.update_parent(Some(""), Some(""));
            if !self.repo.config_exists(&root.node.config_path()) {
                return Err(self.not_found(&root.node, parent_path));
            }
        }
        // The package header (`# @package`) of the config this element points at.
        if !root.node.is_missing()
            && root.node.name().is_some()
            && let Some(loaded) = self.repo.load(&root.node.config_path())?
        {
            let header = loaded.header_package.clone();
            root.node.set_package_header(header.as_deref());
        }
        if self.overrides.is_deleted(&root.node) {
            self.overrides.delete(&mut root.node);
            return Ok(root);
        }
        self.overrides.set_known_choice(&root.node)?;
        if root.node.name().is_none() {
            return Ok(root);
        }
        if root.node.is_missing() {
            if self.skip_missing {
                return Ok(root);
            }
            if root.node.is_group() {
                let options = self
                    .repo
                    .group_options(&root.node.group_path(), ObjectType::Config);
                return Err(DefaultsError::MustSpecify {
                    key: root.node.override_key(),
                    options,
                });
            }
            return Err(DefaultsError::MissingConfigDefault {
                path: root.node.config_path(),
            });
        }
        let path = root.node.config_path();
        let Some(loaded) = self.repo.load(&path)? else {
            if root.node.optional {
                root.node.deleted = true;
                return Ok(root);
            }
            return Err(self.not_found(&root.node, parent_path));
        };
        let mut defaults = parse_defaults(&path, &loaded.root)?;
        let mut self_added = false;
        if !defaults.is_empty() || is_root_config && !self.overrides.appends.is_empty() {
            self_added = validate_self(&root.node, &mut defaults)?;
        }
        if is_root_config {
            defaults.extend(self.overrides.appends.iter().cloned());
        }
        self.update_overrides(&mut defaults, &root.node, interpolated)?;

        let parent_group = root.node.group_path();
        let parent_package = root.node.final_package(true);
        let mut children: Vec<Child> = Vec::new();
        for d in defaults.iter_mut().rev() {
            if d.is_self() {
                let base = root.node.parent_base_dir.clone();
                let package = root.node.get_package(true);
                d.update_parent(base.as_deref(), package.as_deref());
                children.push(Child::Leaf(d.clone()));
                continue;
            }
            if d.is_override() {
                continue;
            }
            d.update_parent(Some(&parent_group), Some(&parent_package));
            if self.overrides.is_overridden(d) {
                self.overrides.override_default_option(d);
            }
            if let DefaultKind::Group {
                group,
                value: GroupValue::Options(options),
                ..
            } = &d.kind
            {
                for item in options.iter().rev() {
                    if item.contains("${") {
                        return Err(DefaultsError::InterpolationInOptions { path: path.clone() });
                    }
                    let mut node = InputDefault::config(
                        &format!("{group}/{item}"),
                        d.package.clone(),
                        d.optional,
                    )?;
                    node.update_parent(Some(&parent_group), Some(&parent_package));
                    self.add_child(&mut children, node, &path, interpolated)?;
                }
            } else if d.is_interpolation() {
                children.push(Child::Leaf(d.clone()));
            } else {
                self.add_child(&mut children, d.clone(), &path, interpolated)?;
            }
        }

        // Deferred interpolations (`db: ${foo}_${bar}`) are resolved once all choices at this level are known.
        let choices = self.interpolation_map(&defaults, self_added);
        for child in children.iter_mut() {
            let Child::Leaf(dd) = child else { continue };
            if !dd.is_interpolation() {
                continue;
            }
            let mut dd = dd.clone();
            resolve_element_interpolation(&mut dd, &choices)?;
            dd.update_parent(Some(&parent_group), Some(&parent_package));
            let subtree = self.build(
                TreeNode {
                    node: dd,
                    children: None,
                },
                Some(&path),
                false,
                true,
            )?;
            *child = if subtree.children.is_none() {
                Child::Leaf(subtree.node)
            } else {
                Child::Tree(subtree)
            };
        }
        if !children.is_empty() {
            children.reverse();
            root.children = Some(children);
        }
        Ok(root)
    }

    fn add_child(
        &mut self,
        children: &mut Vec<Child>,
        node: InputDefault,
        parent_path: &str,
        interpolated: bool,
    ) -> Result<(), DefaultsError> {
        let subtree = self.build(
            TreeNode {
                node,
                children: None,
            },
            Some(parent_path),
            false,
            interpolated,
        )?;
        children.push(if subtree.children.is_none() {
            Child::Leaf(subtree.node)
        } else {
            Child::Tree(subtree)
        });
        Ok(())
    }

    fn update_overrides(
        &mut self,
        defaults: &mut [InputDefault],
        parent: &InputDefault,
        interpolated: bool,
    ) -> Result<(), DefaultsError> {
        let parent_group = parent.group_path();
        let parent_package = parent.final_package(true);
        let mut seen_override = false;
        let mut last_override: Option<InputDefault> = None;
        for d in defaults.iter_mut() {
            if d.is_self() {
                continue;
            }
            d.update_parent(Some(&parent_group), Some(&parent_package));
            // version_base 1.1: a `hydra/...` group default without `override` still acts as an override.
            let legacy_hydra_override = matches!(&d.kind, DefaultKind::Group { group, is_override: false, .. } if group.starts_with("hydra/"));
            if seen_override
                && !(d.is_override() || d.is_external_append() || legacy_hydra_override)
            {
                let last = last_override.as_ref();
                return Err(DefaultsError::OverrideNotLast {
                    parent: parent.config_path(),
                    okey: last.map(InputDefault::override_key).unwrap_or_default(),
                    oval: last
                        .and_then(InputDefault::name)
                        .unwrap_or_else(|| "None".into()),
                    key: d.override_key(),
                    name: d.name().unwrap_or_else(|| "None".into()),
                });
            }
            if let DefaultKind::Group { is_override, .. } = &mut d.kind {
                if legacy_hydra_override {
                    *is_override = true;
                }
                if *is_override {
                    if !legacy_hydra_override {
                        seen_override = true;
                    }
                    last_override = Some(d.clone());
                    if interpolated {
                        return Err(DefaultsError::OverrideInInterpolatedSubtree {
                            parent: parent.config_path(),
                            key: d.override_key(),
                            name: d.name().unwrap_or_else(|| "None".into()),
                        });
                    }
                    self.overrides.add_override(&parent.config_path(), d);
                }
            }
        }
        Ok(())
    }

    /// Hydra's `_create_interpolation_map`: the known choices plus this level's `defaults` list.
    fn interpolation_map(&self, defaults: &[InputDefault], self_added: bool) -> Node {
        let mut map = Dict::new();
        for (key, value) in &self.overrides.known_choices {
            map.insert(
                Key::from(key.as_str()),
                Node::new(value.clone().map_or(Value::NULL, Value::str)),
            );
        }
        let mut list = Vec::new();
        for d in defaults {
            if self_added && d.is_self() {
                continue;
            }
            match &d.kind {
                DefaultKind::Config { .. } => list.push(Node::str(d.config_path())),
                DefaultKind::Group { value, .. } => {
                    let value = match value {
                        GroupValue::Name(n) => n.clone().map_or(Value::NULL, Value::str),
                        GroupValue::Options(o) => {
                            Value::List(o.iter().map(|x| Node::str(x.clone())).collect())
                        }
                    };
                    let mut entry = Dict::new();
                    entry.insert(Key::from(d.override_key()), Node::new(value));
                    list.push(Node::new(Value::Dict(entry)));
                }
                DefaultKind::Virtual => {}
            }
        }
        map.insert(Key::from("defaults"), Node::new(Value::List(list)));
        Node::new(Value::Dict(map))
    }
}

/// `_self_` must appear at most once; when absent it is appended (after the group defaults).
/// Returns true if it was added.
fn validate_self(
    containing: &InputDefault,
    defaults: &mut Vec<InputDefault>,
) -> Result<bool, DefaultsError> {
    let mut has_self = false;
    let mut has_non_override = false;
    for d in defaults.iter() {
        if !d.is_override() {
            has_non_override = true;
        }
        if d.is_self() {
            if has_self {
                return Err(DefaultsError::DuplicateSelf {
                    config_path: containing.config_path(),
                });
            }
            has_self = true;
        }
    }
    if !has_self && has_non_override || defaults.is_empty() {
        defaults.push(InputDefault::config("_self_", None, false)?);
    }
    Ok(!has_self)
}

/// Resolve `${choice}` references of a defaults element against the choices known so far (Hydra resolves
/// the element as a value whose parent is a config of the known choices plus a `defaults` list).
fn resolve_element_interpolation(
    d: &mut InputDefault,
    choices: &Node,
) -> Result<(), DefaultsError> {
    let template = match &d.kind {
        DefaultKind::Config { .. } => d.config_path(),
        DefaultKind::Group {
            value: GroupValue::Name(Some(n)),
            ..
        } => n.clone(),
        _ => return Ok(()),
    };
    let resolved =
        interpolate::resolve_str(&template, choices, &ResolveContext::new()).map_err(|_| {
            let keys = choices
                .as_dict()
                .map(|d| {
                    d.keys()
                        .filter_map(Key::as_str)
                        .filter(|k| *k != "defaults")
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            DefaultsError::Interpolation {
                value: template.clone(),
                keys,
            }
        })?;
    let resolved = match resolved.value {
        Value::Scalar(Scalar::Str(s)) => s,
        other => other.python_str(),
    };
    match &mut d.kind {
        DefaultKind::Config { path } => *path = resolved,
        DefaultKind::Group { value, .. } => *value = GroupValue::Name(Some(resolved)),
        DefaultKind::Virtual => {}
    }
    Ok(())
}

/// Build the defaults tree for `config_name` (with Hydra's own `hydra/config` first when `with_hydra`) and
/// flatten it. `skip_missing` skips `???` group defaults (multirun) instead of failing.
pub(crate) fn create_defaults_list(
    repo: &mut Repository,
    config_name: &str,
    overrides: &GroupOverrides,
    with_hydra: bool,
    skip_missing: bool,
) -> Result<DefaultsList, DefaultsError> {
    let mut primary = InputDefault::config(config_name, None, false)?;
    primary.primary = true;
    let root = if with_hydra {
        let hydra = InputDefault::config("hydra/config", None, false)?;
        TreeNode {
            node: InputDefault::virtual_root(),
            children: Some(vec![Child::Leaf(hydra), Child::Leaf(primary)]),
        }
    } else {
        TreeNode {
            node: primary,
            children: None,
        }
    };
    let mut builder = Builder {
        repo,
        overrides: Overrides::new(overrides),
        skip_missing,
        ancestors: Vec::new(),
    };
    let tree = builder.build(root, None, true, false)?;
    let mut defaults = Vec::new();
    collect(&tree, None, &mut defaults);
    let mut seen = BTreeSet::new();
    for d in &defaults {
        if let (false, Some(key)) = (d.is_self, &d.override_key)
            && !seen.insert(key.clone())
        {
            return Err(DefaultsError::Duplicate { key: key.clone() });
        }
    }
    builder.overrides.ensure_used()?;
    Ok(DefaultsList {
        defaults,
        tree,
        known_choices: builder.overrides.known_choices,
    })
}

/// Depth-first flattening (Hydra's `_tree_to_list`). `parent` is the config path of the node above `tree`.
fn collect(tree: &TreeNode, parent: Option<&str>, out: &mut Vec<ResultDefault>) {
    match &tree.children {
        Some(children) if !children.is_empty() => {
            let here = tree.node.config_path();
            for child in children {
                match child {
                    Child::Leaf(node) => push_result(Some(tree), Some(&here), parent, node, out),
                    Child::Tree(sub) => collect(sub, Some(&here), out),
                }
            }
        }
        _ => push_result(None, parent, None, &tree.node, out),
    }
}

/// One flattened entry. `containing` is the tree node a `_self_` belongs to; `containing_parent` its parent.
fn push_result(
    containing: Option<&TreeNode>,
    parent: Option<&str>,
    containing_parent: Option<&str>,
    node: &InputDefault,
    out: &mut Vec<ResultDefault>,
) {
    if node.deleted || node.is_missing() || node.is_virtual() || node.name().is_none() {
        return;
    }
    let result = match (node.is_self(), containing) {
        (true, Some(tree)) => ResultDefault {
            config_path: tree.node.config_path(),
            parent: containing_parent.map(str::to_owned),
            package: tree.node.final_package(true),
            is_self: true,
            primary: tree.node.primary,
            override_key: None,
        },
        _ => ResultDefault {
            config_path: node.config_path(),
            parent: parent.map(str::to_owned),
            package: node.final_package(true),
            is_self: false,
            primary: node.primary,
            override_key: node.is_group().then(|| node.override_key()),
        },
    };
    out.push(result);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The needs-Python line names the program that composes, not a fixed one.
    #[test]
    fn needs_python_hints_name_the_program() {
        let hint = |group: Option<&str>, options: &[String]| {
            needs_python_hint("myapp", "db/x", group, options)
        };
        assert!(
            hint(Some("hydra/launcher"), &[])
                .ends_with("myapp has only Hydra's built-in options of 'hydra/launcher'")
        );
        assert!(
            hint(Some("db"), &[])
                .contains("that is Python code myapp does not run; write it as db/x.yaml")
        );
        assert!(
            hint(None, &[])
                .contains("that is Python code myapp does not run; write it as db/x.yaml")
        );
        assert_eq!(hint(Some("db"), &["mysql".to_owned()]), "");
    }

    fn group(group: &str, value: &str, package: Option<&str>) -> InputDefault {
        InputDefault::group(
            group,
            GroupValue::Name(Some(value.into())),
            package.map(str::to_owned),
            false,
            false,
        )
    }

    #[test]
    fn packages_and_override_keys_follow_hydra() {
        // (element, parent base dir, parent package, final package, override key)
        let check = |mut d: InputDefault, base: &str, pkg: &str, want_pkg: &str, want_key: &str| {
            d.update_parent(Some(base), Some(pkg));
            assert_eq!(d.final_package(true), want_pkg, "{d:?}");
            assert_eq!(d.override_key(), want_key, "{d:?}");
        };
        check(group("db", "mysql", None), "", "", "db", "db");
        check(
            group("db", "mysql", Some("backup")),
            "",
            "",
            "backup",
            "db@backup",
        );
        check(
            group("db", "mysql", Some("_global_")),
            "",
            "",
            "",
            "db@_global_",
        );
        check(
            group("db", "mysql", Some("_here_")),
            "",
            "",
            "",
            "db@_global_",
        );
        check(
            group("group2", "file1", None),
            "group1",
            "group1",
            "group1.group2",
            "group1/group2",
        );
        check(
            group("/db", "mysql", None),
            "group1",
            "group1",
            "group1.db",
            "db@group1.db",
        );
        check(
            group("output", "default", None),
            "hydra",
            "hydra",
            "hydra.output",
            "hydra/output",
        );
    }

    #[test]
    fn package_header_is_absolute() {
        let mut d = group("output", "default", None);
        d.update_parent(Some("hydra"), Some("hydra"));
        d.set_package_header(Some("hydra"));
        assert_eq!(d.final_package(true), "hydra");
        assert_eq!(d.override_key(), "hydra/output");
    }

    #[test]
    fn defaults_entries_parse_keywords_and_packages() {
        let check = |yaml_item: Node, want: InputDefault| {
            assert_eq!(parse_item("cfg", &yaml_item).ok(), Some(want));
        };
        let mut dict = crate::node::Dict::new();
        dict.insert(Key::from("override db@backup"), Node::str("mysql"));
        check(
            Node::new(Value::Dict(dict)),
            InputDefault::group(
                "db",
                GroupValue::Name(Some("mysql".into())),
                Some("backup".into()),
                false,
                true,
            ),
        );
        check(
            Node::str("db/mysql@pkg"),
            InputDefault::config("db/mysql", Some("pkg".into()), false)
                .ok()
                .unwrap_or_else(|| unreachable!()),
        );
        assert!(matches!(
            parse_item("cfg", &Node::str("_self_@x")),
            Err(DefaultsError::SelfWithPackage)
        ));
        assert!(matches!(
            parse_item("cfg", &Node::new(Value::int(1))),
            Err(DefaultsError::UnsupportedItemType { .. })
        ));
    }
}
