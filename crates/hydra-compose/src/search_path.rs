//! The config search path: ordered config sources (embedded trees, directories) and the repository that finds,
//! lists and loads configs from them, each file read and parsed at most once.
//!
//! Order and lookup follow Hydra 1.3: `pkg://hydra.conf` (Hydra's built-in groups), the primary source
//! (`--config-path`, or the repo's `config/` tree compiled into the binary), `--config-dir`, the entries of
//! `hydra.searchpath`, and last the "structured" source holding what Hydra keeps in its ConfigStore
//! (`hydra/config`, `hydra/launcher/basic`, `hydra/sweeper/basic`). A config is taken from the first source
//! that has it; group options are the sorted union over all sources.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::interpolate::{self, InterpolationError};
use crate::node::Node;
use crate::yaml::{self, YamlError};

mod python;

pub use python::{PackageLookup, PythonEnv};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded_configs.rs"));
}

/// A program's own config tree compiled into it: its primary config source when there is no
/// `--config-path` (rlsync embeds its `config/` directory).
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedTree {
    /// The program's name, as the engine's own messages name it where a config needs Python code that
    /// Hydra would run and the program does not (`… which rlsync does not run`).
    pub program: &'static str,
    /// The Python module Hydra would name this source by (`rlsync.config`), as `hydra.runtime.config_sources`
    /// shows it.
    pub module: &'static str,
    /// `(path relative to the tree root with '/' separators, file text)`, sorted by path.
    pub files: &'static [(&'static str, &'static str)],
}

/// Errors while building the search path or loading a config file.
#[derive(Debug, thiserror::Error)]
pub enum SearchPathError {
    #[error(
        "Primary config directory not found.\nCheck that the config directory '{path}' exists and readable"
    )]
    PrimaryDirNotFound { path: String },
    #[error("Additional config directory '{path}' not found")]
    ConfigDirNotFound { path: String },
    #[error(
        "search path entry '{entry}' is not supported: only file:// and pkg:// paths can be searched"
    )]
    UnsupportedScheme { entry: String },
    #[error(
        "Primary config module '{module}' not found.\nCheck that it's correct and contains an __init__.py file\n(looked for it as Python would import it, in: {})",
        .searched.join(", ")
    )]
    PrimaryModuleNotFound {
        module: String,
        searched: Vec<String>,
    },
    #[error(
        "Primary config module is empty.\nPython requires resources to be in a module with an __init__.py file"
    )]
    PrimaryModuleEmpty,
    #[error("cannot read config file '{file}'")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Yaml {
        #[from]
        source: YamlError,
    },
    /// A value with bad interpolation syntax (OmegaConf rejects it when the file is loaded).
    #[error(transparent)]
    Interpolation(#[from] InterpolationError),
    #[error("in '{file}': Expected header format: KEY VALUE, got '{line}'")]
    HeaderFormat { file: String, line: String },
    #[error("in '{file}': Too many components in '{line}'")]
    HeaderTooManyComponents { file: String, line: String },
}

/// Where a source's configs are stored.
#[derive(Debug, Clone)]
enum Store {
    /// A tree compiled into the binary: `(relative path, text)` sorted by path.
    Embedded(&'static [(&'static str, &'static str)]),
    /// A directory on disk (may not exist: then the source is simply unavailable, as in Hydra).
    Dir(PathBuf),
    /// A `pkg://` package that Python would not find: never matches.
    Unavailable,
}

/// One entry of the search path.
#[derive(Debug, Clone)]
pub struct Source {
    /// Who added it: `hydra`, `main`, `command-line`, `hydra.searchpath in main`, `schema`, ...
    pub provider: String,
    /// `file`, `pkg` or `structured`, as Hydra's `hydra.runtime.config_sources[].schema`.
    pub scheme: &'static str,
    /// The path part (`/abs/dir`, `hydra.conf`, empty for structured).
    pub path: String,
    store: Store,
}

/// Whether listing returns configs or groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectType {
    Config,
    Group,
}

impl Source {
    /// Hydra's built-in `hydra/` groups (`pkg://hydra.conf`).
    pub(crate) fn hydra_builtin() -> Source {
        Source {
            provider: "hydra".into(),
            scheme: "pkg",
            path: "hydra.conf".into(),
            store: Store::Embedded(embedded::HYDRA_PKG),
        }
    }

