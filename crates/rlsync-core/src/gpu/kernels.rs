//! Where the kernels come from: the PTX that `scripts/gen_ptx.py` compiles from `kernels/rlsync.cu`
//! (committed, embedded here), or a directory named by `RLSYNC_PTX_DIR`; and the kernels' names.
//!
//! The PTX targets `compute_80` and was made by NVRTC 12.4 (pinned pip wheel), so any driver from R550 on
//! JIT-compiles it for its GPU (cached by the driver per architecture). `RLSYNC_PTX_DIR=dir` loads
//! `dir/rlsync.ptx` instead (e.g. built with `nvcc -ptx` on a GPU machine).

use std::path::PathBuf;

use super::{GpuError, Kernel};

/// The committed PTX of `kernels/rlsync.cu`.
pub const EMBEDDED: &str = include_str!("../../kernels/rlsync.ptx");

/// Environment variable naming a directory whose `rlsync.ptx` replaces the embedded one.
pub const PTX_DIR_VAR: &str = "RLSYNC_PTX_DIR";

/// The kernels' PTX and where it came from.
pub struct Ptx {
    pub text: String,
    pub origin: String,
}

/// The PTX to load: `$RLSYNC_PTX_DIR/rlsync.ptx` when the variable is set, else the embedded one.
pub fn ptx() -> Result<Ptx, GpuError> {
    ptx_from(std::env::var_os(PTX_DIR_VAR))
}

/// [`ptx`] with the variable's value given.
fn ptx_from(dir: Option<std::ffi::OsString>) -> Result<Ptx, GpuError> {
    match dir {
        Some(dir) if !dir.is_empty() => {
            let path = PathBuf::from(dir).join("rlsync.ptx");
            let text = std::fs::read_to_string(&path).map_err(|source| GpuError::PtxFile {
                path: path.clone(),
                source,
            })?;
            Ok(Ptx {
                text,
                origin: path.display().to_string(),
            })
        }
        _ => Ok(Ptx {
            text: EMBEDDED.to_owned(),
            origin: "embedded".to_owned(),
        }),
    }
}

/// The element widths every kernel family is instantiated for.
pub const WIDTHS: [usize; 4] = [1, 2, 4, 8];

/// The `extern "C"` name of `kernel` for elements of `width` bytes (`diff_compact_w2`).
pub fn name(kernel: Kernel, width: usize) -> String {
    let family = match kernel {
        Kernel::DiffCompact => "diff_compact",
        Kernel::Scatter => "scatter",
        Kernel::ApplyCompact => "apply_compact",
        Kernel::ChecksumCompact => "checksum_compact",
        // One kernel for every width.
        Kernel::CastGather => return CAST_GATHER.to_owned(),
        Kernel::Xxh3Chunks => return XXH3_CHUNKS.to_owned(),
    };
    format!("{family}_w{width}")
}

/// The `extern "C"` name of the bucket cast kernel ([`Kernel::CastGather`]).
pub const CAST_GATHER: &str = "cast_gather";

/// The `extern "C"` name of the state checksum's chunk kernel ([`Kernel::Xxh3Chunks`]).
pub const XXH3_CHUNKS: &str = "xxh3_chunks";

/// Position of `width` in [`WIDTHS`].
pub fn width_slot(width: usize) -> Option<usize> {
    WIDTHS.iter().position(|&w| w == width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_ptx_defines_every_kernel_the_backend_loads() {
        for k in crate::gpu::KERNELS {
            for w in WIDTHS {
                let entry = format!(".entry {}(", name(k, w));
                assert!(EMBEDDED.contains(&entry), "the PTX lacks {entry}");
            }
        }
        for k in crate::gpu::SINGLE_KERNELS {
            let entry = format!(".entry {}(", name(k, 2));
            assert!(EMBEDDED.contains(&entry), "the PTX lacks {entry}");
        }
    }

    #[test]
    fn a_ptx_dir_replaces_the_embedded_ptx_and_a_missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = ptx_from(Some(dir.path().into())).err().unwrap();
        let chain = crate::error_chain(&err);
        assert!(
            chain.contains("RLSYNC_PTX_DIR") && chain.contains("rlsync.ptx"),
            "{chain}"
        );
        std::fs::write(dir.path().join("rlsync.ptx"), ".version 8.4\n").unwrap();
        let p = ptx_from(Some(dir.path().into())).unwrap();
        assert_eq!(p.text, ".version 8.4\n");
        assert!(p.origin.ends_with("rlsync.ptx"));
        assert_eq!(ptx_from(None).unwrap().origin, "embedded");
        assert_eq!(ptx_from(Some("".into())).unwrap().text, EMBEDDED);
    }
}
