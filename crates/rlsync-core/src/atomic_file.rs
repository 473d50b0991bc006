//! A file replaced whole or not at all: written as a temporary file beside it, synced, renamed over it.
//!
//! Checkpoints, a rollout's local weights copy and the launch file are read by another process, maybe one
//! started after a crash; none may ever see a half-written file. [`AtomicFile`] is `tempfile`'s
//! `NamedTempFile` in the target's directory, named `<file name>.<random>.tmp` (a sweep can tell the leftovers
//! of a writer that was killed), with the mode the caller asks for.

use std::fs::{File, Permissions};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

/// Who may read the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Like `File::create`: `0666` less the umask.
    Shared,
    /// The owner only (`0600`), whatever the umask.
    Private,
}

/// A file being written in place of its target.
#[derive(Debug)]
pub struct AtomicFile {
    tmp: NamedTempFile,
    target: PathBuf,
}

impl AtomicFile {
    /// Start writing `target` (its directory must exist); until [`AtomicFile::commit`], `target` is untouched
    /// and dropping this removes the temporary file.
    pub fn create(target: &Path, access: Access) -> std::io::Result<AtomicFile> {
        let dir = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let mut prefix = target.file_name().unwrap_or_default().to_owned();
        prefix.push(".");
        let mode = match access {
            Access::Shared => 0o666,
            Access::Private => 0o600,
        };
        let tmp = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".tmp")
            .permissions(Permissions::from_mode(mode))
            .tempfile_in(dir)?;
        if access == Access::Private {
            // The umask applied at creation may have taken more than group and other bits.
            tmp.as_file()
                .set_permissions(Permissions::from_mode(0o600))?;
        }
        Ok(AtomicFile {
            tmp,
            target: target.to_owned(),
        })
    }

    /// The temporary file, for writers that take a path (it is replaced by the rename, not reopened by it).
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    /// The temporary file, for writers that take a file.
    pub fn file(&mut self) -> &mut File {
        self.tmp.as_file_mut()
    }

    /// Sync the written bytes to disk and rename the temporary file over the target.
    pub fn commit(self) -> std::io::Result<()> {
        self.tmp.as_file().sync_all()?;
        self.tmp.persist(&self.target).map_err(|e| e.error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_target_changes_only_on_commit_and_keeps_the_asked_mode() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("launch.json");
        std::fs::write(&target, b"old").unwrap();
        let mut f = AtomicFile::create(&target, Access::Private).unwrap();
        f.file().write_all(b"new").unwrap();
        let tmp = f.path().to_owned();
        let name = tmp.file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            name.starts_with("launch.json.") && name.ends_with(".tmp") && name.len() > 16,
            "{name}"
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        f.commit().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(mode(&target), 0o600);
        assert!(!tmp.exists());
        // Dropped without a commit: the target stays, the temporary file goes.
        let mut f = AtomicFile::create(&target, Access::Shared).unwrap();
        f.file().write_all(b"never").unwrap();
        let tmp = f.path().to_owned();
        drop(f);
        assert!(!tmp.exists());
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(AtomicFile::create(&dir.path().join("no/such.file"), Access::Shared).is_err());
    }
}
