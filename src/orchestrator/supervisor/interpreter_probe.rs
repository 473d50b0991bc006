//! Before Python workers start: ask their interpreter once whether it can run them.
//!
//! A Python worker is `INTERPRETER -m rlsync.worker` with the role's `entry` (`package.module:Attr`) imported
//! inside it, and on `cuda` its torch must see that GPU. Each would otherwise fail on its own after the run has
//! started (three workers, three `No module named 'rlsync'`). Instead the orchestrator (and `--dry-run`) runs
//! each distinct interpreter once, with the workers' `PYTHONPATH`, bounded by [`PROBE_TIMEOUT`]: it imports
//! `rlsync.worker`, every entry of the roles it runs (the attribute must exist), and, when a role's device is
//! `cuda`, torch; and it answers with one JSON line. A failure names the interpreter, the key that chose it and
//! the fix.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::spawn::{default_python, python_path};
use crate::config::schema::{RunConfig, WorkerConfig, WorkerDevice, WorkerKind};

/// How long the interpreter may take to import rlsync, the entries (user code) and torch, and answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

/// The probe: `argv[1]` is the JSON request (`entries`: [role, key, entry]; `torch`: whether to ask torch);
/// it prints one JSON line.
const PROBE: &str = r#"import importlib, json, sys
req = json.loads(sys.argv[1])
def why(e):
    return f"{type(e).__name__}: {e}"
out = {"python": sys.executable, "version": sys.version.split()[0], "sys_path": [p for p in sys.path if p]}
try:
    import rlsync.worker
    out["rlsync"] = None
except BaseException as e:
    out["rlsync"] = why(e)
entries = []
for role, key, entry in req["entries"]:
    module_name, _, attr = entry.partition(":")
    attr = attr or ("Trainer" if role == "trainer" else "Rollout")
    err = None
    try:
        module = importlib.import_module(module_name)
    except BaseException as e:
        err = f"cannot import module '{module_name}': {why(e)}"
    else:
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                err = f"module '{module_name}' ({getattr(module, '__file__', None)}) has no attribute '{attr}'"
                break
            obj = getattr(obj, part)
    entries.append({"key": key, "error": err})
out["entries"] = entries
if req["torch"]:
    try:
        import torch
        ok = bool(torch.cuda.is_available())
        out["torch"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": ok,
                        "count": torch.cuda.device_count() if ok else 0}
    except BaseException as e:
        out["torch"] = {"import_error": why(e)}
sys.stdout.flush()
print(json.dumps(out), flush=True)
"#;

