//! Where Python's import system would find a package, for `pkg://a.b` config sources, without running
//! Python: the directories of `sys.path` (the current directory, `PYTHONPATH`, the active virtual
//! environment's or `python3`'s site-packages and the directories their `.pth` files add), searched part by
//! part as `importlib` does (a regular package with `__init__.py` wins at once; plain directories are
//! namespace portions). Hydra's `ImportlibResourcesConfigSource` is available only for a regular package.
//! The package's `__init__.py` is never run.

use std::path::{Path, PathBuf};

/// The result of a lookup: the package directory, and the `sys.path` entries that were searched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageLookup {
    pub found: Option<PathBuf>,
    pub searched: Vec<PathBuf>,
}

/// What the lookup reads from the process: injectable so tests do not depend on the machine.
#[derive(Debug, Clone, Default)]
pub struct PythonEnv {
    pub cwd: Option<PathBuf>,
    pub pythonpath: Option<String>,
    pub virtual_env: Option<PathBuf>,
    pub path: Option<String>,
}

impl PythonEnv {
    /// The current process's directory and variables.
    pub(crate) fn from_process() -> PythonEnv {
        let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        PythonEnv {
            cwd: std::env::current_dir().ok(),
            pythonpath: var("PYTHONPATH"),
            virtual_env: var("VIRTUAL_ENV")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            path: var("PATH"),
        }
    }

    /// The equivalent of `sys.path`, in Python's order (the standard library is left out: it holds no
    /// config packages).
    pub(crate) fn sys_path(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = Vec::new();
        let cwd = self.cwd.clone().unwrap_or_else(|| PathBuf::from("."));
        out.push(cwd.clone());
        if let Some(pp) = &self.pythonpath {
            for entry in pp.split(':') {
                out.push(if entry.is_empty() {
                    cwd.clone()
                } else {
                    cwd.join(entry)
                });
            }
        }
        for site in self.site_packages() {
            let pth = pth_entries(&site);
            out.push(site);
            out.extend(pth);
        }
        let mut seen = std::collections::HashSet::new();
        out.retain(|p| seen.insert(p.clone()));
        out
    }

    /// The site-packages of `VIRTUAL_ENV`, or else of the first `python3` on `PATH`.
    fn site_packages(&self) -> Vec<PathBuf> {
        let prefix = match &self.virtual_env {
            Some(venv) => Some(venv.clone()),
            None => self.path.as_deref().and_then(|path| {
                path.split(':')
                    .filter(|dir| !dir.is_empty())
                    .map(Path::new)
                    .find(|dir| dir.join("python3").is_file())
                    .and_then(|bin| bin.parent().map(Path::to_path_buf))
            }),
        };
        let Some(prefix) = prefix else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for lib in [prefix.join("lib"), prefix.join("local").join("lib")] {
            let Ok(entries) = std::fs::read_dir(&lib) else {
                continue;
            };
            let mut versions: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("python3"))
                })
                .collect();
            versions.sort();
            for dir in versions {
                for name in ["site-packages", "dist-packages"] {
                    if dir.join(name).is_dir() {
                        out.push(dir.join(name));
                    }
                }
            }
        }
        out
    }
}

/// The directories a site directory's `.pth` files add (lines that are not comments or `import`s).
fn pth_entries(site: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(site) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "pth"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for line in text.lines() {
            let line = line.trim_end();
            if line.is_empty()
                || line.starts_with('#')
                || line.starts_with("import ")
                || line.starts_with("import\t")
            {
                continue;
            }
            let dir = site.join(line);
            if dir.is_dir() {
                out.push(dir);
            }
        }
    }
    out
}

/// Find the regular package `module` (`a.b.c`) along `sys_path` as `importlib` would.
pub(crate) fn find_package(module: &str, sys_path: &[PathBuf]) -> PackageLookup {
    PackageLookup {
        found: find_in(module, sys_path),
        searched: sys_path.to_vec(),
    }
}

fn find_in(module: &str, sys_path: &[PathBuf]) -> Option<PathBuf> {
    let parts: Vec<&str> = module.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return None;
    }
    let mut portions: Vec<PathBuf> = sys_path.to_vec();
    for part in parts {
        let mut regular = None;
        let mut namespace = Vec::new();
        for dir in &portions {
            let candidate = dir.join(part);
            if candidate.join("__init__.py").is_file() {
                regular = Some(candidate);
                break;
            }
            if ["py", "pyc"]
                .iter()
                .any(|ext| dir.join(format!("{part}.{ext}")).is_file())
            {
                // A plain module: it has no submodules, and `importlib.resources` refuses it.
                return None;
            }
            if candidate.is_dir() {
                namespace.push(candidate);
            }
        }
        portions = match regular {
            Some(dir) => vec![dir],
            None if !namespace.is_empty() => namespace,
            None => return None,
        };
    }
    // Hydra's `available()`: the package directory must hold an `__init__.py`.
    portions
        .into_iter()
        .find(|dir| dir.join("__init__.py").is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path) {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(path, "").expect("write");
    }

    #[test]
    fn finds_regular_packages_in_sys_path_order() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        touch(&a.join("pkg/__init__.py"));
        touch(&a.join("pkg/conf/__init__.py"));
        touch(&b.join("pkg/__init__.py"));
        touch(&b.join("pkg/other/__init__.py"));
        let path = vec![a.clone(), b.clone()];
        assert_eq!(find_in("pkg.conf", &path), Some(a.join("pkg/conf")));
        // The first regular `pkg` wins, so `pkg.other` (only in b) is not found.
        assert_eq!(find_in("pkg.other", &path), None);
        assert_eq!(
            find_in("pkg.other", std::slice::from_ref(&b)),
            Some(b.join("pkg/other"))
        );
        assert_eq!(find_in("nope", &path), None);
        assert_eq!(find_in("pkg..conf", &path), None);
        assert_eq!(find_in("", &path), None);
    }

    #[test]
    fn namespace_portions_and_modules() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir_all(a.join("ns")).expect("mkdir");
        touch(&b.join("ns/conf/__init__.py"));
        touch(&b.join("bare/x.yaml"));
        touch(&a.join("mod.py"));
        touch(&b.join("mod/__init__.py"));
        let path = vec![a.clone(), b.clone()];
        assert_eq!(find_in("ns.conf", &path), Some(b.join("ns/conf")));
        // A namespace package itself is not available to Hydra (no `__init__.py`).
        assert_eq!(find_in("ns", &path), None);
        assert_eq!(find_in("bare", &path), None);
        // `a/mod.py` shadows the package `b/mod`.
        assert_eq!(find_in("mod", &path), None);
    }

    #[test]
    fn sys_path_order_and_pth_files() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let venv = tmp.path().join("venv");
        let site = venv.join("lib/python3.11/site-packages");
        std::fs::create_dir_all(&site).expect("mkdir");
        std::fs::create_dir_all(tmp.path().join("editable")).expect("mkdir");
        let pth = format!(
            "# comment\nimport os\n{}\n/nonexistent\n",
            tmp.path().join("editable").display()
        );
        std::fs::write(site.join("x.pth"), pth).expect("write");
        let env = PythonEnv {
            cwd: Some(tmp.path().join("cwd")),
            pythonpath: Some("p1::/abs".into()),
            virtual_env: Some(venv.clone()),
            path: None,
        };
        assert_eq!(
            env.sys_path(),
            vec![
                tmp.path().join("cwd"),
                tmp.path().join("cwd/p1"),
                PathBuf::from("/abs"),
                site,
                tmp.path().join("editable"),
            ]
        );
    }
}
