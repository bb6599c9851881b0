//! The kernel parameter struct, mirrored from `kernels/common/params.cuh`. Both sides assert the
//! size (the header's `static_assert`, the tests here) and the offsets of the fields that move.

use cudarc::driver::DeviceRepr;

use crate::problem::Sequence;
use crate::tensor::Layout;

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
    pub head_dim_v: i32,
    pub scale_log2: f32,
    pub softcap_scale: f32,
    pub softcap: f32,
    pub lse_scale: f32,
}

/// What the common params of any attention problem (dense or paged) are made of: its buffers'
/// device addresses (`[q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k]`, 0 = absent), layouts,
/// sequences and options. The one place the kernels' conventions for them are written.
pub(crate) struct Common<'a> {
    /// Device addresses.
    pub ptrs: [u64; 7],
    /// Q, K, V and output layouts `[batch, rows, heads, dim]` (K and V: the cache's, paged).
    pub layouts: [&'a Layout; 4],
    /// The LSE's batch and head strides.
    pub lse_strides: (usize, usize),
    /// The sequences (fixed-length batches: every entry's lengths; varlen: each one's).
    pub sequences: &'a [Sequence],
    /// Query heads.
    pub heads_q: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// `seqlen_q`, `seqlen_k` as the kernel reads them.
    pub seqlens: (usize, usize),
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V and the output.
    pub head_dim_v: usize,
    /// The mask's left and right bounds.
    pub bounds: (Option<usize>, Option<usize>),
    /// The softmax scale.
    pub scale: f32,
    /// The softcap.
    pub softcap: Option<f32>,
}

impl FwdParams {
    /// The params of a validated problem and its checked buffers.
    pub(crate) fn new(c: &Common<'_>) -> FwdParams {
        let i = |x: usize| x as i64;
        let [q, k, v, o] = c.layouts;
        // A side at least as long as a sequence's queries plus keys bounds nothing: pass it as
        // unbounded (-1), so the kernels' int32 bound arithmetic cannot overflow on huge windows.
        let span = c
            .sequences
            .iter()
            .map(|s| s.q_len + s.k_len)
            .max()
            .unwrap_or(0);
        let side = |b: Option<usize>| match b {
            Some(x) if x < span => x.min(i32::MAX as usize) as i32,
            _ => -1,
        };
        let scale = c.scale;
        let (scale_log2, softcap_scale, softcap) = match c.softcap {
            Some(cap) => (std::f32::consts::LOG2_E, scale.abs() / cap, cap),
            None => (scale.abs() * std::f32::consts::LOG2_E, 0.0, 0.0),
        };
        FwdParams {
            q: c.ptrs[0],
            k: c.ptrs[1],
            v: c.ptrs[2],
            o: c.ptrs[3],
            lse: c.ptrs[4],
            cu_seqlens_q: c.ptrs[5],
            cu_seqlens_k: c.ptrs[6],
            q_batch_stride: i(q.strides[0]),
            q_row_stride: i(q.strides[1]),
            q_head_stride: i(q.strides[2]),
            k_batch_stride: i(k.strides[0]),
            k_row_stride: i(k.strides[1]),
            k_head_stride: i(k.strides[2]),
            v_batch_stride: i(v.strides[0]),
            v_row_stride: i(v.strides[1]),
            v_head_stride: i(v.strides[2]),
            o_batch_stride: i(o.strides[0]),
            o_row_stride: i(o.strides[1]),
            o_head_stride: i(o.strides[2]),
            lse_batch_stride: i(c.lse_strides.0),
            lse_head_stride: i(c.lse_strides.1),
            batch: c.sequences.len() as i32,
            heads_q: c.heads_q as i32,
            group: c.group as i32,
            seqlen_q: c.seqlens.0 as i32,
            seqlen_k: c.seqlens.1 as i32,
            head_dim: c.head_dim as i32,
            window_left: side(c.bounds.0),
            window_right: side(c.bounds.1),
            negate_q: i32::from(scale < 0.0),
            head_dim_v: c.head_dim_v as i32,
            scale_log2,
            softcap_scale,
            softcap,
            lse_scale: scale_log2 * std::f32::consts::LN_2,
        }
    }
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
    /// [`crate::config::sm90::Plan::tiles`]: the tiles the dynamic schedule's counter numbers.
    pub tiles: i32,
    /// e4m3 kernel, fixed-length batch: Vᵀ columns per sequence (0 otherwise).
    pub vt_seq_keys: i32,
    /// e4m3 kernel, varlen batch: device `[batch + 1]` first Vᵀ column per sequence (0 otherwise).
    pub cu_vt: u64,
    /// e4m3 kernel: device `[3][batch][heads_kv]` f32 descales of Q, K and V (0 otherwise).
    pub descales: u64,
    /// e4m3 kernel: batch · heads_kv, the distance between the descale planes.
    pub descale_plane: i32,
    /// Padding (the header's `pad0`).
    pub pad0: i32,
    /// O, for the TMA-store epilogue (zeroed where the kernel stores O itself).
    pub to: TmaMap,
}

/// The header's `FA4_SM90_PARAMS_SIZE`.
pub const SM90_PARAMS_SIZE: usize = 768;

const _: () = assert!(std::mem::size_of::<Sm90Params>() == SM90_PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(Sm90Params, p) == 384);
const _: () = assert!(std::mem::offset_of!(Sm90Params, tiles) == 384 + PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(Sm90Params, cu_vt) == 384 + PARAMS_SIZE + 8);
const _: () = assert!(std::mem::offset_of!(Sm90Params, to) == 640);

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