/// Why Python workers cannot start with their interpreter.
#[derive(Debug, thiserror::Error)]
pub enum InterpreterProbeError {
    #[error(
        "cannot run the Python workers' interpreter {} ({chosen_by}): run inside the venv that has rlsync, or set \
         {set}; install rlsync there with `make python`",
        interpreter.display()
    )]
    Spawn {
        interpreter: PathBuf,
        /// The key that chose it, or how the default was found.
        chosen_by: String,
        /// The overrides that choose another (`actor.worker.python=/path/to/python …`).
        set: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the Python workers' interpreter {} ({chosen_by}) did not answer within {} s (importing rlsync, the \
         workers' entries and torch)",
        interpreter.display(), PROBE_TIMEOUT.as_secs()
    )]
    Timeout {
        interpreter: PathBuf,
        chosen_by: String,
    },
    #[error(
        "the Python workers' interpreter {} ({chosen_by}) gave no answer (exit status {status}): {stderr}",
        interpreter.display()
    )]
    NoAnswer {
        interpreter: PathBuf,
        chosen_by: String,
        status: String,
        /// The interpreter's last lines on stderr.
        stderr: String,
    },
    #[error(
        "the Python workers' interpreter {} ({chosen_by}, Python {version}) cannot import rlsync ({python_error}): \
         run inside the venv that has rlsync, or set {set}; install rlsync there with `make python`",
        interpreter.display()
    )]
    NoRlsync {
        interpreter: PathBuf,
        chosen_by: String,
        /// The overrides that choose another (`actor.worker.python=/path/to/python …`).
        set: String,
        version: String,
        /// Python's exception, as the interpreter printed it.
        python_error: String,
    },
    #[error(
        "{key}={entry}: {python_error} (interpreter {}; sys.path searched: {})",
        interpreter.display(), sys_path.join(":")
    )]
    Entry {
        key: String,
        entry: String,
        interpreter: PathBuf,
        /// What the import or the attribute lookup raised.
        python_error: String,
        /// The interpreter's `sys.path`, where the module was looked for.
        sys_path: Vec<String>,
    },
    #[error("{key}={device}: the workers' interpreter {} cannot import torch ({python_error})", interpreter.display())]
    NoTorch {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
        /// Python's exception, as the interpreter printed it.
        python_error: String,
    },
    #[error(
        "{key}={device}: torch {torch} in {} is a CPU-only build (torch.version.cuda is None); install a CUDA \
         build of torch there, or set {key}=cpu",
        interpreter.display()
    )]
    CpuOnlyTorch {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
        torch: String,
    },
    #[error(
        "{key}={device}: CUDA is not available on this machine (torch {torch} in {}, built for CUDA {cuda}, \
         reports torch.cuda.is_available() = False: no NVIDIA GPU or driver here); set {key}=cpu",
        interpreter.display()
    )]
    NoGpu {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
        torch: String,
        cuda: String,
    },
    #[error(
        "{key}={device}: torch in {} sees {count} CUDA device(s) here (cuda:0 .. cuda:{last})",
        interpreter.display(), last = count.saturating_sub(1)
    )]
    NoSuchGpu {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
        count: u32,
    },
}

/// Torch's part of the answer.
#[derive(Debug, Deserialize, PartialEq)]
struct Answer {
    import_error: Option<String>,
    torch: Option<String>,
    cuda: Option<String>,
    #[serde(default)]
    available: bool,
    #[serde(default)]
    count: u32,
}

/// One entry's verdict.
#[derive(Debug, Deserialize, PartialEq)]
struct EntryAnswer {
    key: String,
    error: Option<String>,
}

/// The probe's one JSON line.
#[derive(Debug, Deserialize, PartialEq)]
struct Report {
    #[serde(default)]
    version: String,
    #[serde(default)]
    sys_path: Vec<String>,
    /// Why `import rlsync.worker` failed (`None`: it imported).
    rlsync: Option<String>,
    #[serde(default)]
    entries: Vec<EntryAnswer>,
    torch: Option<Answer>,
}

/// The Python roles that run on one interpreter with one `PYTHONPATH`.
struct Group<'a> {
    interpreter: PathBuf,
    path: &'a [PathBuf],
    /// (role, section) of each Python role in this group.
    roles: Vec<(&'static str, &'static str, &'a WorkerConfig)>,
}

impl Group<'_> {
    /// The overrides that choose another interpreter for the group's roles.
    fn set(&self) -> String {
        let keys: Vec<String> = self
            .roles
            .iter()
            .map(|(_, section, _)| format!("{section}.worker.python=/path/to/python"))
            .collect();
        keys.join(" ")
    }

    /// The key that chose the interpreter, or where the default came from.
    fn chosen_by(&self) -> String {
        let keys: Vec<String> = self
            .roles
            .iter()
            .filter(|(_, _, w)| w.python.is_some())
            .map(|(_, section, _)| format!("{section}.worker.python"))
            .collect();
        if !keys.is_empty() {
            return keys.join(", ");
        }
        let sections: Vec<String> = self
            .roles
            .iter()
            .map(|(_, section, _)| format!("{section}.worker.python"))
            .collect();
        let default = match std::env::var_os("VIRTUAL_ENV") {
            Some(venv) if !venv.is_empty() => "the active venv's ($VIRTUAL_ENV)",
            _ => "python3 on PATH, no venv active",
        };
        format!("{} unset: {default}", sections.join(", "))
    }
}

