//! Run independent work items on scoped OS threads (kernels never run on tokio worker threads' behalf alone),
//! count the cores once, and lower a background thread's priority.

use std::num::NonZeroUsize;
use std::sync::{Mutex, OnceLock};

/// The cores this process may use, asked once: `available_parallelism` reads the affinity mask and the
/// cgroup's CPU quota files on every call (~50 µs on Linux), and every checksum resolves its threads.
pub fn available_cores() -> NonZeroUsize {
    static CORES: OnceLock<NonZeroUsize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN))
}

/// Resolve a `threads` setting: `0` means every available core.
pub fn resolve_threads(threads: usize) -> NonZeroUsize {
    NonZeroUsize::new(threads).unwrap_or_else(available_cores)
}

/// Bytes of synced state per kernel thread, at least: below, one more scoped thread costs more (spawned and
/// joined per kernel call, tens of µs each) than it saves. `rlsync bench_sync` of f32 states at 1 % density,
/// one thread against two (docs/measurements.md "Kernel threads"): 40 KB 0.05 vs 0.49 ms per sync, 1 MB
/// 0.25 vs 0.79, 4 MB 2.16 vs 2.23, 16 MB 8.38 vs 6.24. One byte in unit tests, so that their small states
/// take the parallel paths too.
pub const STATE_BYTES_PER_THREAD: usize = if cfg!(test) { 1 } else { 4 << 20 };

/// The kernel threads for a state of `state_bytes`: at most `threads`, at most one per
/// [`STATE_BYTES_PER_THREAD`], at least one.
pub fn threads_for_state(state_bytes: usize, threads: NonZeroUsize) -> NonZeroUsize {
    threads
        .min(NonZeroUsize::new(state_bytes / STATE_BYTES_PER_THREAD).unwrap_or(NonZeroUsize::MIN))
}

/// Apply `f` to every item, on up to `threads` scoped threads (items are taken from a shared queue, so uneven
/// items balance). Results come back in item order. With one thread (or one item) everything runs inline.
pub fn map_items<T: Send, R: Send>(
    items: Vec<T>,
    threads: NonZeroUsize,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    let n = items.len();
    let workers = threads.get().min(n);
    if workers <= 1 {
        return items.into_iter().map(f).collect();
    }
    let queue = Mutex::new(items.into_iter().enumerate());
    let mut results: Vec<(usize, R)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        // A poisoned lock means another worker panicked; the scope re-raises that panic.
                        let next = match queue.lock() {
                            Ok(mut q) => q.next(),
                            Err(_) => None,
                        };
                        match next {
                            Some((i, item)) => out.push((i, f(item))),
                            None => break out,
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.sort_unstable_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// Make the calling thread the host's lowest-priority work (nice 19): background work (a snapshot's checksum)
/// then takes only CPU time nothing else wants (receivers installing on the same host, the trainer's next
/// step), and runs at full speed once something waits for it.
pub fn lowest_priority() {
    // SAFETY: two syscalls about the calling thread, no memory handed over; a failure leaves its priority as
    // it was.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_item_order_for_any_thread_count() {
        for threads in [1, 2, 5] {
            let items: Vec<u64> = (0..100).collect();
            let out = map_items(items, NonZeroUsize::new(threads).unwrap(), |x| x * x);
            assert_eq!(
                out,
                (0..100u64).map(|x| x * x).collect::<Vec<_>>(),
                "threads {threads}"
            );
        }
    }

    #[test]
    fn zero_means_all_cores() {
        let all = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
        // Asked once, then the same answer.
        assert_eq!(resolve_threads(0), all);
        assert_eq!(available_cores(), all);
        assert_eq!(resolve_threads(3).get(), 3);
    }

    #[test]
    fn a_small_state_gets_fewer_threads() {
        let eight = NonZeroUsize::new(8).unwrap();
        let per = STATE_BYTES_PER_THREAD;
        assert_eq!(threads_for_state(0, eight).get(), 1);
        assert_eq!(threads_for_state(per - 1, eight).get(), 1);
        assert_eq!(threads_for_state(3 * per, eight).get(), 3);
        assert_eq!(threads_for_state(3 * per + per / 2, eight).get(), 3);
        assert_eq!(threads_for_state(100 * per, eight).get(), 8);
    }
}
