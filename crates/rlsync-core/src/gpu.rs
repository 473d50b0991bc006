//! rlsync on the GPU: the compacted-changes format of the patch kernels and their CPU reference.

pub mod compact;
pub mod reference;
