//! Keeps ARCHITECTURE.md true (rust-analyzer's "tidy"): its code map against the files, `//!` first lines, and
//! the invariants by their textual signs, each exception listed here with its reason.
//!
//! The checks read source text, so they are proxies: an import is a `crate::module` path, spawning is
//! `Command::new` / `fork`, a serialized format is a byte-order or JSON call. Code under `#[cfg(test)]` (an
//! inline `mod … {` or a file declared as `#[cfg(test)] mod …;`) is "test code"; the invariants about what the
//! product does skip it, the ones about what the crate may contain at all (processes, tch) do not.

use std::collections::BTreeSet;

/// The repository root.
fn root() -> std::path::PathBuf {
    crate::util::repo_root()
}

/// Where each crate's sources live: (section heading directory in ARCHITECTURE.md, source directory).
const CRATES: &[(&str, &str)] = &[
    ("./", "src"),
    ("crates/hydra-compose/", "crates/hydra-compose/src"),
    ("crates/rlsync-core/", "crates/rlsync-core/src"),
    ("crates/rlsync-learner/", "crates/rlsync-learner/src"),
    ("python/", "python/src"),
];

/// Process spawning outside the supervisor, with the reason it is allowed.
const SPAWN_EXCEPTIONS: &[(&str, &str)] = &[
    (
        "crates/rlsync-core/src/transport/shm/segment.rs",
        "a unit test starts `true` to get a zombie child (the liveness check must call it dead)",
    ),
    (
        "crates/rlsync-core/src/host_shared/tests.rs",
        "unit tests re-run their own test binary as a reader process (whole versions across processes, a killed reader)",
    ),
    (
        "crates/rlsync-core/src/gpu/reference/xxh3/tests.rs",
        "a unit test compiles the kernel's own XXH3 source for the host with the system C++ compiler and runs it",
    ),
    (
        "crates/rlsync-learner/src/rl/libtorch/tests.rs",
        "a learning test runs the TorchScript export example with the venv's Python",
    ),
];

/// Where the process-spawning code lives (invariant 5).
const SUPERVISOR: &[&str] = &[
    "src/orchestrator/supervisor.rs",
    "src/orchestrator/supervisor/",
];

/// Byte-order or JSON calls outside the format homes that are not a serialized format, with the reason.
const FORMAT_EXCEPTIONS: &[(&str, &str)] = &[
    (
        "crates/rlsync-core/src/tensor/checksum.rs",
        "feeds lengths and dims to the hash in a fixed byte order (hash input, never stored or parsed)",
    ),
    (
        "src/worker/synthetic.rs",
        "reads and writes one tensor element's value in the tensor's own (little-endian) storage",
    ),
];

/// The signs of a serialized format: a fixed byte order, JSON, safetensors.
const FORMAT_SIGNS: &[&str] = &[
    "to_le_bytes",
    "from_le_bytes",
    "to_be_bytes",
    "from_be_bytes",
    "serde_json::to_",
    "serde_json::from_",
    "safetensors::",
    "SafeTensors",
];

/// Module layering inside a crate (invariant 7): (crate source dir, module, modules it must not import).
const LAYERS: &[(&str, &str, &[&str])] = &[
    (
        "src",
        "config",
        &["orchestrator", "worker", "dry_run", "bench", "cluster"],
    ),
    ("src", "orchestrator", &["worker", "dry_run"]),
    ("src", "worker", &["orchestrator", "dry_run"]),
    (
        "crates/rlsync-core/src",
        "tensor",
        &["syncer", "transport", "protocol", "host_shared"],
    ),
    (
        "crates/rlsync-core/src",
        "transport",
        &["syncer", "host_shared"],
    ),
    (
        "crates/rlsync-core/src",
        "syncer",
        &["protocol", "host_shared"],
    ),
];

