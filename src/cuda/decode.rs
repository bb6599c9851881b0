//! The GPU decode path: split-KV attention over a paged KV cache, the combine of its splits and
//! the append of new rows (`kernels/decode/`, planned by [`crate::config::decode_gpu`]).
//!
//! [`CudaBackend::forward_paged_host`] is what [`crate::Backend::run_paged`] uses on a GPU:
//! host slices in and out. Callers who keep the cache on the GPU upload the validated page
//! table once ([`CudaBackend::paged_tables`], which also holds the split workspace) and call
//! [`CudaBackend::forward_paged_device`] per step, and [`CudaBackend::append_paged`] to write
//! new K/V rows into their pages.
//!
//! An fp8 e4m3 cache with per-KV-head scales ([`crate::paged::KvScales`]) has the same entries
//! with `_fp8`: [`CudaBackend::forward_paged_fp8_host`] (what
//! [`crate::Backend::forward_paged_fp8`] uses on a GPU), [`CudaBackend::forward_paged_fp8_device`]
//! and [`CudaBackend::append_paged_fp8`], the scales on the device as [`DeviceKvScales`].

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};

use super::compile::{KernelSource, COMMON_SRCS, PARAMS_SRC, SM80_PTX_SRC, SM80_TILE_OPS_SRC};
use super::family::decode::{Append, AppendFp8, Combine};
use super::params::FwdParams;
use super::CudaBackend;
use crate::config::decode::DecodePlan;
use crate::config::decode_gpu::{
    self, AppendFp8Spec, AppendSpec, CombineSpec, DecodeVariant, GpuDecodePlan, HeadsSpec,
    SplitKvSpec,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::fp8::F8E4M3;
use crate::paged::{append_targets, KvScales, PagedCache, PagedProblem};
use crate::tensor::{Element, Layout};

/// The decode params header.
pub const DECODE_PARAMS_SRC: &str = include_str!("../kernels/decode/params.cuh");
/// The decode kernels' PTX wrappers.
pub const DECODE_PTX_SRC: &str = include_str!("../kernels/decode/ptx.cuh");
/// The split-KV kernel.
pub const SPLITKV_SRC: &str = include_str!("../kernels/decode/splitkv.cu");
/// The all-heads split-KV kernel (a [`DecodeVariant`]).
pub const HEADS_SRC: &str = include_str!("../kernels/decode/heads.cu");
/// The merge of a workspace row's splits (the combine kernel's, and the fused combine's).
pub const MERGE_SRC: &str = include_str!("../kernels/decode/merge.cuh");
/// The combine kernel.
pub const COMBINE_SRC: &str = include_str!("../kernels/decode/combine.cu");
/// The append kernel.
pub const APPEND_SRC: &str = include_str!("../kernels/decode/append.cu");
/// The split kernels' fp8-cache layer (`KV_FP8`).
pub const FP8_SRC: &str = include_str!("../kernels/decode/fp8.cuh");
/// The append into an fp8 cache.
pub const APPEND_FP8_SRC: &str = include_str!("../kernels/decode/append_fp8.cu");

/// Launch parameters of the split and combine kernels (`DecodeParams` in
/// `kernels/decode/params.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DecodeParams {
    pub p: FwdParams,
    pub page_table: u64,
    pub seqlens_k: u64,
    pub o_part: u64,
    pub lse_part: u64,
    pub part_rows: i64,
    pub page_size: i32,
    pub max_pages: i32,
    pub num_splits: i32,
    pub pad1: i32,
    pub counters: u64,
    pub k_scale: u64,
    pub v_scale: u64,
}

/// The header's `FA4_DECODE_PARAMS_SIZE`.
pub const DECODE_PARAMS_SIZE: usize = 304;
const _: () = assert!(std::mem::size_of::<DecodeParams>() == DECODE_PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(DecodeParams, page_table) == 224);
const _: () = assert!(std::mem::offset_of!(DecodeParams, page_size) == 264);
const _: () = assert!(std::mem::offset_of!(DecodeParams, counters) == 280);
const _: () = assert!(std::mem::offset_of!(DecodeParams, v_scale) == 296);
// SAFETY: #[repr(C)] plain integers and floats, laid out like the header (size asserted on both
// sides).
unsafe impl DeviceRepr for DecodeParams {}

/// Launch parameters of the append kernel (`AppendParams` in `kernels/decode/append.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AppendParams {
    pub k_new: u64,
    pub v_new: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_dst: u64,
    pub v_dst: u64,
    pub k_head_stride: i64,
    pub v_head_stride: i64,
    pub rows: i32,
    pub heads_kv: i32,
    pub k_units: i32,
    pub v_units: i32,
}