    /// What Hydra keeps in its ConfigStore (always last).
    pub(crate) fn structured() -> Source {
        Source {
            provider: "schema".into(),
            scheme: "structured",
            path: String::new(),
            store: Store::Embedded(embedded::HYDRA_STRUCTURED),
        }
    }

    /// The program's own config tree compiled into it, as the primary source.
    pub(crate) fn embedded_main(tree: &EmbeddedTree) -> Source {
        Source {
            provider: "main".into(),
            scheme: "pkg",
            path: tree.module.into(),
            store: Store::Embedded(tree.files),
        }
    }

    /// A directory source; `dir` should be absolute.
    pub fn dir(provider: &str, dir: PathBuf) -> Source {
        Source {
            provider: provider.into(),
            scheme: "file",
            path: dir.display().to_string(),
            store: Store::Dir(dir),
        }
    }

    /// A `pkg://a.b` source: the package directory where Python's import would find it (see
    /// [`PythonEnv::sys_path`]), or an unavailable source; the lookup says where it looked.
    pub fn package(provider: &str, module: &str, env: &PythonEnv) -> (Source, PackageLookup) {
        // Hydra normalizes `a/b/` to `a.b`.
        let module = module.replace('/', ".").trim_end_matches('.').to_owned();
        let lookup = python::find_package(&module, &env.sys_path());
        let store = match &lookup.found {
            Some(dir) => Store::Dir(dir.clone()),
            None => Store::Unavailable,
        };
        let source = Source {
            provider: provider.into(),
            scheme: "pkg",
            path: module,
            store,
        };
        (source, lookup)
    }

    /// A `hydra.searchpath` entry: `file://dir`, `pkg://module` or a bare directory (relative to the working
    /// directory).
    pub(crate) fn from_search_path_entry(
        provider: &str,
        entry: &str,
    ) -> Result<Source, SearchPathError> {
        let path = match entry.find("://") {
            None => entry,
            Some(idx) if &entry[..idx] == "pkg" => {
                return Ok(Source::package(
                    provider,
                    &entry[idx + 3..],
                    &PythonEnv::from_process(),
                )
                .0);
            }
            Some(idx) if &entry[..idx] == "file" => &entry[idx + 3..],
            Some(_) => {
                return Err(SearchPathError::UnsupportedScheme {
                    entry: entry.into(),
                });
            }
        };
        let dir = std::path::absolute(Path::new(path)).unwrap_or_else(|_| PathBuf::from(path));
        Ok(Source {
            provider: provider.into(),
            scheme: "file",
            path: path.into(),
            store: Store::Dir(dir),
        })
    }

    /// `provider=..., path=scheme://path`, as Hydra prints a source.
    pub fn describe(&self) -> String {
        format!(
            "provider={}, path={}://{}",
            self.provider, self.scheme, self.path
        )
    }

    /// True if the source points at something that exists.
    pub fn available(&self) -> bool {
        self.is_group("")
    }

    pub(crate) fn is_group(&self, group: &str) -> bool {
        match &self.store {
            Store::Embedded(files) => {
                if group.is_empty() {
                    return true;
                }
                let prefix = format!("{group}/");
                files.iter().any(|(p, _)| p.starts_with(&prefix))
            }
            Store::Dir(root) => root.join(group).is_dir(),
            Store::Unavailable => false,
        }
    }

    pub(crate) fn is_config(&self, config_path: &str) -> bool {
        let file = normalize_file_name(config_path);
        match &self.store {
            Store::Embedded(files) => files.iter().any(|(p, _)| *p == file),
            Store::Dir(root) => root.join(&file).is_file(),
            Store::Unavailable => false,
        }
    }