/// Invariant 4's list of format homes, read from ARCHITECTURE.md (the backticked paths between the
/// `format-homes` markers), so the document and the check cannot disagree.
fn format_homes() -> Vec<String> {
    let doc = read("ARCHITECTURE.md");
    let (_, rest) = doc
        .split_once("<!-- format-homes -->")
        .expect("ARCHITECTURE.md marks invariant 4's list with <!-- format-homes -->");
    let (list, _) = rest
        .split_once("<!-- /format-homes -->")
        .expect("ARCHITECTURE.md closes invariant 4's list with <!-- /format-homes -->");
    list.lines()
        .flat_map(|line| {
            let paths = line.split_once(':').map_or(line, |(paths, _)| paths);
            backticked(paths)
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

struct Source {
    /// Repository-relative, `/`-separated.
    path: String,
    text: String,
    /// The whole file is test code (declared under `#[cfg(test)]`).
    test_only: bool,
}

impl Source {
    /// The text outside test code.
    fn product(&self) -> &str {
        if self.test_only {
            return "";
        }
        let mut offset = 0;
        let mut lines = self.text.split_inclusive('\n').peekable();
        while let Some(line) = lines.next() {
            if line.trim() == "#[cfg(test)]"
                && lines
                    .peek()
                    .is_some_and(|next| is_mod_decl(next) && next.trim_end().ends_with('{'))
            {
                return &self.text[..offset];
            }
            offset += line.len();
        }
        &self.text
    }

    fn under<S: AsRef<str>>(&self, prefixes: &[S]) -> bool {
        prefixes
            .iter()
            .map(AsRef::as_ref)
            .any(|p| self.path == p || (p.ends_with('/') && self.path.starts_with(p)))
    }

    /// The module this file belongs to in the crate whose sources are in `src_dir`
    /// (`src/config/typed.rs` → `config` for `src`).
    fn top_module(&self, src_dir: &str) -> Option<&str> {
        let rest = self.path.strip_prefix(src_dir)?.strip_prefix('/')?;
        let first = rest.split('/').next()?;
        Some(first.strip_suffix(".rs").unwrap_or(first))
    }
}

fn is_mod_decl(line: &str) -> bool {
    let t = line.trim_start();
    let t = t
        .strip_prefix("pub(crate) ")
        .or_else(|| t.strip_prefix("pub "))
        .unwrap_or(t);
    t.starts_with("mod ")
}

fn files_under(rel: &str, ext: &str, out: &mut Vec<String>) {
    let dir = root().join(rel);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        let child = format!("{rel}/{name}");
        let p = root().join(&child);
        if p.is_dir() {
            if !name.starts_with('.') && name != "__pycache__" && name != "target" {
                files_under(&child, ext, out);
            }
        } else if ext.is_empty() || name.ends_with(ext) {
            out.push(child);
        }
    }
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every `.rs` file under the crates' `src/` directories, with its test-only flag.
fn sources() -> Vec<Source> {
    let mut paths = Vec::new();
    for (_, src) in CRATES {
        files_under(src, ".rs", &mut paths);
    }
    let texts: Vec<(String, String)> = paths
        .into_iter()
        .map(|p| {
            let text = read(&p);
            (p, text)
        })
        .collect();
    // Files declared as `#[cfg(test)] mod name;`: `<module dir>/name.rs`.
    let mut test_files = BTreeSet::new();
    for (path, text) in &texts {
        let dir = module_dir(path);
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            if line.trim() != "#[cfg(test)]" {
                continue;
            }
            if let Some(next) = lines.peek()
                && is_mod_decl(next)
                && let Some(name) = next.trim().trim_end_matches(';').rsplit(' ').next()
                && next.trim_end().ends_with(';')
            {
                test_files.insert(format!("{dir}{name}.rs"));
            }
        }
    }
    let mut out = Vec::new();
    for (path, text) in texts {
        // A file under a test-only module's directory is test code too.
        let test_only = test_files
            .iter()
            .any(|t| path == *t || path.starts_with(&format!("{}/", t.trim_end_matches(".rs"))));
        out.push(Source {
            path,
            text,
            test_only,
        });
    }
    out
}

/// Where a file's child modules live: `src/lib.rs` → `src/`, `src/a.rs` → `src/a/`, `src/a/mod.rs` → `src/a/`.
fn module_dir(path: &str) -> String {
    let (dir, file) = path.rsplit_once('/').unwrap_or(("", path));
    match file {
        "lib.rs" | "main.rs" | "mod.rs" => format!("{dir}/"),
        _ => format!("{dir}/{}/", file.trim_end_matches(".rs")),
    }
}

/// `*` matches any characters, `/` included.
fn glob(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, tail)) => {
            let Some(rest) = text.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len()).any(|i| rest.is_char_boundary(i) && glob(tail, &rest[i..]))
        }
    }
}

/// `a/{b,c}.rs` → `a/b.rs`, `a/c.rs`.
fn expand_braces(token: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (token.find('{'), token.find('}')) else {
        return vec![token.to_owned()];
    };
    let (head, alts, tail) = (&token[..open], &token[open + 1..close], &token[close + 1..]);
    alts.split(',')
        .flat_map(|alt| expand_braces(&format!("{head}{alt}{tail}")))
        .collect()
}

fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// One row of the code map: its line, and the repository-relative patterns it names.
struct Row {
    line: usize,
    patterns: Vec<String>,
}

/// The code map's rows (and the entry points' bullets), resolved by the rules ARCHITECTURE.md states.
fn code_map(doc: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut in_map = false;
    let mut base = String::new();
    for (i, line) in doc.lines().enumerate() {
        if let Some(title) = line.strip_prefix("## ") {
            in_map = title == "Entry points" || title == "Code map";
            base.clear();
            continue;
        }
        if !in_map {
            continue;
        }
        if let Some(heading) = line.strip_prefix("### ") {
            let (names, _) = heading.split_once(" — ").unwrap_or((heading, ""));
            let dirs = backticked(names);
            base = match dirs.as_slice() {
                [one] => CRATES
                    .iter()
                    .find(|(dir, _)| dir == one)
                    .map(|(_, src)| format!("{src}/"))
                    .unwrap_or_else(|| panic!("ARCHITECTURE.md:{}: `{one}` is not a crate", i + 1)),
                _ => String::new(),
            };
            continue;
        }
        let cell = if let Some(bullet) = line.strip_prefix("- `") {
            // An entry point: its first name only.
            bullet.split('`').next().map(|n| format!("`{n}`"))
        } else if line.starts_with('|') && !line.starts_with("|---") {
            line.split('|').nth(1).map(str::to_owned)
        } else {
            None
        };
        let Some(cell) = cell else { continue };
        let mut patterns = Vec::new();
        let mut prev_dir: Option<String> = None;
        for token in backticked(&cell) {
            let mut dir_of_this = None;
            for name in expand_braces(token) {
                let path = if base.is_empty() || name.starts_with("python/") {
                    name.clone()
                } else if !name.contains('/')
                    && let Some(d) = &prev_dir
                {
                    format!("{d}{name}")
                } else {
                    format!("{base}{name}")
                };
                if name.contains('/') {
                    dir_of_this = path.rsplit_once('/').map(|(d, _)| format!("{d}/"));
                }
                patterns.push(path);
            }
            prev_dir = dir_of_this.or(prev_dir);
        }
        if !patterns.is_empty() {
            rows.push(Row {
                line: i + 1,
                patterns,
            });
        }
    }
    rows
}

