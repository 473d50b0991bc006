//! Device payloads: a patch as `diff_compact` wrote it, copied device to device into one buffer of the caller's
//! (a CUDA tensor handed to its `send`, e.g. an NCCL broadcast), verified and installed by the receiver on its
//! GPU reading that buffer in place; no host coding, no host round trip of the changes.
//!
//! This is the same-host GPU channel's work ([`super::ipc`]) with the caller's transport instead of CUDA IPC:
//! the sender's device side is the channel's ([`SenderDevice`]: snapshot copy and pools in rlsync's
//! allocations, `diff_compact` then `checksum_compact` seeded per payload), the receiver's too
//! ([`ReceiverDevice`], on buffers it is handed instead of opened). What crosses is one buffer:
//! [`wire::Header`] (host-coded, checksummed: versions, sizes, per-width pool checksums), then per width the
//! directory, index and value pool as the kernel wrote them ([`wire::Mode::Patch`]), or the whole snapshot
//! image ([`wire::Mode::Full`]) when a patch cannot be sent: a width's changes overflowed its pool (more than
//! 1/16 of its elements changed), the sender's own check of its build failed (its count is not the kernel's
//! cursor: it re-copies the state into its snapshot first), or the previous payload never reached the receivers
//! ([`PayloadSender::lost`], or a build that was not filled).
//!
//! A receiver checks before it writes anything: the header (magic, wire version, its own checksum), the layout
//! (same tensors, same order), the sequence numbers (a patch's base is the one it holds; a full payload is
//! newer), every section inside the buffer and aligned, then `checksum_compact` over the buffer's sections,
//! which must give each width's sum and count in the header. A receiver on the GPU runs the kernels there
//! ([`crate::gpu::ipc::CudaReceiver`]); one whose tensors are host memory runs their reference ([`host`]). A payload that fails is rejected ([`PayloadError::Rejected`])
//! with the tensors and the version untouched. [`PayloadReceiver::stage`] verifies and holds a payload,
//! [`PayloadReceiver::commit`] installs it (`apply_compact` per width, or a copy per tensor), waited for on the
//! receiver's stream.

pub mod host;
pub mod wire;

#[cfg(test)]
mod tests;

use super::GpuError;
use super::IpcHandle;
use super::compact::{Layout, TileDir};
use super::ipc::wire::{Export, Setup, WidthExport};
use super::ipc::{ReceiverDevice, SenderDevice, facts, snapshot_offsets, width_export};
use crate::tensor::DType;
use wire::{ALIGN, Header, MAX_HEADER, Mode, WidthPart};

/// Why a payload could not be made or was not installed.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    #[error("the GPU failed")]
    Gpu(#[from] GpuError),
    #[error(
        "device payload rejected ({len} bytes): {reason} (tensors and version untouched, sequence {have})"
    )]
    Rejected { len: u64, have: u64, reason: Reject },
    #[error("the payload buffer holds {have} bytes, {need} needed")]
    Buffer { need: u64, have: u64 },
    #[error("no payload was built: build() comes before fill()")]
    NotBuilt,
    #[error("nothing is staged: stage() comes before commit()")]
    NotStaged,
}

/// Why a receiver rejected a payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("its header: {0}")]
    Header(#[from] wire::HeaderError),
    #[error("it says it is {stated} bytes long, the buffer holds {have}")]
    Length { stated: u64, have: u64 },
    #[error("the buffer's address {addr:#x} is not 8-byte aligned")]
    Misaligned { addr: u64 },
    #[error(
        "it is for {found} tensors with layout digest {digest:#018x}, this receiver syncs {expected} with {mine:#018x} (not the same tensors in the same order)"
    )]
    Layout {
        found: u64,
        expected: u64,
        digest: u64,
        mine: u64,
    },
    #[error("it lists widths {found:?}, the receiver's tensors have {expected:?}")]
    Widths { found: Vec<u8>, expected: Vec<u8> },
    #[error("width {width}: section {item} does not fit the payload ({detail})")]
    Section {
        width: u8,
        item: &'static str,
        detail: u64,
    },
    #[error(
        "a patch from sequence {base} to {sequence}, this receiver holds {have} (a replay, or a payload was missed: a full resync is needed)"
    )]
    Base { base: u64, sequence: u64, have: u64 },
    #[error("sequence {sequence} is not newer than the receiver's {have}")]
    Stale { sequence: u64, have: u64 },
    #[error(
        "width {width}: the payload's checksum is {found:#018x} on the receiver, the sender's {expected:#018x} (the bytes changed in transit)"
    )]
    Checksum {
        width: u8,
        expected: u64,
        found: u64,
    },
    #[error("width {width}: the receiver counted {found} changes, the sender {expected}")]
    Count {
        width: u8,
        expected: u64,
        found: u64,
    },
}

