//! CUDA ring (in progress).