    /// Names directly under `group` (config names without extension, or sub-group names), sorted, unique.
    pub fn list(&self, group: &str, filter: ObjectType) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        let join = |name: &str| {
            if group.is_empty() {
                name.to_owned()
            } else {
                format!("{group}/{name}")
            }
        };
        let mut consider = |name: &str| {
            if name == "__pycache__" || name == "__init__.py" {
                return;
            }
            let child = join(name);
            match filter {
                ObjectType::Group if self.is_group(&child) => names.push(name.to_owned()),
                ObjectType::Config if self.is_config(&child) => {
                    let stem = name.rfind('.').map_or(name, |dot| &name[..dot]);
                    names.push(stem.to_owned());
                }
                _ => {}
            }
        };
        match &self.store {
            Store::Embedded(files) => {
                let prefix = if group.is_empty() {
                    String::new()
                } else {
                    format!("{group}/")
                };
                for (path, _) in files.iter() {
                    if let Some(rest) = path.strip_prefix(prefix.as_str()) {
                        let first = rest.split('/').next().unwrap_or(rest);
                        consider(first);
                    }
                }
            }
            Store::Dir(root) => {
                if let Ok(entries) = std::fs::read_dir(root.join(group)) {
                    for entry in entries.flatten() {
                        if let Some(name) = entry.file_name().to_str() {
                            consider(name);
                        }
                    }
                }
            }
            Store::Unavailable => {}
        }
        names.sort();
        names.dedup();
        names
    }

    /// The text of a config and the name to show in errors, if this source has it.
    fn read(&self, config_path: &str) -> Result<Option<(String, String)>, SearchPathError> {
        let file = normalize_file_name(config_path);
        match &self.store {
            Store::Embedded(files) => {
                Ok(files.iter().find(|(p, _)| *p == file).map(|(p, text)| {
                    (
                        (*text).to_owned(),
                        format!("{}://{}/{}", self.scheme, self.path, p),
                    )
                }))
            }
            Store::Dir(root) => {
                let full = root.join(&file);
                if !full.is_file() {
                    return Ok(None);
                }
                let shown = full.display().to_string();
                match std::fs::read_to_string(&full) {
                    Ok(text) => Ok(Some((text, shown))),
                    Err(source) => Err(SearchPathError::Read {
                        file: shown,
                        source,
                    }),
                }
            }
            Store::Unavailable => Ok(None),
        }
    }
}

/// `name` → `name.yaml` unless it already ends in `.yaml` or `.yml` (version_base 1.1 still accepts `.yml`).
fn normalize_file_name(config_path: &str) -> String {
    if config_path.ends_with(".yaml") || config_path.ends_with(".yml") {
        config_path.to_owned()
    } else {
        format!("{config_path}.yaml")
    }
}

/// A loaded config file: the parsed tree (still holding its `defaults` key) and its `# @package` header.
#[derive(Debug)]
pub struct ConfigFile {
    /// The config path it was loaded as (`db/mysql`).
    pub config_path: String,
    /// The file as shown in errors.
    pub file: String,
    /// The raw `# @package` header value, if any.
    pub header_package: Option<String>,
    /// The whole document.
    pub root: Node,
}

/// The search path plus a cache of loaded configs.
#[derive(Debug)]
pub struct Repository {
    /// The program composing (see [`EmbeddedTree::program`]), for the messages that name it.
    program: &'static str,
    sources: Vec<Source>,
    cache: HashMap<String, Option<Rc<ConfigFile>>>,
}

impl Repository {
    pub fn new(program: &'static str, sources: Vec<Source>) -> Repository {
        Repository {
            program,
            sources,
            cache: HashMap::new(),
        }
    }

    /// The program composing, as messages name it.
    pub fn program(&self) -> &'static str {
        self.program
    }

    pub fn sources(&self) -> &[Source] {
        &self.sources
    }

    /// Insert sources just before the final structured source (how `hydra.searchpath` entries are added).
    /// Already loaded configs stay cached, as in Hydra's caching repository.
    pub(crate) fn append_before_structured(&mut self, extra: Vec<Source>) {
        let at = self
            .sources
            .iter()
            .position(|s| s.scheme == "structured")
            .unwrap_or(self.sources.len());
        self.sources.splice(at..at, extra);
    }

    pub(crate) fn group_exists(&self, group: &str) -> bool {
        self.sources.iter().any(|s| s.is_group(group))
    }

    pub(crate) fn config_exists(&self, config_path: &str) -> bool {
        self.sources.iter().any(|s| s.is_config(config_path))
    }

    /// Options of a group over all sources, sorted and unique.
    pub(crate) fn group_options(&self, group: &str, filter: ObjectType) -> Vec<String> {
        let mut all: Vec<String> = Vec::new();
        for source in &self.sources {
            if source.is_group(group) {
                all.extend(source.list(group, filter));
            }
        }
        all.sort();
        all.dedup();
        all
    }

    /// Load a config from the first source that has it; `None` if none has. Cached.
    pub fn load(&mut self, config_path: &str) -> Result<Option<Rc<ConfigFile>>, SearchPathError> {
        if let Some(hit) = self.cache.get(config_path) {
            return Ok(hit.clone());
        }
        let mut found = None;
        for source in &self.sources {
            if let Some(hit) = source.read(config_path)? {
                found = Some(hit);
                break;
            }
        }
        let loaded = match found {
            None => None,
            Some((text, file)) => {
                let header_package = parse_package_header(&text, &file)?;
                let root = yaml::load_str(&text, &file)?;
                interpolate::validate_tree(&root)?;
                Some(Rc::new(ConfigFile {
                    config_path: config_path.to_owned(),
                    file,
                    header_package,
                    root,
                }))
            }
        };
        self.cache.insert(config_path.to_owned(), loaded.clone());
        Ok(loaded)
    }
}