/// The kernel's `FA4_APPEND_PARAMS_SIZE`.
pub const APPEND_PARAMS_SIZE: usize = 80;
const _: () = assert!(std::mem::size_of::<AppendParams>() == APPEND_PARAMS_SIZE);
// SAFETY: as DecodeParams.
unsafe impl DeviceRepr for AppendParams {}

/// Launch parameters of the fp8 append kernel (`AppendFp8Params` in
/// `kernels/decode/append_fp8.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AppendFp8Params {
    pub k_new: u64,
    pub v_new: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_dst: u64,
    pub v_dst: u64,
    pub k_scale: u64,
    pub v_scale: u64,
    pub k_head_stride: i64,
    pub v_head_stride: i64,
    pub rows: i32,
    pub heads_kv: i32,
    pub head_dim: i32,
    pub head_dim_v: i32,
}

/// The kernel's `FA4_APPEND_FP8_PARAMS_SIZE`.
pub const APPEND_FP8_PARAMS_SIZE: usize = 96;
const _: () = assert!(std::mem::size_of::<AppendFp8Params>() == APPEND_FP8_PARAMS_SIZE);
// SAFETY: as DecodeParams.
unsafe impl DeviceRepr for AppendFp8Params {}

impl KernelSource for SplitKvSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        SplitKvSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        let mut v: Vec<std::borrow::Cow<'static, str>> = vec![
            SM80_PTX_SRC.into(),
            SM80_TILE_OPS_SRC.into(),
            DECODE_PTX_SRC.into(),
            DECODE_PARAMS_SRC.into(),
        ];
        if self.fp8 {
            v.push(FP8_SRC.into());
        }
        if self.fuse {
            v.push(MERGE_SRC.into());
        }
        v.push(SPLITKV_SRC.into());
        v
    }
    fn entry(&self) -> &'static str {
        SplitKvSpec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        SplitKvSpec::smem_bytes(self)
    }
}

impl KernelSource for HeadsSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        HeadsSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        let mut v: Vec<std::borrow::Cow<'static, str>> = vec![
            SM80_PTX_SRC.into(),
            SM80_TILE_OPS_SRC.into(),
            DECODE_PTX_SRC.into(),
            DECODE_PARAMS_SRC.into(),
        ];
        if self.fp8 {
            v.push(FP8_SRC.into());
        }
        if self.bulk {
            v.push(super::compile::MBARRIER_SRC.into());
        }
        if self.fuse {
            v.push(MERGE_SRC.into());
        }
        v.push(HEADS_SRC.into());
        v
    }
    fn entry(&self) -> &'static str {
        HeadsSpec::entry(self)
    }
    fn smem_bytes(&self) -> usize {
        HeadsSpec::smem_bytes(self)
    }
}

impl KernelSource for CombineSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        CombineSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        vec![
            DECODE_PARAMS_SRC.into(),
            MERGE_SRC.into(),
            COMBINE_SRC.into(),
        ]
    }
    /// The base types and the params only: the mask and softmax headers want constants of
    /// the split kernel's prelude that a combine has no use for.
    fn source(&self) -> String {
        [
            self.prelude().as_str(),
            COMMON_SRCS[0],
            PARAMS_SRC,
            DECODE_PARAMS_SRC,
            MERGE_SRC,
            COMBINE_SRC,
        ]
        .join("\n")
    }
    fn entry(&self) -> &'static str {
        "fa4_decode_combine"
    }
    fn smem_bytes(&self) -> usize {
        0
    }
}

impl KernelSource for AppendSpec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        AppendSpec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        vec![APPEND_SRC.into()]
    }
    fn source(&self) -> String {
        [self.prelude().as_str(), COMMON_SRCS[0], APPEND_SRC].join("\n")
    }
    fn entry(&self) -> &'static str {
        "fa4_paged_append"
    }
    fn smem_bytes(&self) -> usize {
        0
    }
}

impl KernelSource for AppendFp8Spec {
    fn target(&self) -> &'static str {
        self.target
    }
    fn prelude(&self) -> String {
        AppendFp8Spec::prelude(self)
    }
    fn family_sources(&self) -> Vec<std::borrow::Cow<'static, str>> {
        vec![APPEND_FP8_SRC.into()]
    }
    fn source(&self) -> String {
        [self.prelude().as_str(), COMMON_SRCS[0], APPEND_FP8_SRC].join("\n")
    }
    fn entry(&self) -> &'static str {
        "fa4_paged_append_fp8"
    }
    fn smem_bytes(&self) -> usize {
        0
    }
}

