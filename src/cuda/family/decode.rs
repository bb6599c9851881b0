//! The decode kernels as launchable plans (`kernels/decode/`, planned by
//! [`crate::config::decode_gpu`]): the split-KV kernel of a [`GpuDecodePlan`], the combine of
//! its splits ([`Combine`]) and the paged appends ([`Append`], [`AppendFp8`]). They take a paged problem, not a
//! [`crate::problem::Problem`], so they are [`Launchable`] without being a
//! [`super::ForwardFamily`]; `cuda/decode.rs` builds their params and launches them through
//! the one launch site.

use super::{Launch, Launchable};
use crate::config::decode_gpu::{
    AppendFp8Spec, AppendSpec, GpuDecodePlan, APPEND_THREADS, COMBINE_WARPS,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

// SAFETY: `config::decode_gpu::plan` sized the grid as (sequence · KV head, row tile, split)
// and the shared memory as the spec's (static_asserted by the kernel), and checked strides in
// whole 16-byte chunks. With the params `forward_paged_device` builds (buffers checked against
// the validated problem, the page table and lengths that `paged_tables` uploaded for this very
// cache, a workspace of num_splits · part_rows rows touched only with more than one split), the
// kernel reads a table entry only for a key below the sequence's length, and every used entry
// was validated against num_pages.
//
// The all-heads variant (`heads`, when the variant asks for it) has the grid (sequence · KV-head
// group, row tile, split) and its spec's shared memory (static_asserted likewise); its CTA
// copies `heads` heads of a key row from head0 = group · heads, inside heads_kv, and its bulk
// copies (one span of heads · head_dim elements per key) are planned only where the cache's
// head stride is head_dim, so the span is exactly those heads. Table entries are read for keys
// below the length only, as above.
//
// With an fp8 cache (the specs' `fp8`, planned only for a problem made `with_fp8_cache`, whose
// buffers `forward_paged_fp8_device` checked in elements, one byte each) the kernels read the
// same rows as bytes (strides planned in whole 16-byte copies), and `k_scale`/`v_scale` entry
// kv_head < heads_kv of the two `heads_kv`-long scale buffers it checked.
//
// With the fused combine (`fuse`, planned only with more than one split) each CTA also adds one
// to counter blockIdx.x · grid.y + blockIdx.y of `counters`, which `forward_paged_device`
// allocates with grid.x · grid.y zeroed entries for such a plan; the last of a tile's num_splits
// CTAs reads the workspace rows the others wrote (the combine's reads, below) and writes O and
// LSE of the tile's rows once, then sets the counter back to 0.
unsafe impl Launchable for GpuDecodePlan {
    fn launch(&self) -> Launch<'_> {
        match &self.heads {
            Some(h) => Launch::new(h, self.grid, h.threads()),
            None => Launch::new(&self.spec, self.grid, self.spec.threads()),
        }
    }
}

/// The combine of a plan's splits: one warp per output row, `COMBINE_WARPS` rows per CTA.
pub(crate) struct Combine<'a> {
    plan: &'a GpuDecodePlan,
    blocks: u32,
}

impl<'a> Combine<'a> {
    /// The combine of `plan`'s splits over `part_rows` rows (queries · heads).
    pub(crate) fn new(plan: &'a GpuDecodePlan, part_rows: usize) -> Result<Combine<'a>> {
        let blocks = u32::try_from(part_rows.div_ceil(COMBINE_WARPS))
            .map_err(|_| Error::invalid("q", "too many rows"))?;
        Ok(Combine { plan, blocks })
    }
}

// SAFETY: with the split kernel's params, the combine reads the num_splits · part_rows rows the
// split kernel wrote (every CTA writes each of its valid rows' LSE and O, and a row's LSE of
// −inf keeps its O unread) and writes each row of O and LSE once, at the places the split
// kernel would have; the grid covers part_rows rows at COMBINE_WARPS per CTA, and the kernel
// returns for rows past part_rows. No shared memory.
unsafe impl Launchable for Combine<'_> {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.plan.combine, (self.blocks, 1, 1), COMBINE_WARPS * 32)
    }
}

/// The paged append: one CTA per new row.
pub(crate) struct Append {
    spec: AppendSpec,
    rows: u32,
}

impl Append {
    /// The append of `rows` new rows on `target`.
    pub(crate) fn new(target: &'static str, rows: usize) -> Result<Append> {
        let rows = u32::try_from(rows)
            .map_err(|_| Error::invalid("cu_new", "exceeds the append kernel's int32 range"))?;
        Ok(Append {
            spec: AppendSpec { target },
            rows,
        })
    }
}

// SAFETY: `paged::append_targets` checked both caches against their layouts' extents, k_new and
// v_new against [rows, heads_kv, dim], every destination page against num_pages and that no
// slot is written twice; `append_paged` uploads those slots' row starts, range-checks the int32
// counts, and each CTA copies heads_kv rows of dim elements at the layout's head stride, all
// inside the extent. One CTA per row; no shared memory.
unsafe impl Launchable for Append {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.spec, (self.rows, 1, 1), APPEND_THREADS)
    }
}

/// The append into an fp8 cache: one CTA per new row.
pub(crate) struct AppendFp8 {
    spec: AppendFp8Spec,
    rows: u32,
}

impl AppendFp8 {
    /// The append of `rows` new rows of `dtype` on `target`.
    pub(crate) fn new(target: &'static str, dtype: DType, rows: usize) -> Result<AppendFp8> {
        let rows = u32::try_from(rows)
            .map_err(|_| Error::invalid("cu_new", "exceeds the append kernel's int32 range"))?;
        Ok(AppendFp8 {
            spec: AppendFp8Spec { target, dtype },
            rows,
        })
    }
}

// SAFETY: as Append: `append_paged_fp8` checked both caches (bytes) and the new rows (`dtype`
// elements, `[rows, heads_kv, dim]`) through `paged::append_targets`, and both scale buffers
// against heads_kv; each CTA reads heads_kv · dim new elements of its row, the scales of heads
// < heads_kv, and writes heads_kv rows of dim bytes at the layout's head stride from the
// uploaded slot offsets, inside the caches' extents. No shared memory.
unsafe impl Launchable for AppendFp8 {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.spec, (self.rows, 1, 1), APPEND_THREADS)
    }
}
