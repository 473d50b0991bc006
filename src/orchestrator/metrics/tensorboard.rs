//! TensorBoard event files written by hand: TFRecord framing (length, masked CRC-32C) around `Event`
//! protobufs with scalar `Summary` values. Small enough not to need a protobuf crate (the CRC is `crc32c`'s).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::orchestrator::metrics::{MetricsError, StepRecord};
use rlsync_core::bytes::Writer;

/// TFRecord's masked CRC-32C (Castagnoli).
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xA282_EAD8)
}

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn key(out: &mut Writer, field: u32, wire: u8) -> &mut Writer {
    out.varint((u64::from(field) << 3) | u64::from(wire))
}

fn bytes_field(out: &mut Writer, field: u32, data: &[u8]) {
    key(out, field, LEN).varint(data.len() as u64).bytes(data);
}

/// `Event { wall_time, step, …`: the fields every event starts with.
fn event_start(wall_time: f64, step: i64) -> Writer {
    let mut out = Writer::new();
    key(&mut out, 1, FIXED64).f64(wall_time);
    // An int64 is the varint of its two's complement.
    key(&mut out, 2, VARINT).varint(step as u64);
    out
}

/// `Event { wall_time, step, session_log: SessionLog { status: START } }`: TensorBoard drops every point at
/// `step` or later written before it (what PyTorch's `SummaryWriter(purge_step=…)` writes on a resume).
pub fn encode_session_start(wall_time: f64, step: i64) -> Vec<u8> {
    let mut out = event_start(wall_time, step);
    // SessionLog.status (field 1, enum) = START (1).
    bytes_field(&mut out, 7, &[0x08, 0x01]);
    out.into_vec()
}

/// `Event { wall_time, step, file_version | summary }` as protobuf bytes.
pub fn encode_event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut out = event_start(wall_time, step);
    if let Some(version) = file_version {
        bytes_field(&mut out, 3, version.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Writer::new();
        for (tag, value) in scalars {
            let mut v = Writer::new();
            bytes_field(&mut v, 1, tag.as_bytes());
            key(&mut v, 2, FIXED32).f32(*value);
            bytes_field(&mut summary, 1, v.as_slice());
        }
        bytes_field(&mut out, 5, summary.as_slice());
    }
    out.into_vec()
}

/// One TFRecord around `data`: `u64 length`, its masked CRC, the data, the data's masked CRC.
pub fn frame_record(data: &[u8]) -> Vec<u8> {
    let mut out = Writer::with_capacity(data.len() + 16);
    out.u64(data.len() as u64);
    let len_crc = masked_crc(out.as_slice());
    out.u32(len_crc).bytes(data).u32(masked_crc(data));
    out.into_vec()
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Create `<dir>/events.out.tfevents.<secs>.rlsync.<pid>` and write the file-version event and a session
    /// start at `first_step` (the run's steps from there on replace any an earlier run left in `dir`).
    pub fn create(dir: &Path, first_step: u64) -> Result<EventWriter, MetricsError> {
        std::fs::create_dir_all(dir).map_err(|source| MetricsError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let wall = now();
        // Never overwrite an earlier run's file (a resume in the same second by the same process): a `.<n>`
        // suffix sorts after it, and TensorBoard reads a dir's event files in name order.
        let base = format!(
            "events.out.tfevents.{}.rlsync.{}",
            wall as u64,
            std::process::id()
        );
        let mut n = 0u32;
        let (path, file) = loop {
            let name = match n {
                0 => base.clone(),
                n => format!("{base}.{n}"),
            };
            let path = dir.join(name);
            match File::create_new(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(source) => return Err(MetricsError::Io { path, source }),
            }
        };
        let mut writer = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        let step = first_step as i64;
        writer.put(&encode_event(wall, step, Some("brain.Event:2"), &[]))?;
        writer.put(&encode_session_start(wall, step))?;
        writer.flush()?;
        Ok(writer)
    }

    fn put(&mut self, event: &[u8]) -> Result<(), MetricsError> {
        self.out
            .write_all(&frame_record(event))
            .map_err(|source| MetricsError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Every numeric metric of the record as a scalar at `rec.step`.
    pub fn write(&mut self, rec: &StepRecord) -> Result<(), MetricsError> {
        let scalars: Vec<(&str, f32)> = rec
            .entries
            .iter()
            .filter_map(|(k, v)| v.as_f64().map(|f| (k.as_str(), f as f32)))
            .collect();
        self.put(&encode_event(now(), rec.step as i64, None, &scalars))?;
        self.flush()
    }

    pub fn flush(&mut self) -> Result<(), MetricsError> {
        self.out.flush().map_err(|source| MetricsError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc32c_known_vectors() {
        // CRC-32C's check value and RFC 3720's 32 zero bytes, masked as TFRecord masks them.
        let mask = |crc: u32| crc.rotate_right(15).wrapping_add(0xA282_EAD8);
        assert_eq!(masked_crc(b"123456789"), mask(0xE306_9283));
        assert_eq!(masked_crc(b""), mask(0));
        assert_eq!(masked_crc(&[0u8; 32]), mask(0x8A91_36AA));
    }

    #[test]
    fn record_framing_checks_out() {
        let event = encode_event(1.5, 7, None, &[("time/step", 0.25)]);
        let rec = frame_record(&event);
        let len = u64::from_le_bytes(rec[..8].try_into().unwrap()) as usize;
        assert_eq!(len, event.len());
        assert_eq!(
            u32::from_le_bytes(rec[8..12].try_into().unwrap()),
            masked_crc(&rec[..8])
        );
        assert_eq!(&rec[12..12 + len], &event[..]);
        assert_eq!(
            u32::from_le_bytes(rec[12 + len..].try_into().unwrap()),
            masked_crc(&event)
        );
    }

    #[test]
    fn session_start_layout() {
        let event = encode_session_start(1.0, 5);
        let mut expect = vec![0x09];
        expect.extend_from_slice(&1.0f64.to_le_bytes());
        // step 5, then session_log (field 7, length 2) holding status START.
        expect.extend_from_slice(&[0x10, 5, 0x3A, 2, 0x08, 0x01]);
        assert_eq!(event, expect);
    }

    #[test]
    fn event_protobuf_layout() {
        let event = encode_event(1.0, 300, None, &[("a", 2.0)]);
        let mut expect = vec![0x09];
        expect.extend_from_slice(&1.0f64.to_le_bytes());
        expect.extend_from_slice(&[0x10, 0xAC, 0x02]); // step 300 as varint
        // summary (field 5) → value (field 1) → tag "a" (field 1), simple_value (field 2, fixed32)
        expect.extend_from_slice(&[0x2A, 10, 0x0A, 8, 0x0A, 1, b'a', 0x15]);
        expect.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(event, expect);
    }
}