/// An fp8 cache's per-KV-head scales on the device ([`KvScales`]' device form): `k` and `v`
/// hold `heads_kv` f32 each, finite and > 0. The kernels read them as given: the host entries
/// ([`CudaBackend::forward_paged_fp8_host`]) validate their host copies; a caller of the device
/// entries promises it (a wrong value is a wrong answer, not a wrong memory access).
#[derive(Debug, Clone, Copy)]
pub struct DeviceKvScales<'a, S> {
    /// `k_scale`, `[heads_kv]`.
    pub k: &'a S,
    /// `v_scale`, `[heads_kv]`.
    pub v: &'a S,
}

impl<S: DevicePtr<f32>> DeviceKvScales<'_, S> {
    /// Checks both lengths against `heads_kv`; errors name `k_scale` or `v_scale`.
    fn check(&self, heads_kv: usize) -> Result<()> {
        for (name, len) in [("k_scale", self.k.len()), ("v_scale", self.v.len())] {
            if len != heads_kv {
                return Err(Error::invalid(
                    name,
                    format!("expected heads_kv = {heads_kv} values, got {len}"),
                ));
            }
        }
        Ok(())
    }
}

/// A validated page table and lengths on the device, and the split workspace (grown on
/// demand; with the fused combine also one arrival counter per row tile, zeroed when allocated
/// and left at zero by every call). Made for one [`PagedCache`] by [`CudaBackend::paged_tables`]; a call with a problem
/// over another cache (other table, lengths or query offsets) is an error naming `page_table`,
/// so the kernels only ever read a table that was validated against the cache's pages.
pub struct PagedTables {
    cache: PagedCache,
    variant: DecodeVariant,
    cu_q: Option<Vec<i32>>,
    table: CudaSlice<i32>,
    seqlens: CudaSlice<i32>,
    d_cu_q: Option<CudaSlice<i32>>,
    o_part: Option<CudaSlice<f32>>,
    lse_part: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<i32>>,
}

impl PagedTables {
    /// The kernel variant the calls with these tables run (`FA4_DECODE_VARIANT` when they were
    /// made; the default when it was unset).
    pub fn variant(&self) -> DecodeVariant {
        self.variant
    }
    /// Picks the kernel variant of later calls (benchmarks compare them in one process).
    pub fn set_variant(&mut self, variant: DecodeVariant) {
        self.variant = variant;
    }
    /// Whether these tables were made for `p`'s cache (page table, lengths) and query offsets,
    /// so that a call with `p` may use them; a caller keeping tables across calls asks this
    /// before [`CudaBackend::paged_tables`] makes new ones.
    pub fn matches(&self, p: &PagedProblem) -> bool {
        self.cache == *p.cache() && self.cu_q == cu_q(p)
    }
}

impl std::fmt::Debug for PagedTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedTables")
            .field("batch", &self.cache.batch())
            .field("max_pages_per_seq", &self.cache.max_pages_per_seq())
            .finish()
    }
}

/// `cu_seqlens_q` of a varlen paged problem.
fn cu_q(p: &PagedProblem) -> Option<Vec<i32>> {
    p.is_varlen().then(|| {
        let seqs = p.sequences();
        let mut cu: Vec<i32> = seqs.iter().map(|s| s.q_start as i32).collect();
        cu.push(seqs.last().map_or(0, |s| (s.q_start + s.q_len) as i32));
        cu
    })
}

/// The forward's params of a validated paged problem; pointers `[q, k, v, out, lse, cu_q]`.
fn fwd_params(p: &PagedProblem, ptrs: [u64; 6]) -> FwdParams {
    let c = p.cache();
    let q = p.q_layout();
    let [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr] = ptrs;
    FwdParams::new(&super::params::Common {
        ptrs: [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr, 0],
        layouts: [q, c.k_layout(), c.v_layout(), p.o_layout()],
        lse_strides: if p.is_varlen() {
            (0, p.total_q())
        } else {
            (p.heads_q() * q.dims[1], q.dims[1])
        },
        sequences: p.sequences(),
        heads_q: p.heads_q(),
        group: p.group(),
        seqlens: (q.dims[1], 0),
        head_dim: c.head_dim(),
        head_dim_v: c.head_dim_v(),
        bounds: p.options().get_mask().bounds(),
        scale: p.scale(),
        softcap: p.softcap(),
    })
}

impl CudaBackend {
    /// Plans a paged problem for this device: the split count (forced by `num_splits`, or the
    /// planner's over this GPU's SMs), the kernel variant and its grid; the variant is
    /// `FA4_DECODE_VARIANT`'s (the default when unset).
    pub fn plan_paged(&self, p: &PagedProblem, num_splits: Option<usize>) -> Result<GpuDecodePlan> {
        self.plan_paged_variant(p, num_splits, DecodeVariant::from_env()?)
    }