/// The `# @package X` header: leading comment lines of the first 512 characters, as Hydra reads them.
fn parse_package_header(text: &str, file: &str) -> Result<Option<String>, SearchPathError> {
    let head: String = text.chars().take(512).collect();
    let mut package = None;
    for line in head.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some(rest) = line.strip_prefix('#') else {
            break;
        };
        if !rest.trim_start().starts_with('@') {
            break;
        }
        let body = line.trim_start_matches('#').trim();
        let parts: Vec<&str> = body.split(' ').filter(|p| !p.is_empty()).collect();
        match parts.as_slice() {
            [key, value] => {
                if let Some(key) = key.strip_prefix('@')
                    && key == "package"
                {
                    package = Some((*value).to_owned());
                }
            }
            [_] | [] => {
                return Err(SearchPathError::HeaderFormat {
                    file: file.into(),
                    line: body.into(),
                });
            }
            _ => {
                return Err(SearchPathError::HeaderTooManyComponents {
                    file: file.into(),
                    line: body.into(),
                });
            }
        }
    }
    Ok(package)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_header_is_read_from_leading_comments() {
        let check = |text: &str, want: Option<&str>| {
            assert_eq!(
                parse_package_header(text, "f").ok().flatten().as_deref(),
                want,
                "{text:?}"
            );
        };
        check("# @package foo\na: 1\n", Some("foo"));
        check("\n\n#   @package _global_.x\n", Some("_global_.x"));
        check("# a comment\n# @package foo\n", None);
        check("a: 1\n# @package foo\n", None);
        check("# @other x\n# @package y\n", Some("y"));
        assert!(parse_package_header("# @package\n", "f").is_err());
        assert!(parse_package_header("# @package a b\n", "f").is_err());
    }

    #[test]
    fn builtin_hydra_groups_are_listed_like_hydra() {
        let repo = Repository::new("test", vec![Source::hydra_builtin(), Source::structured()]);
        assert_eq!(
            repo.group_options("hydra/job_logging", ObjectType::Config),
            ["default", "disabled", "none", "stdout"]
        );
        assert_eq!(
            repo.group_options("hydra/launcher", ObjectType::Config),
            ["basic"]
        );
        assert!(repo.config_exists("hydra/config"));
        assert!(repo.group_exists("hydra"));
        assert!(!repo.group_exists("hydra/nosuch"));
        assert!(
            repo.group_options("hydra", ObjectType::Group)
                .contains(&"job_logging".to_owned())
        );
    }

    #[test]
    fn an_unreadable_config_file_keeps_its_io_error_as_the_cause() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        std::fs::write(dir.path().join("bad.yaml"), b"a: \xff\n")
            .unwrap_or_else(|e| panic!("write: {e}"));
        let mut repo = Repository::new("test", vec![Source::dir("main", dir.path().to_path_buf())]);
        let err = match repo.load("bad") {
            Err(err) => err,
            Ok(found) => panic!("a file that is not UTF-8 loaded: {found:?}"),
        };
        assert!(
            matches!(&err, SearchPathError::Read { file, .. } if file.ends_with("bad.yaml")),
            "{err:?}"
        );
        assert!(
            err.to_string().starts_with("cannot read config file '"),
            "{err}"
        );
        let cause = std::error::Error::source(&err)
            .and_then(|c| c.downcast_ref::<std::io::Error>())
            .map(std::io::Error::kind);
        assert_eq!(cause, Some(std::io::ErrorKind::InvalidData));
    }

    #[test]
    fn unsupported_search_path_scheme_is_an_error() {
        assert!(Source::from_search_path_entry("p", "http://foo.conf").is_err());
        assert!(
            Source::from_search_path_entry("p", "file:///nonexistent/dir")
                .is_ok_and(|s| !s.available())
        );
    }
}
