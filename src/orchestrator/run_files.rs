//! The run's own files outside its results: the run-dir lock, the private 0700 directory under `TMPDIR` that
//! holds the control sockets, the 0600 launch file, the removal of the rollouts' local weights copies, and the
//! sweep of what runs whose orchestrator died left.
//!
//! Naming: a run's tag is `rlsync-<orchestrator pid>-<nonce>`; its private directory is `$TMPDIR/<tag>/`
//! (sockets inside), its shared-memory segments are `/dev/shm/<tag>.<creator pid>.…` and its host-shared arenas
//! `/dev/shm/<tag>.arena.<node>`. So after a SIGKILL of the orchestrator, anything named `rlsync-<pid>-…` whose
//! pid is gone can be swept: by the next run's start and by `rlsync --cleanup`.

use std::fs::File;
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use rlsync_core::atomic_file::{Access, AtomicFile};

pub use rlsync_core::transport::shm::MAX_SOCKET_PATH;
/// File names inside the private directory (short, so deep `TMPDIR`s still fit [`MAX_SOCKET_PATH`]).
const CONTROL_SOCKET: &str = "control.sock";
const WEIGHT_SOCKET: &str = "weights.sock";
const GPU_SOCKET: &str = "gpu.sock";
/// What a run's tag looks like at most: `rlsync-<pid up to 10 digits>-<8 hex digits>`.
const LONGEST_TAG: usize = "rlsync-".len() + 10 + 1 + 8;

#[derive(Debug, thiserror::Error)]
pub enum RunFilesError {
    #[error(
        "run directory {run_dir} is in use by another rlsync run (pid {holder}); wait for it or choose another hydra.run.dir"
    )]
    InUse { run_dir: PathBuf, holder: String },
    #[error("cannot prepare {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "socket path {path} is {len} bytes, more than the {MAX_SOCKET_PATH} a Unix socket address holds; set TMPDIR to a shorter directory"
    )]
    SocketPathTooLong { path: PathBuf, len: usize },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunFilesError + '_ {
    move |source| RunFilesError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The exclusive hold on a run directory, released when dropped (or when the process dies, however it dies).
#[derive(Debug)]
pub struct RunLock {
    _lock: Flock<File>,
}

/// Lock `<run_dir>/.rlsync/lock` for the life of the run; refused, naming the holder's pid, when another run
/// holds it. Creates `<run_dir>/.rlsync` (0700).
pub fn lock_run_dir(run_dir: &Path) -> Result<RunLock, RunFilesError> {
    let private = run_dir.join(".rlsync");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&private)
        .map_err(io(&private))?;
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))
        .map_err(io(&private))?;
    let path = private.join("lock");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(io(&path))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((mut file, Errno::EWOULDBLOCK)) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(RunFilesError::InUse {
                run_dir: run_dir.to_owned(),
                holder: if holder.is_empty() {
                    "unknown".to_owned()
                } else {
                    holder.to_owned()
                },
            });
        }
        Err((_, errno)) => return Err(io(&path)(std::io::Error::from(errno))),
    };
    let pid = std::process::id().to_string();
    lock.set_len(0)
        .and_then(|()| lock.rewind())
        .and_then(|()| lock.write_all(pid.as_bytes()))
        .map_err(io(&path))?;
    Ok(RunLock { _lock: lock })
}

/// Remove the rollouts' local weights copies (and temporary files of copies being written) from
/// `<run_dir>/.rlsync`: at a run's start (a previous run's copies are not this run's versions) and at its end.
/// Returns how many files were removed.
pub fn remove_rollout_copies(run_dir: &Path) -> usize {
    let prefix = crate::protocol::launch::ROLLOUT_COPY_PREFIX;
    let mut removed = 0;
    if let Ok(entries) = std::fs::read_dir(run_dir.join(".rlsync")) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            // A copy, or the temporary file of a write that did not finish (`rlsync_core::atomic_file`).
            let copy = name.ends_with(".safetensors") || name.ends_with(".tmp");
            if name.starts_with(prefix) && copy && std::fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// Write `bytes` to `path` readable and writable by the owner only, whatever the umask; a reader sees the
/// previous file or the whole new one (`rlsync_core::atomic_file`).
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), RunFilesError> {
    let mut file = AtomicFile::create(path, Access::Private).map_err(io(path))?;
    file.file().write_all(bytes).map_err(io(path))?;
    file.commit().map_err(io(path))
}

/// A new run tag: `rlsync-<pid>-<nonce>` (unique per run, sweepable once the pid is gone).
pub fn new_tag() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("rlsync-{}-{nanos:08x}", std::process::id())
}

