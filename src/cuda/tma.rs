//! TMA maps for the Hopper kernel: Q, K and V described to `cuTensorMapEncodeTiled`.
//!
//! Each tensor `(batch, rows, heads, head_dim)` (element strides batch, row, head) is seen as
//! five dimensions, innermost first: 64 columns of a slab, rows, `head_dim / 64` slabs, heads,
//! batch, with byte strides (row, 128, head, batch). One box of `(64, box_rows, slabs, 1, 1)`
//! then lands in shared memory as `slabs` tiles of `(box_rows, 64)` with the 128-byte swizzle:
//! the layout `wgmma` reads. Rows past the end of the tensor are zero-filled. A packed varlen
//! tensor is one batch entry of all sequences' rows.

use cudarc::driver::sys::{
    self, CUresult, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use super::params::TmaMap;
use crate::error::{Error, Result};

/// The element type of a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapElem {
    /// bf16.
    Bf16,
    /// fp16.
    F16,
    /// One byte (e4m3 bit patterns): a 128-byte swizzle row is 128 of them.
    Byte,
}

impl MapElem {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            MapElem::Byte => 1,
            _ => 2,
        }
    }

    /// Elements per 128-byte swizzle row (a slab's width).
    pub fn slab_elems(self) -> usize {
        128 / self.bytes() as usize
    }
}

/// One tensor for a map.
pub(crate) struct MapSpec {
    /// Device address of element (0, 0, 0, 0): 16-byte aligned.
    pub ptr: u64,
    /// The element type.
    pub elem: MapElem,
    /// `[batch, rows, heads, head_dim]`; head_dim a multiple of 64 for the 5-D maps, of 8 for
    /// the slab maps.
    pub dims: [usize; 4],
    /// Element strides of batch, row and head (multiples of 8).
    pub strides: [usize; 3],
    /// Rows per box (≤ 256).
    pub box_rows: usize,
}

/// Encodes the 4-D map of a tensor narrower than its tiles (the sm100 kernel's, and the sm90
/// kernel's slab maps): dimensions (head_dim, rows, heads, batch), innermost first, boxes of
/// (64, box_rows, 1, 1). The kernel loads a tile slab by slab; columns past `head_dim` (a padded
/// depth such as 80 → 128) are outside the map and arrive as zeros, and a store of such a box
/// writes only the columns inside it.
pub(crate) fn encode_slabs(name: &str, m: &MapSpec) -> Result<TmaMap> {
    let [batch, rows, heads, head_dim] = m.dims;
    let el = m.elem.bytes();
    let batch_stride = if batch == 1 {
        (m.strides[1] as u64 * el).max(16)
    } else {
        m.strides[0] as u64 * el
    };
    tiled(
        name,
        m,
        &[head_dim as u64, rows as u64, heads as u64, batch as u64],
        &[
            m.strides[1] as u64 * el,
            m.strides[2] as u64 * el,
            batch_stride,
        ],
        &[m.elem.slab_elems() as u32, m.box_rows as u32, 1, 1],
    )
}

/// Encodes a map, or the driver's error naming the tensor.
pub(crate) fn encode(name: &str, m: &MapSpec) -> Result<TmaMap> {
    five_d(name, m, m.dims[3] / m.elem.slab_elems())
}

/// Encodes the map of the Hopper kernel's TMA-store epilogue: the same 5-D view as [`encode`],
/// with boxes of one slab, `(64, box_rows, 1, 1, 1)`. A consumer warpgroup's O rows sit in its
/// rows of a Q slot, whose slabs are a whole Q tile's rows apart, so it stores them slab by
/// slab. Box rows past the tensor's extent (a fixed-length batch entry's last query block) are
/// not written.
pub(crate) fn encode_store(name: &str, m: &MapSpec) -> Result<TmaMap> {
    five_d(name, m, 1)
}

/// The 5-D map of [`encode`] with `box_slabs` slabs per box.
fn five_d(name: &str, m: &MapSpec, box_slabs: usize) -> Result<TmaMap> {
    let [batch, rows, heads, head_dim] = m.dims;
    let slab = m.elem.slab_elems();
    let slabs = head_dim / slab;
    let global_dim: [u64; 5] = [
        slab as u64,
        rows as u64,
        slabs as u64,
        heads as u64,
        batch as u64,
    ];
    let el = m.elem.bytes();
    // A batch axis of extent 1 (packed varlen tensors: stride 0) is never stepped along; the
    // driver still wants a non-zero multiple of 16 bytes there.
    let batch_stride = if batch == 1 {
        (m.strides[1] as u64 * el).max(16)
    } else {
        m.strides[0] as u64 * el
    };
    let global_strides: [u64; 4] = [
        m.strides[1] as u64 * el,
        128,
        m.strides[2] as u64 * el,
        batch_stride,
    ];
    let box_dim: [u32; 5] = [slab as u32, m.box_rows as u32, box_slabs as u32, 1, 1];
    tiled(name, m, &global_dim, &global_strides, &box_dim)
}

/// The 3-D map of the e4m3 kernel's Vᵀ buffer `[heads_kv][rows][cols]` bytes: dimensions
/// (cols, rows, heads_kv), innermost first, boxes of (128 columns, `rows`, 1), one 128-byte
/// swizzled slab of Vᵀ per box.
pub(crate) fn encode_vt(ptr: u64, cols: usize, rows: usize, heads_kv: usize) -> Result<TmaMap> {
    let m = MapSpec {
        ptr,
        elem: MapElem::Byte,
        dims: [1, rows, heads_kv, cols],
        strides: [0, cols, rows * cols],
        box_rows: rows,
    };
    tiled(
        "vt",
        &m,
        &[cols as u64, rows as u64, heads_kv as u64],
        &[cols as u64, (rows * cols) as u64],
        &[128, rows as u32, 1],
    )
}

/// `cuTensorMapEncodeTiled` with the 128-byte swizzle: `dims` innermost first, byte `strides` of
/// every dimension but the first, one `boxes` entry per dimension.
fn tiled(
    name: &str,
    m: &MapSpec,
    global_dim: &[u64],
    global_strides: &[u64],
    box_dim: &[u32],
) -> Result<TmaMap> {
    let rank = global_dim.len();
    assert!(
        global_strides.len() + 1 == rank && box_dim.len() == rank && rank <= 5,
        "map arrays of one rank"
    );
    let element_strides = [1u32; 5];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let dtype = match m.elem {
        MapElem::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        MapElem::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        MapElem::Byte => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
    };
    // SAFETY: every pointer is to a live array of at least the rank's length (dims, box dims,
    // element strides; rank − 1 strides) or to `map`; the driver only writes `map`. The address
    // is not dereferenced here (the kernel reads through the map); the caller checked that the
    // buffer holds the layout's extent and is 16-byte aligned, and the planner that every
    // stride is a multiple of 16 bytes below 2^40.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            dtype,
            rank as u32,
            m.ptr as *mut std::ffi::c_void,
            global_dim.as_ptr(),
            global_strides.as_ptr(),
            box_dim.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != CUresult::CUDA_SUCCESS {
        return Err(Error::cuda(
            format!("cuTensorMapEncodeTiled ({name}: dims {global_dim:?}, byte strides {global_strides:?}, box {box_dim:?})"),
            cudarc::driver::DriverError(r),
        ));
    }
    Ok(TmaMap { opaque: map.opaque })
}
