//! The decode planner: how many splits over the keys a paged decode call gets.
//!
//! A decode call has few query rows per sequence (1 for decode, 2–8 for speculative decode), so
//! one tile per (sequence, KV head) leaves most of a GPU idle: a batch of 1 with 8 KV heads
//! would run 8 tiles on 132 SMs. Two things fix that:
//!
//! - **GQA packing.** The `group = heads_q / heads_kv` query heads that read one KV head go into
//!   one tile, row `r` of a (sequence, KV head) being query row `r / group` of query head
//!   `kv_head · group + r % group`. A decode tile then has `seqlen_q · group` rows (32 at
//!   group 8, seqlen_q 4) instead of 1 of 128, and K and V are read once per group, not once per
//!   query head. Tiles: `batch · heads_kv · ceil(seqlen_q · group / block_m)`.
//! - **Split-KV.** Each tile's keys are cut into `num_splits` parts of whole key blocks, run as
//!   separate work items that write partial `(O, LSE)`, merged by [`crate::combine`].
//!
//! The split count follows FlashAttention-3's heuristic (`num_splits_heuristic`): if the tiles
//! alone fill 80% of the units (SMs, or CPU threads), no split. Otherwise, for each candidate
//! `s` up to `min(MAX_SPLITS, units, key blocks)`, the wave efficiency
//! `n_tiles·s / (ceil(n_tiles·s / units)·units)` (the busy fraction of the last wave's
//! schedule) is computed, candidates that give the same key blocks per split as `s − 1` are
//! skipped (they only add combine work), and the smallest `s` within 85% of the best efficiency
//! wins: more splits cost partial-output traffic and a bigger combine, so among nearly equal
//! schedules the fewest splits is best. `num_splits` forces a count instead.

use std::fmt;

use crate::error::{Error, Result};

/// Most splits over the keys of one tile (FlashAttention-3's cap as well).
pub const MAX_SPLITS: usize = 128;

/// Tiles that fill this fraction of the units need no split.
pub const FILL_NO_SPLIT: f64 = 0.8;

/// Candidates within this fraction of the best wave efficiency are as good; the fewest splits
/// among them wins.
pub const NEAR_BEST: f64 = 0.85;

/// The shape a decode plan depends on (the longest sequence stands for all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// Sequences.
    pub batch: usize,
    /// Query rows of the longest query sequence.
    pub seqlen_q: usize,
    /// Keys of the longest sequence.
    pub seqlen_k: usize,
    /// Query heads.
    pub heads_q: usize,
    /// KV heads (dividing `heads_q`).
    pub heads_kv: usize,
}

/// Tile sizes of a decode kernel: packed query rows per tile and keys per key block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeTiles {
    /// Packed query rows (query rows × the query heads of one KV head) per tile.
    pub block_m: usize,
    /// Keys per block; splits are whole blocks.
    pub block_n: usize,
}

impl DecodeTiles {
    /// The largest tiles the GPU decode kernel (`kernels/decode/splitkv.cu`) is planned with:
    /// 128 keys up to head dim 128 and 64 beyond (the K and V tiles of one stage stay at
    /// 64 KiB in 16-bit); 32 packed rows up to head dim 128 and 16 beyond. Every warp of the
    /// kernel holds all the tile's rows of O in f32 (it splits the keys, not the rows), so the
    /// rows are bounded by registers: 32 rows of d128 are 128 accumulator registers per
    /// thread, as are 16 of d256. A tile with fewer packed rows runs with fewer MMA tiles of
    /// 16 ([`crate::config::decode_gpu`]), which leaves the tile count unchanged.
    pub fn gpu(head_dim: usize) -> DecodeTiles {
        DecodeTiles {
            block_m: if head_dim <= 128 { 32 } else { 16 },
            block_n: if head_dim <= 128 { 128 } else { 64 },
        }
    }
}

/// The plan, with the evidence for its split count.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodePlan {
    /// The shape planned for.
    pub shape: DecodeShape,
    /// The tiles planned with.
    pub tiles: DecodeTiles,
    /// Units work is spread over (SMs, or CPU threads).
    pub units: usize,
    /// Query heads per KV head, packed into one tile.
    pub group: usize,
    /// Packed rows per (sequence, KV head): `seqlen_q · group`.
    pub packed_rows: usize,
    /// Tiles without splitting: `batch · heads_kv · ceil(packed_rows / block_m)`.
    pub tiles_unsplit: usize,
    /// Key blocks of the longest sequence.
    pub key_blocks: usize,
    /// The chosen split count.
    pub num_splits: usize,
    /// Whether the caller forced it.
    pub forced: bool,
    /// `(s, wave efficiency)` of every candidate considered (empty when forced or not needed).
    pub candidates: Vec<(usize, f64)>,
}

