//! The ring on the CPU: `N` simulated ranks in one process, one step of the loop per ring step,
//! K/V blocks exchanged through memory ([`InMemory`](super::InMemory), or any host
//! [`Transport`]) on a second thread while the ranks compute the block in hand, partial results
//! merged with [`crate::combine::combine_row`].
//!
//! Every rank's Q, K and V are widened to f32 once (exact for f16 and bf16), the calls run the
//! CPU backend in f32 and the partial O stay f32 until the last merge, so the only rounding to
//! the storage type is the final one, as in a single call.

use std::time::Instant;

use rayon::prelude::*;

use crate::combine::combine_row;
use crate::cpu::CpuBackend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::{Options, Problem};
use crate::tensor::{Element, Layout};

use super::transport::Transport;
use super::Ring;

/// Per-step times of a simulated ring, seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Compute of every rank's calls (run one rank after another) and their merge, per step.
    pub compute_s: Vec<f64>,
    /// Exchange of the next step's blocks, per step (0 for the last step, which sends nothing);
    /// it runs on its own thread during the step's compute.
    pub exchange_s: Vec<f64>,
    /// Wall time of each step: the longer of the two, plus the hand-over.
    pub step_s: Vec<f64>,
    /// `rank_compute_s[t][r]`: rank `r`'s share of step `t`'s compute.
    pub rank_compute_s: Vec<Vec<f64>>,
}

impl Timings {
    /// The time `N` real ranks would take with these per-rank times, each on its own copy of
    /// this machine: every step lasts as long as its slowest rank or its exchange, whichever is
    /// longer (the exchange overlaps the compute).
    pub fn projected_s(&self) -> f64 {
        self.rank_compute_s
            .iter()
            .zip(&self.exchange_s)
            .map(|(c, &x)| c.iter().copied().fold(x, f64::max))
            .sum()
    }
}

/// Rank-local outputs: `o[r]` `[batch, len_r, heads_q, head_dim_v]`, `lse[r]`
/// `[batch, heads_q, len_r]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalOutputs<T> {
    /// O per rank.
    pub o: Vec<Vec<T>>,
    /// LSE per rank (natural log).
    pub lse: Vec<Vec<f32>>,
}

fn widen<T: Element>(x: &[T]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// Runs the ring over rank-local inputs (`q[r]`, `k[r]`, `v[r]` as [`Ring::shard`] makes them)
/// with `transport` moving the blocks, computing on `cpu`.
pub fn simulate<T: Element, X>(
    ring: &Ring,
    cpu: &CpuBackend,
    transport: &mut X,
    q: &[Vec<T>],
    k: &[Vec<T>],
    v: &[Vec<T>],
) -> Result<(LocalOutputs<T>, Timings)>
where
    X: Transport<Block = Vec<f32>> + Send,
{
    let n = ring.ranks();
    if transport.world_size() != n || transport.local_ranks() != (0..n).collect::<Vec<_>>() {
        return Err(Error::invalid(
            "transport",
            format!(
                "drives ranks {:?} of {}; the CPU ring simulates all {n} ranks in one process",
                transport.local_ranks(),
                transport.world_size()
            ),
        ));
    }
    ring.check_locals("q", q, super::Operand::Q)?;
    ring.check_locals("k", k, super::Operand::K)?;
    ring.check_locals("v", v, super::Operand::V)?;
    let p = ring.problem();
    let (b, hq, dv) = (ring.batch(), p.heads_q(), p.head_dim_v());
    let q32: Vec<Vec<f32>> = q.iter().map(|x| widen(x)).collect();
    // A block is the rank's K then its V, so one message carries both.
    let mut cur: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            let mut blk = widen(&k[r]);
            blk.extend(v[r].iter().map(|x| x.to_f32()));
            blk
        })
        .collect();
    let mut next: Vec<Vec<f32>> = vec![Vec::new(); n];
    // Accumulators in [batch, len_r, heads_q] row order for LSE (one O row's heads together).
    let mut acc_o: Vec<Vec<f32>> = (0..n)
        .map(|r| vec![0.0; b * ring.q_len(r) * hq * dv])
        .collect();
    let mut acc_lse: Vec<Vec<f32>> = (0..n)
        .map(|r| vec![f32::NEG_INFINITY; b * ring.q_len(r) * hq])
        .collect();
    let mut timings = Timings::default();
    for t in 0..n {
        let t0 = Instant::now();
        let (compute, exchange) = std::thread::scope(|s| {
            let exchange = (t + 1 < n).then(|| {
                let (cur, next) = (&cur, &mut next);
                let transport = &mut *transport;
                s.spawn(move || {
                    let t0 = Instant::now();
                    transport
                        .shift(t, cur, next)
                        .map(|()| t0.elapsed().as_secs_f64())
                })
            });
            let t0 = Instant::now();
            let mut per_rank = Vec::with_capacity(n);
            let mut res = Ok(());
            for r in 0..n {
                let tr = Instant::now();
                res = res.and_then(|()| {
                    rank_step(
                        ring,
                        cpu,
                        r,
                        t,
                        &q32[r],
                        &cur[r],
                        &mut acc_o[r],
                        &mut acc_lse[r],
                    )
                });
                per_rank.push(tr.elapsed().as_secs_f64());
            }
            let compute = res.map(|()| (t0.elapsed().as_secs_f64(), per_rank));
            let exchange = match exchange {
                Some(h) => h.join().unwrap_or_else(|_| {
                    Err(Error::invalid("transport", "the exchange thread panicked"))
                }),
                None => Ok(0.0),
            };
            (compute, exchange)
        });
        let (compute, per_rank) = compute?;
        timings.compute_s.push(compute);
        timings.rank_compute_s.push(per_rank);
        timings.exchange_s.push(exchange?);
        std::mem::swap(&mut cur, &mut next);
        timings.step_s.push(t0.elapsed().as_secs_f64());
    }
    let o = acc_o
        .iter()
        .map(|a| a.iter().map(|&x| T::from_f32(x)).collect())
        .collect();
    let lse = (0..n)
        .map(|r| {
            let len = ring.q_len(r);
            let mut out = vec![0f32; b * hq * len];
            for bi in 0..b {
                for i in 0..len {
                    for h in 0..hq {
                        out[(bi * hq + h) * len + i] = acc_lse[r][(bi * len + i) * hq + h];
                    }
                }
            }
            out
        })
        .collect();
    Ok((LocalOutputs { o, lse }, timings))
}

