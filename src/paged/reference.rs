//! The float64 oracle of paged attention: gather each sequence's keys and values out of their
//! pages into a contiguous varlen problem, then evaluate the existing definition
//! ([`crate::cpu::reference::attention_f64`]) on it.
//!
//! The gather reads the raw `page_table` and the cache strides with its own indexing (it shares
//! no code with the paged CPU backend's page lookup), so a wrong page, slot or head in the
//! backend cannot be mirrored here.

use super::PagedProblem;
use crate::check::{self, Report};
use crate::cpu::reference::{self, Output};
use crate::error::Result;
use crate::fp8::F8E4M3;
use crate::problem::{Options, Problem};
use crate::tensor::{Element, Layout};

/// A paged problem gathered into the contiguous varlen form: Q `[total_q, heads_q, head_dim]`,
/// K `[total_k, heads_kv, head_dim]`, V `[total_k, heads_kv, head_dim_v]`, sequence `b` at rows
/// `cu_q[b]..` and `cu_k[b]..` (the same sequences, rows and heads as the paged problem).
#[derive(Debug, Clone)]
pub struct Gathered<T, K = T> {
    /// The validated varlen problem.
    pub problem: Problem,
    /// Queries.
    pub q: Vec<T>,
    /// Keys in sequence order.
    pub k: Vec<K>,
    /// Values in sequence order.
    pub v: Vec<K>,
}

/// Gathers `p`'s queries and each sequence's keys and values (see [`Gathered`]); the cache's
/// element type may differ from the queries' (an fp8 cache).
pub fn gather<T: Element, K: Copy>(
    p: &PagedProblem,
    q: &[T],
    k_cache: &[K],
    v_cache: &[K],
) -> Result<Gathered<T, K>> {
    let c = p.cache();
    let (hq, hkv, d, dv) = (p.heads_q(), c.heads_kv(), c.head_dim(), c.head_dim_v());
    let (ps, max_pages) = (c.page_size(), c.max_pages_per_seq());
    let table = &c.table;
    let (ks, vs) = (c.k_layout().strides, c.v_layout().strides);
    let (qd, qs) = (p.q_layout().dims, p.q_layout().strides);

    let mut gq = Vec::new();
    let mut gk = Vec::new();
    let mut gv = Vec::new();
    let mut cu_q = vec![0i32];
    let mut cu_k = vec![0i32];
    for (b, s) in p.sequences().iter().enumerate() {
        // Queries: fixed batches are [b, i, h, :], packed ones [cu_q[b] + i, h, :].
        let (batch_off, row0) = if p.is_varlen() {
            (0, s.q_start)
        } else {
            (b * qs[0], 0)
        };
        for i in 0..s.q_len {
            for h in 0..hq {
                let off = batch_off + (row0 + i) * qs[1] + h * qs[2];
                gq.extend_from_slice(&q[off..off + qd[3]]);
            }
        }
        // Key j of sequence b: page table[b][j / ps], slot j % ps.
        for j in 0..s.k_len {
            let page = table[b * max_pages + j / ps] as usize;
            let slot = j % ps;
            for h in 0..hkv {
                let ko = page * ks[0] + slot * ks[1] + h * ks[2];
                gk.extend_from_slice(&k_cache[ko..ko + d]);
                let vo = page * vs[0] + slot * vs[1] + h * vs[2];
                gv.extend_from_slice(&v_cache[vo..vo + dv]);
            }
        }
        cu_q.push(cu_q[b] + s.q_len as i32);
        cu_k.push(cu_k[b] + s.k_len as i32);
    }
    let total_q = *cu_q.last().expect("non-empty") as usize;
    let total_k = *cu_k.last().expect("non-empty") as usize;
    let ql = Layout::new("q", &[total_q, hq, d], None)?;
    let kl = Layout::new("k_cache", &[total_k, hkv, d], None)?;
    let vl = Layout::new("v_cache", &[total_k, hkv, dv], None)?;
    let ol = Layout::new("out", &[total_q, hq, dv], None)?;
    let mut opts = Options::new().mask(p.options().get_mask()).scale(p.scale());
    if let Some(c) = p.softcap() {
        opts = opts.softcap(c);
    }
    let problem = Problem::new(
        p.dtype(),
        &ql,
        &kl,
        &vl,
        &ol,
        Some(&cu_q),
        Some(&cu_k),
        &opts,
    )?;
    Ok(Gathered {
        problem,
        q: gq,
        k: gk,
        v: gv,
    })
}

