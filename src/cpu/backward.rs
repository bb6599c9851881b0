//! The tiled CPU backward pass: dQ, dK and dV from Q, K, V, the forward's O and LSE, and dO.
//!
//! P is recomputed tile by tile from the forward's LSE (`P = exp(s − LSE)`), never stored
//! whole, so memory is O(tile) per thread, as in the forward. Two passes, each over work items
//! that own their output rows outright:
//!
//! 1. **dK, dV**: one item per (sequence, KV head, key block). It walks the query heads of its
//!    KV head (GQA) and, for each, the query blocks the mask lets see its keys, and per tile
//!    computes `S = Q·Kᵀ`, `P`, `dP = dO·Vᵀ`, `dX = P∘(dP − D)·(1 − tanh²)·scale`, then
//!    `dV += Pᵀ·dO` and `dK += dXᵀ·Q`.
//! 2. **dQ**: one item per (sequence, query head, query block), walking its key blocks and
//!    recomputing `S`, `P`, `dP`, `dX` to form `dQ = dX·K`.
//!
//! `D_i = dO_i·O_i` is formed in f32 from the stored O when a query block is loaded (O(rows ·
//! head_dim_v), a small fraction of a tile's products). The products run on the forward's
//! register-blocked microkernels (the `cols` family: A given transposed, so Q, dO, K and V are
//! transposed on load and dX before the dQ product); on partial tiles whose operands hold a
//! non-finite value, per-row sums over each row's own keys replace them (see below).
//!
//! **Determinism.** Every output element is summed by exactly one item, in a fixed order (query
//! heads, then blocks, then rows; keys in order), so the result is the same bits on every run
//! and for any thread count: the CPU backward is always deterministic and
//! `BackwardOptions::deterministic` costs nothing here. The price is paid always: pass 2
//! recomputes `S` and `dP`, 7 tile products where a pass that accumulated dQ across threads
//! (with atomics, as the GPU kernels do) would need 5.
//!
//! Precision: f32 throughout (16-bit inputs are widened once per tile), P and dS kept in f32,
//! results rounded to the storage dtype once, at the end. Non-finite inputs give what the
//! formula gives: masked pairs are left out of every sum (a product over a whole tile would add
//! `0 · NaN` for them), so a NaN key reaches only the rows that attend to it (and through them
//! the keys those rows attend to). The bits depend on the instruction set (FMA), not on the
//! thread count.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::micro::{exp2, LOG2E};
use super::plan::CpuTiles;
use super::simd::{self, Init, Isa, Kernel, Simd};
use crate::mask::{SeqMask, TileKind};
use crate::problem::{Problem, Sequence};
use crate::tensor::{Element, Layout};

/// The inputs of a backward call: the problem's tensors plus O, LSE and dO.
pub(crate) struct BwdInputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    /// O, in the problem's O layout.
    pub o: &'a [T],
    /// LSE, in the problem's LSE layout.
    pub lse: &'a [f32],
    pub d_out: &'a [T],
    /// dO's layout (O's dims, its own strides).
    pub d_out_layout: Layout,
}

/// The outputs: dQ, dK, dV with their layouts (the dims of Q, K, V).
pub(crate) struct BwdOutputs<'a, T> {
    pub dq: &'a mut [T],
    pub dq_layout: Layout,
    pub dk: &'a mut [T],
    pub dk_layout: Layout,
    pub dv: &'a mut [T],
    pub dv_layout: Layout,
}

/// A work item of either pass.
#[derive(Debug, Clone, Copy)]
enum Item {
    /// Pass 1: keys `key0..key0 + keys` of KV head `head`.
    Kv {
        seq: usize,
        head: usize,
        key0: usize,
        keys: usize,
    },
    /// Pass 2: query rows `row0..row0 + rows` of query head `head`.
    Q {
        seq: usize,
        head: usize,
        row0: usize,
        rows: usize,
    },
}

