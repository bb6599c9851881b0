//! The GPU decode kernels' plan: which split-KV kernel variant a paged problem gets
//! (`kernels/decode/splitkv.cu`), its grid and shared memory, and the specs of the combine and
//! append kernels. Pure functions of the problem, the GPU's SM count and the NVRTC target; the
//! split count comes from [`super::decode::plan`].
//!
//! The split kernel's CTA is one (sequence · KV head, tile of packed rows, split): grid
//! `(batch · heads_kv, row tiles, num_splits)`. Its warps split each block of keys, each
//! holding all the tile's rows (see the kernel's header); the rows are `16 · m_tiles`, the
//! fewest MMA tiles that hold the packed rows of the longest query sequence, up to
//! [`DecodeTiles::gpu`]'s `block_m`.
//!
//! A problem over an fp8 e4m3 cache ([`PagedProblem::kv_dtype`]) gets the kernels' `KV_FP8`
//! variants (`kernels/decode/fp8.cuh`): the same tiles, grids and split counts, a K/V stage of
//! half the bytes and a ring up to [`MAX_STAGES_FP8`] deep.

use std::fmt;

use super::decode::{self, DecodePlan, DecodeTiles};
use super::prelude::Prelude;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::paged::PagedProblem;

/// Most warps of the split kernel: each owns `block_n / warps` keys of every block, at least 16
/// (one k16 step of P·V), so 128-key blocks get 8 warps and the 64-key blocks of d256 get 4.
/// More warps issue the cp.async gather faster: on the H200 (d128, 3 stages, bf16) 8 warps read
/// 2.1–3.4 TB/s on the grid where 4 read 1.7–2.5 (same run, `examples/decode_bench.rs`,
/// caches of zeros; on random caches the 8-warp kernel reads 1.3–2.0 TB/s, docs/perf.md).
pub const MAX_WARPS: usize = 8;

/// Warps of the split kernel for a key block.
pub fn warps_for(block_n: usize) -> usize {
    (block_n / 16).clamp(1, MAX_WARPS)
}
/// Deepest K/V ring of the split kernel. A decode CTA computes little per key block, so its
/// speed is the bytes it has in flight: the planner takes the deepest ring that fits the GPU's
/// shared memory, up to this. Measured on the H200 (d128, 128-key blocks, 1 CTA per SM, 4
/// warps): 2 stages read 1.6–2.4 TB/s on the grid (pages 16–256), 3 stages 1.7–2.5.
pub const MAX_STAGES: usize = 4;
/// Deepest K/V ring of the kernels' fp8-cache variants: a stage holds half the bytes of a
/// 16-bit one, so the same shared memory buys twice the stages and as many bytes in flight
/// (d128 on the H200: 6 stages of 36 KiB against the 16-bit kernel's 3 of 64 KiB). A cap, not a
/// measured optimum: as for the 16-bit kernels, the planner takes the deepest ring that fits.
pub const MAX_STAGES_FP8: usize = 8;
/// Warps (one per workspace row) per CTA of the combine kernel.
pub const COMBINE_WARPS: usize = 4;
/// Threads per CTA of the append kernel (one CTA per new row).
pub const APPEND_THREADS: usize = 128;
/// Head dims the split kernel is built for (Q, K and V alike).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// A variant of the split-KV kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SplitKvSpec {
    /// NVRTC target (`sm_80`, `sm_90a`, …).
    pub target: &'static str,
    /// bf16 (else fp16).
    pub bf16: bool,
    /// Head dim of Q, K and V.
    pub head_dim: usize,
    /// MMA tiles of 16 packed rows per CTA.
    pub m_tiles: usize,
    /// Keys per block.
    pub block_n: usize,
    /// Depth of the K/V ring (cp.async groups in flight + 1).
    pub stages: usize,
    /// A window (or causal) mask.
    pub window: bool,
    /// Softcap.
    pub softcap: bool,
    /// The fused combine (`fuse`): the last split CTA of a row tile merges the splits, no
    /// combine launch. Only planned with more than one split.
    pub fuse: bool,
    /// The cache holds fp8 e4m3 bytes with per-KV-head scales (`KV_FP8`); else it has the
    /// queries' type.
    pub fp8: bool,
}

impl SplitKvSpec {
    /// Packed rows per CTA.
    pub fn block_m(&self) -> usize {
        16 * self.m_tiles
    }
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        warps_for(self.block_n) * 32
    }
    /// Dynamic shared memory: the Q tile and the K/V ring (at least the merge's f32 O).
    pub fn smem_bytes(&self) -> usize {
        smem_bytes(
            self.head_dim,
            self.m_tiles,
            self.block_n,
            self.stages,
            self.fp8,
        )
    }
    /// The entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_decode_splitkv"
    }
    /// The generated prelude.
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .int("HEAD_DIM", self.head_dim)
            .int("BLOCK_M", self.block_m())
            .int("BLOCK_N", self.block_n)
            .int("NUM_WARPS", warps_for(self.block_n))
            .int("M_TILES", self.m_tiles)
            .int("STAGES", self.stages)
            .flag("IS_BF16", self.bf16)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .flag("LAZY_RESCALE", true)
            .define("FUSE", u8::from(self.fuse))
            .define("KV_FP8", u8::from(self.fp8))
            .define("FA4_SMEM_BYTES", self.smem_bytes())
            .finish()
    }
}

