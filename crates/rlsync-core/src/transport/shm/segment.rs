//! POSIX shared-memory segments: create (0600, space reserved up front), map read-only, unlink, sweep leftovers.
//!
//! Names are `<prefix>.<pid>.<instance>.<generation>` so a crash sweep can tell whose segment it is and skip the
//! segments of processes that are still alive.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{Mmap, MmapMut, MmapOptions};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;

use crate::transport::TransportError;

/// Where Linux exposes POSIX shm segments as files.
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// Longest segment name Linux accepts (a file name under /dev/shm).
const NAME_MAX: usize = 255;

/// Where a payload starts inside its segment (segments are page-aligned).
pub(crate) const PAYLOAD_OFFSET: usize = crate::transport::PAYLOAD_PAGE_OFFSET;

/// Distinguishes senders created by the same process.
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(0);

fn segment_error(name: &str, op: &'static str, errno: Errno) -> TransportError {
    TransportError::Segment {
        name: name.to_owned(),
        op,
        source: std::io::Error::from(errno),
    }
}

/// Checks a user-given prefix: a plain file-name fragment, so segment names stay valid and sweepable.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), TransportError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if prefix.is_empty() || !prefix.chars().all(ok_char) || prefix.len() > NAME_MAX - 64 {
        return Err(TransportError::Config {
            reason: format!(
                "segment prefix {prefix:?} must be 1..={} characters of [A-Za-z0-9_.-]",
                NAME_MAX - 64
            ),
        });
    }
    Ok(())
}

/// Checks a segment name announced by the sender before handing it to `shm_open`.
pub(crate) fn validate_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.')
}

/// Allocates names for one sender's segments.
#[derive(Debug)]
pub(crate) struct Namer {
    prefix: String,
    pid: u32,
    instance: u64,
    next_generation: u64,
}

impl Namer {
    pub(crate) fn new(prefix: &str) -> Self {
        Namer {
            prefix: prefix.to_owned(),
            pid: std::process::id(),
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            next_generation: 0,
        }
    }

    /// A fresh (generation, name) pair.
    pub(crate) fn next(&mut self) -> (u64, String) {
        let generation = self.next_generation;
        self.next_generation += 1;
        (
            generation,
            format!(
                "{}.{}.{}.{}",
                self.prefix, self.pid, self.instance, generation
            ),
        )
    }
}

fn shm_path(name: &str) -> String {
    format!("/{name}")
}

/// A segment this process created and writes; unlinked on [`OwnedSegment::unlink`] or drop, whichever is first.
#[derive(Debug)]
pub(crate) struct OwnedSegment {
    name: String,
    generation: u64,
    map: MmapMut,
    linked: bool,
}