/// The run's private directory under `tmp` and the paths of its sockets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrivateDir {
    pub dir: PathBuf,
    pub control_socket: PathBuf,
    pub weight_socket: PathBuf,
    /// The same-host GPU channel's (`weight_syncer.patch.transport_device: cuda`).
    pub gpu_socket: PathBuf,
}

impl PrivateDir {
    pub fn layout(tmp: &Path, tag: &str) -> PrivateDir {
        let dir = tmp.join(tag);
        PrivateDir {
            control_socket: dir.join(CONTROL_SOCKET),
            weight_socket: dir.join(WEIGHT_SOCKET),
            gpu_socket: dir.join(GPU_SOCKET),
            dir,
        }
    }

    /// Create the directory (0700, whatever the umask) after checking that its socket paths fit.
    pub fn create(tmp: &Path, tag: &str) -> Result<PrivateDir, RunFilesError> {
        let layout = PrivateDir::layout(tmp, tag);
        for path in [
            &layout.control_socket,
            &layout.weight_socket,
            &layout.gpu_socket,
        ] {
            check_socket_path(path)?;
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&layout.dir)
            .map_err(io(&layout.dir))?;
        std::fs::set_permissions(&layout.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io(&layout.dir))?;
        Ok(layout)
    }

    /// Remove the directory and everything in it.
    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn check_socket_path(path: &Path) -> Result<(), RunFilesError> {
    if let Some(len) = rlsync_core::transport::shm::socket_path_too_long(path) {
        return Err(RunFilesError::SocketPathTooLong {
            path: path.to_owned(),
            len,
        });
    }
    Ok(())
}

/// The dry run's check: would the longest socket path of a run fit under `tmp`?
pub fn check_socket_dir(tmp: &Path) -> Result<(), RunFilesError> {
    let tag = "x".repeat(LONGEST_TAG);
    let layout = PrivateDir::layout(tmp, &tag);
    check_socket_path(&layout.control_socket)?;
    check_socket_path(&layout.weight_socket)?;
    check_socket_path(&layout.gpu_socket)
}

/// What a sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    pub dirs: Vec<PathBuf>,
    pub segments: usize,
}

/// The orchestrator pid in a name that starts `rlsync-<pid>-`.
fn owner_pid(name: &str) -> Option<i32> {
    let rest = name.strip_prefix("rlsync-")?;
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok().filter(|p| *p > 0)
}

fn pid_alive(pid: i32) -> bool {
    rlsync_core::transport::shm::pid_alive(pid)
}

/// Remove what runs whose orchestrator is gone left behind: their private directories (and sockets of the
/// older flat layout) under `tmp`, and their shared-memory segments whose creator is gone too. Only this
/// user's entries are touched; anything of a live pid is kept.
pub fn sweep_leftovers(tmp: &Path) -> Swept {
    use std::os::unix::fs::MetadataExt as _;
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut swept = Swept::default();
    if let Ok(entries) = std::fs::read_dir(tmp) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(owner_pid) else {
                continue;
            };
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.uid() != uid || pid_alive(pid) {
                continue;
            }
            let path = entry.path();
            let removed = if meta.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            if removed.is_ok() {
                swept.dirs.push(path);
            }
        }
    }
    let mut prefixes = std::collections::BTreeSet::new();
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(prefix) = name.split('.').next() else {
                continue;
            };
            if let Some(pid) = owner_pid(prefix)
                && !pid_alive(pid)
                && entry.metadata().is_ok_and(|m| m.uid() == uid)
            {
                prefixes.insert(prefix.to_owned());
            }
        }
    }
    for prefix in prefixes {
        swept.segments += rlsync_core::transport::shm::remove_leftovers(&prefix).unwrap_or(0);
        swept.segments += remove_arenas(&prefix);
    }
    swept
}

/// Unlink a host-shared arena (`weight_syncer.host_shared`) by name; `None` or an arena already gone is no
/// error. Returns whether one was removed.
pub fn remove_arena(name: Option<&str>) -> bool {
    let Some(name) = name else { return false };
    match nix::sys::mman::shm_unlink(format!("/{name}").as_str()) {
        Ok(()) => true,
        Err(Errno::ENOENT) => false,
        Err(errno) => {
            tracing::warn!("removing the host-shared arena {name}: {errno}");
            false
        }
    }
}

/// The arenas (`<tag>.arena.<node>`) of run `tag`, whose orchestrator is gone: their names carry no creator
/// pid, so the segment sweep of the transport leaves them. Returns how many were removed.
fn remove_arenas(tag: &str) -> usize {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|name| is_arena_of(name, tag))
        .filter(|name| remove_arena(Some(name)))
        .count()
}