/// Check every Python worker role against its interpreter: one probe per distinct interpreter and path (the
/// roles that share them share it). `Ok` at once when no role is a Python worker.
pub fn check(cfg: &RunConfig) -> Result<(), InterpreterProbeError> {
    let mut groups: Vec<Group<'_>> = Vec::new();
    for (role, section, worker) in [
        ("trainer", "actor", &cfg.actor.worker),
        ("rollout", "rollout", &cfg.rollout.worker),
    ] {
        if worker.kind != WorkerKind::Python {
            continue;
        }
        let interpreter = worker.python.clone().unwrap_or_else(default_python);
        match groups
            .iter_mut()
            .find(|g| g.interpreter == interpreter && g.path == worker.path.as_slice())
        {
            Some(g) => g.roles.push((role, section, worker)),
            None => groups.push(Group {
                interpreter,
                path: &worker.path,
                roles: vec![(role, section, worker)],
            }),
        }
    }
    for group in &groups {
        let report = probe(group)?;
        judge_group(group, &report)?;
    }
    Ok(())
}

/// Run the probe with the group's interpreter and `PYTHONPATH`.
fn probe(group: &Group<'_>) -> Result<Report, InterpreterProbeError> {
    let entries: Vec<(&str, String, &str)> = group
        .roles
        .iter()
        .filter_map(|(role, section, w)| {
            Some((
                *role,
                format!("{section}.worker.entry"),
                w.entry.as_deref()?,
            ))
        })
        .collect();
    let torch = group.roles.iter().any(|(_, _, w)| w.device.is_cuda());
    let request = serde_json::json!({ "entries": entries, "torch": torch }).to_string();
    let interpreter = &group.interpreter;
    let mut cmd = Command::new(interpreter);
    cmd.args(["-c", PROBE, &request])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(joined) = python_path(group.path, std::env::var_os("PYTHONPATH")) {
        cmd.env("PYTHONPATH", joined);
    }
    let spawn_err = |source| InterpreterProbeError::Spawn {
        interpreter: interpreter.clone(),
        chosen_by: group.chosen_by(),
        set: group.set(),
        source,
    };
    let mut child = cmd.spawn().map_err(spawn_err)?;
    // Read both pipes on threads so a chatty interpreter cannot block on a full pipe while we wait.
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = stdout.as_mut() {
            let _ = p.read_to_string(&mut s);
        }
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(p) = stderr.as_mut() {
            let _ = p.read_to_string(&mut s);
        }
        s
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait().map_err(spawn_err)? {
            Some(status) => break status,
            None if started.elapsed() > PROBE_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(InterpreterProbeError::Timeout {
                    interpreter: interpreter.clone(),
                    chosen_by: group.chosen_by(),
                });
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let report = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str::<Report>(line.trim()).ok());
    match report {
        Some(r) if status.success() => Ok(r),
        _ => {
            let lines: Vec<&str> = stderr.lines().collect();
            Err(InterpreterProbeError::NoAnswer {
                interpreter: interpreter.clone(),
                chosen_by: group.chosen_by(),
                status: status.to_string(),
                stderr: lines[lines.len().saturating_sub(3)..].join(" | "),
            })
        }
    }
}

/// The verdict on a group from its interpreter's report: rlsync first, then each entry, then each GPU.
fn judge_group(group: &Group<'_>, report: &Report) -> Result<(), InterpreterProbeError> {
    if let Some(python_error) = &report.rlsync {
        return Err(InterpreterProbeError::NoRlsync {
            interpreter: group.interpreter.clone(),
            chosen_by: group.chosen_by(),
            set: group.set(),
            version: report.version.clone(),
            python_error: python_error.clone(),
        });
    }
    for (_, section, worker) in &group.roles {
        let key = format!("{section}.worker.entry");
        if let Some(python_error) = report
            .entries
            .iter()
            .find(|e| e.key == key)
            .and_then(|e| e.error.clone())
        {
            return Err(InterpreterProbeError::Entry {
                entry: worker.entry.clone().unwrap_or_default(),
                key,
                interpreter: group.interpreter.clone(),
                python_error,
                sys_path: report.sys_path.clone(),
            });
        }
    }
    for (_, section, worker) in &group.roles {
        if !worker.device.is_cuda() {
            continue;
        }
        let key = format!("{section}.worker.device");
        let Some(answer) = &report.torch else {
            return Err(InterpreterProbeError::NoTorch {
                key,
                device: worker.device,
                interpreter: group.interpreter.clone(),
                python_error: "the probe did not ask torch".into(),
            });
        };
        judge(answer, key, worker.device, group.interpreter.clone())?;
    }
    Ok(())
}