/// The queries' type, and the cache's where it is fp8: `bf16`, `bf16 e4m3-cache`.
fn dtypes(bf16: bool, fp8: bool) -> &'static str {
    match (bf16, fp8) {
        (true, false) => "bf16",
        (false, false) => "fp16",
        (true, true) => "bf16 e4m3-cache",
        (false, true) => "fp16 e4m3-cache",
    }
}

impl fmt::Display for SplitKvSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode splitkv {} {} d{} {}x{} {} stages{}{}{}",
            self.target,
            dtypes(self.bf16, self.fp8),
            self.head_dim,
            self.block_m(),
            self.block_n,
            self.stages,
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            if self.fuse { " fuse" } else { "" }
        )
    }
}

/// The combine kernel of one dtype and head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CombineSpec {
    /// NVRTC target.
    pub target: &'static str,
    /// bf16 (else fp16) output.
    pub bf16: bool,
    /// Values per row.
    pub head_dim: usize,
}

impl CombineSpec {
    /// The generated prelude.
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .int("HEAD_DIM", self.head_dim)
            .flag("IS_BF16", self.bf16)
            .finish()
    }
}

impl fmt::Display for CombineSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode combine {} {} d{}",
            self.target,
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim
        )
    }
}

/// The append kernel (dtype-free: it moves 16-bit units).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AppendSpec {
    /// NVRTC target.
    pub target: &'static str,
}

impl AppendSpec {
    /// The generated prelude (the shared base header wants IS_BF16; the copy uses none).
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .flag("IS_BF16", false)
            .finish()
    }
}

impl fmt::Display for AppendSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "paged append {}", self.target)
    }
}

/// The append into an fp8 cache (`kernels/decode/append_fp8.cu`): new rows of `dtype` (f32,
/// fp16 or bf16) quantized to e4m3 with the per-KV-head scales, as [`crate::paged::append_fp8`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AppendFp8Spec {
    /// NVRTC target.
    pub target: &'static str,
    /// The new rows' element type.
    pub dtype: DType,
}

impl AppendFp8Spec {
    /// The generated prelude: the new rows' element size and, for 16-bit ones, which type.
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .flag("IS_BF16", self.dtype == DType::Bf16)
            .int("SRC_BYTES", self.dtype.size_bytes())
            .finish()
    }
}

impl fmt::Display for AppendFp8Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "paged append {} {} to e4m3", self.target, self.dtype)
    }
}

/// Bytes of one K (or V) row of one head in a split kernel's stage: 16-bit elements, or e4m3
/// bytes at a pitch of 16 more (`splitkv.cu`, KV_FP8).
fn kv_row_bytes(head_dim: usize, fp8: bool) -> usize {
    if fp8 {
        head_dim + 16
    } else {
        2 * head_dim
    }
}

/// Shared memory of a split kernel: the 16-bit Q tile and the K/V ring, or the merge's f32 O of
/// every warp where that is larger (only an fp8 ring of few stages is smaller).
fn smem_bytes(head_dim: usize, m_tiles: usize, block_n: usize, stages: usize, fp8: bool) -> usize {
    let ring = 2 * stages * block_n * kv_row_bytes(head_dim, fp8);
    let merge = warps_for(block_n) * 16 * m_tiles * head_dim * 4;
    2 * head_dim * 16 * m_tiles + ring.max(merge)
}

/// The deepest K/V ring (2..=[`MAX_STAGES`]) of the 16-bit split kernel within `max_smem` bytes
/// per CTA, if any.
pub fn stages_for(
    head_dim: usize,
    m_tiles: usize,
    block_n: usize,
    max_smem: usize,
) -> Option<usize> {
    stages_for_cache(head_dim, m_tiles, block_n, false, max_smem)
}

/// [`stages_for`] for a 16-bit (`fp8` false) or fp8 cache (2..=[`MAX_STAGES_FP8`]).
pub fn stages_for_cache(
    head_dim: usize,
    m_tiles: usize,
    block_n: usize,
    fp8: bool,
    max_smem: usize,
) -> Option<usize> {
    let most = if fp8 { MAX_STAGES_FP8 } else { MAX_STAGES };
    (2..=most)
        .rev()
        .find(|&s| smem_bytes(head_dim, m_tiles, block_n, s, fp8) <= max_smem)
}

/// A planned GPU decode call.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuDecodePlan {
    /// The split count and its evidence.
    pub decode: DecodePlan,
    /// The split kernel.
    pub spec: SplitKvSpec,
    /// Its grid: `(batch · heads_kv, row tiles, num_splits)`.
    pub grid: (u32, u32, u32),
    /// The combine kernel (run when `num_splits > 1`, unless the split kernel fuses it:
    /// [`GpuDecodePlan::fused`]).
    pub combine: CombineSpec,
    /// The variant planned ([`DecodeVariant`], `FA4_DECODE_VARIANT`).
    pub variant: DecodeVariant,
    /// The all-heads kernel when the variant asks for it: it runs instead of `spec`, with
    /// `grid` = `(batch · heads_kv / heads, row tiles, num_splits)`.
    pub heads: Option<HeadsSpec>,
}

impl GpuDecodePlan {
    /// Whether the split kernel merges its splits itself (`fuse` with more than one split): then
    /// no combine is launched, and the call needs the row tiles' arrival counters.
    pub fn fused(&self) -> bool {
        match &self.heads {
            Some(h) => h.fuse,
            None => self.spec.fuse,
        }
    }
}

