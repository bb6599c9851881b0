//! NCCL (in progress).