    /// [`CudaBackend::plan_paged`] for a given variant.
    pub fn plan_paged_variant(
        &self,
        p: &PagedProblem,
        num_splits: Option<usize>,
        variant: DecodeVariant,
    ) -> Result<GpuDecodePlan> {
        let info = self.info();
        decode_gpu::plan_variant(
            p,
            info.sm_count as usize,
            info.max_smem_per_block as usize,
            info.target,
            num_splits,
            variant,
        )
    }

    /// Uploads a problem's validated page table, `seqlens_k` and query offsets; the tables run
    /// `FA4_DECODE_VARIANT`'s kernel variant (an unknown one is an error naming it).
    pub fn paged_tables(&self, p: &PagedProblem) -> Result<PagedTables> {
        let variant = DecodeVariant::from_env()?;
        let c = p.cache();
        // A zero-length buffer cannot be allocated: empty tables get one unread entry.
        let nonempty = |v: Vec<i32>| if v.is_empty() { vec![0] } else { v };
        let seqlens: Vec<i32> = c.seqlens_k().iter().map(|&l| l as i32).collect();
        let cu = cu_q(p);
        Ok(PagedTables {
            table: self.upload_i32(&nonempty(c.page_table().to_vec()))?,
            seqlens: self.upload_i32(&nonempty(seqlens))?,
            d_cu_q: cu.as_ref().map(|v| self.upload_i32(v)).transpose()?,
            cache: c.clone(),
            variant,
            cu_q: cu,
            o_part: None,
            lse_part: None,
            counters: None,
        })
    }

