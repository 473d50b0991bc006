//! Byte channels from one sender to N receivers: in-process, and shared memory with Unix-socket control.
