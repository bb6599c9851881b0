//! Context parallelism (ring attention): one sequence's attention computed by `N` ranks, each
//! holding a slice of the sequence, with K/V blocks travelling round a ring.
//!
//! The pieces, each in its own file:
//!
//! - [`split`]: which rows each rank holds. [`SplitKind::Zigzag`] cuts the sequence into `2N`
//!   chunks and gives rank `r` chunks `r` and `2N − 1 − r`, so under a causal mask every rank
//!   does the same work; [`SplitKind::Contiguous`] gives rank `r` chunk `r` of `N`. Lengths that
//!   do not divide the chunk count are neither padded nor refused: chunks differ by one row.
//! - [`schedule`]: at step `t` rank `r` holds the K/V of rank `(r − t) mod N`; each (query
//!   piece, key piece) pair is full, diagonal (a causal boundary crosses it: trimmed, with a
//!   local mask equal to the whole sequence's bottom-right rule there) or skipped.
//! - the merge: each call returns its O and natural-log LSE over the keys it saw, and the rank
//!   folds them into its running result with the public [`crate::combine`]
//!   (`LSE = ln Σ exp(LSE_s)`, `O = Σ exp(LSE_s − LSE)·O_s`); the parts of a row are over
//!   disjoint key sets whose union is the row's allowed keys, so the result is exact.
//! - [`transport`]: the [`Transport`] trait; [`InMemory`] (simulated ranks, host copies) and,
//!   in [`nccl`], NCCL send/recv between GPUs.
//! - [`cpu`]: the ring simulated on the CPU, what CI tests; [`cuda`]: the ring on GPUs.
//!
//! Inputs are fixed-length batches (`[batch, seqlen, heads, dim]`, GQA allowed), f32, f16 or
//! bf16, with no mask or a causal one; local windows and varlen batches are refused with an
//! error naming the argument. See `docs/cp.md` for the schedule's picture and what has run where.

pub mod cpu;
pub mod cuda;
pub mod nccl;
pub mod schedule;
pub mod split;
pub mod transport;

pub use schedule::{Call, Product, ProductKind, Schedule, Step, Work};
pub use split::{Piece, Split, SplitKind};
pub use transport::{InMemory, Transport};

use crate::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::tensor::{Element, Layout};

/// Which input tensor a local buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// Q `[batch, len, heads_q, head_dim]`.
    Q,
    /// K `[batch, len, heads_kv, head_dim]`.
    K,
    /// V `[batch, len, heads_kv, head_dim_v]`.
    V,
}

/// A problem planned over `N` ranks: the whole problem, how its rows are split, the schedule.
///
/// Rank `r`'s local tensors are contiguous: Q `[batch, q_len(r), heads_q, head_dim]`, K and V
/// `[batch, k_len(r), heads_kv, head_dim(_v)]`, O `[batch, q_len(r), heads_q, head_dim_v]`,
/// LSE `[batch, heads_q, q_len(r)]`; their rows are the rank's pieces in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Ring {
    problem: Problem,
    schedule: Schedule,
}

impl Ring {
    /// Plans `p` (the whole problem, as one call would compute it) over `ranks` ranks.
    pub fn new(p: &Problem, ranks: usize, kind: SplitKind) -> Result<Ring> {
        if ranks == 0 {
            return Err(Error::invalid(
                "cp",
                "the number of ranks must be ≥ 1, got 0",
            ));
        }
        if p.is_varlen() {
            return Err(Error::invalid(
                "q",
                "context parallelism takes fixed-length batches [batch, seqlen, heads, dim]; \
                 varlen batches are not split yet",
            ));
        }
        let (sq, sk) = (p.q_layout().dims[1], p.k_layout().dims[1]);
        let q = Split::new(kind, sq, ranks)?;
        let k = Split::new(kind, sk, ranks)?;
        let schedule = Schedule::new(q, k, p.mask())?;
        Ok(Ring {
            problem: p.clone(),
            schedule,
        })
    }

    /// The whole problem.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }
    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
    /// Ranks.
    pub fn ranks(&self) -> usize {
        self.schedule.ranks()
    }
    /// Batch size.
    pub fn batch(&self) -> usize {
        self.problem.q_layout().dims[0]
    }
    /// Query rows rank `r` holds.
    pub fn q_len(&self, r: usize) -> usize {
        self.schedule.q_split().local_len(r)
    }
    /// Key rows rank `r` holds.
    pub fn k_len(&self, r: usize) -> usize {
        self.schedule.k_split().local_len(r)
    }

    fn operand(&self, which: Operand) -> (&Layout, &Split, usize) {
        let p = &self.problem;
        match which {
            Operand::Q => (p.q_layout(), self.schedule.q_split(), p.head_dim()),
            Operand::K => (p.k_layout(), self.schedule.k_split(), p.head_dim()),
            Operand::V => (p.v_layout(), self.schedule.k_split(), p.head_dim_v()),
        }
    }