/// Per-thread scratch, O(tile), all f32.
struct Scratch {
    /// Q block, `block_m × d`, and its transpose.
    q: Vec<f32>,
    qt: Vec<f32>,
    /// dO block, `block_m × dv`, and its transpose.
    d_o: Vec<f32>,
    d_ot: Vec<f32>,
    /// LSE·log2e and D of the block's rows.
    lse2: Vec<f32>,
    dd: Vec<f32>,
    /// K tile `block_n × d` and its transpose `d × block_n`.
    k: Vec<f32>,
    kt: Vec<f32>,
    /// V tile `block_n × dv` and its transpose `dv × block_n`.
    v: Vec<f32>,
    vt: Vec<f32>,
    /// Scores then P (`block_m × block_n`), dP then dX (same).
    p: Vec<f32>,
    dx: Vec<f32>,
    /// dXᵀ, `block_n × block_m` (pass 2).
    dxt: Vec<f32>,
    /// Each row's allowed keys in the tile, local.
    lo: Vec<usize>,
    hi: Vec<usize>,
    /// Accumulators: dK `block_n × d`, dV `block_n × dv` (pass 1) or dQ `block_m × d` (pass 2).
    acc_a: Vec<f32>,
    acc_b: Vec<f32>,
}

impl Scratch {
    fn new(p: &Problem, t: CpuTiles) -> Scratch {
        let (d, dv, m, n) = (p.head_dim(), p.head_dim_v(), t.block_m, t.block_n);
        Scratch {
            q: vec![0.0; m * d],
            qt: vec![0.0; d * m],
            d_o: vec![0.0; m * dv],
            d_ot: vec![0.0; dv * m],
            lse2: vec![0.0; m],
            dd: vec![0.0; m],
            k: vec![0.0; n * d],
            kt: vec![0.0; d * n],
            v: vec![0.0; n * dv],
            vt: vec![0.0; dv * n],
            p: vec![0.0; m * n],
            dx: vec![0.0; m * n],
            dxt: vec![0.0; n * m],
            lo: vec![0; m],
            hi: vec![0; m],
            acc_a: vec![0.0; n.max(m) * d],
            acc_b: vec![0.0; n * dv],
        }
    }
}

/// Where items write: the output slices (their layouts are in [`BwdOutputs`]' copy, `lay`).
struct Outs<'c, T> {
    dq: &'c mut [T],
    dk: &'c mut [T],
    dv: &'c mut [T],
}

/// What every worker of a pass shares.
struct Ctx<'c, 'a, T> {
    p: &'c Problem,
    t: CpuTiles,
    x: &'c BwdInputs<'a, T>,
    /// Layouts of dQ, dK, dV.
    lay: [Layout; 3],
    items: Vec<Item>,
    next: AtomicUsize,
    /// Each finished item writes its rows under the lock (a small fraction of its work, and
    /// safe for any output strides).
    out: Mutex<Outs<'c, T>>,
}

struct Worker<'w, 'c, 'a, T>(&'w Ctx<'c, 'a, T>);

impl<T: Element> Kernel for Worker<'_, '_, '_, T> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let cx = self.0;
        let mut sc = Scratch::new(cx.p, cx.t);
        loop {
            let i = cx.next.fetch_add(1, Ordering::Relaxed);
            let Some(&it) = cx.items.get(i) else { break };
            match it {
                Item::Kv { .. } => kv_item::<S, T>(cx, it, &mut sc),
                Item::Q { .. } => q_item::<S, T>(cx, it, &mut sc),
            }
        }
    }
}

/// Runs the backward of a validated problem whose buffers the caller checked.
pub(crate) fn backward<T: Element>(
    p: &Problem,
    t: CpuTiles,
    x: &BwdInputs<'_, T>,
    out: &mut BwdOutputs<'_, T>,
) {
    backward_on(Isa::selected(), p, t, x, out)
}