impl OwnedSegment {
    /// Create segment `name` of `capacity` bytes (mode 0600), reserving its memory now so that a full /dev/shm
    /// is an error here rather than a SIGBUS on first write, and mapping it with its pages already faulted in.
    pub(crate) fn create(
        name: &str,
        generation: u64,
        capacity: usize,
    ) -> Result<Self, TransportError> {
        let path = shm_path(name);
        let fd = shm_open(
            path.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| segment_error(name, "create", e))?;
        let unlink_on_error = |err: TransportError| {
            let _ = shm_unlink(path.as_str());
            err
        };
        let len = libc::off_t::try_from(capacity).map_err(|_| {
            unlink_on_error(TransportError::TooLarge {
                what: "segment",
                len: capacity,
                max: libc::off_t::MAX as usize,
            })
        })?;
        if capacity > 0 {
            nix::fcntl::posix_fallocate(&fd, 0, len)
                .map_err(|e| unlink_on_error(segment_error(name, "reserve", e)))?;
        }
        let file = File::from(fd);
        // SAFETY: the segment was just created exclusively (O_EXCL) by us with the size mapped here, and only
        // this sender writes it; receivers map it read-only and read a slot only between publish and release.
        let map =
            unsafe { MmapOptions::new().len(capacity).populate().map_mut(&file) }.map_err(|e| {
                unlink_on_error(TransportError::Segment {
                    name: name.to_owned(),
                    op: "map",
                    source: e,
                })
            })?;
        Ok(OwnedSegment {
            name: name.to_owned(),
            generation,
            map,
            linked: true,
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Size of the whole segment.
    pub(crate) fn size(&self) -> usize {
        self.map.len()
    }

    /// The largest payload the segment holds.
    pub(crate) fn payload_capacity(&self) -> usize {
        self.map.len().saturating_sub(PAYLOAD_OFFSET)
    }

    /// The first `len` payload bytes, if the segment holds that many.
    pub(crate) fn payload_mut(&mut self, len: usize) -> Option<&mut [u8]> {
        self.map
            .get_mut(PAYLOAD_OFFSET..PAYLOAD_OFFSET.checked_add(len)?)
    }

    /// Remove the name (the memory lives on while mapped). Idempotent.
    /// Whether the name still exists (a receiver can still open it).
    pub(crate) fn is_linked(&self) -> bool {
        self.linked
    }

    pub(crate) fn unlink(&mut self) {
        if std::mem::replace(&mut self.linked, false)
            && let Err(errno) = shm_unlink(shm_path(&self.name).as_str())
        {
            tracing::warn!(segment = %self.name, %errno, "could not unlink shared memory segment");
        }
    }
}

impl Drop for OwnedSegment {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// A segment announced by the sender, mapped read-only.
#[derive(Debug)]
pub(crate) struct MappedSegment {
    map: Mmap,
}

impl MappedSegment {
    /// Open and map `name`, checking that the file really holds `capacity` bytes (reading past its end would
    /// raise SIGBUS).
    pub(crate) fn open(name: &str, capacity: usize) -> Result<Self, TransportError> {
        let fd = shm_open(shm_path(name).as_str(), OFlag::O_RDONLY, Mode::empty())
            .map_err(|e| segment_error(name, "open", e))?;
        let file = File::from(fd);
        let size = file
            .metadata()
            .map_err(|e| TransportError::Segment {
                name: name.to_owned(),
                op: "stat",
                source: e,
            })?
            .len();
        if size < capacity as u64 {
            return Err(TransportError::Protocol {
                peer: crate::transport::Peer::Sender,
                reason: format!("segment {name} holds {size} bytes, {capacity} were announced"),
            });
        }
        // SAFETY: mapped read-only; the sender never shrinks a segment, and writes a slot only after every
        // receiver released it, so the bytes we hand out are stable while `read` runs.
        let map =
            unsafe { MmapOptions::new().len(capacity).populate().map(&file) }.map_err(|e| {
                TransportError::Segment {
                    name: name.to_owned(),
                    op: "map",
                    source: e,
                }
            })?;
        Ok(MappedSegment { map })
    }

    /// The first `len` payload bytes, if the segment holds that many.
    pub(crate) fn payload(&self, len: usize) -> Option<&[u8]> {
        self.map
            .get(PAYLOAD_OFFSET..PAYLOAD_OFFSET.checked_add(len)?)
    }
}

/// Whether a process with this pid exists (a zombie counts as existing until reaped).
/// Whether `pid` is a running process. A zombie (dead, not yet reaped: the child of an orchestrator killed
/// by SIGKILL, waiting for init) counts as gone: it can no longer use a segment.
pub(crate) fn pid_alive(pid: i32) -> bool {
    if matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    ) {
        return false;
    }
    // `/proc/<pid>/stat` is `pid (comm) state …`; comm may hold spaces or parentheses, so split at the last ')'.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// Unlink the segments named `<prefix>.<pid>.…` whose creating process no longer exists; returns how many.
pub(crate) fn sweep(prefix: &str) -> Result<usize, TransportError> {
    validate_prefix(prefix)?;
    let entries = std::fs::read_dir(SHM_DIR).map_err(|source| TransportError::Io {
        op: "listing /dev/shm",
        source,
    })?;
    let lead = format!("{prefix}.");
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str() else {
            continue;
        };
        let Some(rest) = name.strip_prefix(&lead) else {
            continue;
        };
        let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if pid <= 0 || pid_alive(pid) {
            continue;
        }
        match shm_unlink(shm_path(name).as_str()) {
            Ok(()) => removed += 1,
            // Someone else swept it first.
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(segment_error(name, "unlink", e)),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn prefixes_and_names_are_checked() {
        for ok in ["rlsync", "a", "run-3_x.y"] {
            assert!(validate_prefix(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "sp ace", "ü", &"x".repeat(250)] {
            assert!(validate_prefix(bad).is_err(), "{bad}");
        }
        assert!(validate_name("rlsync.1.0.3"));
        for bad in ["", "../etc/passwd", "/x", ".hidden", "a b"] {
            assert!(!validate_name(bad), "{bad}");
        }
    }

    #[test]
    fn created_segment_is_private_shared_and_unlinked_on_drop() {
        let mut namer = Namer::new("rlsync-unit-seg");
        let (generation, name) = namer.next();
        let mut seg = OwnedSegment::create(&name, generation, 8192).unwrap();
        let path = std::path::Path::new(SHM_DIR).join(&name);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        seg.payload_mut(4).unwrap().copy_from_slice(b"abcd");
        let view = MappedSegment::open(&name, 8192).unwrap();
        assert_eq!(view.payload(4), Some(&b"abcd"[..]));
        assert!(view.payload(8192 - PAYLOAD_OFFSET + 1).is_none());
        assert!(
            MappedSegment::open(&name, 8193).is_err(),
            "announced size beyond the file"
        );
        drop(seg);
        assert!(!path.exists());
        assert_eq!(
            view.payload(4),
            Some(&b"abcd"[..]),
            "mapping outlives the name"
        );
    }

    #[test]
    fn a_zombie_is_not_alive() {
        assert!(pid_alive(std::process::id() as i32));
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // Not reaped yet: once it exits it is a zombie until `wait`.
        let zombie = (0..2000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(5));
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
        });
        assert!(zombie, "the child never became a zombie");
        assert!(!pid_alive(pid));
        let mut child = child;
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }

    #[test]
    fn sweep_skips_live_processes() {
        let mut namer = Namer::new("rlsync-unit-sweep");
        let (generation, name) = namer.next();
        let seg = OwnedSegment::create(&name, generation, 4096).unwrap();
        assert_eq!(
            sweep("rlsync-unit-sweep").unwrap(),
            0,
            "our own pid is alive"
        );
        assert!(std::path::Path::new(SHM_DIR).join(seg.name()).exists());
    }
}
