//! Host copies of a workload's device weights, refreshed only when the runtime reads them.
//!
//! A workload whose weights live on a device (a Python model on a GPU) hands the runtime a state dict of host
//! copies. The device always holds the current weights: what the runtime writes into the copies (a
//! bootstrap, a rejoin, a local copy, a checkpoint, a host-path install) is pushed at once. The copies are
//! pulled only when the runtime is about to read them and the device changed since (a train step, a device
//! install), so a worker whose syncs run on the device pulls only for checksums, checkpoints, local copies
//! and rejoins. (A host write is always of copies that are current or written whole: the trainer's only host
//! write is a resume before its first step, a rollout's happen before its installer is attached.)

/// Pulls and pushes between a device's weights and their host copies.
pub trait HostCopies {
    type Error;
    /// Host copies := device weights.
    fn pull(&mut self) -> Result<(), Self::Error>;
    /// Device weights := host copies.
    fn push(&mut self) -> Result<(), Self::Error>;
}

/// [`HostCopies`] pulled lazily and pushed eagerly (see the module docs): what a workload's
/// [`Workload::host_view`](super::workload::Workload::host_view) and
/// [`Workload::weights_written`](super::workload::Workload::weights_written) do.
pub struct LazyHostCopies<C> {
    copies: C,
    /// The device changed since the copies were last pulled.
    stale: bool,
}

impl<C: HostCopies> LazyHostCopies<C> {
    /// Copies not read yet: pulled on the first read.
    pub fn new(copies: C) -> LazyHostCopies<C> {
        LazyHostCopies {
            copies,
            stale: true,
        }
    }

    pub fn copies(&self) -> &C {
        &self.copies
    }

    /// Whether the copies hold the device's weights now (no pull pending).
    pub fn is_current(&self) -> bool {
        !self.stale
    }

    /// The device weights changed (the workload's own compute, a device install).
    pub fn device_changed(&mut self) {
        self.stale = true;
    }

    /// Before the runtime reads the copies: pull them if the device changed since.
    pub fn host_view(&mut self) -> Result<(), C::Error> {
        if self.stale {
            self.copies.pull()?;
            self.stale = false;
        }
        Ok(())
    }

    /// The runtime wrote the copies: push them to the device now.
    pub fn host_changed(&mut self) -> Result<(), C::Error> {
        self.copies.push()?;
        self.stale = false;
        Ok(())
    }

    /// What the runtime reports through [`Workload::weights_written`](super::workload::Workload::weights_written).
    pub fn written(&mut self, on_device: bool) -> Result<(), C::Error> {
        if on_device {
            self.device_changed();
            Ok(())
        } else {
            self.host_changed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts the pulls and pushes; the next one fails when `fail` is set.
    #[derive(Default)]
    struct Record {
        pulls: u32,
        pushes: u32,
        fail: bool,
    }

    impl HostCopies for Record {
        type Error = ();
        fn pull(&mut self) -> Result<(), ()> {
            if std::mem::take(&mut self.fail) {
                return Err(());
            }
            self.pulls += 1;
            Ok(())
        }
        fn push(&mut self) -> Result<(), ()> {
            if std::mem::take(&mut self.fail) {
                return Err(());
            }
            self.pushes += 1;
            Ok(())
        }
    }

    fn counts(c: &LazyHostCopies<Record>) -> (u32, u32) {
        (c.copies().pulls, c.copies().pushes)
    }

    #[test]
    fn a_trainer_syncing_on_the_device_pulls_only_for_host_reads() {
        let mut c = LazyHostCopies::new(Record::default());
        c.host_view().unwrap(); // the init bootstrap reads the copies
        assert_eq!(counts(&c), (1, 0));
        for _ in 0..3 {
            c.device_changed(); // train()
            // a device build reads nothing on the host; a checksum of the snapshot neither
            assert_eq!(counts(&c), (1, 0), "no pull without a host read");
        }
        c.host_view().unwrap(); // a checkpoint
        c.host_view().unwrap(); // and a second reader of the same weights
        assert_eq!(
            counts(&c),
            (2, 0),
            "one pull per change, however many readers"
        );
    }

    #[test]
    fn a_rollout_pushes_what_the_runtime_wrote_and_pulls_after_device_installs() {
        let mut c = LazyHostCopies::new(Record::default());
        c.host_view().unwrap(); // describe: the initial weights
        c.written(false).unwrap(); // the init bootstrap into the copies
        assert_eq!(counts(&c), (1, 1));
        c.host_view().unwrap(); // its checksum reads the copies just written: no pull
        assert_eq!(counts(&c), (1, 1));
        for n in 1..=3 {
            c.written(true).unwrap(); // a device install
            c.host_view().unwrap(); // the verified sync's checksum
            assert_eq!(counts(&c), (1 + n, 1));
        }
        // A host-path install (no installer attached): pushed at once, so the next rollout sees it.
        c.written(false).unwrap();
        assert_eq!(counts(&c), (4, 2));
    }

    #[test]
    fn a_failed_pull_is_retried_by_the_next_reader() {
        let mut c = LazyHostCopies::new(Record::default());
        c.copies.fail = true;
        assert!(c.host_view().is_err());
        c.host_view().unwrap();
        assert_eq!(
            counts(&c),
            (1, 0),
            "the copies stay stale until a pull succeeds"
        );
        c.copies.fail = true;
        assert!(
            c.host_changed().is_err(),
            "a failed push is the caller's error"
        );
        assert_eq!(counts(&c), (1, 0));
    }
}
