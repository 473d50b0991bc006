//! Named CPU tensors with dtype, shape and role (trainable | buffer | frozen); safetensors I/O; checksums.