/// Plans a validated paged problem for a GPU of `sm_count` SMs and `max_smem` bytes of shared
/// memory per CTA, and an NVRTC target; errors name what the kernels do not cover. The default
/// variant ([`DecodeVariant::default`], `auto`: see [`DecodeVariant`]).
pub fn plan(
    p: &PagedProblem,
    sm_count: usize,
    max_smem: usize,
    target: &'static str,
    num_splits: Option<usize>,
) -> Result<GpuDecodePlan> {
    plan_variant(
        p,
        sm_count,
        max_smem,
        target,
        num_splits,
        DecodeVariant::default(),
    )
}

/// [`plan`] for a [`DecodeVariant`]: the default plan, then (for a heads variant) the all-heads
/// kernel and its own split count, then (for `best`) the split count of the best wave
/// efficiency. Errors name `FA4_DECODE_VARIANT` where the variant cannot run here.
pub fn plan_variant(
    p: &PagedProblem,
    sm_count: usize,
    max_smem: usize,
    target: &'static str,
    num_splits: Option<usize>,
    variant: DecodeVariant,
) -> Result<GpuDecodePlan> {
    let plan = plan_default(p, sm_count, max_smem, target, num_splits)?;
    if variant.auto {
        return plan_auto(p, plan, sm_count, max_smem, num_splits);
    }
    plan_variant_fixed(p, plan, sm_count, max_smem, num_splits, variant)
}

/// A named (not `auto`) variant applied to the default plan `plan`.
fn plan_variant_fixed(
    p: &PagedProblem,
    mut plan: GpuDecodePlan,
    sm_count: usize,
    max_smem: usize,
    num_splits: Option<usize>,
    variant: DecodeVariant,
) -> Result<GpuDecodePlan> {
    plan.variant = variant;
    if let Some(max_heads) = variant.heads {
        let heads = plan_heads(
            p,
            &plan,
            sm_count,
            max_smem,
            max_heads,
            variant.bulk,
            num_splits,
        )?;
        plan.decode = heads.0;
        plan.grid = heads.1;
        plan.heads = Some(heads.2);
    }
    if variant.best_splits && !plan.decode.forced {
        let one_wave = plan.decode.units / plan.decode.tiles_unsplit.max(1);
        if let Some(s) = best_efficiency(&plan.decode.candidates, one_wave) {
            plan.decode.num_splits = s;
            plan.grid.2 = s as u32;
        }
    }
    // With one split the kernel writes O itself: the unfused kernel, no counters.
    let fuse = variant.fuse && plan.decode.num_splits > 1;
    plan.spec.fuse = fuse;
    if let Some(h) = plan.heads.as_mut() {
        h.fuse = fuse;
    }
    Ok(plan)
}

/// Most sequences × KV-head groups below which `auto` keeps the split kernel: with fewer, the
/// all-heads kernel's CTAs are one per (sequence, group, split) and the split count that fills
/// the GPU makes each split short (on the H200, (1 sequence, 8 KV heads, 32k keys) ran
/// heads+bulk+best at 1.65 TB/s and best at 2.27; at 4 and more sequences the all-heads kernel
/// led, 3.4–4.2 TB/s against 2.6–2.9).
pub const AUTO_MIN_HEAD_GROUPS: usize = 4;

/// Pages of at least this many keys keep the split kernel under `auto` whatever the batch: on
/// the H200 (2026-12-02, build 3b9b949, after the split kernel's gather lost its division)
/// `best` matched or beat `heads+bulk+best` at pages of 64 (−2 to +5%) and 256 (−2 to +7%),
/// while the all-heads kernel still led at pages of 16 (5–11%) and 1 (2×).
pub const AUTO_HEADS_MAX_PAGE: usize = 32;

/// Pages of fewer keys than this take the all-heads kernel under `auto` even below
/// [`AUTO_MIN_HEAD_GROUPS`]: a key row of one head is then a short scattered read for the split
/// kernel, where the all-heads kernel reads the row of all the group's heads at once (H200,
/// 2026-12-02, build 3b9b949, pages of 1 key, one sequence of 32k keys: `heads+bulk+best` 58 µs,
/// `best` 83 µs; only page size 1 was measured below 16).
pub const AUTO_HEADS_SMALL_PAGE: usize = 16;