/// One copy of a payload's fill: `len` bytes at `src_off` of the sender's buffer `src` to `dst_off` of the
/// payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub src: Src,
    pub src_off: u64,
    pub len: u64,
    pub dst_off: u64,
}

/// A sender buffer a [`Part`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    /// The snapshot copy.
    Snapshot,
    /// The output (directory | index | values) of the `k`-th width of the layout.
    Width(usize),
}

/// A sender device that can write payloads.
pub trait PayloadOut: SenderDevice {
    /// Write `header` at `dst` (device memory of this device, the payload's length at least) and copy `parts`
    /// of this device's buffers after it, on the sender's stream, waited for.
    fn copy_out(&mut self, dst: u64, header: &[u8], parts: &[Part]) -> Result<(), GpuError>;
    /// The state checksum ([`crate::tensor::state_checksum`]) of the snapshot copy (tensor `k` at
    /// `offsets[k]`, named by `names[k]`: key, the receivers' dtype and shape): what the receivers hold.
    fn snapshot_checksum(
        &mut self,
        names: &[(String, DType, Vec<usize>)],
        offsets: &[u64],
    ) -> Result<u64, GpuError>;
}

/// A receiver device that can read payloads in place.
pub trait PayloadIn: ReceiverDevice {
    /// The `len` bytes at device address `addr` (the payload's header), on the host, after the work already
    /// queued on the receiver's stream.
    fn read(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, GpuError>;
    /// Use `addrs` (the snapshot image first, then one per width of `setup`) as the buffers the next
    /// checksum / apply / full copy read; nothing is opened, and nothing is closed when they are replaced.
    fn attach(&mut self, setup: &Setup, addrs: Vec<u64>) -> Result<(), GpuError>;
}

impl<D: PayloadOut + ?Sized> PayloadOut for Box<D> {
    fn copy_out(&mut self, dst: u64, header: &[u8], parts: &[Part]) -> Result<(), GpuError> {
        (**self).copy_out(dst, header, parts)
    }
    fn snapshot_checksum(
        &mut self,
        names: &[(String, DType, Vec<usize>)],
        offsets: &[u64],
    ) -> Result<u64, GpuError> {
        (**self).snapshot_checksum(names, offsets)
    }
}

fn align(n: u64) -> u64 {
    n.next_multiple_of(ALIGN)
}

fn words(width: usize) -> u64 {
    if width == 8 { 2 } else { 1 }
}

/// The payload a build planned, waiting for its buffer.
#[derive(Debug, Clone)]
struct Planned {
    header: Header,
    parts: Vec<Part>,
}

/// What one payload carried.
#[derive(Debug, Clone, PartialEq)]
pub struct PayloadReport {
    pub sequence: u64,
    /// The caller's version label.
    pub version: u64,
    pub full: bool,
    pub bytes: u64,
    /// Changes per width, as (width, changes) (a full payload: the width's elements).
    pub changes: Vec<(u8, u64)>,
    /// Seconds of the build (kernels, checksums, their read back) and of the fill (copies into the buffer).
    pub build_s: f64,
    pub fill_s: f64,
}

/// Builds device payloads (see the module docs).
pub struct PayloadSender<D: PayloadOut> {
    dev: D,
    layout: Layout,
    offsets: Vec<u64>,
    snap_bytes: u64,
    widths: Vec<WidthExport>,
    session: u64,
    /// The sequence number of the last payload filled, and its version label.
    sequence: u64,
    version: u64,
    /// The next payload is a full one.
    full_next: bool,
    planned: Option<Planned>,
    build_s: f64,
    /// Builds whose own check failed (sent full instead).
    pub fallbacks: u64,
}

impl<D: PayloadOut> PayloadSender<D> {
    /// Allocate the device buffers for `layout` and set the snapshot copy to the state (which the receivers
    /// hold at `sequence`, labelled `version`: the state of the syncer's init). The device's state addresses
    /// are set by the caller.
    pub fn new(
        mut dev: D,
        layout: Layout,
        sequence: u64,
        version: u64,
    ) -> Result<PayloadSender<D>, PayloadError> {
        let (offsets, snap_bytes) = snapshot_offsets(&layout);
        let (_, widths) = dev.prepare(&layout, &offsets, snap_bytes)?;
        dev.bootstrap(&layout, &offsets)?;
        Ok(PayloadSender {
            dev,
            layout,
            offsets,
            snap_bytes,
            widths,
            session: session_id(),
            sequence,
            version,
            full_next: false,
            planned: None,
            build_s: 0.0,
            fallbacks: 0,
        })
    }