/// [`backward`] with a given instruction set (the baseline if this CPU lacks it).
pub(crate) fn backward_on<T: Element>(
    isa: Isa,
    p: &Problem,
    t: CpuTiles,
    x: &BwdInputs<'_, T>,
    out: &mut BwdOutputs<'_, T>,
) {
    let max_q = p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0);
    let max_k = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
    let t = CpuTiles {
        block_m: t.block_m.min(max_q.max(1)),
        block_n: t.block_n.min(max_k.max(1)),
    };
    // Keys of sequences without queries are owned by no item: dK = dV = 0 there. Zero all of
    // dK and dV first; items overwrite the rows they own. Every dQ row is owned by pass 2.
    zero(out.dk, &out.dk_layout);
    zero(out.dv, &out.dv_layout);
    let lay = [out.dq_layout, out.dk_layout, out.dv_layout];
    for items in [kv_items(p, t), q_items(p, t)] {
        if items.is_empty() {
            continue;
        }
        let cx = Ctx {
            p,
            t,
            x,
            lay,
            items,
            next: AtomicUsize::new(0),
            out: Mutex::new(Outs {
                dq: &mut *out.dq,
                dk: &mut *out.dk,
                dv: &mut *out.dv,
            }),
        };
        rayon::broadcast(|_| simd::dispatch_on(isa, Worker(&cx)));
    }
}

/// Sets every element a layout reaches to zero.
fn zero<T: Element>(data: &mut [T], l: &Layout) {
    let [b, s, h, d] = l.dims;
    for bi in 0..b {
        for r in 0..s {
            for hh in 0..h {
                let off = l.offset(bi, r, hh);
                data[off..off + d].fill(T::from_f32(0.0));
            }
        }
    }
}

fn kv_items(p: &Problem, t: CpuTiles) -> Vec<Item> {
    let mut out = Vec::new();
    for (seq, s) in p.sequences().iter().enumerate() {
        if s.q_len == 0 {
            continue;
        }
        for key0 in (0..s.k_len).step_by(t.block_n) {
            let keys = t.block_n.min(s.k_len - key0);
            for head in 0..p.heads_kv() {
                out.push(Item::Kv {
                    seq,
                    head,
                    key0,
                    keys,
                });
            }
        }
    }
    out
}

fn q_items(p: &Problem, t: CpuTiles) -> Vec<Item> {
    let mut out = Vec::new();
    for (seq, s) in p.sequences().iter().enumerate() {
        for row0 in (0..s.q_len).step_by(t.block_m) {
            let rows = t.block_m.min(s.q_len - row0);
            for head in 0..p.heads_q() {
                out.push(Item::Q {
                    seq,
                    head,
                    row0,
                    rows,
                });
            }
        }
    }
    out
}

/// `C[r][j] (init)= Σ_{p<k} A[p·lda + r] · B[p·ldb + j]` for `r < m`, `j < n`: A by columns
/// (its transpose stored row-major), with the forward's register-blocked microkernels. `init`
/// is [`Init::Zero`] (overwrite) or [`Init::Add`] (accumulate into C).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemm<S: Simd>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    init: Init,
) {
    let mut r0 = 0;
    while r0 + S::MR <= m {
        let (a, c) = (&a[r0..], &mut c[r0 * ldc..]);
        let mut c0 = 0;
        while c0 + S::NR <= n {
            S::cols_mn(k, a, lda, &b[c0..], ldb, &mut c[c0..], ldc, init);
            c0 += S::NR;
        }
        while c0 + S::LANES <= n {
            S::cols_mw(k, a, lda, &b[c0..], ldb, &mut c[c0..], ldc, init);
            c0 += S::LANES;
        }
        for c0 in c0..n {
            S::cols_m1(k, a, lda, &b[c0..], ldb, &mut c[c0..], ldc, init);
        }
        r0 += S::MR;
    }
    for r in r0..m {
        let (a, c) = (&a[r..], &mut c[r * ldc..]);
        let mut c0 = 0;
        while c0 + S::NR <= n {
            S::cols_1n(k, a, lda, &b[c0..], ldb, &mut c[c0..], ldc, init);
            c0 += S::NR;
        }
        while c0 + S::LANES <= n {
            S::cols_1w(k, a, lda, &b[c0..], ldb, &mut c[c0..], ldc, init);
            c0 += S::LANES;
        }
        for c0 in c0..n {
            S::cols_11(k, a, lda, &b[c0..], ldb, &mut c[c0..], ldc, init);
        }
    }
}