/// `auto`: on sm_90 and later, for a problem of one row tile per (sequence, KV head) (decode and
/// speculative decode), at least [`AUTO_MIN_HEAD_GROUPS`] sequences × KV-head groups (or pages of
/// fewer than [`AUTO_HEADS_SMALL_PAGE`] keys) and pages of at most [`AUTO_HEADS_MAX_PAGE`] keys,
/// the all-heads kernel with bulk copies and the best single-wave split count (`heads+bulk+best`);
/// otherwise the split kernel with the best single-wave split count (`best`). Before sm_90,
/// `plain` (the split kernel with the planner's count: the variants were measured on an H200
/// only, and there `best` differs from `plain` only where one wave holds more splits). The
/// plan's `variant` is the one chosen, marked `auto`.
fn plan_auto(
    p: &PagedProblem,
    base: GpuDecodePlan,
    sm_count: usize,
    max_smem: usize,
    num_splits: Option<usize>,
) -> Result<GpuDecodePlan> {
    let heads_kv = p.cache().heads_kv();
    let groups = p.decode_shape().batch * heads_kv.div_ceil(MAX_HEADS_PER_CTA.min(heads_kv).max(1));
    let hopper = sm_version(base.spec.target) >= 90;
    let page = p.cache().page_size();
    let wide = hopper
        && base.grid.1 == 1
        && (groups >= AUTO_MIN_HEAD_GROUPS || page < AUTO_HEADS_SMALL_PAGE)
        && page <= AUTO_HEADS_MAX_PAGE;
    let pick =
        |v: DecodeVariant| plan_variant_fixed(p, base.clone(), sm_count, max_smem, num_splits, v);
    let best = DecodeVariant {
        best_splits: true,
        ..DecodeVariant::PLAIN
    };
    let chosen = if !hopper {
        // Before sm_90 nothing but `plain` was measured (no such GPU was lent): keep it.
        pick(DecodeVariant::PLAIN)?
    } else if wide {
        // A cache the all-heads kernel cannot hold (shared memory) keeps the split kernel.
        let heads_bulk_best = DecodeVariant {
            heads: Some(MAX_HEADS_PER_CTA),
            bulk: true,
            ..best
        };
        pick(heads_bulk_best).or_else(|_| pick(best))?
    } else {
        pick(best)?
    };
    Ok(GpuDecodePlan {
        variant: DecodeVariant {
            auto: true,
            ..chosen.variant
        },
        ..chosen
    })
}

fn plan_default(
    p: &PagedProblem,
    sm_count: usize,
    max_smem: usize,
    target: &'static str,
    num_splits: Option<usize>,
) -> Result<GpuDecodePlan> {
    let bf16 = match p.dtype() {
        DType::Bf16 => true,
        DType::F16 => false,
        other => {
            return Err(Error::invalid(
                "dtype",
                format!("the GPU decode kernels take fp16 or bf16, got {other}"),
            ))
        }
    };
    let fp8 = p.kv_dtype() == DType::Fp8E4M3;
    let c = p.cache();
    let d = c.head_dim();
    if !HEAD_DIMS.contains(&d) {
        return Err(Error::invalid(
            "k_cache",
            format!("the GPU decode kernels take head dims {HEAD_DIMS:?}, got {d}"),
        ));
    }
    if c.head_dim_v() != d {
        return Err(Error::invalid(
            "v_cache",
            format!(
                "the GPU decode kernels need head_dim_v equal to head_dim {d}, got {}",
                c.head_dim_v()
            ),
        ));
    }
    // Every row the kernels copy is 16-byte chunks: strides in whole chunks, 8 16-bit elements
    // or 16 e4m3 bytes.
    let skip = |l: &crate::tensor::Layout| if l.packed { 1 } else { 0 };
    let cache_chunk = if fp8 { 16 } else { 8 };
    for (name, l, chunk) in [
        ("q", p.q_layout(), 8),
        ("out", p.o_layout(), 8),
        ("k_cache", c.k_layout(), cache_chunk),
        ("v_cache", c.v_layout(), cache_chunk),
    ] {
        if let Some(s) = l.strides[skip(l)..3]
            .iter()
            .find(|&&s| !s.is_multiple_of(chunk))
        {
            return Err(Error::invalid(
                name,
                format!("the GPU decode kernels need strides in multiples of {chunk} elements (16 bytes), got {s}"),
            ));
        }
    }
    let full = DecodeTiles::gpu(d);
    let shape = p.decode_shape();
    let rows = shape.seqlen_q * p.group();
    let m_tiles = rows.div_ceil(16).clamp(1, full.block_m / 16);
    let tiles = DecodeTiles {
        block_m: 16 * m_tiles,
        block_n: full.block_n,
    };
    let decode = decode::plan(shape, tiles, sm_count, num_splits)?;
    let too_big = |what: &str| Error::invalid("q", format!("the decode grid's {what} overflows"));
    let x = u32::try_from(shape.batch * c.heads_kv())
        .ok()
        .filter(|&x| x <= i32::MAX as u32)
        .ok_or_else(|| too_big("sequences × KV heads"))?;
    let y = u32::try_from(rows.div_ceil(tiles.block_m))
        .ok()
        .filter(|&y| y <= 65535)
        .ok_or_else(|| too_big("row tiles"))?;
    let stages = stages_for_cache(d, m_tiles, tiles.block_n, fp8, max_smem).ok_or_else(|| {
        Error::invalid(
            "device",
            format!(
                "the GPU decode kernel needs {} bytes of shared memory per CTA, the GPU gives {max_smem}",
                smem_bytes(d, m_tiles, tiles.block_n, 2, fp8)
            ),
        )
    })?;
    let spec = SplitKvSpec {
        target,
        bf16,
        head_dim: d,
        m_tiles,
        block_n: tiles.block_n,
        stages,
        window: p.options().get_mask().is_restrictive(),
        softcap: p.softcap().is_some(),
        fuse: false,
        fp8,
    };
    Ok(GpuDecodePlan {
        grid: (x, y, decode.num_splits as u32),
        decode,
        spec,
        combine: CombineSpec {
            target,
            bf16,
            head_dim: d,
        },
        variant: DecodeVariant::PLAIN,
        heads: None,
    })
}

/// Every 16-bit split-kernel variant the planner can emit for a target whose CTAs get
/// `max_smem` bytes of shared memory (for NVRTC tests).
pub fn all_specs(target: &'static str, max_smem: usize) -> Vec<SplitKvSpec> {
    specs_of(target, max_smem, false)
}