/// Rank `r`'s calls of step `t` on the block in hand, merged into its accumulators.
#[allow(clippy::too_many_arguments)]
fn rank_step(
    ring: &Ring,
    cpu: &CpuBackend,
    r: usize,
    t: usize,
    q: &[f32],
    block: &[f32],
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
) -> Result<()> {
    let p = ring.problem();
    let (b, hq, hkv, d, dv) = (
        ring.batch(),
        p.heads_q(),
        p.heads_kv(),
        p.head_dim(),
        p.head_dim_v(),
    );
    let source = ring.schedule().step(r, t).source;
    let (lq, lk) = (ring.q_len(r), ring.k_len(source));
    if block.len() != b * lk * hkv * (d + dv) {
        return Err(Error::invalid(
            "transport",
            format!(
                "rank {r} step {t} received {} values, rank {source}'s K/V block holds {}",
                block.len(),
                b * lk * hkv * (d + dv)
            ),
        ));
    }
    let (kb, vb) = block.split_at(b * lk * hkv * d);
    for call in ring.schedule().calls(r, t) {
        let (rows, keys) = (call.q_local.len(), call.k_local.len());
        let view = |name: &str, heads: usize, dim: usize, len: usize, n: usize| {
            Layout::new(
                name,
                &[b, n, heads, dim],
                Some(&[len * heads * dim, heads * dim, dim, 1]),
            )
        };
        let ql = view("q", hq, d, lq, rows)?;
        let kl = view("k", hkv, d, lk, keys)?;
        let vl = view("v", hkv, dv, lk, keys)?;
        let ol = Layout::new("out", &[b, rows, hq, dv], None)?;
        let mut opts = Options::new().mask(call.mask).scale(p.scale());
        if let Some(c) = p.softcap() {
            opts = opts.softcap(c);
        }
        let cp = Problem::new(DType::F32, &ql, &kl, &vl, &ol, None, None, &opts)?;
        let mut part_o = vec![0f32; b * rows * hq * dv];
        let mut part_lse = vec![0f32; b * hq * rows];
        cpu.forward(
            &cp,
            &q[call.q_local.start * hq * d..],
            &kb[call.k_local.start * hkv * d..],
            &vb[call.k_local.start * hkv * dv..],
            &mut part_o,
            Some(&mut part_lse),
        )?;
        merge_into(
            acc_o,
            acc_lse,
            Shape { lq, hq, dv },
            call.q_local.clone(),
            &part_o,
            &part_lse,
        )?;
    }
    Ok(())
}

/// The sizes [`merge_into`] needs: the rank's query rows, query heads, head_dim_v.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub lq: usize,
    pub hq: usize,
    pub dv: usize,
}

/// Folds one call's partial result into a rank's running result with the public combine.
///
/// - `acc_o` `[b, lq, hq, dv]`, `acc_lse` `[b, lq, hq]` (the rank's accumulators)
/// - `part_o` `[b, rows, hq, dv]`, `part_lse` `[b, hq, rows]` for local rows `rows`
pub(crate) fn merge_into(
    acc_o: &mut [f32],
    acc_lse: &mut [f32],
    s: Shape,
    rows: std::ops::Range<usize>,
    part_o: &[f32],
    part_lse: &[f32],
) -> Result<()> {
    let Shape { lq, hq, dv } = s;
    let n = rows.len();
    acc_o
        .par_chunks_mut(hq * dv)
        .zip(acc_lse.par_chunks_mut(hq))
        .enumerate()
        .filter(|(row, _)| rows.contains(&(row % lq)))
        .try_for_each(|(row, (o_row, l_row))| {
            let (bi, i) = (row / lq, row % lq - rows.start);
            let mut held = vec![0f32; dv];
            for h in 0..hq {
                let part = &part_o[((bi * n + i) * hq + h) * dv..][..dv];
                let pl = part_lse[(bi * hq + h) * n + i];
                let acc = &mut o_row[h * dv..(h + 1) * dv];
                held.copy_from_slice(acc);
                l_row[h] = combine_row(&[l_row[h], pl], &[&held, part], acc)?;
            }
            Ok(())
        })
}