/// `y += a · x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Whether every element of the first `len` of `x` is finite.
#[inline(always)]
fn all_finite(x: &[f32], len: usize) -> bool {
    x[..len].iter().all(|v| v.is_finite())
}

/// Loads query rows `row0..row0 + m` of head `h`: Q and Qᵀ, dO and dOᵀ, LSE·log2e and
/// `D = dO·O`.
#[inline(always)]
fn load_q<T: Element>(
    cx: &Ctx<'_, '_, T>,
    s: &Sequence,
    h: usize,
    row0: usize,
    m: usize,
    sc: &mut Scratch,
) {
    let p = cx.p;
    let x = cx.x;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    for i in 0..m {
        let r = s.q_start + row0 + i;
        let qo = p.q_layout().offset(s.batch_index, r, h);
        for (dst, e) in sc.q[i * d..(i + 1) * d].iter_mut().zip(&x.q[qo..qo + d]) {
            *dst = e.to_f32();
        }
        let go = x.d_out_layout.offset(s.batch_index, r, h);
        let oo = p.o_layout().offset(s.batch_index, r, h);
        let mut dd = 0f32;
        let row = &mut sc.d_o[i * dv..(i + 1) * dv];
        for ((dst, g), o) in row
            .iter_mut()
            .zip(&x.d_out[go..go + dv])
            .zip(&x.o[oo..oo + dv])
        {
            *dst = g.to_f32();
            dd += *dst * o.to_f32();
        }
        sc.dd[i] = dd;
        sc.lse2[i] = x.lse[p.lse_offset(s, h, row0 + i)] * LOG2E;
    }
    transpose(&sc.q, m, d, &mut sc.qt);
    transpose(&sc.d_o, m, dv, &mut sc.d_ot);
}

/// `dst[c·rows + r] = src[r·cols + c]`, 16 rows at a time so that every store runs along a
/// cache line (row by row, each store of a 96-row tile's transpose touched a new line: loads
/// and transposes were a fifth of the backward's time in `perf`).
#[inline(always)]
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    const RB: usize = 16;
    for r0 in (0..rows).step_by(RB) {
        let nr = RB.min(rows - r0);
        for c in 0..cols {
            let out = &mut dst[c * rows + r0..c * rows + r0 + nr];
            for (rr, o) in out.iter_mut().enumerate() {
                *o = src[(r0 + rr) * cols + c];
            }
        }
    }
}

/// Loads keys `key0..key0 + n` of KV head `hk`: K, Kᵀ, V and Vᵀ.
#[inline(always)]
fn load_kv<T: Element>(
    cx: &Ctx<'_, '_, T>,
    s: &Sequence,
    hk: usize,
    key0: usize,
    n: usize,
    sc: &mut Scratch,
) {
    let p = cx.p;
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    for j in 0..n {
        let r = s.k_start + key0 + j;
        let ko = p.k_layout().offset(s.batch_index, r, hk);
        for (dst, e) in sc.k[j * d..(j + 1) * d].iter_mut().zip(&cx.x.k[ko..ko + d]) {
            *dst = e.to_f32();
        }
        let vo = p.v_layout().offset(s.batch_index, r, hk);
        for (dst, e) in sc.v[j * dv..(j + 1) * dv]
            .iter_mut()
            .zip(&cx.x.v[vo..vo + dv])
        {
            *dst = e.to_f32();
        }
    }
    transpose(&sc.k, n, d, &mut sc.kt);
    transpose(&sc.v, n, dv, &mut sc.vt);
}