    /// The version label of the last payload filled (the one given at construction before any).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The sequence number of the last payload filled.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// The state checksum of what the receivers hold after the last payload (the snapshot copy), each tensor
    /// named by `names[k]` (key, the receivers' dtype and shape, in layout order).
    pub fn checksum(&mut self, names: &[(String, DType, Vec<usize>)]) -> Result<u64, PayloadError> {
        Ok(self.dev.snapshot_checksum(names, &self.offsets)?)
    }

    /// The last payload filled did not reach the receivers (the caller's send failed): the next one is full.
    pub fn lost(&mut self) {
        self.full_next = true;
    }

    /// Build the next payload, labelled `version`, on the device (the state's addresses set on the device
    /// first) and return its length in bytes: the caller allocates a buffer of that size and calls
    /// [`Self::fill`].
    pub fn build(&mut self, version: u64) -> Result<u64, PayloadError> {
        let t0 = std::time::Instant::now();
        let unfilled = self.planned.take().is_some();
        let sequence = self.sequence + 1;
        let seed = wire::seed(self.session, sequence);
        // Until this build is planned, a failure leaves the snapshot copy in an unknown state: the next
        // payload is a full one. A build that was never filled advanced the snapshot past what the receivers
        // hold: this one is.
        let mut full = std::mem::replace(&mut self.full_next, true) || unfilled;
        let built = self.dev.build(&self.layout, &self.offsets, seed)?;
        let mut parts_patch = Vec::new();
        let mut widths = Vec::new();
        let mut at = align(wire::header_len(self.widths.len()) as u64);
        for (k, (w, b)) in self.widths.iter().zip(&built).enumerate() {
            if b.sum.count != b.cursor {
                tracing::warn!(
                    width = w.width,
                    cursor = b.cursor,
                    counted = b.sum.count,
                    "the device payload's own check failed (the checksum counted other changes than the kernel wrote): sending payload {sequence} in full"
                );
                self.fallbacks += 1;
                full = true;
            }
            if b.cursor > w.capacity {
                full = true;
            }
            let width = usize::from(w.width);
            let entries = b.cursor.min(w.capacity);
            let dir_len = w.ntiles * size_of::<TileDir>() as u64;
            let idx_len = entries * 4;
            let vals_len = entries * 8 * words(width);
            let part = WidthPart {
                width: w.width,
                ntiles: w.ntiles,
                entries,
                dir_off: at,
                idx_off: align(at + dir_len),
                vals_off: align(align(at + dir_len) + idx_len),
                sum: b.sum.sum,
                count: b.sum.count,
            };
            at = align(part.vals_off + vals_len);
            for (src_off, len, dst_off) in [
                (w.dir_off, dir_len, part.dir_off),
                (w.idx_off, idx_len, part.idx_off),
                (w.vals_off, vals_len, part.vals_off),
            ] {
                if len > 0 {
                    parts_patch.push(Part {
                        src: Src::Width(k),
                        src_off,
                        len,
                        dst_off,
                    });
                }
            }
            widths.push(part);
        }
        let mut header = Header {
            mode: Mode::Patch,
            ntensors: self.layout.tensors().len() as u32,
            session: self.session,
            sequence,
            base: self.sequence,
            version,
            total: at,
            layout: digest(&self.layout),
            snapshot_off: 0,
            snapshot_bytes: 0,
            widths,
        };
        let parts = if full {
            // The snapshot copy := the state (also what a failed own check needs), hashed whole.
            self.dev.bootstrap(&self.layout, &self.offsets)?;
            let sums = self.dev.snapshot_sum(&self.layout, &self.offsets, seed)?;
            let snap_off = align(header.len() as u64);
            header.mode = Mode::Full;
            header.snapshot_off = snap_off;
            header.snapshot_bytes = self.snap_bytes;
            header.total = snap_off + self.snap_bytes;
            for (p, s) in header.widths.iter_mut().zip(sums) {
                *p = WidthPart {
                    width: p.width,
                    ntiles: p.ntiles,
                    sum: s.sum,
                    count: s.count,
                    ..WidthPart::default()
                };
            }
            vec![Part {
                src: Src::Snapshot,
                src_off: 0,
                len: self.snap_bytes,
                dst_off: snap_off,
            }]
        } else {
            parts_patch
        };
        let total = header.total;
        self.full_next = false;
        self.planned = Some(Planned { header, parts });
        self.build_s = t0.elapsed().as_secs_f64();
        Ok(total)
    }