/// Whether `name` is an arena (`<tag>.arena.<node>`, node digits only) of run `tag`.
fn is_arena_of(name: &str, tag: &str) -> bool {
    name.strip_prefix(tag)
        .and_then(|rest| rest.strip_prefix('.'))
        .and_then(|rest| rest.strip_prefix(crate::protocol::launch::ARENA_INFIX))
        .and_then(|rest| rest.strip_prefix('.'))
        .is_some_and(|node| !node.is_empty() && node.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_run_dir_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock_run_dir(dir.path()).expect("first lock");
        let err = lock_run_dir(dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!(
                "in use by another rlsync run (pid {})",
                std::process::id()
            )),
            "{text}"
        );
        drop(held);
        lock_run_dir(dir.path()).expect("free again once the holder is gone");
        let mode = std::fs::metadata(dir.path().join(".rlsync"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn private_files_are_owner_only_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let private = PrivateDir::create(dir.path(), "rlsync-1-0000abcd");
        let file = dir.path().join("launch.json");
        let written = write_private(&file, b"{}");
        nix::sys::stat::umask(old);
        let private = private.unwrap();
        written.unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&private.dir), 0o700);
        assert_eq!(mode(&file), 0o600);
        assert!(private.control_socket.starts_with(&private.dir));
    }

    #[test]
    fn socket_paths_beyond_sun_len_are_refused() {
        let long = PathBuf::from(format!("/tmp/{}", "d".repeat(90)));
        let err = check_socket_dir(&long).unwrap_err();
        assert!(
            err.to_string()
                .contains("more than the 107 a Unix socket address holds"),
            "{err}"
        );
        check_socket_dir(Path::new("/tmp")).expect("a short TMPDIR fits");
        assert!(PrivateDir::create(&long, "rlsync-1-x").is_err());
    }

    #[test]
    fn sweep_removes_only_dead_owners() {
        let dir = tempfile::tempdir().unwrap();
        // A pid far above any pid_max is never alive.
        let dead = dir.path().join("rlsync-2147483000-00000001");
        let live = dir
            .path()
            .join(format!("rlsync-{}-00000002", std::process::id()));
        let flat = dir.path().join("rlsync-2147483000-00000003.sock");
        let other = dir.path().join("unrelated-1-2");
        for d in [&dead, &live, &other] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(dead.join("control.sock"), b"").unwrap();
        std::fs::write(&flat, b"").unwrap();
        let swept = sweep_leftovers(dir.path());
        assert_eq!(swept.dirs.len(), 2, "{swept:?}");
        assert!(!dead.exists() && !flat.exists());
        assert!(live.exists() && other.exists());
        assert_eq!(owner_pid("rlsync-12-ab"), Some(12));
    }

    #[test]
    fn sweep_removes_the_arenas_of_dead_runs_only() {
        use std::os::unix::fs::OpenOptionsExt as _;
        let nonce = std::process::id();
        let dead =
            crate::protocol::launch::arena_name(&format!("rlsync-2147483001-{nonce:08x}"), 0);
        let live = crate::protocol::launch::arena_name(
            &format!("rlsync-{}-{nonce:08x}", std::process::id()),
            3,
        );
        for name in [&dead, &live] {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(Path::new("/dev/shm").join(name))
                .unwrap();
        }
        let empty = tempfile::tempdir().unwrap();
        // Any sweep removes a dead run's arenas, also that of an rlsync a parallel test starts: what must hold
        // is the outcome, not which sweep got there first (so no count is asserted here).
        sweep_leftovers(empty.path());
        assert!(
            !Path::new("/dev/shm").join(&dead).exists(),
            "a dead run's arena is swept"
        );
        assert!(
            Path::new("/dev/shm").join(&live).exists(),
            "a live run's arena is kept"
        );
        assert!(remove_arena(Some(&live)));
        assert!(
            !remove_arena(Some(&live)),
            "already gone: no error, nothing removed"
        );
        assert!(!remove_arena(None));
        assert_eq!(owner_pid("rlsync-bench.1.2"), None);
    }

    #[test]
    fn only_a_runs_own_arenas_are_its_arenas() {
        let tag = "rlsync-12-0000abcd";
        let arena = crate::protocol::launch::arena_name(tag, 3);
        assert!(is_arena_of(&arena, tag), "{arena}");
        assert!(
            !is_arena_of(&arena, "rlsync-12-0000abc"),
            "another run's tag"
        );
        assert!(
            !is_arena_of(&format!("{tag}.7.0"), tag),
            "a segment, not an arena"
        );
        assert!(!is_arena_of(&format!("{arena}x"), tag), "node digits only");
        assert!(
            !is_arena_of(&arena.replace(".3", "."), tag),
            "a node number"
        );
    }
}