/// The wave efficiency of `work` equal items on `units` units: busy fraction of the schedule.
pub fn wave_efficiency(work: usize, units: usize) -> f64 {
    if work == 0 || units == 0 {
        return 0.0;
    }
    let waves = work.div_ceil(units);
    work as f64 / (waves * units) as f64
}

/// Plans the split count of a decode call (see the module docs). `num_splits` forces a count
/// in `1..=MAX_SPLITS` (splits past the key blocks are empty parts, correct but wasted).
pub fn plan(
    shape: DecodeShape,
    tiles: DecodeTiles,
    units: usize,
    num_splits: Option<usize>,
) -> Result<DecodePlan> {
    if tiles.block_m == 0 || tiles.block_n == 0 {
        return Err(Error::invalid(
            "tiles",
            format!("block sizes must be ≥ 1, got {tiles:?}"),
        ));
    }
    if units == 0 {
        return Err(Error::invalid("units", "must be at least 1"));
    }
    if shape.heads_q == 0 || shape.heads_kv == 0 || !shape.heads_q.is_multiple_of(shape.heads_kv) {
        return Err(Error::invalid(
            "heads_kv",
            format!(
                "heads_kv {} must be ≥ 1 and divide heads_q {} (GQA/MQA)",
                shape.heads_kv, shape.heads_q
            ),
        ));
    }
    let group = shape.heads_q / shape.heads_kv;
    let overflow = || Error::invalid("batch", "the decode grid overflows usize");
    let packed_rows = shape.seqlen_q.checked_mul(group).ok_or_else(overflow)?;
    let tiles_unsplit = shape
        .batch
        .checked_mul(shape.heads_kv)
        .and_then(|x| x.checked_mul(packed_rows.div_ceil(tiles.block_m)))
        .ok_or_else(overflow)?;
    let key_blocks = shape.seqlen_k.div_ceil(tiles.block_n);
    let mut plan = DecodePlan {
        shape,
        tiles,
        units,
        group,
        packed_rows,
        tiles_unsplit,
        key_blocks,
        num_splits: 1,
        forced: false,
        candidates: Vec::new(),
    };
    if let Some(n) = num_splits {
        if !(1..=MAX_SPLITS).contains(&n) {
            return Err(Error::invalid(
                "num_splits",
                format!("must be in 1..={MAX_SPLITS}, got {n}"),
            ));
        }
        plan.num_splits = n;
        plan.forced = true;
        return Ok(plan);
    }
    if tiles_unsplit == 0 || tiles_unsplit as f64 >= FILL_NO_SPLIT * units as f64 {
        return Ok(plan);
    }
    let max_s = MAX_SPLITS.min(units).min(key_blocks).max(1);
    let blocks_per_split = |s: usize| key_blocks.div_ceil(s);
    for s in 1..=max_s {
        if s > 1 && blocks_per_split(s) == blocks_per_split(s - 1) {
            continue;
        }
        let work = tiles_unsplit.checked_mul(s).ok_or_else(overflow)?;
        plan.candidates.push((s, wave_efficiency(work, units)));
    }
    let best = plan.candidates.iter().map(|&(_, e)| e).fold(0.0, f64::max);
    plan.num_splits = plan
        .candidates
        .iter()
        .find(|&&(_, e)| e >= NEAR_BEST * best)
        .map_or(1, |&(s, _)| s);
    Ok(plan)
}

