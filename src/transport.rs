//! Byte channels from one sender to N receivers: in-process, and shared memory with Unix-socket control.
//!
//! NOTE (h/syncer only): a minimal in-process stand-in with the API.md signatures so the syncer compiles and
//! is tested before the real transport (branch h/transport) lands in main; it is dropped at that merge.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

/// How long any single wait may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("timed out after {timeout:?} while {op}")]
    Timeout { op: &'static str, timeout: Duration },
    #[error("peer is gone (disconnected) while {op}")]
    PeerGone { op: &'static str },
    #[error("rank {rank} is out of range for a channel with {receivers} receivers")]
    NoSuchRank { rank: usize, receivers: usize },
}

pub enum Sender {
    InProc(InProcSender),
}

pub enum Receiver {
    InProc(InProcReceiver),
}

struct Outstanding {
    count: AtomicUsize,
    notify: Notify,
}

pub struct InProcSender {
    down: Vec<mpsc::Sender<Arc<[u8]>>>,
    up: Vec<mpsc::Receiver<Vec<u8>>>,
    outstanding: Arc<Outstanding>,
    timeout: Duration,
}

pub struct InProcReceiver {
    rank: usize,
    down: mpsc::Receiver<Arc<[u8]>>,
    up: mpsc::Sender<Vec<u8>>,
    outstanding: Arc<Outstanding>,
    timeout: Duration,
}

pub fn inproc_channel(receivers: usize) -> (Sender, Vec<Receiver>) {
    inproc_channel_with_timeout(receivers, DEFAULT_TIMEOUT)
}

pub fn inproc_channel_with_timeout(receivers: usize, timeout: Duration) -> (Sender, Vec<Receiver>) {
    let outstanding = Arc::new(Outstanding { count: AtomicUsize::new(0), notify: Notify::new() });
    let mut down = Vec::new();
    let mut up = Vec::new();
    let mut rx = Vec::new();
    for rank in 0..receivers {
        let (dtx, drx) = mpsc::channel(2);
        let (utx, urx) = mpsc::channel(64);
        down.push(dtx);
        up.push(urx);
        rx.push(Receiver::InProc(InProcReceiver { rank, down: drx, up: utx, outstanding: outstanding.clone(), timeout }));
    }
    (Sender::InProc(InProcSender { down, up, outstanding, timeout }), rx)
}

async fn within<T>(timeout: Duration, op: &'static str, f: impl std::future::Future<Output = Option<T>>) -> Result<T, TransportError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Some(v)) => Ok(v),
        Ok(None) => Err(TransportError::PeerGone { op }),
        Err(_) => Err(TransportError::Timeout { op, timeout }),
    }
}

impl Sender {
    pub fn receivers(&self) -> usize {
        match self {
            Sender::InProc(s) => s.down.len(),
        }
    }

    pub async fn send_with<R>(&mut self, len: usize, fill: impl FnOnce(&mut [u8]) -> R) -> Result<R, TransportError> {
        let Sender::InProc(s) = self;
        let mut buf = vec![0u8; len];
        let r = fill(&mut buf);
        let payload: Arc<[u8]> = buf.into();
        for tx in &s.down {
            s.outstanding.count.fetch_add(1, Ordering::SeqCst);
            let p = payload.clone();
            within(s.timeout, "sending a payload", async { tx.send(p).await.ok() }).await?;
        }
        Ok(r)
    }

    pub async fn send(&mut self, payload: &[u8]) -> Result<(), TransportError> {
        self.send_with(payload.len(), |b| b.copy_from_slice(payload)).await
    }

    pub async fn flush(&mut self) -> Result<(), TransportError> {
        let Sender::InProc(s) = self;
        let o = s.outstanding.clone();
        within(s.timeout, "waiting for receivers to release payloads", async move {
            loop {
                let notified = o.notify.notified();
                if o.count.load(Ordering::SeqCst) == 0 {
                    return Some(());
                }
                notified.await;
            }
        })
        .await
    }

    pub async fn recv_from(&mut self, rank: usize) -> Result<Vec<u8>, TransportError> {
        let Sender::InProc(s) = self;
        let receivers = s.up.len();
        let timeout = s.timeout;
        let rx = s.up.get_mut(rank).ok_or(TransportError::NoSuchRank { rank, receivers })?;
        within(timeout, "receiving an upstream message", rx.recv()).await
    }
}

impl Receiver {
    pub fn rank(&self) -> usize {
        match self {
            Receiver::InProc(r) => r.rank,
        }
    }

    pub async fn recv_with<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<R, TransportError> {
        let Receiver::InProc(r) = self;
        let payload = within(r.timeout, "receiving a payload", r.down.recv()).await?;
        let out = read(&payload);
        drop(payload);
        r.outstanding.count.fetch_sub(1, Ordering::SeqCst);
        r.outstanding.notify.notify_waiters();
        Ok(out)
    }

    pub async fn send(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        let Receiver::InProc(r) = self;
        let msg = msg.to_vec();
        within(r.timeout, "sending an upstream message", async { r.up.send(msg).await.ok() }).await
    }
}