    /// Elements of rank `r`'s local buffer of `which`.
    pub fn local_numel(&self, which: Operand, r: usize) -> usize {
        let (l, s, dim) = self.operand(which);
        l.dims[0] * s.local_len(r) * l.dims[2] * dim
    }

    pub(crate) fn check_locals<T>(&self, name: &str, x: &[Vec<T>], which: Operand) -> Result<()> {
        if x.len() != self.ranks() {
            return Err(Error::invalid(
                name,
                format!("{} rank buffers for {} ranks", x.len(), self.ranks()),
            ));
        }
        for (r, buf) in x.iter().enumerate() {
            let want = self.local_numel(which, r);
            if buf.len() != want {
                return Err(Error::invalid(
                    name,
                    format!(
                        "rank {r}'s buffer holds {} elements, expected {want}",
                        buf.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Cuts a whole input (laid out as the problem's layout of `which` says) into the ranks'
    /// contiguous local buffers.
    pub fn shard<T: Element>(&self, which: Operand, full: &[T]) -> Result<Vec<Vec<T>>> {
        let (l, s, dim) = self.operand(which);
        let name = match which {
            Operand::Q => "q",
            Operand::K => "k",
            Operand::V => "v",
        };
        l.check_fits(name, full.len())?;
        let (b, h) = (l.dims[0], l.dims[2]);
        Ok((0..self.ranks())
            .map(|r| {
                let mut out = Vec::with_capacity(self.local_numel(which, r));
                for bi in 0..b {
                    for piece in s.pieces(r) {
                        for g in piece.global {
                            for hi in 0..h {
                                let off = l.offset(bi, g, hi);
                                out.extend_from_slice(&full[off..off + dim]);
                            }
                        }
                    }
                }
                out
            })
            .collect())
    }

    /// Writes the ranks' local O and LSE into the whole problem's O (in its layout) and LSE
    /// (`[batch, heads_q, seqlen_q]`).
    pub fn gather<T: Element>(
        &self,
        local: &cpu::LocalOutputs<T>,
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let p = &self.problem;
        let ol = p.o_layout();
        ol.check_fits("out", out.len())?;
        let (b, hq, dv) = (self.batch(), p.heads_q(), p.head_dim_v());
        let s = self.schedule.q_split();
        if local.o.len() != self.ranks() || local.lse.len() != self.ranks() {
            return Err(Error::invalid("local", "one O and one LSE buffer per rank"));
        }
        for r in 0..self.ranks() {
            let len = s.local_len(r);
            if local.o[r].len() != b * len * hq * dv || local.lse[r].len() != b * hq * len {
                return Err(Error::invalid(
                    "local",
                    format!("rank {r}'s O or LSE does not hold its {len} rows"),
                ));
            }
        }
        let mut lse = lse;
        if let Some(l) = lse.as_deref() {
            if l.len() != p.lse_len() {
                return Err(Error::invalid(
                    "lse",
                    format!("expected {} elements, got {}", p.lse_len(), l.len()),
                ));
            }
        }
        let sq = s.len();
        for r in 0..self.ranks() {
            let len = s.local_len(r);
            for bi in 0..b {
                for piece in s.pieces(r) {
                    for (g, i) in piece.global.clone().zip(piece.local()) {
                        for h in 0..hq {
                            let src = &local.o[r][((bi * len + i) * hq + h) * dv..][..dv];
                            let off = ol.offset(bi, g, h);
                            out[off..off + dv].copy_from_slice(src);
                            if let Some(l) = lse.as_deref_mut() {
                                l[(bi * hq + h) * sq + g] = local.lse[r][(bi * hq + h) * len + i];
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The whole problem `p` computed by `ranks` simulated ranks on the CPU (shard, ring over an
/// [`InMemory`] transport, gather): the same O and LSE a single call writes, with the per-step
/// times of the simulation.
#[allow(clippy::too_many_arguments)]
pub fn forward_simulated<T: Element>(
    p: &Problem,
    ranks: usize,
    kind: SplitKind,
    cpu: &CpuBackend,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
) -> Result<cpu::Timings> {
    p.check_buffers(
        T::DTYPE,
        q.len(),
        k.len(),
        v.len(),
        out.len(),
        lse.as_deref().map(<[f32]>::len),
    )?;
    let ring = Ring::new(p, ranks, kind)?;
    let (lq, lk, lv) = (
        ring.shard(Operand::Q, q)?,
        ring.shard(Operand::K, k)?,
        ring.shard(Operand::V, v)?,
    );
    let mut transport = InMemory::new(ranks)?;
    let (local, timings) = cpu::simulate(&ring, cpu, &mut transport, &lq, &lk, &lv)?;
    ring.gather(&local, out, lse)?;
    Ok(timings)
}