impl fmt::Display for DecodePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(
            f,
            "decode: batch {}, seqlen_q {}, seqlen_k {}, heads {}/{} (group {})",
            s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, self.group
        )?;
        writeln!(
            f,
            "  GQA packing: {} packed rows per (sequence, KV head) in tiles of {} rows; {} tiles \
             unsplit on {} units",
            self.packed_rows, self.tiles.block_m, self.tiles_unsplit, self.units
        )?;
        writeln!(
            f,
            "  keys: {} blocks of {} in the longest sequence",
            self.key_blocks, self.tiles.block_n
        )?;
        if self.forced {
            return write!(f, "  num_splits {} (forced)", self.num_splits);
        }
        if self.candidates.is_empty() {
            return write!(
                f,
                "  num_splits 1: the tiles fill ≥ {:.0}% of the units (or there is no work)",
                FILL_NO_SPLIT * 100.0
            );
        }
        let list: Vec<String> = self
            .candidates
            .iter()
            .map(|(s, e)| format!("{s}:{:.0}%", e * 100.0))
            .collect();
        writeln!(f, "  wave efficiency by split count: {}", list.join(" "))?;
        write!(
            f,
            "  num_splits {}: the fewest splits within {:.0}% of the best efficiency ({} key \
             blocks per split)",
            self.num_splits,
            NEAR_BEST * 100.0,
            self.key_blocks.div_ceil(self.num_splits)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, seqlen_k: usize, heads_q: usize, heads_kv: usize) -> DecodeShape {
        DecodeShape {
            batch,
            seqlen_q: 1,
            seqlen_k,
            heads_q,
            heads_kv,
        }
    }

    /// The heuristic written out by brute force: best efficiency, then the smallest split within
    /// 85% of it, among splits that change the blocks per split.
    fn brute(tiles: usize, blocks: usize, units: usize) -> usize {
        if tiles as f64 >= 0.8 * units as f64 {
            return 1;
        }
        let cands: Vec<(usize, f64)> = (1..=blocks.min(units).clamp(1, 128))
            .filter(|&s| s == 1 || blocks.div_ceil(s) != blocks.div_ceil(s - 1))
            .map(|s| {
                let w = tiles * s;
                let waves = w.div_ceil(units);
                (s, w as f64 / (waves * units) as f64)
            })
            .collect();
        let best = cands.iter().map(|c| c.1).fold(0.0, f64::max);
        cands.iter().find(|c| c.1 >= 0.85 * best).unwrap().0
    }

    #[test]
    fn matches_the_heuristic_on_a_grid() {
        for batch in [1, 2, 3, 8, 32, 100] {
            for seqlen_k in [0, 1, 127, 128, 4096, 32768, 131072] {
                for (hq, hkv) in [(32, 8), (8, 8), (32, 1), (4, 2)] {
                    let sh = shape(batch, seqlen_k, hq, hkv);
                    let t = DecodeTiles::gpu(128);
                    let p = plan(sh, t, 132, None).unwrap();
                    let tiles = batch * hkv;
                    assert_eq!(p.tiles_unsplit, tiles);
                    let want = if tiles == 0 {
                        1
                    } else {
                        brute(tiles, seqlen_k.div_ceil(128), 132)
                    };
                    assert_eq!(p.num_splits, want, "{sh:?}");
                    assert!(p.num_splits <= p.key_blocks.max(1));
                }
            }
        }
    }

    #[test]
    fn the_issue_shapes_split_where_the_tiles_leave_sms_idle() {
        let t = DecodeTiles::gpu(128);
        // (1, 32k), 8 KV heads: 8 tiles on 132 SMs. The best candidates reach 97% (16, 32, 64
        // and 128 splits: 128·k items on 132·k places); 14 splits (112 items, 85%) is the
        // fewest within 85% of that (13 give 79%).
        let p = plan(shape(1, 32768, 32, 8), t, 132, None).unwrap();
        assert_eq!(p.num_splits, 14);
        // (32, 4k): 256 tiles already fill the GPU.
        let p = plan(shape(32, 4096, 32, 8), t, 132, None).unwrap();
        assert_eq!(p.num_splits, 1);
        assert!(p.candidates.is_empty());
        // GQA packing: 32 query heads at seqlen_q 1 are 8 tiles of 4 rows, not 32 tiles.
        assert_eq!(p.packed_rows, 4);
        assert!(p.to_string().contains("num_splits 1"));
    }

    #[test]
    fn forcing_and_bad_inputs() {
        let t = DecodeTiles::gpu(128);
        let p = plan(shape(1, 100, 8, 8), t, 132, Some(5)).unwrap();
        assert_eq!((p.num_splits, p.forced), (5, true));
        let name = |e: Error| match e {
            Error::InvalidArgument { name, .. } => name,
            e => panic!("{e}"),
        };
        assert_eq!(
            name(plan(shape(1, 100, 8, 8), t, 132, Some(0)).unwrap_err()),
            "num_splits"
        );
        assert_eq!(
            name(plan(shape(1, 100, 8, 8), t, 132, Some(MAX_SPLITS + 1)).unwrap_err()),
            "num_splits"
        );
        assert_eq!(
            name(plan(shape(1, 100, 8, 3), t, 132, None).unwrap_err()),
            "heads_kv"
        );
        assert_eq!(
            name(plan(shape(usize::MAX, 100, 8, 8), t, 132, None).unwrap_err()),
            "batch"
        );
    }
}