/// The verdict on one role's device from its interpreter's answer.
fn judge(
    answer: &Answer,
    key: String,
    device: WorkerDevice,
    interpreter: PathBuf,
) -> Result<(), InterpreterProbeError> {
    if let Some(python_error) = &answer.import_error {
        return Err(InterpreterProbeError::NoTorch {
            key,
            device,
            interpreter,
            python_error: python_error.clone(),
        });
    }
    let torch = answer.torch.clone().unwrap_or_else(|| "?".into());
    let Some(cuda) = answer.cuda.clone() else {
        return Err(InterpreterProbeError::CpuOnlyTorch {
            key,
            device,
            interpreter,
            torch,
        });
    };
    if !answer.available || answer.count == 0 {
        return Err(InterpreterProbeError::NoGpu {
            key,
            device,
            interpreter,
            torch,
            cuda,
        });
    }
    match device {
        WorkerDevice::Cuda(Some(n)) if n >= answer.count => Err(InterpreterProbeError::NoSuchGpu {
            key,
            device,
            interpreter,
            count: answer.count,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(json: &str) -> Answer {
        serde_json::from_str(json).unwrap()
    }

    fn verdict(json: &str, device: WorkerDevice) -> Result<(), String> {
        judge(
            &answer(json),
            "rollout.worker.device".into(),
            device,
            PathBuf::from("/venv/bin/python"),
        )
        .map_err(|e| e.to_string())
    }

    #[test]
    fn each_answer_gets_its_verdict_naming_the_key_and_the_fix() {
        let gpus = r#"{"torch": "2.11.0+cu130", "cuda": "13.0", "available": true, "count": 2}"#;
        assert_eq!(verdict(gpus, WorkerDevice::Cuda(None)), Ok(()));
        assert_eq!(verdict(gpus, WorkerDevice::Cuda(Some(1))), Ok(()));
        let e = verdict(gpus, WorkerDevice::Cuda(Some(2))).unwrap_err();
        assert!(
            e.contains("rollout.worker.device=cuda:2") && e.contains("2 CUDA device(s)"),
            "{e}"
        );
        assert!(e.contains("cuda:0 .. cuda:1"), "{e}");
        let e = verdict(
            r#"{"torch": "2.13.0+cu130", "cuda": "13.0", "available": false, "count": 0}"#,
            WorkerDevice::Cuda(None),
        )
        .unwrap_err();
        assert!(e.contains("CUDA is not available on this machine"), "{e}");
        assert!(
            e.contains("set rollout.worker.device=cpu") && e.contains("/venv/bin/python"),
            "{e}"
        );
        let e = verdict(
            r#"{"torch": "2.13.0+cpu", "cuda": null, "available": false, "count": 0}"#,
            WorkerDevice::Cuda(None),
        )
        .unwrap_err();
        assert!(
            e.contains("CPU-only build") && e.contains("2.13.0+cpu"),
            "{e}"
        );
        let e = verdict(
            r#"{"import_error": "ModuleNotFoundError: No module named 'torch'"}"#,
            WorkerDevice::Cuda(None),
        )
        .unwrap_err();
        assert!(
            e.contains("cannot import torch") && e.contains("No module named"),
            "{e}"
        );
    }

    #[test]
    fn builtin_workers_probe_nothing() {
        // No interpreter is run: a path that does not exist would fail the probe.
        let mut cfg = RunConfig::default();
        cfg.actor.worker.python = Some(PathBuf::from("/nonexistent/python"));
        assert!(check(&cfg).is_ok());
    }

    fn python_workers(entry: &str, python: &str, path: &std::path::Path) -> RunConfig {
        let mut cfg = RunConfig::default();
        for w in [&mut cfg.actor.worker, &mut cfg.rollout.worker] {
            w.kind = WorkerKind::Python;
            w.entry = Some(entry.into());
            w.python = Some(PathBuf::from(python));
            w.path = vec![path.to_owned()];
        }
        cfg
    }

    #[test]
    fn an_interpreter_that_cannot_run_or_answer_is_named_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = python_workers("bandit", "/nonexistent/python", dir.path());
        let e = check(&cfg).unwrap_err();
        assert!(matches!(e, InterpreterProbeError::Spawn { .. }), "{e:?}");
        let text = e.to_string();
        for want in [
            "/nonexistent/python",
            "actor.worker.python, rollout.worker.python",
            "run inside the venv",
            "make python",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        // A program that runs but is no Python: no answer, its status named.
        let cfg = python_workers("bandit", "/bin/false", dir.path());
        let e = check(&cfg).unwrap_err();
        assert!(matches!(e, InterpreterProbeError::NoAnswer { .. }), "{e:?}");
    }

    /// A directory holding a stand-in `rlsync.worker` (when `rlsync`) and a module `bandit` with `Trainer`.
    fn fixture(rlsync: bool) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        if rlsync {
            std::fs::create_dir(dir.path().join("rlsync")).unwrap();
            std::fs::write(dir.path().join("rlsync/__init__.py"), "").unwrap();
            std::fs::write(dir.path().join("rlsync/worker.py"), "").unwrap();
        }
        std::fs::write(
            dir.path().join("bandit.py"),
            "class Trainer:\n    pass\nclass Rollout:\n    pass\n",
        )
        .unwrap();
        dir
    }

    #[test]
    fn an_interpreter_without_rlsync_is_named_with_the_fix() {
        let dir = fixture(false);
        // An interpreter that cannot see rlsync even where the venv on PATH has it installed (a `make test`
        // after an earlier one): python3 without its site-packages, as a named program.
        let python = dir.path().join("python3");
        std::fs::write(&python, "#!/bin/sh\nexec python3 -S \"$@\"\n").unwrap();
        std::fs::set_permissions(&python, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let python = python.to_str().unwrap().to_owned();
        let e = check(&python_workers("bandit", &python, dir.path())).unwrap_err();
        assert!(matches!(e, InterpreterProbeError::NoRlsync { .. }), "{e:?}");
        let text = e.to_string();
        for want in [
            python.as_str(),
            "cannot import rlsync",
            "No module named 'rlsync'",
            "set actor.worker.python=/path/to/python rollout.worker.python=/path/to/python",
            "make python",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
    }

    #[test]
    fn an_entry_whose_attribute_is_missing_is_named_with_the_path_searched() {
        let dir = fixture(true);
        // The module's default class for the role, and a named one: both exist.
        check(&python_workers("bandit", "python3", dir.path())).unwrap();
        check(&python_workers("bandit:Trainer", "python3", dir.path())).unwrap();
        let mut cfg = python_workers("bandit", "python3", dir.path());
        cfg.actor.worker.entry = Some("bandit:Trainr".into());
        let e = check(&cfg).unwrap_err();
        assert!(matches!(e, InterpreterProbeError::Entry { .. }), "{e:?}");
        let text = e.to_string();
        for want in [
            "actor.worker.entry=bandit:Trainr",
            "has no attribute 'Trainr'",
            "bandit.py",
            "sys.path searched",
            &dir.path().display().to_string(),
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        let mut cfg = python_workers("bandit", "python3", dir.path());
        cfg.rollout.worker.entry = Some("no_such_module_xyz".into());
        let text = check(&cfg).unwrap_err().to_string();
        assert!(
            text.starts_with("rollout.worker.entry=no_such_module_xyz: cannot import module")
                && text.contains("No module named 'no_such_module_xyz'"),
            "{text}"
        );
    }
}
