//! Keeps ARCHITECTURE.md true (rust-analyzer's "tidy"): its code map against the files, `//!` first lines, and
//! the invariants by their textual signs, each exception listed here with its reason.
//!
//! The checks read source text, so they are proxies: an import is a `crate::module` path, spawning is
//! `Command::new` / `fork`, a serialized format is a byte-order or JSON call. Code under `#[cfg(test)]` (an
//! inline `mod … {` or a file declared as `#[cfg(test)] mod …;`) is "test code"; the invariants about what the
//! product does skip it, the ones about what the crate may contain at all (processes, tch) do not.

use std::collections::BTreeSet;
use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Process spawning in `src/` and `python/src/` outside the supervisor, with the reason it is allowed.
const SPAWN_EXCEPTIONS: &[(&str, &str)] = &[
    (
        "src/transport/shm/segment.rs",
        "a unit test starts `true` to get a zombie child (the liveness check must call it dead)",
    ),
    (
        "src/rl/libtorch/tests.rs",
        "a learning test runs the TorchScript export example with the venv's Python",
    ),
];

/// Where the process-spawning code lives (invariant 5).
const SUPERVISOR: &[&str] = &[
    "src/orchestrator/supervisor.rs",
    "src/orchestrator/supervisor/",
];

/// Files that may hold serialized formats (invariant 4), by the calls that write or read one.
const FORMAT_HOMES: &[&str] = &[
    "src/bytes.rs",
    "src/protocol.rs",
    "src/protocol/",
    "src/syncer/wire.rs",
    "src/syncer/patch.rs",
    "src/transport/frame.rs",
    "src/transport/tcp.rs",
    "src/orchestrator/metrics/tensorboard.rs",
    "src/rl/libtorch/checkpoint.rs",
    // Checkpoints of workloads without libtorch (synthetic, Python workers) and their metadata, read from the
    // safetensors header alone (resume, --dry-run): the same file format as the learner's.
    "src/tensor/safetensors_io.rs",
    "src/rl/checkpoint_layout.rs",
    // metrics.csv (the csv logger backend) and the metrics.jsonl reader of `rlsync plot`.
    "src/orchestrator/metrics/csv.rs",
    "src/plot.rs",
    "python/src/syncer.rs",
    "python/src/worker.rs",
];

/// Byte-order or JSON calls that are not a serialized format, with the reason.
const FORMAT_EXCEPTIONS: &[(&str, &str)] = &[
    (
        "src/tensor/checksum.rs",
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

/// Module layering: (module, modules it must not import) — invariants 1–3 and "neither imports the other".
const LAYERS: &[(&str, &[&str])] = &[
    (
        "config",
        &[
            "tensor",
            "syncer",
            "transport",
            "protocol",
            "orchestrator",
            "worker",
            "rl",
            "env",
            "bench",
            "dry_run",
        ],
    ),
    ("syncer", &["protocol", "orchestrator", "worker", "rl"]),
    ("transport", &["syncer", "orchestrator", "worker", "rl"]),
    (
        "tensor",
        &["syncer", "transport", "orchestrator", "worker", "rl"],
    ),
    ("protocol", &["orchestrator", "worker", "syncer"]),
    ("orchestrator", &["worker"]),
    ("worker", &["orchestrator"]),
];

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

    fn under(&self, prefixes: &[&str]) -> bool {
        prefixes
            .iter()
            .any(|p| self.path == *p || (p.ends_with('/') && self.path.starts_with(p)))
    }

    /// The module this file belongs to, below `src/` (`src/config/yaml.rs` → `config`).
    fn top_module(&self) -> Option<&str> {
        let rest = self.path.strip_prefix("src/")?;
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
    let dir = Path::new(ROOT).join(rel);
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
        let p = Path::new(ROOT).join(&child);
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
    std::fs::read_to_string(Path::new(ROOT).join(rel))
        .unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// Every `.rs` file of the crate and the Python binding, with its test-only flag.
fn sources() -> Vec<Source> {
    let mut paths = Vec::new();
    files_under("src", ".rs", &mut paths);
    files_under("python/src", ".rs", &mut paths);
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
                [one] if one.ends_with('/') => (*one).to_owned(),
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
                let path = if name.starts_with("src/") || name.starts_with("python/") {
                    name.clone()
                } else if !name.contains('/')
                    && let Some(d) = &prev_dir
                {
                    format!("{d}{name}")
                } else {
                    format!("src/{base}{name}")
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
    files_under("python", "", &mut existing);
    let mut problems = Vec::new();
    for row in &rows {
        for p in &row.patterns {
            let found = if p.contains('*') {
                existing.iter().any(|f| glob(p, f))
            } else {
                Path::new(ROOT).join(p.trim_end_matches('/')).exists()
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
fn every_rust_file_starts_by_stating_its_job() {
    let mut paths = Vec::new();
    for dir in ["src", "python/src", "tests", "benches", "examples"] {
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

#[test]
fn tch_only_under_rl() {
    let srcs = sources();
    let found = hits(&srcs, false, &["tch::", "use tch"], |s| {
        s.path.starts_with("src/rl/")
    });
    assert!(
        found.is_empty(),
        "tch outside src/rl/:\n{}",
        found.join("\n")
    );
}

#[test]
fn only_rl_selects_on_cargo_features() {
    let srcs = sources();
    let found = hits(&srcs, false, &["feature = \""], |s| s.path == "src/rl.rs");
    assert!(
        found.is_empty(),
        "cfg(feature) outside src/rl.rs (invariant 6):\n{}",
        found.join("\n")
    );
}

#[test]
fn serialized_formats_only_in_the_modules_invariant_4_names() {
    let srcs = sources();
    let found = hits(&srcs, true, FORMAT_SIGNS, |s| {
        s.under(FORMAT_HOMES) || FORMAT_EXCEPTIONS.iter().any(|(p, _)| s.path == *p)
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
    for (module, forbidden) in LAYERS {
        // `crate::m::…`, `crate::m;`, `crate::m,` and `crate::m}` (the last two inside a `use {…}` group).
        let signs: Vec<String> = forbidden
            .iter()
            .flat_map(|m| ["::", ";", ",", "}"].map(|end| format!("crate::{m}{end}")))
            .collect();
        let signs: Vec<&str> = signs.iter().map(String::as_str).collect();
        found.extend(hits(&srcs, true, &signs, |s| {
            s.top_module() != Some(module)
        }));
    }
    assert!(
        found.is_empty(),
        "imports across layers (ARCHITECTURE.md invariants 1-3):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_exception_lists_name_files_that_exist() {
    for (path, why) in SPAWN_EXCEPTIONS.iter().chain(FORMAT_EXCEPTIONS) {
        assert!(
            Path::new(ROOT).join(path).is_file(),
            "{path} ({why}) is gone: drop its exception"
        );
    }
    for path in FORMAT_HOMES.iter().chain(SUPERVISOR) {
        assert!(
            Path::new(ROOT).join(path).exists(),
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
}
