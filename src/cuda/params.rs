//! The kernel parameter struct, mirrored from `kernels/common/params.cuh`. Both sides assert the
//! size (the header's `static_assert`, the tests here) and the offsets of the fields that move.

use cudarc::driver::DeviceRepr;

/// Launch parameters of the forward kernel (see the header for each field's meaning).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FwdParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    pub lse_batch_stride: i64,
    pub lse_head_stride: i64,
    pub batch: i32,
    pub heads_q: i32,
    pub group: i32,
    pub seqlen_q: i32,
    pub seqlen_k: i32,
    pub head_dim: i32,
    pub window_left: i32,
    pub window_right: i32,
    pub negate_q: i32,
    pub pad0: i32,
    pub scale_log2: f32,
    pub softcap_scale: f32,
    pub softcap: f32,
    pub lse_scale: f32,
}

/// The header's `FA4_PARAMS_SIZE`.
pub const PARAMS_SIZE: usize = 224;

const _: () = assert!(std::mem::size_of::<FwdParams>() == PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(FwdParams, q_batch_stride) == 56);
const _: () = assert!(std::mem::offset_of!(FwdParams, batch) == 168);
const _: () = assert!(std::mem::offset_of!(FwdParams, scale_log2) == 208);

// SAFETY: a plain #[repr(C)] struct of integers and floats, laid out like the C header.
unsafe impl DeviceRepr for FwdParams {}

/// A TMA map as the kernel receives it (`TmaMap` in `kernels/sm90/params.cuh`): the 128 opaque
/// bytes `cuTensorMapEncodeTiled` writes.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default)]
pub struct TmaMap {
    pub opaque: [u64; 16],
}

/// Launch parameters of the Hopper kernel: the Q, K and V maps and the common parameters.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default)]
pub struct Sm90Params {
    pub tq: TmaMap,
    pub tk: TmaMap,
    pub tv: TmaMap,
    pub p: FwdParams,
}

/// The header's `FA4_SM90_PARAMS_SIZE`.
pub const SM90_PARAMS_SIZE: usize = 640;

const _: () = assert!(std::mem::size_of::<Sm90Params>() == SM90_PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(Sm90Params, p) == 384);

// SAFETY: #[repr(C)] plain data (the maps are opaque bytes, FwdParams is DeviceRepr), laid out
// like the header's struct (size asserted on both sides, alignment 64 on both).
unsafe impl DeviceRepr for Sm90Params {}

#[cfg(test)]
mod tests {
    #[test]
    fn the_header_states_the_same_size() {
        let header = super::super::compile::PARAMS_SRC;
        assert!(header.contains(&format!("#define FA4_PARAMS_SIZE {}", super::PARAMS_SIZE)));
        let header = super::super::compile::SM90_PARAMS_SRC;
        assert!(header.contains(&format!(
            "#define FA4_SM90_PARAMS_SIZE {}",
            super::SM90_PARAMS_SIZE
        )));
    }
}