/// Sets each row's allowed local keys `lo[i]..hi[i]` of the tile `rows × keys`.
#[inline(always)]
fn ranges(
    mask: &SeqMask,
    kind: TileKind,
    rows: Range<usize>,
    keys: Range<usize>,
    sc: &mut Scratch,
) {
    for (i, r) in rows.enumerate() {
        let (lo, hi) = if kind == TileKind::Free {
            (0, keys.len())
        } else {
            let kr = mask.key_range(r);
            let lo = kr.start.clamp(keys.start, keys.end) - keys.start;
            let hi = kr.end.clamp(keys.start, keys.end) - keys.start;
            (lo, hi.max(lo))
        };
        sc.lo[i] = lo;
        sc.hi[i] = hi;
    }
}

/// `min(x, 0)`, keeping a NaN: the exponent `s·log2e − LSE·log2e` of `P = exp(s − LSE)`.
///
/// `s ≤ LSE` holds exactly, so `P ≤ 1`, but the two terms are rounded separately: at scores of
/// 1e30 (a finite input, e.g. `--scale 1e30`) their difference is off by ulps of 1e30, and
/// `exp2` of that overflows to +∞, whose product with a zero `dP − D` is NaN where the
/// gradient is finite. Clamping the exponent at 0 keeps `P` in `[0, 1]` as the math says, and
/// costs one `minss`; an ordinary row's `P` moves by at most the rounding it had. A NaN score
/// (or `+∞ − +∞` after a +∞ score) stays NaN: `0 < NaN` is false.
#[inline(always)]
fn at_most_zero(x: f32) -> f32 {
    if 0.0 < x {
        0.0
    } else {
        x
    }
}

/// One tile of `m` loaded query rows × `n` loaded keys: `P` into `sc.p` and `dX` (the gradient
/// of the raw products `q·k`) into `sc.dx`, both `m × n` and 0 outside each row's allowed keys.
#[inline(always)]
fn tile<S: Simd>(p: &Problem, m: usize, n: usize, sc: &mut Scratch) {
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let scale = p.scale();
    let cap = p.softcap();
    // S = Q·Kᵀ and dP = dO·Vᵀ, A given transposed.
    gemm::<S>(m, n, d, &sc.qt, m, &sc.kt, n, &mut sc.p, n, Init::Zero);
    gemm::<S>(m, n, dv, &sc.d_ot, m, &sc.vt, n, &mut sc.dx, n, Init::Zero);
    for i in 0..m {
        let (lo, hi) = (sc.lo[i], sc.hi[i]);
        let (lse2, dd) = (sc.lse2[i], sc.dd[i]);
        let prow = &mut sc.p[i * n..(i + 1) * n];
        let xrow = &mut sc.dx[i * n..(i + 1) * n];
        prow[..lo].fill(0.0);
        prow[hi..].fill(0.0);
        xrow[..lo].fill(0.0);
        xrow[hi..].fill(0.0);
        let (prow, xrow) = (&mut prow[lo..hi], &mut xrow[lo..hi]);
        match cap {
            None => {
                for (s, dp) in prow.iter_mut().zip(xrow.iter_mut()) {
                    let pij = exp2::<S>(at_most_zero(S::fmadd(*s * scale, LOG2E, -lse2)));
                    *s = pij;
                    *dp = pij * (*dp - dd) * scale;
                }
            }
            Some(c) => {
                // s = c·tanh(x/c), ds/dx = 1 − tanh²(x/c).
                for (s, dp) in prow.iter_mut().zip(xrow.iter_mut()) {
                    let t = (*s * scale / c).tanh();
                    let pij = exp2::<S>(at_most_zero(S::fmadd(c * t, LOG2E, -lse2)));
                    *s = pij;
                    *dp = pij * (*dp - dd) * (1.0 - t * t) * scale;
                }
            }
        }
    }
}