/// [`all_specs`] for an fp8 cache (`KV_FP8`).
pub fn all_fp8_specs(target: &'static str, max_smem: usize) -> Vec<SplitKvSpec> {
    specs_of(target, max_smem, true)
}

fn specs_of(target: &'static str, max_smem: usize, fp8: bool) -> Vec<SplitKvSpec> {
    let mut out = Vec::new();
    for d in HEAD_DIMS {
        let full = DecodeTiles::gpu(d);
        for m_tiles in 1..=full.block_m / 16 {
            let Some(stages) = stages_for_cache(d, m_tiles, full.block_n, fp8, max_smem) else {
                continue;
            };
            for bf16 in [false, true] {
                for window in [false, true] {
                    for softcap in [false, true] {
                        out.push(SplitKvSpec {
                            target,
                            bf16,
                            head_dim: d,
                            m_tiles,
                            block_n: full.block_n,
                            stages,
                            window,
                            softcap,
                            fuse: false,
                            fp8,
                        });
                    }
                }
            }
        }
    }
    out
}

// ---- Variants (measured on the H200 on 2026-12-01 and 2026-12-02: docs/perf.md) ----

/// The environment variable that picks a [`DecodeVariant`] at run time (read by
/// `CudaBackend::plan_paged` and `CudaBackend::paged_tables`).
pub const VARIANT_ENV: &str = "FA4_DECODE_VARIANT";

/// Keys per block of the all-heads kernel: one k16 step of P·V per warp, so a stage of 8 KV
/// heads of d128 is 16 rows of 2 KB for K and for V (64 KiB with padding), 3 stages on an H200.
pub const HEADS_BLOCK_N: usize = 16;

/// Most KV heads (warps) per CTA of the all-heads kernel.
pub const MAX_HEADS_PER_CTA: usize = 8;

/// Which split-KV kernel and split rule a GPU decode call uses, selectable at run time
/// (`FA4_DECODE_VARIANT`, or [`crate::cuda::decode::PagedTables::set_variant`]) so that one
/// binary times them all:
///
/// - `auto` (the default, and what an unset or empty `FA4_DECODE_VARIANT` means): chosen per
///   problem from the H200 measurements in `docs/perf.md`, see [`AUTO_MIN_HEAD_GROUPS`] and
///   [`AUTO_HEADS_MAX_PAGE`]: `heads+bulk+best` for decode batches over pages of up to 32 keys
///   on sm_90 and later, `best` for the rest there, and
///   `plain` before sm_90 (not measured there).
/// - `plain`: the split kernel (`kernels/decode/splitkv.cu`) with the planner's split count
///   (the default before `auto`).
/// - `heads` (`heads4`, `heads2`, `heads1`: at most that many KV heads per CTA):
///   `kernels/decode/heads.cu`, one CTA per (sequence, KV-head group, row tile, split) with a
///   warp per KV head, so each key's row of the group's heads is one contiguous read; splits
///   re-planned for its fewer CTAs.
/// - `bulk` (implies `heads` unless a `headsN` is given; sm_90 and later): the same kernel with
///   its K/V rows moved by 1-D bulk copies completing on mbarriers. Caches whose heads are not
///   contiguous (`head stride ≠ head_dim`) fall back to the cp.async copies (the plan says so).
/// - `best`: the split count that fills the most SMs in one wave (fewest splits among equals)
///   instead of the planner's fewest splits within 85% of the best efficiency over any number
///   of waves (its rule, shared with the CPU, is unchanged).
/// - `fuse` (with either kernel): with more than one split, the last split CTA of each row tile
///   to finish merges the splits (an arrival counter per row tile in the workspace), instead
///   of a second launch of the combine kernel. Measured on the H200 (2026-12-02, build
///   3b9b949): a tie with the split kernel, 4–12% slower with the all-heads kernel, so `auto`
///   does not take it.
///
/// Tokens join with `+`: `heads+bulk+best`, `best+fuse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeVariant {
    /// Chosen per problem (`auto`); in a plan, the variant `auto` chose, with this flag kept.
    pub auto: bool,
    /// `Some(max KV heads per CTA)`: the all-heads kernel.
    pub heads: Option<usize>,
    /// Bulk copies (with the all-heads kernel).
    pub bulk: bool,
    /// The best wave efficiency's split count.
    pub best_splits: bool,
    /// The combine fused into the split kernel.
    pub fuse: bool,
}

impl Default for DecodeVariant {
    /// `auto`.
    fn default() -> DecodeVariant {
        DecodeVariant {
            auto: true,
            ..DecodeVariant::PLAIN
        }
    }
}

impl DecodeVariant {
    /// `plain`: the split kernel with the planner's split count.
    pub const PLAIN: DecodeVariant = DecodeVariant {
        auto: false,
        heads: None,
        bulk: false,
        best_splits: false,
        fuse: false,
    };

