//! A worker executable for the integration tests: `rlsync worker` that can hold itself at a stage of its
//! start-up until the test kills it, so a test kills a rollout at an exact moment.
//!
//! The tests point `RLSYNC_WORKER` at this executable (built by `cargo test` with the other examples) and name
//! the worker and stage in `RLSYNC_TEST_HOLD=<role>-<rank>@<hello|handshake|bootstrap|catchup>[*<n>]:<file>`:
//! the first `n` (default 1) processes of that worker to reach the stage each create the first of `<file>`,
//! `<file>.2`, … `<file>.<n>` that does not exist, write their pid and a newline there, and wait until killed;
//! later processes (once all `n` files exist) go on. The hold is this example's probe passed into the app's
//! worker runtime (`rlsync::worker::run_worker_probed`); the shipped `rlsync` has none.
//! `RLSYNC_TEST_BUILD_S=<seconds>` makes every worker's workload take that long to build (a slow model or
//! Python import), so a test can tell the workers' start-up from the init bootstrap.
//! `RLSYNC_TEST_DEVICE=1` puts every worker's weights on a simulated device ([`sim_device`]).

mod sim_device;

use std::path::PathBuf;
use std::process::ExitCode;

use rlsync::worker::workload::Workload;
use rlsync::worker::{Stage, StageProbe};
use rlsync_core::protocol::messages::Role;
use rlsync_core::syncer::Hold;

/// The variable naming the worker, the stage and the pid file.
const TEST_HOLD_VAR: &str = "RLSYNC_TEST_HOLD";
/// The variable giving the seconds each workload's build sleeps first.
const TEST_BUILD_VAR: &str = "RLSYNC_TEST_BUILD_S";
/// The variable that puts the weights on a simulated device (`1`).
const TEST_DEVICE_VAR: &str = "RLSYNC_TEST_DEVICE";

/// Where this worker holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TestHold {
    stage: Stage,
    /// Processes held, one file each.
    times: u32,
    file: PathBuf,
}

impl TestHold {
    /// This worker's hold from the variable's value `spec` (`None`: unset, or another worker's); `Err` names a
    /// malformed value.
    fn parse(spec: Option<&str>, role: Role, rank: u32) -> Result<Option<TestHold>, String> {
        let Some(spec) = spec else {
            return Ok(None);
        };
        let usage = || {
            format!(
                "{TEST_HOLD_VAR}={spec}: expected <role>-<rank>@<hello|handshake|bootstrap|catchup>[*<n>]:<file>"
            )
        };
        let (who, rest) = spec.split_once('@').ok_or_else(usage)?;
        let (stage, file) = rest.split_once(':').ok_or_else(usage)?;
        let (stage, times) = match stage.split_once('*') {
            Some((stage, n)) => (
                stage,
                n.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(usage)?,
            ),
            None => (stage, 1),
        };
        let stage = match stage {
            "hello" => Stage::Hello,
            "handshake" => Stage::Handshake,
            "bootstrap" => Stage::Bootstrap,
            "catchup" => Stage::CatchUp,
            _ => return Err(usage()),
        };
        if file.is_empty() {
            return Err(usage());
        }
        if who != format!("{}-{rank}", role.name()) {
            return Ok(None);
        }
        Ok(Some(TestHold {
            stage,
            times,
            file: PathBuf::from(file),
        }))
    }

    /// Hold here unless every one of the `times` files exists (it never returns then).
    async fn reach(self) {
        // The first file no predecessor made; none left (or none can be made): go on.
        let mut created = None;
        for n in 1..=self.times {
            let path = match n {
                1 => self.file.clone(),
                n => PathBuf::from(format!("{}.{n}", self.file.display())),
            };
            let made = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path);
            match made {
                Ok(file) => {
                    created = Some(file);
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(_) => return,
            }
        }
        let Some(mut file) = created else {
            return;
        };
        use std::io::Write as _;
        // The log line first and in one write: the test kills this process as soon as the pid arrives, and a
        // kill between `eprintln!`'s pieces left half a line in the log (seen once under load).
        let line = format!("{TEST_HOLD_VAR}: held at {:?} until killed\n", self.stage);
        let _ = std::io::stderr().write_all(line.as_bytes());
        let _ = writeln!(file, "{}", std::process::id());
        drop(file);
        std::future::pending::<()>().await;
    }
}