    /// Runs a validated paged problem on device buffers laid out as it says (`k_cache`,
    /// `v_cache` as the cache's layouts, `out` and `lse` as the problem's), with the tables of
    /// [`CudaBackend::paged_tables`] for this problem's cache. Asynchronous on the stream.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged_device<T: Element>(
        &self,
        p: &PagedProblem,
        tables: &mut PagedTables,
        q: &CudaSlice<T>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
        lse: Option<&mut CudaSlice<f32>>,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        self.forward_paged_views(p, tables, q, k_cache, v_cache, out, lse, num_splits)
    }

    /// [`CudaBackend::forward_paged_device`] on device buffers of any cudarc kind, or
    /// [`super::ForeignBuffer`]s over another framework's memory.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged_views<T: Element>(
        &self,
        p: &PagedProblem,
        tables: &mut PagedTables,
        q: &impl DevicePtr<T>,
        k_cache: &impl DevicePtr<T>,
        v_cache: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<T>,
        lse: Option<&mut impl DevicePtrMut<f32>>,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k_cache.len(),
            v_cache.len(),
            out.len(),
            lse.as_deref().map(|l| l.len()),
        )?;
        if p.kv_dtype() != T::DTYPE {
            return Err(Error::invalid(
                "k_cache",
                format!(
                    "the problem's cache is {}, these buffers {}: an fp8 cache runs through \
                     forward_paged_fp8_device",
                    p.kv_dtype(),
                    T::DTYPE
                ),
            ));
        }
        let stream = self.stream();
        let (q_ptr, _q_sync) = q.device_ptr(stream);
        let (k_ptr, _k_sync) = k_cache.device_ptr(stream);
        let (v_ptr, _v_sync) = v_cache.device_ptr(stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(stream);
        let (lse_ptr, _lse_sync) = match lse {
            Some(l) => {
                let (ptr, sync) = l.device_ptr_mut(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        self.launch_paged(
            p,
            tables,
            [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr],
            (0, 0),
            num_splits,
        )
    }

    /// [`CudaBackend::forward_paged_views`] over an fp8 e4m3 cache: `p` made with
    /// [`PagedProblem::with_fp8_cache`] (else an error naming `k_cache`), `k_cache` and
    /// `v_cache` its e4m3 bytes in the cache's layouts, `scales` its per-KV-head scales
    /// (`heads_kv` each, finite and > 0: see [`DeviceKvScales`]); `q`, `out` and `lse` as the
    /// 16-bit entry. Asynchronous on the stream.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged_fp8_device<T: Element, S: DevicePtr<f32>>(
        &self,
        p: &PagedProblem,
        tables: &mut PagedTables,
        q: &impl DevicePtr<T>,
        k_cache: &impl DevicePtr<F8E4M3>,
        v_cache: &impl DevicePtr<F8E4M3>,
        scales: &DeviceKvScales<'_, S>,
        out: &mut impl DevicePtrMut<T>,
        lse: Option<&mut impl DevicePtrMut<f32>>,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        if p.kv_dtype() != DType::Fp8E4M3 {
            return Err(Error::invalid(
                "k_cache",
                format!(
                    "the problem's cache is {}: an fp8 cache's problem is made with \
                     PagedProblem::with_fp8_cache",
                    p.kv_dtype()
                ),
            ));
        }
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k_cache.len(),
            v_cache.len(),
            out.len(),
            lse.as_deref().map(|l| l.len()),
        )?;
        scales.check(p.cache().heads_kv())?;
        let stream = self.stream();
        let (q_ptr, _q_sync) = q.device_ptr(stream);
        let (k_ptr, _k_sync) = k_cache.device_ptr(stream);
        let (v_ptr, _v_sync) = v_cache.device_ptr(stream);
        let (ks_ptr, _ks_sync) = scales.k.device_ptr(stream);
        let (vs_ptr, _vs_sync) = scales.v.device_ptr(stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(stream);
        let (lse_ptr, _lse_sync) = match lse {
            Some(l) => {
                let (ptr, sync) = l.device_ptr_mut(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        self.launch_paged(
            p,
            tables,
            [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr],
            (ks_ptr, vs_ptr),
            num_splits,
        )
    }

    /// The launches of a paged call whose buffers were checked against `p`: device addresses
    /// `[q, k_cache, v_cache, out, lse]` (lse 0 when not wanted) and an fp8 cache's scales
    /// `(k_scale, v_scale)` (0 for a 16-bit cache), held by the caller's sync guards.
    fn launch_paged(
        &self,
        p: &PagedProblem,
        tables: &mut PagedTables,
        [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr]: [u64; 5],
        (k_scale, v_scale): (u64, u64),
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        if !tables.matches(p) {
            return Err(Error::invalid(
                "page_table",
                "the device tables were made for another cache or query batch (call paged_tables \
                 with this problem)",
            ));
        }
        let plan = self.plan_paged_variant(p, num_splits, tables.variant)?;
        let (gx, gy, splits) = plan.grid;
        if gx == 0 || gy == 0 || p.total_q() == 0 {
            return Ok(plan.decode);
        }
        let part_rows = p.total_q() * p.heads_q();
        let d = p.cache().head_dim();
        if splits > 1 {
            let want_o = splits as usize * part_rows * d;
            let want_l = splits as usize * part_rows;
            if tables.o_part.as_ref().is_none_or(|b| b.len() < want_o) {
                tables.o_part = Some(self.alloc::<f32>(want_o)?);
            }
            if tables.lse_part.as_ref().is_none_or(|b| b.len() < want_l) {
                tables.lse_part = Some(self.alloc::<f32>(want_l)?);
            }
        }
        // The fused combine's arrival counters, one per CTA row tile (grid x · y), zeroed here
        // once: every fused call leaves them at zero (the last CTA of a tile resets its own).
        let fused = plan.fused();
        if fused {
            let want_c = gx as usize * gy as usize;
            if tables.counters.as_ref().is_none_or(|b| b.len() < want_c) {
                tables.counters = Some(self.upload_i32(&vec![0; want_c])?);
            }
        }
        for (name, ptr) in [
            ("q", q_ptr),
            ("k_cache", k_ptr),
            ("v_cache", v_ptr),
            ("out", o_ptr),
        ] {
            if ptr % 16 != 0 {
                return Err(Error::invalid(
                    name,
                    "device buffer must be 16-byte aligned",
                ));
            }
        }
        let stream = self.stream();
        let (table_ptr, _t_sync) = tables.table.device_ptr(stream);
        let (seqlens_ptr, _s_sync) = tables.seqlens.device_ptr(stream);
        let (cu_ptr, _cu_sync) = match &tables.d_cu_q {
            Some(c) => {
                let (ptr, sync) = c.device_ptr(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let (o_part_ptr, _op_sync) = match tables.o_part.as_mut().filter(|_| splits > 1) {
            Some(b) => {
                let (ptr, sync) = b.device_ptr_mut(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let (lse_part_ptr, _lp_sync) = match tables.lse_part.as_mut().filter(|_| splits > 1) {
            Some(b) => {
                let (ptr, sync) = b.device_ptr_mut(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let (counters_ptr, _c_sync) = match tables.counters.as_mut().filter(|_| fused) {
            Some(b) => {
                let (ptr, sync) = b.device_ptr_mut(stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let c = p.cache();
        let params = DecodeParams {
            p: fwd_params(p, [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr]),
            page_table: table_ptr,
            seqlens_k: seqlens_ptr,
            o_part: o_part_ptr,
            lse_part: lse_part_ptr,
            part_rows: part_rows as i64,
            page_size: i32::try_from(c.page_size())
                .map_err(|_| Error::invalid("k_cache", "page_size exceeds int32"))?,
            max_pages: i32::try_from(c.max_pages_per_seq())
                .map_err(|_| Error::invalid("page_table", "max_pages_per_seq exceeds int32"))?,
            num_splits: splits as i32,
            pad1: 0,
            counters: counters_ptr,
            k_scale,
            v_scale,
        };
        self.launch(&plan, &params)?;
        if splits > 1 && !fused {
            self.launch(&Combine::new(&plan, part_rows)?, &params)?;
        }
        Ok(plan.decode)
    }

    /// Runs a validated paged problem on host slices: copies in, launches, copies out, waits.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged_host<T: Element>(
        &self,
        p: &PagedProblem,
        q: &[T],
        k_cache: &[T],
        v_cache: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k_cache.len(),
            v_cache.len(),
            out.len(),
            lse.as_deref().map(<[f32]>::len),
        )?;
        // Plan first, so an unsupported problem costs no copies.
        self.plan_paged(p, num_splits)?;
        let extent = |l: &Layout| l.extent().unwrap_or(0).max(1);
        let c = p.cache();
        let dq = self.upload(&q[..extent(p.q_layout()).min(q.len())])?;
        let dk = self.upload(&k_cache[..extent(c.k_layout()).min(k_cache.len())])?;
        let dv = self.upload(&v_cache[..extent(c.v_layout()).min(v_cache.len())])?;
        let on = extent(p.o_layout()).min(out.len());
        // The output is uploaded too: elements between strided rows must survive.
        let mut dout = self.upload(&out[..on])?;
        let mut dlse = match &lse {
            Some(l) if !l.is_empty() => Some(self.upload::<f32>(l)?),
            _ => None,
        };
        let mut tables = self.paged_tables(p)?;
        let plan = self.forward_paged_device(
            p,
            &mut tables,
            &dq,
            &dk,
            &dv,
            &mut dout,
            dlse.as_mut(),
            num_splits,
        )?;
        self.stream()
            .memcpy_dtoh(&dout, &mut out[..on])
            .map_err(|e| Error::cuda("download out", e))?;
        if let (Some(l), Some(d)) = (lse, dlse) {
            self.stream()
                .memcpy_dtoh(&d, l)
                .map_err(|e| Error::cuda("download lse", e))?;
        }
        self.synchronize()?;
        Ok(plan)
    }

    /// [`CudaBackend::forward_paged_host`] over an fp8 e4m3 cache: `p` made with
    /// [`PagedProblem::with_fp8_cache`], `k_cache` and `v_cache` its bytes, `scales` validated
    /// here (errors name `k_scale` or `v_scale`). Copies in, launches, copies out, waits.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged_fp8_host<T: Element>(
        &self,
        p: &PagedProblem,
        q: &[T],
        k_cache: &[F8E4M3],
        v_cache: &[F8E4M3],
        scales: &KvScales,
        out: &mut [T],
        lse: Option<&mut [f32]>,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k_cache.len(),
            v_cache.len(),
            out.len(),
            lse.as_deref().map(<[f32]>::len),
        )?;
        scales.validate(p.cache().heads_kv())?;
        if p.kv_dtype() != DType::Fp8E4M3 {
            return Err(Error::invalid(
                "k_cache",
                "an fp8 cache's problem is made with PagedProblem::with_fp8_cache",
            ));
        }
        // Plan first, so an unsupported problem costs no copies.
        self.plan_paged(p, num_splits)?;
        let extent = |l: &Layout| l.extent().unwrap_or(0).max(1);
        let c = p.cache();
        let stream = self.stream();
        let up8 = |name: &str, x: &[F8E4M3], l: &Layout| {
            stream
                .clone_htod(&x[..extent(l).min(x.len())])
                .map_err(|e| Error::cuda(format!("upload {name}"), e))
        };
        let dq = self.upload(&q[..extent(p.q_layout()).min(q.len())])?;
        let dk = up8("k_cache", k_cache, c.k_layout())?;
        let dv = up8("v_cache", v_cache, c.v_layout())?;
        let (dks, dvs) = (self.upload(scales.k)?, self.upload(scales.v)?);
        let on = extent(p.o_layout()).min(out.len());
        // The output is uploaded too: elements between strided rows must survive.
        let mut dout = self.upload(&out[..on])?;
        let mut dlse = match &lse {
            Some(l) if !l.is_empty() => Some(self.upload::<f32>(l)?),
            _ => None,
        };
        let mut tables = self.paged_tables(p)?;
        let plan = self.forward_paged_fp8_device(
            p,
            &mut tables,
            &dq,
            &dk,
            &dv,
            &DeviceKvScales { k: &dks, v: &dvs },
            &mut dout,
            dlse.as_mut(),
            num_splits,
        )?;
        stream
            .memcpy_dtoh(&dout, &mut out[..on])
            .map_err(|e| Error::cuda("download out", e))?;
        if let (Some(l), Some(d)) = (lse, dlse) {
            stream
                .memcpy_dtoh(&d, l)
                .map_err(|e| Error::cuda("download lse", e))?;
        }
        self.synchronize()?;
        Ok(plan)
    }

    /// Writes new K and V rows into their pages on the GPU: [`crate::paged::append`]'s
    /// contract (and validation, done on the host before anything is written) on device
    /// buffers. `k_new` `[total_new, heads_kv, head_dim]` and `v_new` `[total_new, heads_kv,
    /// head_dim_v]` are contiguous; `cu_new` (host) holds `batch + 1` offsets. Returns the new
    /// `seqlens_k`. Asynchronous on the stream.
    pub fn append_paged<T: Element>(
        &self,
        cache: &PagedCache,
        k_cache: &mut impl DevicePtrMut<T>,
        v_cache: &mut impl DevicePtrMut<T>,
        k_new: &impl DevicePtr<T>,
        v_new: &impl DevicePtr<T>,
        cu_new: &[i32],
    ) -> Result<Vec<i32>> {
        let t = append_targets(
            cache,
            k_cache.len(),
            v_cache.len(),
            k_new.len(),
            v_new.len(),
            cu_new,
        )?;
        let bytes = T::DTYPE.size_bytes() as usize;
        if !bytes.is_multiple_of(2) {
            return Err(Error::invalid(
                "k_cache",
                format!(
                    "the GPU append moves 16-bit units; {} elements are {bytes} byte",
                    T::DTYPE
                ),
            ));
        }
        let rows = t.slots.len();
        if rows == 0 || cache.heads_kv() == 0 {
            return Ok(t.seqlens_k);
        }
        let units = bytes / 2;
        let (kl, vl) = (cache.k_layout(), cache.v_layout());
        let k_dst: Vec<i64> = t
            .slots
            .iter()
            .map(|&(page, slot)| (kl.offset(page, slot, 0) * units) as i64)
            .collect();
        let v_dst: Vec<i64> = t
            .slots
            .iter()
            .map(|&(page, slot)| (vl.offset(page, slot, 0) * units) as i64)
            .collect();
        let dk_dst = self
            .stream()
            .clone_htod(&k_dst)
            .map_err(|e| Error::cuda("upload", e))?;
        let dv_dst = self
            .stream()
            .clone_htod(&v_dst)
            .map_err(|e| Error::cuda("upload", e))?;
        let too_big = |name: &str| Error::invalid(name, "exceeds the append kernel's int32 range");
        let stream = self.stream();
        let (kn, _kn_sync) = k_new.device_ptr(stream);
        let (vn, _vn_sync) = v_new.device_ptr(stream);
        let (kc, _kc_sync) = k_cache.device_ptr_mut(stream);
        let (vc, _vc_sync) = v_cache.device_ptr_mut(stream);
        let (kd, _kd_sync) = dk_dst.device_ptr(stream);
        let (vd, _vd_sync) = dv_dst.device_ptr(stream);
        let params = AppendParams {
            k_new: kn,
            v_new: vn,
            k_cache: kc,
            v_cache: vc,
            k_dst: kd,
            v_dst: vd,
            k_head_stride: (kl.strides[2] * units) as i64,
            v_head_stride: (vl.strides[2] * units) as i64,
            rows: i32::try_from(rows).map_err(|_| too_big("cu_new"))?,
            heads_kv: cache.heads_kv() as i32,
            // The kernel's loop counts heads_kv · units of a row in int32.
            k_units: i32::try_from(cache.head_dim() * units)
                .ok()
                .filter(|&u| u as usize * cache.heads_kv() <= i32::MAX as usize)
                .ok_or_else(|| too_big("k_new"))?,
            v_units: i32::try_from(cache.head_dim_v() * units)
                .ok()
                .filter(|&u| u as usize * cache.heads_kv() <= i32::MAX as usize)
                .ok_or_else(|| too_big("v_new"))?,
        };
        self.launch(&Append::new(self.info().target, rows)?, &params)?;
        Ok(t.seqlens_k)
    }

    /// [`crate::paged::append_fp8`] on the GPU: new rows of `T` (`k_new` `[total_new, heads_kv,
    /// head_dim]`, `v_new` `[total_new, heads_kv, head_dim_v]`, contiguous) quantized with the
    /// device `scales` into an e4m3 cache, the same bytes the CPU writes. Validation is
    /// [`CudaBackend::append_paged`]'s (on the host, before anything is written), plus the
    /// scales' lengths (errors name `k_scale`, `v_scale`). Returns the new `seqlens_k`.
    /// Asynchronous on the stream.
    #[allow(clippy::too_many_arguments)]
    pub fn append_paged_fp8<T: Element, S: DevicePtr<f32>>(
        &self,
        cache: &PagedCache,
        k_cache: &mut impl DevicePtrMut<F8E4M3>,
        v_cache: &mut impl DevicePtrMut<F8E4M3>,
        k_new: &impl DevicePtr<T>,
        v_new: &impl DevicePtr<T>,
        cu_new: &[i32],
        scales: &DeviceKvScales<'_, S>,
    ) -> Result<Vec<i32>> {
        let t = append_targets(
            cache,
            k_cache.len(),
            v_cache.len(),
            k_new.len(),
            v_new.len(),
            cu_new,
        )?;
        scales.check(cache.heads_kv())?;
        let rows = t.slots.len();
        if rows == 0 || cache.heads_kv() == 0 {
            return Ok(t.seqlens_k);
        }
        let (kl, vl) = (cache.k_layout(), cache.v_layout());
        let k_dst: Vec<i64> = t
            .slots
            .iter()
            .map(|&(page, slot)| kl.offset(page, slot, 0) as i64)
            .collect();
        let v_dst: Vec<i64> = t
            .slots
            .iter()
            .map(|&(page, slot)| vl.offset(page, slot, 0) as i64)
            .collect();
        let stream = self.stream();
        let dk_dst = stream
            .clone_htod(&k_dst)
            .map_err(|e| Error::cuda("upload", e))?;
        let dv_dst = stream
            .clone_htod(&v_dst)
            .map_err(|e| Error::cuda("upload", e))?;
        let too_big = |name: &str| Error::invalid(name, "exceeds the append kernel's int32 range");
        // The kernel's loop counts heads_kv · dim of a row in int32.
        let dim = |d: usize, name: &str| {
            i32::try_from(d)
                .ok()
                .filter(|_| d.saturating_mul(cache.heads_kv()) <= i32::MAX as usize)
                .ok_or_else(|| too_big(name))
        };
        let (kn, _kn_sync) = k_new.device_ptr(stream);
        let (vn, _vn_sync) = v_new.device_ptr(stream);
        let (kc, _kc_sync) = k_cache.device_ptr_mut(stream);
        let (vc, _vc_sync) = v_cache.device_ptr_mut(stream);
        let (kd, _kd_sync) = dk_dst.device_ptr(stream);
        let (vd, _vd_sync) = dv_dst.device_ptr(stream);
        let (ks, _ks_sync) = scales.k.device_ptr(stream);
        let (vs, _vs_sync) = scales.v.device_ptr(stream);
        let params = AppendFp8Params {
            k_new: kn,
            v_new: vn,
            k_cache: kc,
            v_cache: vc,
            k_dst: kd,
            v_dst: vd,
            k_scale: ks,
            v_scale: vs,
            k_head_stride: kl.strides[2] as i64,
            v_head_stride: vl.strides[2] as i64,
            rows: i32::try_from(rows).map_err(|_| too_big("cu_new"))?,
            heads_kv: cache.heads_kv() as i32,
            head_dim: dim(cache.head_dim(), "k_new")?,
            head_dim_v: dim(cache.head_dim_v(), "v_new")?,
        };
        self.launch(
            &AppendFp8::new(self.info().target, T::DTYPE, rows)?,
            &params,
        )?;
        Ok(t.seqlens_k)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_headers_state_the_same_sizes() {
        assert!(super::DECODE_PARAMS_SRC.contains(&format!(
            "#define FA4_DECODE_PARAMS_SIZE {}",
            super::DECODE_PARAMS_SIZE
        )));
        assert!(super::APPEND_SRC.contains(&format!(
            "#define FA4_APPEND_PARAMS_SIZE {}",
            super::APPEND_PARAMS_SIZE
        )));
        assert!(super::APPEND_FP8_SRC.contains(&format!(
            "#define FA4_APPEND_FP8_PARAMS_SIZE {}",
            super::APPEND_FP8_PARAMS_SIZE
        )));
    }
}
