//! A worker's background task that hands its results over a channel, owned: aborted when dropped.
//!
//! A worker that stops or fails must leave no task behind: the runtime is dropped when the worker returns, and
//! a task still waiting on a timer then may be polled by a worker thread after the time driver is gone, which
//! panics ("A Tokio 1.x context was found, but it is being shutdown").

use std::future::Future;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A spawned task and the receiving end of what it sends.
pub(crate) struct Background<T> {
    pub(crate) results: mpsc::Receiver<T>,
    task: JoinHandle<()>,
}

impl<T: Send + 'static> Background<T> {
    /// Spawn `run` with the sending end of a channel of `capacity` results.
    pub(crate) fn spawn<F>(capacity: usize, run: impl FnOnce(mpsc::Sender<T>) -> F) -> Background<T>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (tx, results) = mpsc::channel(capacity);
        Background {
            results,
            task: tokio::spawn(run(tx)),
        }
    }
}

impl<T> Background<T> {
    /// Abort the task and wait until it is gone.
    pub(crate) async fn stop(&mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

impl<T> Drop for Background<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// Set when dropped: the task's future was dropped (aborted), not left running.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn waiting_task(gone: &Arc<AtomicBool>) -> Background<u32> {
        let flag = Flag(gone.clone());
        Background::spawn(1, move |tx| async move {
            let _flag = flag;
            let _ = tx.send(1).await;
            // Waits on a timer far longer than any test: only an abort ends it.
            tokio::time::sleep(Duration::from_secs(3600)).await;
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_aborts_a_task_waiting_on_a_timer_and_waits_for_it() {
        let gone = Arc::new(AtomicBool::new(false));
        let mut bg = waiting_task(&gone);
        assert_eq!(bg.results.recv().await, Some(1));
        assert!(!gone.load(Ordering::SeqCst), "still waiting");
        bg.stop().await;
        assert!(
            gone.load(Ordering::SeqCst),
            "stopped: its future is dropped"
        );
    }

    #[test]
    fn dropping_it_aborts_the_task_so_the_runtime_shuts_down_without_polling_it() {
        let gone = Arc::new(AtomicBool::new(false));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut bg = waiting_task(&gone);
            assert_eq!(bg.results.recv().await, Some(1));
            drop(bg);
            // The abort is carried out by the runtime: give it the chance.
            for _ in 0..200 {
                if gone.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        assert!(gone.load(Ordering::SeqCst), "dropped: the task is aborted");
        drop(runtime);
    }
}