#[test]
fn the_code_map_names_every_source_file_and_only_files_that_exist() {
    let doc = read("ARCHITECTURE.md");
    let rows = code_map(&doc);
    assert!(
        rows.len() > 40,
        "the code map parsed to {} rows",
        rows.len()
    );
    let mut existing = Vec::new();
    files_under("src", "", &mut existing);
    files_under("crates", "", &mut existing);
    files_under("python", "", &mut existing);
    let mut problems = Vec::new();
    for row in &rows {
        for p in &row.patterns {
            let found = if p.contains('*') {
                existing.iter().any(|f| glob(p, f))
            } else {
                root().join(p.trim_end_matches('/')).exists()
            };
            if !found {
                problems.push(format!(
                    "ARCHITECTURE.md:{}: `{p}` does not exist",
                    row.line
                ));
            }
        }
    }
    let named = |path: &str| rows.iter().flat_map(|r| &r.patterns).any(|p| glob(p, path));
    for src in sources() {
        let file = src.path.rsplit('/').next().unwrap_or("");
        // A module's split-out tests belong to the module's row.
        let split_tests = (file == "tests.rs" || file.ends_with("_tests.rs"))
            && src
                .path
                .rsplit_once('/')
                .is_some_and(|(dir, _)| named(&format!("{dir}.rs")));
        if !named(&src.path) && !split_tests {
            problems.push(format!(
                "{} is in no row of ARCHITECTURE.md's code map",
                src.path
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_code_map_row_says_its_job_in_one_short_sentence() {
    let doc = read("ARCHITECTURE.md");
    let map = doc
        .split_once("## Code map")
        .and_then(|(_, rest)| rest.split_once("\n## "))
        .map(|(map, _)| map)
        .expect("ARCHITECTURE.md has a code map section");
    let long: Vec<&str> = map
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .filter(|l| {
            let job = l
                .trim_end_matches('|')
                .rsplit('|')
                .next()
                .unwrap_or("")
                .trim();
            job.chars().count() > 120 || job.trim_end_matches('.').contains(". ")
        })
        .collect();
    assert!(
        long.is_empty(),
        "code map rows whose job is more than one sentence of at most 120 characters:\n{}",
        long.join("\n")
    );
}

#[test]
fn every_rust_file_starts_by_stating_its_job() {
    let mut paths = Vec::new();
    for dir in [
        "src",
        "crates",
        "python/src",
        "tests",
        "benches",
        "examples",
    ] {
        files_under(dir, ".rs", &mut paths);
    }
    paths.push("build.rs".into());
    let missing: Vec<&String> = paths
        .iter()
        .filter(|p| !read(p).starts_with("//! "))
        .collect();
    assert!(
        missing.is_empty(),
        "files whose first line is not a `//!` doc: {missing:?}"
    );
}

/// Every (file, line) of `sources` whose text (all of it, or the product part) contains one of `signs`.
fn hits(
    sources: &[Source],
    product_only: bool,
    signs: &[&str],
    allowed: impl Fn(&Source) -> bool,
) -> Vec<String> {
    let mut out = Vec::new();
    for src in sources.iter().filter(|s| !allowed(s)) {
        let text = if product_only {
            src.product()
        } else {
            &src.text
        };
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if let Some(sign) = signs.iter().find(|s| contains_word(code, s)) {
                out.push(format!("{}:{}: `{sign}`: {}", src.path, i + 1, line.trim()));
            }
        }
    }
    out
}

/// `sign` in `code`, not as the tail of a longer identifier (`tch::` is not `batch::`).
fn contains_word(code: &str, sign: &str) -> bool {
    code.match_indices(sign).any(|(at, _)| {
        !code[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn anyhow_only_in_the_cli_and_main() {
    let srcs = sources();
    let found = hits(&srcs, true, &["anyhow"], |s| {
        s.path == "src/cli.rs" || s.path == "src/main.rs"
    });
    assert!(
        found.is_empty(),
        "anyhow outside cli.rs / main.rs:\n{}",
        found.join("\n")
    );
}

#[test]
fn only_the_supervisor_spawns_processes() {
    let srcs = sources();
    let signs = [
        "Command::new",
        "process::Command",
        "tokio::process",
        "fork(",
        "posix_spawn",
        "execv",
    ];
    let found = hits(&srcs, false, &signs, |s| {
        s.under(SUPERVISOR) || SPAWN_EXCEPTIONS.iter().any(|(p, _)| s.path == *p)
    });
    assert!(
        found.is_empty(),
        "process spawning outside the supervisor (invariant 5; add a listed exception only with a reason):\n{}",
        found.join("\n")
    );
}

/// The one module that names a Cargo feature (rlsync-core's `cuda`).
const FEATURE_HOME: &str = "crates/rlsync-core/src/gpu.rs";

#[test]
fn no_module_selects_on_cargo_features() {
    let srcs = sources();
    let found = hits(&srcs, false, &["feature = \""], |s| s.path == FEATURE_HOME);
    assert!(
        found.is_empty(),
        "cfg(feature) outside {FEATURE_HOME} (invariant 6: the `cuda` feature is selected in one module):\n{}",
        found.join("\n")
    );
}

#[test]
fn serialized_formats_only_in_the_modules_invariant_4_names() {
    let srcs = sources();
    let homes = format_homes();
    assert!(homes.len() > 10, "invariant 4 lists {homes:?}");
    let found = hits(&srcs, true, FORMAT_SIGNS, |s| {
        s.under(&homes) || FORMAT_EXCEPTIONS.iter().any(|(p, _)| s.path == *p)
    });
    assert!(
        found.is_empty(),
        "byte-order / JSON / safetensors calls outside the format modules of invariant 4:\n{}",
        found.join("\n")
    );
}

#[test]
fn modules_import_only_what_their_layer_may() {
    let srcs = sources();
    let mut found = Vec::new();
    for (src_dir, module, forbidden) in LAYERS {
        // `crate::m::…`, `crate::m;`, `crate::m,` and `crate::m}` (the last two inside a `use {…}` group).
        let signs: Vec<String> = forbidden
            .iter()
            .flat_map(|m| ["::", ";", ",", "}"].map(|end| format!("crate::{m}{end}")))
            .collect();
        let signs: Vec<&str> = signs.iter().map(String::as_str).collect();
        found.extend(hits(&srcs, true, &signs, |s| {
            s.top_module(src_dir) != Some(*module)
        }));
    }
    assert!(
        found.is_empty(),
        "imports across layers (ARCHITECTURE.md invariant 7):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_exception_lists_name_files_that_exist() {
    for (path, why) in SPAWN_EXCEPTIONS.iter().chain(FORMAT_EXCEPTIONS) {
        assert!(
            root().join(path).is_file(),
            "{path} ({why}) is gone: drop its exception"
        );
    }
    for path in format_homes()
        .iter()
        .map(String::as_str)
        .chain(SUPERVISOR.iter().copied())
    {
        assert!(
            root().join(path).exists(),
            "{path} is gone: update the list"
        );
    }
}

#[test]
fn the_tidy_helpers_do_what_they_say() {
    assert!(glob("src/rl/*", "src/rl/libtorch/ppo.rs"));
    assert!(glob("src/env*.rs", "src/env/reach.rs"));
    assert!(!glob("src/env*.rs", "src/envoy.py"));
    assert_eq!(expand_braces("w/{a,b}.rs"), ["w/a.rs", "w/b.rs"]);
    assert!(contains_word("use tch::Tensor;", "tch::"));
    assert!(!contains_word("batch::run()", "tch::"));
    assert_eq!(module_dir("src/lib.rs"), "src/");
    assert_eq!(
        module_dir("src/config/overrides.rs"),
        "src/config/overrides/"
    );
    let s = Source {
        path: "src/x.rs".into(),
        text: "a\n#[cfg(test)]\nmod tests;\nb\n#[cfg(test)]\nmod tests {\nc\n}\n".into(),
        test_only: false,
    };
    assert_eq!(s.product(), "a\n#[cfg(test)]\nmod tests;\nb\n");
    assert_eq!(s.top_module("src"), Some("x"));
    assert_eq!(s.top_module("crates/rlsync-core/src"), None);
    let homes = format_homes();
    assert!(
        homes
            .iter()
            .any(|h| h == "crates/rlsync-core/src/syncer/wire.rs")
    );
    assert!(homes.iter().all(|h| !h.contains(' ')), "{homes:?}");
}

/// Each package of the dependency graph with the feature sets it is compiled with (a package built for the
/// host too — a build script's or proc-macro's dependency — can have two), as `cargo tree` resolves them for
/// the packages in `args`.
fn feature_sets(args: &[&str]) -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["tree", "--locked", "--prefix", "none", "-f", "{p} [{f}]"])
        .args(args)
        .current_dir(root())
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut sets = std::collections::BTreeMap::<String, BTreeSet<String>>::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let line = line.trim_end_matches(" (*)");
        if let Some((package, rest)) = line.split_once(" [")
            && let Some(features) = rest.strip_suffix(']')
        {
            sets.entry(package.to_owned())
                .or_default()
                .insert(features.to_owned());
        }
    }
    sets
}

/// `make build`, the tests and the wheel compile each shared crate once: the features Cargo unifies for the
/// shipped binaries, for the tests (dev-dependencies included) and for the Python binding agree (the feature
/// pins in Cargo.toml keep them so). A new dependency that turns on other features in a shared crate fails
/// here, naming it, instead of silently compiling the graph twice in `make test`.
#[test]
fn the_binaries_the_tests_and_the_wheel_share_one_build_of_each_crate() {
    let tests = feature_sets(&[
        "--workspace",
        "--exclude",
        "rlsync-python",
        "-e",
        "normal,build,dev",
    ]);
    let build = feature_sets(&["-p", "rlsync", "-p", "rlsync-learner", "-e", "normal,build"]);
    let wheel = feature_sets(&["-p", "rlsync-python", "-e", "normal,build"]);
    assert!(
        build.len() > 50 && wheel.len() > 50,
        "{} / {}",
        build.len(),
        wheel.len()
    );
    let mut problems = Vec::new();
    for (package, sets) in &build {
        if tests.get(package) != Some(sets) {
            problems.push(format!(
                "{package}: make build {sets:?}, the tests {:?}",
                tests.get(package)
            ));
        }
    }
    for (package, sets) in &wheel {
        if let Some(in_tests) = tests.get(package)
            && !sets.is_subset(in_tests)
        {
            problems.push(format!(
                "{package}: the wheel {sets:?}, the tests {in_tests:?}"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "feature sets that differ (pin the features in Cargo.toml):\n{}",
        problems.join("\n")
    );
}