    /// Parses `FA4_DECODE_VARIANT`'s grammar (see the type's docs); errors name
    /// `FA4_DECODE_VARIANT`.
    pub fn parse(text: &str) -> Result<DecodeVariant> {
        let text = text.trim();
        if text.is_empty() || text == "auto" {
            return Ok(DecodeVariant::default());
        }
        let mut v = DecodeVariant::PLAIN;
        if text == "plain" {
            return Ok(v);
        }
        for token in text.split('+') {
            match token {
                "heads" => v.heads = Some(MAX_HEADS_PER_CTA),
                "bulk" => v.bulk = true,
                "best" => v.best_splits = true,
                "fuse" => v.fuse = true,
                t if t.starts_with("heads") => {
                    let n = t["heads".len()..]
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_HEADS_PER_CTA).contains(n))
                        .ok_or_else(|| {
                            Error::invalid(
                                VARIANT_ENV,
                                format!("`{t}`: headsN takes N in 1..={MAX_HEADS_PER_CTA}"),
                            )
                        })?;
                    v.heads = Some(n);
                }
                other => {
                    return Err(Error::invalid(
                        VARIANT_ENV,
                        format!(
                            "unknown token `{other}` in `{text}` (expected `auto`, `plain` or \
                             tokens heads, heads1..heads{MAX_HEADS_PER_CTA}, bulk, best, fuse joined by `+`)"
                        ),
                    ))
                }
            }
        }
        if v.bulk && v.heads.is_none() {
            v.heads = Some(MAX_HEADS_PER_CTA);
        }
        Ok(v)
    }

    /// The variant named by `FA4_DECODE_VARIANT` (the default when unset).
    pub fn from_env() -> Result<DecodeVariant> {
        match std::env::var(VARIANT_ENV) {
            Ok(text) => DecodeVariant::parse(&text),
            Err(std::env::VarError::NotPresent) => Ok(DecodeVariant::default()),
            Err(e) => Err(Error::invalid(VARIANT_ENV, e.to_string())),
        }
    }
}

impl fmt::Display for DecodeVariant {
    /// The grammar [`DecodeVariant::parse`] reads; a variant `auto` chose prints as
    /// `auto (CHOICE)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let named = DecodeVariant {
            auto: false,
            ..*self
        };
        if self.auto {
            return if named == DecodeVariant::PLAIN {
                f.write_str("auto")
            } else {
                write!(f, "auto ({named})")
            };
        }
        let mut parts = Vec::new();
        match self.heads {
            Some(MAX_HEADS_PER_CTA) => parts.push("heads".to_string()),
            Some(n) => parts.push(format!("heads{n}")),
            None => {}
        }
        if self.bulk {
            parts.push("bulk".into());
        }
        if self.best_splits {
            parts.push("best".into());
        }
        if self.fuse {
            parts.push("fuse".into());
        }
        if parts.is_empty() {
            f.write_str("plain")
        } else {
            f.write_str(&parts.join("+"))
        }
    }
}

/// A variant of the all-heads split-KV kernel (`kernels/decode/heads.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadsSpec {
    /// NVRTC target.
    pub target: &'static str,
    /// bf16 (else fp16).
    pub bf16: bool,
    /// Head dim of Q, K and V.
    pub head_dim: usize,
    /// MMA tiles of 16 packed rows per warp (each warp holds its KV head's rows).
    pub m_tiles: usize,
    /// Keys per block.
    pub block_n: usize,
    /// KV heads per CTA (one warp each).
    pub heads: usize,
    /// Depth of the K/V ring.
    pub stages: usize,
    /// 1-D bulk copies (sm_90+) instead of cp.async.
    pub bulk: bool,
    /// A window (or causal) mask.
    pub window: bool,
    /// Softcap.
    pub softcap: bool,
    /// The fused combine, as [`SplitKvSpec::fuse`].
    pub fuse: bool,
    /// An fp8 e4m3 cache, as [`SplitKvSpec::fp8`].
    pub fp8: bool,
}

/// Shared memory of the all-heads kernel: a Q tile per warp, the K/V ring with a 16-byte pad per
/// key row (of 16-bit elements, or e4m3 bytes), and one mbarrier per stage with bulk copies.
fn heads_smem_bytes(
    head_dim: usize,
    m_tiles: usize,
    block_n: usize,
    heads: usize,
    stages: usize,
    bulk: bool,
    fp8: bool,
) -> usize {
    let elem = if fp8 { 1 } else { 2 };
    heads * 16 * m_tiles * head_dim * 2
        + 2 * stages * block_n * (heads * head_dim * elem + 16)
        + if bulk { 8 * stages } else { 0 }
}

impl HeadsSpec {
    /// Packed rows per warp (and CTA row tile).
    pub fn block_m(&self) -> usize {
        16 * self.m_tiles
    }
    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        self.heads * 32
    }
    /// Dynamic shared memory.
    pub fn smem_bytes(&self) -> usize {
        heads_smem_bytes(
            self.head_dim,
            self.m_tiles,
            self.block_n,
            self.heads,
            self.stages,
            self.bulk,
            self.fp8,
        )
    }
    /// The entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_decode_heads"
    }
    /// The generated prelude.
    pub fn prelude(&self) -> String {
        Prelude::new("config::decode_gpu", self)
            .int("HEAD_DIM", self.head_dim)
            .int("BLOCK_M", self.block_m())
            .int("BLOCK_N", self.block_n)
            .int("NUM_WARPS", self.heads)
            .int("M_TILES", self.m_tiles)
            .int("STAGES", self.stages)
            .define("BULK", u8::from(self.bulk))
            .define("FUSE", u8::from(self.fuse))
            .define("KV_FP8", u8::from(self.fp8))
            .flag("IS_BF16", self.bf16)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .flag("LAZY_RESCALE", true)
            .define("FA4_SMEM_BYTES", self.smem_bytes())
            .finish()
    }
}