/// Pass 1: dK and dV of one key block of one KV head.
#[inline(always)]
fn kv_item<S: Simd, T: Element>(cx: &Ctx<'_, '_, T>, it: Item, sc: &mut Scratch) {
    let Item::Kv {
        seq,
        head: hk,
        key0,
        keys: n,
    } = it
    else {
        return;
    };
    let p = cx.p;
    let s = &p.sequences()[seq];
    let mask = p.seq_mask(s);
    let (d, dv, g, bm) = (p.head_dim(), p.head_dim_v(), p.group(), cx.t.block_m);
    let keys = key0..key0 + n;
    load_kv(cx, s, hk, key0, n, sc);
    sc.acc_a[..n * d].fill(0.0);
    sc.acc_b[..n * dv].fill(0.0);
    for h in hk * g..(hk + 1) * g {
        for row0 in (0..s.q_len).step_by(bm) {
            let m = bm.min(s.q_len - row0);
            let rows = row0..row0 + m;
            let kind = mask.tile_kind(rows.clone(), keys.clone());
            if kind == TileKind::Masked {
                continue;
            }
            load_q(cx, s, h, row0, m, sc);
            ranges(&mask, kind, rows, keys.clone(), sc);
            tile::<S>(p, m, n, sc);
            // Masked pairs hold P = dX = 0, but 0 · NaN is NaN: where a partial tile's Q or dO
            // is not all finite, each row adds only its own keys.
            if kind == TileKind::Free || (all_finite(&sc.q, m * d) && all_finite(&sc.d_o, m * dv)) {
                // dV += Pᵀ·dO, dK += dXᵀ·Q.
                gemm::<S>(
                    n,
                    dv,
                    m,
                    &sc.p,
                    n,
                    &sc.d_o,
                    dv,
                    &mut sc.acc_b,
                    dv,
                    Init::Add,
                );
                gemm::<S>(n, d, m, &sc.dx, n, &sc.q, d, &mut sc.acc_a, d, Init::Add);
            } else {
                for i in 0..m {
                    let (q_i, do_i) = (&sc.q[i * d..(i + 1) * d], &sc.d_o[i * dv..(i + 1) * dv]);
                    for j in sc.lo[i]..sc.hi[i] {
                        axpy(&mut sc.acc_b[j * dv..(j + 1) * dv], sc.p[i * n + j], do_i);
                        axpy(&mut sc.acc_a[j * d..(j + 1) * d], sc.dx[i * n + j], q_i);
                    }
                }
            }
        }
    }
    let [_, kl, vl] = cx.lay;
    // A poisoned lock only means another worker panicked; these rows are this item's own.
    let mut out = cx.out.lock().unwrap_or_else(|e| e.into_inner());
    for j in 0..n {
        let r = s.k_start + key0 + j;
        let o = kl.offset(s.batch_index, r, hk);
        for (dst, &x) in out.dk[o..o + d].iter_mut().zip(&sc.acc_a[j * d..]) {
            *dst = T::from_f32(x);
        }
        let o = vl.offset(s.batch_index, r, hk);
        for (dst, &x) in out.dv[o..o + dv].iter_mut().zip(&sc.acc_b[j * dv..]) {
            *dst = T::from_f32(x);
        }
    }
}