impl StageProbe for TestHold {
    fn at(&self, stage: Stage) -> Option<Hold> {
        (stage == self.stage).then(|| Box::pin(self.clone().reach()) as Hold)
    }
}

fn main() -> ExitCode {
    let args = match rlsync::cli::utf8_args() {
        Ok(args) => args,
        Err(raw) => {
            eprintln!("Error: argument {raw:?} is not valid UTF-8");
            return ExitCode::FAILURE;
        }
    };
    let Some(("worker", rest)) = args.split_first().map(|(a, rest)| (a.as_str(), rest)) else {
        eprintln!("usage: held_worker worker --role trainer|rollout --rank R --run-dir DIR");
        return ExitCode::from(2);
    };
    let probe = match rlsync::worker::parse_args(rest)
        .map(|w| TestHold::parse(std::env::var(TEST_HOLD_VAR).ok().as_deref(), w.role, w.rank))
    {
        Ok(Ok(hold)) => hold.map(|h| Box::new(h) as Box<dyn StageProbe>),
        Ok(Err(usage)) => {
            eprintln!("Error: {usage}");
            return ExitCode::from(2);
        }
        Err(err) => {
            eprintln!("Error: {err}");
            return ExitCode::from(2);
        }
    };
    let build_s = match std::env::var(TEST_BUILD_VAR).ok().map(|v| v.parse::<f64>()) {
        None => 0.0,
        Some(Ok(s)) if s.is_finite() && s >= 0.0 => s,
        Some(_) => {
            eprintln!("Error: {TEST_BUILD_VAR} must be a number of seconds >= 0");
            return ExitCode::from(2);
        }
    };
    let on_device = std::env::var(TEST_DEVICE_VAR).is_ok_and(|v| v == "1");
    let build = Box::new(move |ctx: &rlsync::worker::WorkerContext| {
        std::thread::sleep(std::time::Duration::from_secs_f64(build_s));
        let workload = rlsync::worker::workload::build(ctx.config(), &ctx.placement())?;
        Ok(match on_device {
            true => {
                // The GPU channel's exports go beside its socket, in the run's private directory.
                let exports = ctx.launch.gpu_socket.as_ref().and_then(|s| s.parent());
                Box::new(sim_device::SimDevice::new(workload, exports)) as Box<dyn Workload>
            }
            false => workload,
        })
    });
    match rlsync::worker::run_worker_probed(rest, build, probe) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{}", rlsync::cli::error_text(&err.into()));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hold_names_one_worker_and_refuses_malformed_values() {
        let parse = |spec: &str, rank| TestHold::parse(Some(spec), Role::Rollout, rank);
        assert_eq!(parse("rollout-1@catchup:/tmp/h", 2).unwrap(), None);
        assert_eq!(TestHold::parse(None, Role::Rollout, 1).unwrap(), None);
        assert_eq!(
            parse("rollout-1@bootstrap:/tmp/h", 1).unwrap(),
            Some(TestHold {
                stage: Stage::Bootstrap,
                times: 1,
                file: PathBuf::from("/tmp/h"),
            })
        );
        assert_eq!(
            parse("rollout-1@hello*2:/tmp/h", 1)
                .unwrap()
                .map(|h| h.times),
            Some(2)
        );
        for bad in [
            "rollout-1",
            "rollout-1@later:/tmp/h",
            "rollout-1@hello:",
            "x@hello",
            "rollout-1@hello*0:/tmp/h",
        ] {
            let err = parse(bad, 1).unwrap_err();
            assert!(err.contains(TEST_HOLD_VAR) && err.contains(bad), "{err}");
        }
        let hold = parse("rollout-1@handshake:/tmp/h", 1).unwrap().unwrap();
        assert!(hold.at(Stage::Handshake).is_some() && hold.at(Stage::Hello).is_none());
    }
}