/// The float64 evaluation of a paged problem: O contiguous in O's dims (`[batch, seqlen_q,
/// heads_q, head_dim_v]` or `[total_q, heads_q, head_dim_v]`), LSE in the problem's LSE layout.
pub fn attention_f64<T: Element>(
    p: &PagedProblem,
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
) -> Result<Output<f64>> {
    let g = gather(p, q, k_cache, v_cache)?;
    let out = reference::attention_f64(&g.problem, &g.q, &g.k, &g.v)?;
    // The gathered O is [total_q, heads_q, dv] in sequence order: the contiguous O of either
    // form. Its LSE is [heads_q, total_q]; fixed batches want [batch, heads_q, seqlen_q].
    let mut lse = vec![0f64; p.lse_len()];
    let total_q = p.total_q();
    for (b, s) in p.sequences().iter().enumerate() {
        let gathered_row0 = g.problem.sequences()[b].q_start;
        for h in 0..p.heads_q() {
            for i in 0..s.q_len {
                lse[p.lse_offset(s, h, i)] = out.lse[h * total_q + gathered_row0 + i];
            }
        }
    }
    Ok(Output { o: out.o, lse })
}

/// Applies the tolerance rule to a backend's paged output: `o` in the problem's O layout, `lse`
/// in its LSE layout. The output is moved into the gathered problem's layout and judged by
/// [`check::check`] there (the oracle and the low-precision evaluation from the same inputs).
pub fn check<T: Element>(
    p: &PagedProblem,
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    o: &[T],
    lse: Option<&[f32]>,
) -> Result<Report> {
    let g = gather(p, q, k_cache, v_cache)?;
    let (go, gl) = regather(p, &g.problem, o, lse);
    check::check(
        &g.problem,
        &g.q,
        &g.k,
        &g.v,
        &go,
        lse.map(|_| gl.as_slice()),
    )
}

/// [`check`] for an fp8 e4m3 cache with per-KV-head scales ([`super::KvScales`]), judged by
/// [`check::check_kv_fp8`] on the gathered problem.
pub fn check_fp8<T: Element>(
    p: &PagedProblem,
    q: &[T],
    k_cache: &[F8E4M3],
    v_cache: &[F8E4M3],
    scales: &super::KvScales,
    o: &[T],
    lse: Option<&[f32]>,
) -> Result<Report> {
    oracle_fp8(p, q, k_cache, v_cache, scales)?.check(p, o, lse)
}

/// [`check_fp8`]'s evaluations of one paged fp8 problem's inputs, computed once to judge several
/// backends' outputs of it ([`Fp8Oracle::check`]): the gathered problem and its
/// [`check::KvFp8Oracle`].
#[derive(Debug, Clone)]
pub struct Fp8Oracle<T> {
    gathered: Problem,
    oracle: check::KvFp8Oracle<T>,
}

/// The [`Fp8Oracle`] of `p`'s inputs; errors as [`check_fp8`] does for them.
pub fn oracle_fp8<T: Element>(
    p: &PagedProblem,
    q: &[T],
    k_cache: &[F8E4M3],
    v_cache: &[F8E4M3],
    scales: &super::KvScales,
) -> Result<Fp8Oracle<T>> {
    let g = gather(p, q, k_cache, v_cache)?;
    let oracle = check::KvFp8Oracle::new(&g.problem, &g.q, &g.k, &g.v, scales.k, scales.v)?;
    Ok(Fp8Oracle {
        gathered: g.problem,
        oracle,
    })
}

impl<T: Element> Fp8Oracle<T> {
    /// [`check_fp8`]'s verdict on a backend's output of `p`, the problem this oracle is of:
    /// `o` in its O layout, `lse` in its LSE layout.
    pub fn check(&self, p: &PagedProblem, o: &[T], lse: Option<&[f32]>) -> Result<Report> {
        let (go, gl) = regather(p, &self.gathered, o, lse);
        self.oracle
            .judge(&self.gathered, &go, lse.map(|_| gl.as_slice()))
    }
}

/// A backend's O and LSE moved into the gathered problem's layouts.
fn regather<T: Element>(
    p: &PagedProblem,
    gathered: &Problem,
    o: &[T],
    lse: Option<&[f32]>,
) -> (Vec<T>, Vec<f32>) {
    let dv = p.cache().head_dim_v();
    let total_q = p.total_q();
    let mut go = Vec::with_capacity(total_q * p.heads_q() * dv);
    let mut gl = vec![0f32; p.lse_len()];
    for (b, s) in p.sequences().iter().enumerate() {
        let gathered_row0 = gathered.sequences()[b].q_start;
        for i in 0..s.q_len {
            for h in 0..p.heads_q() {
                let off = p.o_layout().offset(s.batch_index, s.q_start + i, h);
                go.extend_from_slice(&o[off..off + dv]);
                if let Some(l) = lse {
                    gl[h * total_q + gathered_row0 + i] = l[p.lse_offset(s, h, i)];
                }
            }
        }
    }
    (go, gl)
}