    /// Write the built payload into the caller's buffer at device address `dst` (`len` bytes, at least the
    /// length [`Self::build`] returned), waited for; the version advances.
    pub fn fill(&mut self, dst: u64, len: u64) -> Result<PayloadReport, PayloadError> {
        let t0 = std::time::Instant::now();
        let planned = self.planned.take().ok_or(PayloadError::NotBuilt)?;
        let h = &planned.header;
        if len < h.total {
            self.planned = Some(planned.clone());
            return Err(PayloadError::Buffer {
                need: h.total,
                have: len,
            });
        }
        if let Err(e) = self.dev.copy_out(dst, &h.encode(), &planned.parts) {
            // What the receivers hold is unknown to this end now only through its version: send in full.
            self.full_next = true;
            return Err(e.into());
        }
        self.sequence = h.sequence;
        self.version = h.version;
        let full = h.mode == Mode::Full;
        Ok(PayloadReport {
            sequence: h.sequence,
            version: h.version,
            full,
            bytes: h.total,
            changes: h
                .widths
                .iter()
                .map(|p| (p.width, if full { p.count } else { p.entries }))
                .collect(),
            build_s: self.build_s,
            fill_s: t0.elapsed().as_secs_f64(),
        })
    }
}

/// The layout's digest for the header.
fn digest(layout: &Layout) -> u64 {
    wire::layout_digest(layout.tensors().iter().map(|t| (t.numel, t.width)))
}

/// A random id for a sender's life (not security: it keeps pools of another sender from matching).
fn session_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.finish()
}

/// A verified payload waiting for [`PayloadReceiver::commit`].
#[derive(Debug, Clone)]
struct Staged {
    header: Header,
    /// The sections as the device kernels read them, and their addresses.
    setup: Setup,
    addrs: Vec<u64>,
}

/// What one install did.
#[derive(Debug, Clone, PartialEq)]
pub struct InstallReport {
    pub sequence: u64,
    pub version: u64,
    pub full: bool,
    pub bytes: u64,
    /// Changes per width (a full payload: the width's elements).
    pub changes: Vec<(u8, u64)>,
    /// Seconds: the header's read, the checksum kernels, the install.
    pub read_s: f64,
    pub check_s: f64,
    pub apply_s: f64,
}

/// Verifies and installs device payloads into the receiver's tensors (see the module docs).
pub struct PayloadReceiver<R: PayloadIn> {
    dev: R,
    layout: Layout,
    offsets: Vec<u64>,
    snap_bytes: u64,
    digest: u64,
    /// The sequence number installed last, and its version label.
    sequence: u64,
    version: u64,
    staged: Option<Staged>,
    /// Timings of the stage in progress: (read, check).
    stage_s: (f64, f64),
    last: Option<InstallReport>,
}

impl<R: PayloadIn> PayloadReceiver<R> {
    /// A receiver of `layout` (the synced tensors, in the sender's order) holding sequence `sequence`,
    /// labelled `version`.
    pub fn new(dev: R, layout: Layout, sequence: u64, version: u64) -> PayloadReceiver<R> {
        let (offsets, snap_bytes) = snapshot_offsets(&layout);
        PayloadReceiver {
            dev,
            digest: digest(&layout),
            layout,
            offsets,
            snap_bytes,
            sequence,
            version,
            staged: None,
            stage_s: (0.0, 0.0),
            last: None,
        }
    }