impl fmt::Display for HeadsSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "decode heads {} {} d{} {}x{} {} heads {} stages{}{}{}{}",
            self.target,
            dtypes(self.bf16, self.fp8),
            self.head_dim,
            self.block_m(),
            self.block_n,
            self.heads,
            self.stages,
            if self.bulk { " bulk" } else { "" },
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            if self.fuse { " fuse" } else { "" }
        )
    }
}

/// The SM version of an NVRTC target (`sm_90a` → 90).
fn sm_version(target: &str) -> usize {
    target
        .trim_start_matches("sm_")
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .parse()
        .unwrap_or(0)
}

/// The deepest ring (2..=[`MAX_STAGES`]) of the 16-bit all-heads kernel within `max_smem`, if
/// any.
pub fn heads_stages_for(
    head_dim: usize,
    m_tiles: usize,
    heads: usize,
    bulk: bool,
    max_smem: usize,
) -> Option<usize> {
    heads_stages_for_cache(head_dim, m_tiles, heads, bulk, false, max_smem)
}

/// [`heads_stages_for`] for a 16-bit (`fp8` false) or fp8 cache (2..=[`MAX_STAGES_FP8`]).
pub fn heads_stages_for_cache(
    head_dim: usize,
    m_tiles: usize,
    heads: usize,
    bulk: bool,
    fp8: bool,
    max_smem: usize,
) -> Option<usize> {
    let most = if fp8 { MAX_STAGES_FP8 } else { MAX_STAGES };
    (2..=most).rev().find(|&s| {
        heads_smem_bytes(head_dim, m_tiles, HEADS_BLOCK_N, heads, s, bulk, fp8) <= max_smem
    })
}

/// The all-heads kernel of a planned problem: the most KV heads per CTA (a divisor of heads_kv,
/// at most `max_heads`) whose ring of 2 stages fits, the split count re-planned over its CTAs
/// (the planner's rule on `batch · heads_kv / heads` tiles of 16-key blocks), and the grid.
fn plan_heads(
    p: &PagedProblem,
    base: &GpuDecodePlan,
    sm_count: usize,
    max_smem: usize,
    max_heads: usize,
    bulk: bool,
    num_splits: Option<usize>,
) -> Result<(DecodePlan, (u32, u32, u32), HeadsSpec)> {
    let spec = &base.spec;
    if bulk && sm_version(spec.target) < 90 {
        return Err(Error::invalid(
            VARIANT_ENV,
            format!(
                "`bulk` uses the sm_90 bulk copies (cp.async.bulk); this GPU is {}",
                spec.target
            ),
        ));
    }
    let c = p.cache();
    let heads_kv = c.heads_kv();
    let d = spec.head_dim;
    let fp8 = spec.fp8;
    let heads = (1..=max_heads.min(heads_kv))
        .rev()
        .find(|&h| {
            heads_kv.is_multiple_of(h)
                && heads_stages_for_cache(d, spec.m_tiles, h, bulk, fp8, max_smem).is_some()
        })
        .ok_or_else(|| {
            Error::invalid(
                VARIANT_ENV,
                format!(
                    "the all-heads decode kernel needs {} bytes of shared memory per CTA, the GPU gives {max_smem}",
                    heads_smem_bytes(d, spec.m_tiles, HEADS_BLOCK_N, 1, 2, bulk, fp8)
                ),
            )
        })?;
    // Bulk copies move a key's heads as one span: only where they are contiguous.
    let contiguous = |l: &crate::tensor::Layout| l.strides[2] == l.dims[3];
    let bulk = bulk && contiguous(c.k_layout()) && contiguous(c.v_layout());
    let stages = heads_stages_for_cache(d, spec.m_tiles, heads, bulk, fp8, max_smem)
        .expect("checked when choosing heads");
    let shape = p.decode_shape();
    let tiles = DecodeTiles {
        block_m: spec.block_m(),
        block_n: HEADS_BLOCK_N,
    };
    // A CTA holds `heads` KV heads: plan its tiles as a problem with heads_kv / heads KV heads.
    let grouped = decode::DecodeShape {
        heads_q: shape.heads_q / heads,
        heads_kv: shape.heads_kv / heads,
        ..shape
    };
    let mut decode = decode::plan(grouped, tiles, sm_count, num_splits)?;
    decode.shape = shape;
    let x = u32::try_from(shape.batch * (heads_kv / heads))
        .ok()
        .filter(|&x| x <= i32::MAX as u32)
        .ok_or_else(|| {
            Error::invalid(
                "q",
                "the decode grid's sequences × KV-head groups overflows",
            )
        })?;
    let grid = (x, base.grid.1, decode.num_splits as u32);
    Ok((
        decode,
        grid,
        HeadsSpec {
            target: spec.target,
            bf16: spec.bf16,
            head_dim: d,
            m_tiles: spec.m_tiles,
            block_n: HEADS_BLOCK_N,
            heads,
            stages,
            bulk,
            window: spec.window,
            softcap: spec.softcap,
            fuse: false,
            fp8,
        },
    ))
}

/// The split count of the best wave efficiency among the planner's candidates of at most
/// `max_splits` (those that run in one wave), the fewest splits among equals; None if no
/// candidate qualifies. One wave: a memory-bound CTA costs its pipeline's fill and drain, and
/// several waves of short splits add combine traffic (the best efficiency over all candidates
/// would give (4, 128k) 103 splits of the default kernel, 25 waves).
fn best_efficiency(candidates: &[(usize, f64)], max_splits: usize) -> Option<usize> {
    let fit = || candidates.iter().filter(|&&(s, _)| s <= max_splits);
    let best = fit().map(|&(_, e)| e).fold(0.0, f64::max);
    fit().find(|&&(_, e)| e >= best).map(|&(s, _)| s)
}

