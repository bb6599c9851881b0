//! The CPU backend of paged attention: GQA-packed, split-KV, tiled online softmax.
//!
//! A work item is one tile of packed query rows of one (sequence, KV head) and one split of its
//! keys. Packed row `r` is query row `r / group` of query head `kv_head · group + r % group`
//! ([`crate::config::decode`]), so the query heads sharing a KV head read each K and V tile
//! once. Key blocks of [`CPU_TILES`]`.block_n` keys are gathered from their pages (any page
//! size: a block may straddle pages) and widened to f32; each row then runs the online softmax
//! over the keys its mask allows within the block. Sums are formed per block and then folded
//! into the running ones, so no f32 rounding chain is longer than a block plus the number of
//! blocks. An item ends with its normalised partial O and its LSE (natural log, in f64 before
//! the final rounding), `-inf` where it saw no key; the splits of a tile are then merged by
//! [`crate::combine`] and written to O and LSE. Items run on rayon's pool, each compiled for
//! the selected instruction set (AVX-512, AVX2 or the baseline, `FA4_CPU_ISA`). Measured with
//! `perf record` on `fa4 bench --decode --decode-shapes 1:16384 --dtype bf16 --threads 1` (a
//! loaded 2-core machine, so shares of samples, not times): the item loop went from 0.30 to 0.13
//! of the contiguous forward's samples once compiled per instruction set.

use rayon::prelude::*;

use super::PagedProblem;
use crate::combine;
use crate::config::decode::{DecodePlan, DecodeTiles};
use crate::cpu::simd::{dispatch_on, Kernel, Simd};
use crate::cpu::Isa;
use crate::tensor::Element;

/// Tiles of the CPU backend: 64 packed rows per item (decode problems have `seqlen_q · group`
/// of 1–64 rows, so one item holds a whole (sequence, KV head)), 32 keys per block (the K and V
/// blocks, 32 × 128 f32 each, stay in L1 while every row of the tile reads them; small blocks
/// also give the split planner fine-grained splits on short caches).
pub const CPU_TILES: DecodeTiles = DecodeTiles {
    block_m: 64,
    block_n: 32,
};

/// One work item.
#[derive(Debug, Clone, Copy)]
struct Item {
    seq: usize,
    kv_head: usize,
    /// First packed row and the number of rows.
    row0: usize,
    rows: usize,
    /// Keys of this split: `k0..k1`.
    k0: usize,
    k1: usize,
}

/// The partial result of one item: `rows × dv` normalised O and `rows` LSEs.
struct Part {
    o: Vec<f32>,
    lse: Vec<f32>,
}

/// Dot product with eight independent accumulators (short rounding chains, and the compiler
/// vectorises the lanes).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let (ac, ar) = a.split_at(a.len() / LANES * LANES);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(LANES).zip(bc.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// One item, compiled per instruction set ([`crate::cpu::simd`]): the dot products and the
/// P·V updates are plain loops that LLVM vectorises with the wrapper's target features.
struct Compute<'a, T> {
    p: &'a PagedProblem,
    it: &'a Item,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
}

impl<T: Element> Kernel for Compute<'_, T> {
    type Output = Part;
    #[inline(always)]
    fn run<S: Simd>(self) -> Part {
        compute(self.p, self.it, self.q, self.k, self.v)
    }
}