    /// The version label installed last.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The sequence number installed last.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn device_mut(&mut self) -> &mut R {
        &mut self.dev
    }

    /// The version label staged, if any.
    pub fn staged_version(&self) -> Option<u64> {
        self.staged.as_ref().map(|s| s.header.version)
    }

    /// The last install's report.
    pub fn last(&self) -> Option<&InstallReport> {
        self.last.as_ref()
    }

    /// Drop the staged payload (tensors and version untouched).
    pub fn abort(&mut self) -> Option<u64> {
        self.staged.take().map(|s| s.header.version)
    }

    /// Verify the payload at device address `addr` (`len` bytes) and hold it for [`Self::commit`]; its version.
    /// The caller keeps the buffer alive and unchanged until the commit or abort. A payload already staged is
    /// replaced.
    pub fn stage(&mut self, addr: u64, len: u64) -> Result<u64, PayloadError> {
        self.staged = None;
        let reject = |reason: Reject| PayloadError::Rejected {
            len,
            have: self.sequence,
            reason,
        };
        if !addr.is_multiple_of(8) {
            return Err(reject(Reject::Misaligned { addr }));
        }
        let t0 = std::time::Instant::now();
        let head = self.dev.read(addr, (len as usize).min(MAX_HEADER))?;
        let read_s = t0.elapsed().as_secs_f64();
        let header = Header::decode(&head).map_err(|e| reject(Reject::Header(e)))?;
        self.check(&header, len).map_err(reject)?;
        let t1 = std::time::Instant::now();
        let setup = self.setup_of(&header);
        let addrs = self.addrs_of(&header, addr);
        let full = header.mode == Mode::Full;
        let seed = wire::seed(header.session, header.sequence);
        self.dev.attach(&setup, addrs.clone())?;
        let sums = self.dev.checksum(&setup, &self.layout, seed, full)?;
        for (p, found) in header.widths.iter().zip(&sums) {
            if found.count != p.count {
                return Err(reject(Reject::Count {
                    width: p.width,
                    expected: p.count,
                    found: found.count,
                }));
            }
            if found.sum != p.sum {
                return Err(reject(Reject::Checksum {
                    width: p.width,
                    expected: p.sum,
                    found: found.sum,
                }));
            }
        }
        self.stage_s = (read_s, t1.elapsed().as_secs_f64());
        let version = header.version;
        self.staged = Some(Staged {
            header,
            setup,
            addrs,
        });
        Ok(version)
    }

    /// Install the staged payload into the tensors (their addresses set on the device first), waited for;
    /// the new version.
    pub fn commit(&mut self) -> Result<u64, PayloadError> {
        let staged = self.staged.take().ok_or(PayloadError::NotStaged)?;
        let t0 = std::time::Instant::now();
        let (h, setup) = (&staged.header, &staged.setup);
        self.dev.attach(setup, staged.addrs.clone())?;
        let full = h.mode == Mode::Full;
        if full {
            self.dev.full(setup)?;
        } else {
            self.dev.apply(setup, &self.layout)?;
        }
        self.sequence = h.sequence;
        self.version = h.version;
        self.last = Some(InstallReport {
            sequence: h.sequence,
            version: h.version,
            full,
            bytes: h.total,
            changes: h
                .widths
                .iter()
                .map(|p| (p.width, if full { p.count } else { p.entries }))
                .collect(),
            read_s: self.stage_s.0,
            check_s: self.stage_s.1,
            apply_s: t0.elapsed().as_secs_f64(),
        });
        Ok(h.version)
    }

    /// [`Self::stage`], then [`Self::commit`].
    pub fn apply(&mut self, addr: u64, len: u64) -> Result<u64, PayloadError> {
        self.stage(addr, len)?;
        self.commit()
    }

    /// Everything about `h` that can be checked on the host.
    fn check(&self, h: &Header, len: u64) -> Result<(), Reject> {
        if h.total > len || h.total < h.len() as u64 {
            return Err(Reject::Length {
                stated: h.total,
                have: len,
            });
        }
        let n = self.layout.tensors().len() as u64;
        if u64::from(h.ntensors) != n || h.layout != self.digest {
            return Err(Reject::Layout {
                found: h.ntensors.into(),
                expected: n,
                digest: h.layout,
                mine: self.digest,
            });
        }
        let mine: Vec<u8> = self.layout.widths().map(|w| w as u8).collect();
        let found: Vec<u8> = h.widths.iter().map(|p| p.width).collect();
        if found != mine {
            return Err(Reject::Widths {
                found,
                expected: mine,
            });
        }
        match h.mode {
            Mode::Patch if h.base != self.sequence || h.sequence <= h.base => {
                return Err(Reject::Base {
                    base: h.base,
                    sequence: h.sequence,
                    have: self.sequence,
                });
            }
            Mode::Full if h.sequence <= self.sequence => {
                return Err(Reject::Stale {
                    sequence: h.sequence,
                    have: self.sequence,
                });
            }
            _ => {}
        }
        let start = h.len() as u64;
        // A section [off, off + len) inside the payload, after the header, aligned.
        let fits = |width: u8, item: &'static str, off: u64, bytes: Option<u64>| {
            let end = bytes.and_then(|b| off.checked_add(b));
            match end {
                Some(end) if off >= start && off.is_multiple_of(ALIGN) && end <= h.total => Ok(()),
                _ => Err(Reject::Section {
                    width,
                    item,
                    detail: off,
                }),
            }
        };
        for p in &h.widths {
            let width = usize::from(p.width);
            if p.ntiles != self.layout.ntiles(width) {
                return Err(Reject::Section {
                    width: p.width,
                    item: "tiles",
                    detail: p.ntiles,
                });
            }
            if h.mode == Mode::Full {
                continue;
            }
            let numel: u64 = self.layout.tensors_of(width).map(|t| t.numel).sum();
            if p.entries > numel || p.count != p.entries {
                return Err(Reject::Section {
                    width: p.width,
                    item: "entries",
                    detail: p.entries,
                });
            }
            let dir = p.ntiles.checked_mul(size_of::<TileDir>() as u64);
            fits(p.width, "directory", p.dir_off, dir)?;
            fits(p.width, "index", p.idx_off, p.entries.checked_mul(4))?;
            let vals = p.entries.checked_mul(8 * words(width));
            fits(p.width, "values", p.vals_off, vals)?;
        }
        if h.mode == Mode::Full {
            if h.snapshot_bytes != self.snap_bytes {
                return Err(Reject::Section {
                    width: 0,
                    item: "snapshot image size",
                    detail: h.snapshot_bytes,
                });
            }
            fits(0, "snapshot image", h.snapshot_off, Some(h.snapshot_bytes))?;
        }
        Ok(())
    }

    /// The setup the device kernels read `h`'s sections by (offsets relative to the payload; a patch names no
    /// snapshot image, so no kernel reads a dense source).
    fn setup_of(&self, h: &Header) -> Setup {
        let none = Export {
            handle: IpcHandle([0; super::IPC_HANDLE_BYTES]),
            bytes: 0,
        };
        let full = h.mode == Mode::Full;
        Setup {
            pid: 0,
            device: 0,
            snapshot: Export {
                bytes: h.snapshot_bytes,
                ..none
            },
            tensors: facts(&self.layout),
            offsets: if full {
                self.offsets.clone()
            } else {
                vec![0; self.offsets.len()]
            },
            widths: h
                .widths
                .iter()
                .map(|p| WidthExport {
                    capacity: p.entries,
                    buf: Export {
                        bytes: h.total,
                        ..none
                    },
                    dir_off: p.dir_off,
                    idx_off: p.idx_off,
                    vals_off: p.vals_off,
                    ..width_export(&self.layout, usize::from(p.width), none.handle)
                })
                .collect(),
        }
    }

    /// The device addresses of `h`'s buffers in the payload at `addr`: the snapshot image (0 for a patch),
    /// then each width's (the payload itself: the setup's offsets are the payload's).
    fn addrs_of(&self, h: &Header, addr: u64) -> Vec<u64> {
        let snap = match h.mode {
            Mode::Full => addr + h.snapshot_off,
            Mode::Patch => 0,
        };
        std::iter::once(snap)
            .chain(h.widths.iter().map(|_| addr))
            .collect()
    }
}