/// A handful of all-heads kernel variants for the NVRTC compile test (bf16): the decode grid's
/// d128 with one MMA tile, plain and with window + softcap, by cp.async and (sm_90+) by bulk
/// copies; two MMA tiles of d64 and one of d256 with window + softcap (the largest register
/// and shared-memory footprints). Each at the most KV heads per CTA (up to 8) that fit
/// `max_smem`.
pub fn heads_specs(target: &'static str, max_smem: usize) -> Vec<HeadsSpec> {
    heads_specs_of(target, max_smem, false)
}

/// [`heads_specs`] over an fp8 cache (`KV_FP8`).
pub fn heads_fp8_specs(target: &'static str, max_smem: usize) -> Vec<HeadsSpec> {
    heads_specs_of(target, max_smem, true)
}

fn heads_specs_of(target: &'static str, max_smem: usize, fp8: bool) -> Vec<HeadsSpec> {
    let hopper = sm_version(target) >= 90;
    let mut out = Vec::new();
    let cases = [
        (128, 1, false, false),
        (128, 1, true, false),
        (128, 1, false, true),
        (128, 1, true, true),
        (64, 2, true, true),
        (256, 1, true, true),
    ];
    for (head_dim, m_tiles, masked, bulk) in cases {
        let bulk = bulk && hopper;
        let Some((heads, stages)) = (1..=MAX_HEADS_PER_CTA).rev().find_map(|h| {
            heads_stages_for_cache(head_dim, m_tiles, h, bulk, fp8, max_smem).map(|s| (h, s))
        }) else {
            continue;
        };
        let spec = HeadsSpec {
            target,
            bf16: true,
            head_dim,
            m_tiles,
            block_n: HEADS_BLOCK_N,
            heads,
            stages,
            bulk,
            window: masked,
            softcap: masked,
            fuse: false,
            fp8,
        };
        if !out.contains(&spec) {
            out.push(spec);
        }
    }
    out
}

#[cfg(test)]
mod variant_tests {
    use super::*;

    #[test]
    fn variants_parse_print_and_refuse_unknown_tokens() {
        for (text, want) in [
            ("", DecodeVariant::default()),
            ("auto", DecodeVariant::default()),
            ("plain", DecodeVariant::PLAIN),
            (
                "heads",
                DecodeVariant {
                    heads: Some(8),
                    ..DecodeVariant::PLAIN
                },
            ),
            (
                "bulk",
                DecodeVariant {
                    heads: Some(8),
                    bulk: true,
                    ..DecodeVariant::PLAIN
                },
            ),
            (
                "heads4+bulk+best",
                DecodeVariant {
                    heads: Some(4),
                    bulk: true,
                    best_splits: true,
                    auto: false,
                    fuse: false,
                },
            ),
            (
                "heads+bulk+best+fuse",
                DecodeVariant {
                    heads: Some(8),
                    bulk: true,
                    best_splits: true,
                    auto: false,
                    fuse: true,
                },
            ),
            (
                "best+fuse",
                DecodeVariant {
                    best_splits: true,
                    fuse: true,
                    ..DecodeVariant::PLAIN
                },
            ),
            (
                "fuse",
                DecodeVariant {
                    fuse: true,
                    ..DecodeVariant::PLAIN
                },
            ),
            (
                "best",
                DecodeVariant {
                    best_splits: true,
                    ..DecodeVariant::PLAIN
                },
            ),
        ] {
            let v = DecodeVariant::parse(text).unwrap();
            assert_eq!(v, want, "{text}");
            assert_eq!(DecodeVariant::parse(&v.to_string()).unwrap(), v, "{v}");
        }
        for bad in [
            "heads9",
            "heads0",
            "fast",
            "heads+",
            "Heads",
            "default",
            "auto+best",
            "auto+fuse",
            "fused",
        ] {
            match DecodeVariant::parse(bad) {
                Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, VARIANT_ENV, "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_best_efficiency_takes_the_fewest_splits_among_equals() {
        assert_eq!(best_efficiency(&[], 10), None);
        let c = [(1, 0.5), (2, 0.9), (4, 0.9), (8, 0.7), (9, 1.0)];
        assert_eq!(best_efficiency(&c, 8), Some(2));
        assert_eq!(best_efficiency(&c, 9), Some(9));
        assert_eq!(best_efficiency(&c, 0), None);
    }

    #[test]
    fn heads_shared_memory_fits_the_h200_with_three_stages_at_d128() {
        // 8 KV heads of d128, one MMA tile: 32 KiB of Q, 3 × 2 × 16 × 2064 bytes of K/V.
        let h200 = crate::arch::H200.max_smem_per_block() as usize;
        assert_eq!(heads_stages_for(128, 1, 8, false, h200), Some(3));
        assert_eq!(heads_stages_for(128, 1, 8, true, h200), Some(3));
        assert_eq!(heads_stages_for(128, 2, 8, true, h200), Some(2));
        assert_eq!(heads_stages_for(256, 1, 8, false, h200), None);
        assert_eq!(heads_stages_for(256, 1, 4, false, h200), Some(3));
        assert_eq!(sm_version("sm_90a"), 90);
        assert_eq!(sm_version("sm_100a"), 100);
        assert_eq!(sm_version("sm_80"), 80);
    }
}
