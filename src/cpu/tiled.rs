//! Tiled online-softmax attention on the CPU.

use rayon::prelude::*;

use super::plan::CpuTiles;
use crate::mask::TileKind;
use crate::problem::Problem;
use crate::tensor::Element;

const LOG2E: f32 = std::f32::consts::LOG2_E;

/// One work item: a block of query rows of one head of one sequence.
#[derive(Debug, Clone, Copy)]
struct Item {
    seq: usize,
    head: usize,
    row0: usize,
    rows: usize,
}

/// Result of one work item, scattered into the outputs after a parallel chunk.
struct TileOut {
    item: Item,
    o: Vec<f32>,
    lse: Vec<f32>,
}

fn items(p: &Problem, bm: usize) -> Vec<Item> {
    let mut out = Vec::new();
    for (seq, s) in p.sequences().iter().enumerate() {
        for head in 0..p.heads_q() {
            for row0 in (0..s.q_len).step_by(bm) {
                out.push(Item {
                    seq,
                    head,
                    row0,
                    rows: bm.min(s.q_len - row0),
                });
            }
        }
    }
    out
}

fn compute<T: Element>(p: &Problem, t: CpuTiles, q: &[T], k: &[T], v: &[T], it: Item) -> TileOut {
    let s = &p.sequences()[it.seq];
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let hk = it.head / p.group();
    let m = p.seq_mask(s);
    let rows = it.row0..it.row0 + it.rows;
    let softcap = p.softcap();
    // Scores stay in natural-log units so that LSE = max + ln(sum) adds no rounding of its own;
    // exp2 takes `s·log2e − max·log2e`.
    let qscale = p.scale();
    let mut qt = vec![0f32; it.rows * d];
    for r in 0..it.rows {
        let off = p
            .q_layout()
            .offset(s.batch_index, s.q_start + it.row0 + r, it.head);
        for c in 0..d {
            qt[r * d + c] = q[off + c].to_f32() * qscale;
        }
    }
    let mut row_max = vec![f32::NEG_INFINITY; it.rows];
    let mut row_sum = vec![0f32; it.rows];
    let mut acc = vec![0f32; it.rows * dv];
    let mut sc = vec![0f32; it.rows * t.block_n];
    for kb in m.key_blocks(rows.clone(), t.block_n) {
        let keys = kb * t.block_n..((kb + 1) * t.block_n).min(s.k_len);
        let kind = m.tile_kind(rows.clone(), keys.clone());
        if kind == TileKind::Masked {
            continue;
        }
        let n = keys.len();
        for r in 0..it.rows {
            for (jj, j) in keys.clone().enumerate() {
                let off = p.k_layout().offset(s.batch_index, s.k_start + j, hk);
                let mut part = [0f32; 8];
                for c in 0..d {
                    part[c % 8] += qt[r * d + c] * k[off + c].to_f32();
                }
                let mut dot: f32 = part.iter().sum();
                if let Some(cap) = softcap {
                    dot = cap * (dot / cap).tanh();
                }
                if kind == TileKind::Partial && !m.allowed(it.row0 + r, j) {
                    dot = f32::NEG_INFINITY;
                }
                sc[r * t.block_n + jj] = dot;
            }
        }
        for r in 0..it.rows {
            let srow = &mut sc[r * t.block_n..r * t.block_n + n];
            let new_max = srow.iter().copied().fold(row_max[r], f32::max);
            if new_max == f32::NEG_INFINITY {
                continue;
            }
            let corr = ((row_max[r] - new_max) * LOG2E).exp2();
            row_max[r] = new_max;
            row_sum[r] *= corr;
            let arow = &mut acc[r * dv..(r + 1) * dv];
            for a in arow.iter_mut() {
                *a *= corr;
            }
            for (jj, j) in keys.clone().enumerate() {
                let pj = (srow[jj] * LOG2E - new_max * LOG2E).exp2();
                row_sum[r] += pj;
                let off = p.v_layout().offset(s.batch_index, s.k_start + j, hk);
                for c in 0..dv {
                    arow[c] += pj * v[off + c].to_f32();
                }
            }
        }
    }
    let mut lse = vec![f32::NEG_INFINITY; it.rows];
    for r in 0..it.rows {
        let arow = &mut acc[r * dv..(r + 1) * dv];
        if row_sum[r] == 0.0 {
            arow.fill(0.0);
        } else {
            let inv = 1.0 / row_sum[r];
            for a in arow.iter_mut() {
                *a *= inv;
            }
            lse[r] = row_max[r] + row_sum[r].ln();
        }
    }
    TileOut {
        item: it,
        o: acc,
        lse,
    }
}

/// Runs a validated problem.
pub(crate) fn forward<T: Element>(
    p: &Problem,
    t: CpuTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    mut lse: Option<&mut [f32]>,
) {
    let dv = p.head_dim_v();
    let all = items(p, t.block_m);
    let chunk = 4 * rayon::current_num_threads().max(1);
    for batch in all.chunks(chunk) {
        let tiles: Vec<TileOut> = batch
            .par_iter()
            .map(|&it| compute(p, t, q, k, v, it))
            .collect();
        for tile in tiles {
            let it = tile.item;
            let s = &p.sequences()[it.seq];
            for r in 0..it.rows {
                let off = p
                    .o_layout()
                    .offset(s.batch_index, s.q_start + it.row0 + r, it.head);
                for c in 0..dv {
                    out[off + c] = T::from_f32(tile.o[r * dv + c]);
                }
                if let Some(l) = lse.as_deref_mut() {
                    l[p.lse_offset(s, it.head, it.row0 + r)] = tile.lse[r];
                }
            }
        }
    }
}