#[inline(always)]
fn compute<T: Element>(p: &PagedProblem, it: &Item, q: &[T], k: &[T], v: &[T]) -> Part {
    let c = p.cache();
    let (d, dv, group) = (c.head_dim(), c.head_dim_v(), p.group());
    let bn = CPU_TILES.block_n;
    let s = &p.sequences()[it.seq];
    let m = p.seq_mask(s);
    let scale = p.scale();
    let softcap = p.softcap();
    let row_q = |r: usize| (it.row0 + r) / group;
    let row_head = |r: usize| it.kv_head * group + (it.row0 + r) % group;

    // (scale·Q) rows, and each row's allowed keys within this split.
    let mut qs = vec![0f32; it.rows * d];
    let mut ranges = Vec::with_capacity(it.rows);
    for r in 0..it.rows {
        let off = p
            .q_layout()
            .offset(s.batch_index, s.q_start + row_q(r), row_head(r));
        for (dst, src) in qs[r * d..(r + 1) * d].iter_mut().zip(&q[off..off + d]) {
            *dst = scale * src.to_f32();
        }
        let kr = m.key_range(row_q(r));
        ranges.push(kr.start.max(it.k0)..kr.end.min(it.k1));
    }
    let lo = ranges.iter().map(|r| r.start).min().unwrap_or(0);
    let hi = ranges.iter().map(|r| r.end).max().unwrap_or(0);

    let mut acc = vec![0f32; it.rows * dv];
    let mut mx = vec![f32::NEG_INFINITY; it.rows];
    let mut sum = vec![0f32; it.rows];
    let mut seen = vec![false; it.rows];
    let mut kt = vec![0f32; bn * d];
    let mut vt = vec![0f32; bn * dv];
    let mut sc = vec![0f32; bn];
    let mut pv = vec![0f32; dv];
    let mut j0 = lo;
    while j0 < hi {
        let j1 = (j0 + bn).min(hi);
        // Gather the block from its pages (one page lookup per key: any page size).
        for j in j0..j1 {
            let ko = c.k_offset(it.seq, j, it.kv_head);
            let vo = c.v_offset(it.seq, j, it.kv_head);
            let t = j - j0;
            for (dst, src) in kt[t * d..(t + 1) * d].iter_mut().zip(&k[ko..ko + d]) {
                *dst = src.to_f32();
            }
            for (dst, src) in vt[t * dv..(t + 1) * dv].iter_mut().zip(&v[vo..vo + dv]) {
                *dst = src.to_f32();
            }
        }
        for r in 0..it.rows {
            let a = ranges[r].start.max(j0);
            let z = ranges[r].end.min(j1);
            if a >= z {
                continue;
            }
            let qr = &qs[r * d..(r + 1) * d];
            let mut block_max = f32::NEG_INFINITY;
            for j in a..z {
                let t = j - j0;
                let mut x = dot(qr, &kt[t * d..(t + 1) * d]);
                if let Some(cap) = softcap {
                    x = cap * (x / cap).tanh();
                }
                sc[t] = x;
                block_max = block_max.max(x);
            }
            let new_max = mx[r].max(block_max);
            // exp(−inf − finite) = 0 on the first block; a NaN score reaches sum and O through
            // its exp below, as the definition wants.
            let alpha = (mx[r] - new_max).exp();
            pv.fill(0.0);
            let mut block_sum = 0f32;
            for j in a..z {
                let t = j - j0;
                let w = (sc[t] - new_max).exp();
                block_sum += w;
                for (o, val) in pv.iter_mut().zip(&vt[t * dv..(t + 1) * dv]) {
                    *o += w * val;
                }
            }
            let ar = &mut acc[r * dv..(r + 1) * dv];
            if seen[r] {
                for (o, x) in ar.iter_mut().zip(&pv) {
                    *o = *o * alpha + x;
                }
                sum[r] = sum[r] * alpha + block_sum;
            } else {
                ar.copy_from_slice(&pv);
                sum[r] = block_sum;
                seen[r] = true;
            }
            mx[r] = new_max;
        }
        j0 = j1;
    }

    let mut lse = vec![f32::NEG_INFINITY; it.rows];
    for r in 0..it.rows {
        let ar = &mut acc[r * dv..(r + 1) * dv];
        if !seen[r] {
            ar.fill(0.0);
            continue;
        }
        let inv = 1.0 / sum[r];
        for o in ar.iter_mut() {
            *o *= inv;
        }
        lse[r] = (f64::from(mx[r]) + f64::from(sum[r]).ln()) as f32;
    }
    Part { o: acc, lse }
}

/// Runs a validated problem under a plan (the caller checked the buffers).
pub(super) fn forward<T: Element>(
    p: &PagedProblem,
    plan: &DecodePlan,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    mut lse: Option<&mut [f32]>,
) {
    let c = p.cache();
    let (group, dv) = (p.group(), c.head_dim_v());
    let (bm, bn) = (CPU_TILES.block_m, CPU_TILES.block_n);
    let splits = plan.num_splits.max(1);
    // Items of one tile are consecutive, splits innermost, so tile t's parts are
    // parts[t·splits .. (t+1)·splits].
    let mut items = Vec::new();
    for (seq, s) in p.sequences().iter().enumerate() {
        let rows = s.q_len * group;
        let blocks = s.k_len.div_ceil(bn);
        let per_split = blocks.div_ceil(splits);
        for kv_head in 0..c.heads_kv() {
            for row0 in (0..rows).step_by(bm) {
                for split in 0..splits {
                    let k0 = (split * per_split * bn).min(s.k_len);
                    let k1 = ((split + 1) * per_split * bn).min(s.k_len);
                    items.push(Item {
                        seq,
                        kv_head,
                        row0,
                        rows: bm.min(rows - row0),
                        k0,
                        k1,
                    });
                }
            }
        }
    }
    let isa = Isa::selected();
    let parts: Vec<Part> = items
        .par_iter()
        .map(|it| dispatch_on(isa, Compute { p, it, q, k, v }))
        .collect();
    let mut merged = vec![0f32; dv];
    for (tile, chunk) in items.chunks(splits).enumerate() {
        let it = chunk[0];
        let tile_parts = &parts[tile * splits..(tile + 1) * splits];
        let s = &p.sequences()[it.seq];
        for r in 0..it.rows {
            let l = combine::merge(
                splits,
                |x| tile_parts[x].lse[r],
                |x| &tile_parts[x].o[r * dv..(r + 1) * dv],
                &mut merged,
            );
            let (i, h) = (
                (it.row0 + r) / group,
                it.kv_head * group + (it.row0 + r) % group,
            );
            let off = p.o_layout().offset(s.batch_index, s.q_start + i, h);
            for (dst, x) in out[off..off + dv].iter_mut().zip(&merged) {
                *dst = T::from_f32(*x);
            }
            if let Some(l_out) = lse.as_deref_mut() {
                l_out[p.lse_offset(s, h, i)] = l;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::dot;

    #[test]
    fn dot_matches_a_plain_sum_at_every_length() {
        for n in 0..40 {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            assert!((f64::from(dot(&a, &b)) - want).abs() < 1e-4, "n = {n}");
        }
    }
}
