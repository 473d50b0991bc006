//! Before Python workers start on `cuda`: ask their interpreter's torch whether that device exists here.
//!
//! `actor.worker.device` / `rollout.worker.device` put a Python worker's model on a GPU. On a machine without
//! one (or with a CPU-only torch) the worker would fail deep inside torch after the run has started; instead the
//! orchestrator (and `--dry-run`) runs the workers' interpreter once with the workers' `PYTHONPATH` and refuses
//! the run with what torch reports. A `cpu` device probes nothing.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::spawn::{default_python, python_path};
use crate::config::schema::{RunConfig, WorkerConfig, WorkerDevice, WorkerKind};

/// How long the interpreter may take to import torch and answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

/// What the probe prints: one JSON line.
const PROBE: &str = r#"import json, sys
try:
    import torch
except BaseException as e:
    print(json.dumps({"import_error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
ok = bool(torch.cuda.is_available())
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "available": ok,
                  "count": torch.cuda.device_count() if ok else 0}))
"#;

/// A Python worker's device that its interpreter cannot provide.
#[derive(Debug, thiserror::Error)]
pub enum DeviceProbeError {
    #[error("{key}={device}: cannot run the workers' interpreter {} to ask torch for the device", interpreter.display())]
    Spawn {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{key}={device}: the workers' interpreter {} did not answer within {} s (importing torch)",
        interpreter.display(), PROBE_TIMEOUT.as_secs()
    )]
    Timeout {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
    },
    #[error("{key}={device}: the workers' interpreter {} gave no answer (exit status {status}): {stderr}", interpreter.display())]
    NoAnswer {
        key: String,
        device: WorkerDevice,
        interpreter: PathBuf,
        status: String,
        /// The interpreter's last lines on stderr.
        stderr: String,
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

/// The probe's answer.
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

/// Check every Python worker role whose device is `cuda` / `cuda:N` against its interpreter (one probe per
/// interpreter and path, shared by the roles that use the same). `Ok` when no role asks for a GPU.
pub fn check(cfg: &RunConfig) -> Result<(), DeviceProbeError> {
    let mut answers: Vec<((PathBuf, Vec<PathBuf>), Answer)> = Vec::new();
    for (role, worker) in [
        ("actor", &cfg.actor.worker),
        ("rollout", &cfg.rollout.worker),
    ] {
        if worker.kind != WorkerKind::Python || !worker.device.is_cuda() {
            continue;
        }
        let key = format!("{role}.worker.device");
        let interpreter = worker.python.clone().unwrap_or_else(default_python);
        let id = (interpreter.clone(), worker.path.clone());
        let answer = match answers.iter().position(|(k, _)| *k == id) {
            Some(i) => &answers[i].1,
            None => {
                let answer = probe(worker, &interpreter, &key)?;
                answers.push((id, answer));
                &answers[answers.len() - 1].1
            }
        };
        judge(answer, key, worker.device, interpreter)?;
    }
    Ok(())
}

/// Run the probe with the worker's interpreter and `PYTHONPATH`.
fn probe(
    worker: &WorkerConfig,
    interpreter: &PathBuf,
    key: &str,
) -> Result<Answer, DeviceProbeError> {
    let mut cmd = Command::new(interpreter);
    cmd.args(["-c", PROBE])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(joined) = python_path(&worker.path, std::env::var_os("PYTHONPATH")) {
        cmd.env("PYTHONPATH", joined);
    }
    let spawn_err = |source| DeviceProbeError::Spawn {
        key: key.to_owned(),
        device: worker.device,
        interpreter: interpreter.clone(),
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
                return Err(DeviceProbeError::Timeout {
                    key: key.to_owned(),
                    device: worker.device,
                    interpreter: interpreter.clone(),
                });
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let answer = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str::<Answer>(line.trim()).ok());
    match answer {
        Some(a) if status.success() => Ok(a),
        _ => {
            let lines: Vec<&str> = stderr.lines().collect();
            Err(DeviceProbeError::NoAnswer {
                key: key.to_owned(),
                device: worker.device,
                interpreter: interpreter.clone(),
                status: status.to_string(),
                stderr: lines[lines.len().saturating_sub(3)..].join(" | "),
            })
        }
    }
}

/// The verdict on one role's device from its interpreter's answer.
fn judge(
    answer: &Answer,
    key: String,
    device: WorkerDevice,
    interpreter: PathBuf,
) -> Result<(), DeviceProbeError> {
    if let Some(python_error) = &answer.import_error {
        return Err(DeviceProbeError::NoTorch {
            key,
            device,
            interpreter,
            python_error: python_error.clone(),
        });
    }
    let torch = answer.torch.clone().unwrap_or_else(|| "?".into());
    let Some(cuda) = answer.cuda.clone() else {
        return Err(DeviceProbeError::CpuOnlyTorch {
            key,
            device,
            interpreter,
            torch,
        });
    };
    if !answer.available || answer.count == 0 {
        return Err(DeviceProbeError::NoGpu {
            key,
            device,
            interpreter,
            torch,
            cuda,
        });
    }
    match device {
        WorkerDevice::Cuda(Some(n)) if n >= answer.count => Err(DeviceProbeError::NoSuchGpu {
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
    fn cpu_workers_and_builtin_workers_probe_nothing() {
        // No interpreter is run: a path that does not exist would fail the probe.
        let mut cfg = RunConfig::default();
        cfg.actor.worker.python = Some(PathBuf::from("/nonexistent/python"));
        cfg.actor.worker.kind = WorkerKind::Python;
        assert!(check(&cfg).is_ok());
        cfg.actor.worker.kind = WorkerKind::Builtin;
        cfg.actor.worker.device = WorkerDevice::Cuda(None);
        assert!(check(&cfg).is_ok());
    }

    #[test]
    fn an_interpreter_that_cannot_run_or_answer_is_named() {
        let mut cfg = RunConfig::default();
        cfg.actor.worker.kind = WorkerKind::Python;
        cfg.actor.worker.device = WorkerDevice::Cuda(Some(0));
        cfg.actor.worker.python = Some(PathBuf::from("/nonexistent/python"));
        let e = check(&cfg).unwrap_err();
        assert!(matches!(e, DeviceProbeError::Spawn { .. }), "{e:?}");
        assert!(e.to_string().contains("actor.worker.device=cuda:0"), "{e}");
        // A program that runs but is no Python: no answer, its status named.
        cfg.actor.worker.python = Some(PathBuf::from("/bin/false"));
        let e = check(&cfg).unwrap_err();
        assert!(matches!(e, DeviceProbeError::NoAnswer { .. }), "{e:?}");
    }
}