/// Pass 2: dQ of one query block of one query head.
#[inline(always)]
fn q_item<S: Simd, T: Element>(cx: &Ctx<'_, '_, T>, it: Item, sc: &mut Scratch) {
    let Item::Q {
        seq,
        head: h,
        row0,
        rows: m,
    } = it
    else {
        return;
    };
    let p = cx.p;
    let s = &p.sequences()[seq];
    let mask = p.seq_mask(s);
    let (d, bn) = (p.head_dim(), cx.t.block_n);
    let hk = h / p.group();
    let rows = row0..row0 + m;
    load_q(cx, s, h, row0, m, sc);
    sc.acc_a[..m * d].fill(0.0);
    for kb in mask.key_blocks(rows.clone(), bn) {
        let keys = kb * bn..((kb + 1) * bn).min(s.k_len);
        let kind = mask.tile_kind(rows.clone(), keys.clone());
        if kind == TileKind::Masked {
            continue;
        }
        let n = keys.len();
        load_kv(cx, s, hk, keys.start, n, sc);
        ranges(&mask, kind, rows.clone(), keys, sc);
        tile::<S>(p, m, n, sc);
        if kind == TileKind::Free || all_finite(&sc.k, n * d) {
            // dQ += dX·K, with dX transposed for the microkernel (O(tile), against the
            // product's O(tile · head_dim)).
            for i in 0..m {
                for j in 0..n {
                    sc.dxt[j * m + i] = sc.dx[i * n + j];
                }
            }
            gemm::<S>(m, d, n, &sc.dxt, m, &sc.k, d, &mut sc.acc_a, d, Init::Add);
        } else {
            for i in 0..m {
                let dq_i = &mut sc.acc_a[i * d..(i + 1) * d];
                for j in sc.lo[i]..sc.hi[i] {
                    axpy(dq_i, sc.dx[i * n + j], &sc.k[j * d..(j + 1) * d]);
                }
            }
        }
    }
    let [ql, _, _] = cx.lay;
    let mut out = cx.out.lock().unwrap_or_else(|e| e.into_inner());
    for i in 0..m {
        let o = ql.offset(s.batch_index, s.q_start + row0 + i, h);
        for (dst, &x) in out.dq[o..o + d].iter_mut().zip(&sc.acc_a[i * d..]) {
            *dst = T::from_f32(x);
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::check::grad::{check_grads, GradReport, GradsView};
    use crate::check::random_qkv;
    use crate::mask::Mask;
    use crate::problem::Options;

    /// Where to put a non-finite value: (tensor, row, value).
    #[derive(Clone, Copy)]
    enum Bad {
        None,
        Q(usize, f32),
        K(usize, f32),
        V(usize, f32),
        DOut(usize, f32),
    }

    /// One random problem (4 query heads on 2 KV heads) through the forward and the backward on
    /// `isa` with `tiles`, judged by the gradient rule.
    fn case<T: Element>(
        isa: Isa,
        shape: (usize, usize, usize, usize),
        mask: Mask,
        tiles: CpuTiles,
        bad: Bad,
    ) -> GradReport {
        case_counted::<T>(isa, shape, mask, tiles, bad).0
    }

    /// [`case`], and how many gradient elements came out non-finite.
    fn case_counted<T: Element>(
        isa: Isa,
        (sq, sk, d, dv): (usize, usize, usize, usize),
        mask: Mask,
        tiles: CpuTiles,
        bad: Bad,
    ) -> (GradReport, usize) {
        let l = |s: usize, h: usize, w: usize| Layout::new("t", &[1, s, h, w], None).unwrap();
        let (ql, kl, vl, ol) = (l(sq, 4, d), l(sk, 2, d), l(sk, 2, dv), l(sq, 4, dv));
        let opts = Options::new().mask(mask).softcap(8.0);
        let p = Problem::new(T::DTYPE, &ql, &kl, &vl, &ol, None, None, &opts).unwrap();
        let mut rng = StdRng::seed_from_u64((sq * 7 + sk * 3 + d) as u64);
        let (mut q, mut k, mut v) = (
            vec![T::NAN; ql.numel()],
            vec![T::NAN; kl.numel()],
            vec![T::NAN; vl.numel()],
        );
        random_qkv(&mut rng, &mut q, &mut k, &mut v, d, dv);
        let mut d_out = vec![T::NAN; ol.numel()];
        crate::check::random_fill(&mut rng, &mut d_out, dv, 1.0);
        match bad {
            Bad::None => {}
            Bad::Q(r, x) => q[r * 4 * d + 1] = T::from_f32(x),
            Bad::K(r, x) => k[r * 2 * d + 2] = T::from_f32(x),
            Bad::V(r, x) => v[r * 2 * dv] = T::from_f32(x),
            Bad::DOut(r, x) => d_out[r * 4 * dv + 3] = T::from_f32(x),
        }
        let mut o = vec![T::NAN; ol.numel()];
        let mut lse = vec![f32::NAN; p.lse_len()];
        super::super::tiled::forward_on(isa, &p, tiles, &q, &k, &v, &mut o, Some(&mut lse));
        let (mut dq, mut dk, mut dvv) = (
            vec![T::NAN; q.len()],
            vec![T::NAN; k.len()],
            vec![T::NAN; v.len()],
        );
        let x = BwdInputs {
            q: &q,
            k: &k,
            v: &v,
            o: &o,
            lse: &lse,
            d_out: &d_out,
            d_out_layout: ol,
        };
        let mut out = BwdOutputs {
            dq: &mut dq,
            dq_layout: ql,
            dk: &mut dk,
            dk_layout: kl,
            dv: &mut dvv,
            dv_layout: vl,
        };
        backward_on(isa, &p, tiles, &x, &mut out);
        let got = GradsView {
            dq: (&dq, &ql),
            dk: (&dk, &kl),
            dv: (&dvv, &vl),
        };
        let n = dq
            .iter()
            .chain(&dk)
            .chain(&dvv)
            .filter(|x| !x.to_f32().is_finite())
            .count();
        (check_grads(&p, &q, &k, &v, &o, &d_out, &ol, got), n)
    }

    const T96: CpuTiles = CpuTiles {
        block_m: 96,
        block_n: 96,
    };

    #[test]
    fn every_instruction_set_and_odd_tiles_pass() {
        let masks = [
            Mask::None,
            Mask::Causal,
            Mask::Window {
                left: Some(20),
                right: Some(3),
            },
        ];
        let odd = CpuTiles {
            block_m: 17,
            block_n: 13,
        };
        for isa in Isa::all_available() {
            for mask in masks {
                for t in [T96, odd] {
                    for shape in [(150, 150, 40, 40), (40, 130, 33, 20)] {
                        let r = case::<f32>(isa, shape, mask, t, Bad::None);
                        assert!(r.passed(), "{isa:?} {mask:?} {t:?} {shape:?}: {r}");
                        let r = case::<bf16>(isa, shape, mask, t, Bad::None);
                        assert!(r.passed(), "bf16 {isa:?} {mask:?} {t:?} {shape:?}: {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn non_finite_inputs_reach_only_what_the_formula_says() {
        // Row / key 100 sits inside a diagonal (partial) tile of the causal mask, so both the
        // whole-tile products and the per-row fallback are exercised.
        for isa in Isa::all_available() {
            for x in [f32::NAN, f32::INFINITY] {
                for bad in [
                    Bad::Q(100, x),
                    Bad::K(100, x),
                    Bad::V(100, x),
                    Bad::DOut(100, x),
                ] {
                    let (r, n) =
                        case_counted::<f32>(isa, (150, 150, 32, 24), Mask::Causal, T96, bad);
                    assert!(r.passed(), "{isa:?} {x}: {r}");
                    // The poison reached some gradients but not all (else the test is vacuous
                    // or the poison spread past the rows that see it).
                    let total: usize = r.tensors.iter().map(|t| t.elements).sum();
                    assert!(
                        n > 0 && n < total / 2,
                        "{isa:?} {x}: {n} of {total} non-finite"
                    );
                }
            }
        }
    }
}
