//! Tiled online-softmax attention on the CPU.
//!
//! A work item is one block of `block_m` query rows of one head of one sequence. For each key
//! block the mask lets it see (fully masked blocks are skipped without work, see
//! [`SeqMask::key_blocks`] and [`SeqMask::tile_kind`]), an item computes
//!
//! 1. `Sᵀ = K · (scale·Q)ᵀ`, a `block_n × block_m` tile, with the register-blocked GEMM
//!    microkernel: keys are rows, so the softmax statistics of a query are a column and every
//!    later step runs down columns with full vectors and no horizontal reductions;
//! 2. on partial tiles only, masked scores set to −∞ (fully allowed tiles have no per-element
//!    mask work at all); on partial tiles both GEMMs also leave out the register tiles the mask
//!    removes, so a causal diagonal tile costs about half a tile;
//! 3. the online softmax: new row maxima, the rescale factor of the old accumulator,
//!    `P = exp2(s·log2e − max·log2e)` with a vectorised polynomial, row sums;
//! 4. `O = O·rescale + P·V` with the microkernel, the rescale fused into its accumulator load.
//!
//! Scores stay in natural-log units: the maximum is subtracted in log2 units inside one FMA,
//! `exp2(fma(s, log2e, −shift))` with `shift = round_f32(max·log2e)`, and
//! `LSE = (shift + log2 sum) / log2e` is formed in f64. The shift's rounding cancels exactly
//! (O is normalised by the same sum, LSE adds back the same shift), but it grows with the
//! maximum: past [`FAST_MAX_SCORE`] it would scale a row's P by up to 2^±ulp/2 and overflow or
//! flush it (scores of 1e12 gave NaN rows, 1e9 rows of zeros). Softmax chunks holding such a
//! row use `exp2((s − max)·log2e)` instead, exact for any finite scores; ordinary inputs never
//! take that path, and the test for it is one comparison per row and key tile.
//!
//! Everything is f32 inside; 16-bit K and V tiles are widened once per tile, f32 ones are read
//! in place. Each thread owns O(tile) scratch. Items run longest first from a shared counter
//! (greedy longest-processing-time scheduling: the items of a causal problem differ in cost), and
//! each finished item writes its rows of O and LSE under a mutex (the write is a small fraction
//! of the item's work, and keeps the output code safe for any output strides).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::micro::{exp2, FAST_MAX_SCORE, LOG2E};
use super::plan::CpuTiles;
use super::simd::{self, Init, Isa, Kernel, Simd};
use crate::dtype::DType;
use crate::mask::{SeqMask, TileKind};
use crate::problem::{Problem, Sequence};
use crate::tensor::Element;

/// Inner-dimension block of the score GEMM. Each block starts from zero and is added to the
/// tile ([`Init::Add`]), and the score microkernel splits a block over two accumulator banks,
/// so no rounding chain is longer than 32 products. Measured on 22 022 random f32 cases
/// (`fa4 check --dtype f32 --seed …`), the LSE bound (1e-5) failed in 5 with this; in 12 with
/// blocks of 128 (7% faster at d = 128) and in 18 with one bank and blocks of 64. One chain over
/// all of d failed in 20 of 3 927, the first scalar version (8 accumulators) in 1 of 3 927.
const KC: usize = 64;

/// One work item: a block of query rows of one head of one sequence.
#[derive(Debug, Clone, Copy)]
struct Item {
    seq: usize,
    head: usize,
    row0: usize,
    rows: usize,
    /// Allowed-tile area (query rows × keys), the scheduling weight.
    cost: usize,
}

fn items(p: &Problem, t: CpuTiles) -> Vec<Item> {
    let mut out = Vec::new();
    for (seq, s) in p.sequences().iter().enumerate() {
        let m = p.seq_mask(s);
        for row0 in (0..s.q_len).step_by(t.block_m) {
            let rows = t.block_m.min(s.q_len - row0);
            let range = row0..row0 + rows;
            let cost: usize = m
                .key_blocks(range.clone(), t.block_n)
                .map(|kb| kb * t.block_n..((kb + 1) * t.block_n).min(s.k_len))
                .filter(|keys| m.tile_kind(range.clone(), keys.clone()) != TileKind::Masked)
                .map(|keys| rows * keys.len())
                .sum();
            for head in 0..p.heads_q() {
                out.push(Item {
                    seq,
                    head,
                    row0,
                    rows,
                    cost,
                });
            }
        }
    }
    // Longest first; among equals, one head's row blocks in a row, so that the threads stream
    // the same K and V at about the same time (one thread, seqlen 2048, 4 heads, d = 128:
    // 93 GFLOP/s against 86 when cycling through the heads).
    out.sort_by_key(|it| (std::cmp::Reverse(it.cost), it.seq, it.head, it.row0));
    out
}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

/// Query columns per step of the softmax passes: running statistics of `CHUNK` queries stay in
/// registers while a pass walks down the keys.
const CHUNK: usize = 16;

/// Per-thread scratch, O(tile): all f32.
struct Scratch {
    /// Multiple every query extent is rounded to: whole register tiles of both GEMMs and whole
    /// softmax chunks.
    align: usize,
    /// Leading dimension over queries of `qt` and `st`, and rows of `o`: `block_m` rounded up
    /// to `align`.
    ld: usize,
    /// `(scale·Q)ᵀ`: `head_dim × ld`.
    qt: Vec<f32>,
    /// Scores, then probabilities, transposed: `block_n × ld`.
    st: Vec<f32>,
    /// K tile widened from 16 bits: `block_n × head_dim` (empty for f32, read in place).
    kt: Vec<f32>,
    /// O accumulator: `ld × head_dim_v`.
    o: Vec<f32>,
    /// V tile widened from 16 bits: `block_n × head_dim_v` (empty for f32, read in place).
    vt: Vec<f32>,
    /// Running maximum score per query (natural log units; −∞ before any allowed key).
    mx: Vec<f32>,
    /// The shift in effect, per softmax chunk's form (see [`Scratch::exact`]): `round(mx·log2e)`
    /// in the fast form, `mx` itself in the exact form (0 while `mx` is not finite).
    ml: Vec<f32>,
    /// The shift in log2 units, exactly (`ml`, or `mx·log2e` in f64): for the rescale and LSE.
    sh: Vec<f64>,
    /// Per softmax chunk of the current tile: whether it uses the exact form
    /// `exp2((s − mx)·log2e)` (a row's maximum beyond [`FAST_MAX_SCORE`]).
    exact: Vec<bool>,
    /// Running sum of P, `2^(s·log2e − sh)` in either form.
    l: Vec<f32>,
    /// New running maximum.
    mt: Vec<f32>,
    /// Rescale factor of the old accumulator.
    corr: Vec<f32>,
    /// Tile row sums.
    ls: Vec<f32>,
}

impl Scratch {
    fn new<S: Simd>(p: &Problem, t: CpuTiles, wide: bool) -> Scratch {
        let (d, dv) = (p.head_dim(), p.head_dim_v());
        let align = lcm(lcm(S::SNR, S::MR), CHUNK);
        let ld = round_up(t.block_m, align);
        let kv = if wide { t.block_n } else { 0 };
        Scratch {
            align,
            ld,
            qt: vec![0.0; d * ld],
            st: vec![0.0; t.block_n * ld],
            kt: vec![0.0; kv * d],
            o: vec![0.0; ld * dv],
            vt: vec![0.0; kv * dv],
            mx: vec![0.0; ld],
            ml: vec![0.0; ld],
            sh: vec![0.0; ld],
            exact: vec![false; ld / CHUNK],
            l: vec![0.0; ld],
            mt: vec![0.0; ld],
            corr: vec![0.0; ld],
            ls: vec![0.0; ld],
        }
    }
}

/// The outputs, written by one finished item at a time.
struct Outputs<'a, T> {
    o: &'a mut [T],
    lse: Option<&'a mut [f32]>,
}

/// What every worker shares.
struct Ctx<'a, T> {
    p: &'a Problem,
    t: CpuTiles,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    items: Vec<Item>,
    next: AtomicUsize,
    out: Mutex<Outputs<'a, T>>,
}

/// One worker thread: takes items from the shared counter until none are left.
struct Worker<'c, 'a, T>(&'c Ctx<'a, T>);

impl<T: Element> Kernel for Worker<'_, '_, T> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let cx = self.0;
        let wide = T::DTYPE != DType::F32;
        let mut sc = Scratch::new::<S>(cx.p, cx.t, wide);
        loop {
            let i = cx.next.fetch_add(1, Ordering::Relaxed);
            let Some(&it) = cx.items.get(i) else { break };
            compute::<S, T>(cx, it, &mut sc);
            write(cx, it, &sc);
        }
    }
}

/// Runs a validated problem with the instruction set [`Isa::selected`].
pub(crate) fn forward<T: Element>(
    p: &Problem,
    t: CpuTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
) {
    forward_on(Isa::selected(), p, t, q, k, v, out, lse)
}

/// Runs a validated problem with a given instruction set (the baseline if this CPU lacks it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_on<T: Element>(
    isa: Isa,
    p: &Problem,
    t: CpuTiles,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
) {
    // Tiles larger than the longest sequence only cost scratch memory.
    let max_q = p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0);
    let max_k = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
    let t = CpuTiles {
        block_m: t.block_m.min(max_q.max(1)),
        block_n: t.block_n.min(max_k.max(1)),
    };
    let cx = Ctx {
        p,
        t,
        q,
        k,
        v,
        items: items(p, t),
        next: AtomicUsize::new(0),
        out: Mutex::new(Outputs { o: out, lse }),
    };
    if cx.items.is_empty() {
        return;
    }
    rayon::broadcast(|_| simd::dispatch_on(isa, Worker(&cx)));
}

/// Where a partial tile sits, so that the register tiles of both GEMMs can leave out what the
/// mask removes (on a causal diagonal tile, about half of the work).
#[derive(Clone, Copy)]
struct Part<'a> {
    mask: &'a SeqMask,
    /// First query row of the item and its rows.
    row0: usize,
    rows: usize,
    /// The tile's keys.
    keys: &'a std::ops::Range<usize>,
}

impl Part<'_> {
    /// Real query rows among the item's local rows `i..i + ni`.
    #[inline(always)]
    fn rows(&self, i: usize, ni: usize) -> std::ops::Range<usize> {
        let end = (i + ni).min(self.rows);
        self.row0 + i.min(end)..self.row0 + end
    }

    /// Whether local keys `j..j + nj` × local queries `i..i + ni` hold no allowed element.
    #[inline(always)]
    fn masked(&self, j: usize, nj: usize, i: usize, ni: usize) -> bool {
        let rows = self.rows(i, ni);
        let k0 = self.keys.start;
        rows.is_empty() || self.mask.tile_kind(rows, k0 + j..k0 + j + nj) == TileKind::Masked
    }

    /// The local keys any of local queries `i..i + ni` may attend to.
    #[inline(always)]
    fn keys_of(&self, i: usize, ni: usize) -> (usize, usize) {
        let span = self.mask.key_span(self.rows(i, ni));
        let (k0, k1) = (self.keys.start, self.keys.end);
        let lo = span.start.clamp(k0, k1) - k0;
        let hi = span.end.clamp(k0, k1) - k0;
        (lo, hi.max(lo))
    }
}

/// One register tile of [`scores`]: keys `j..` (`SMR` of them, or 1 at the end), queries
/// `i0..i0 + SNR`; returns the keys it covered.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_tile<S: Simd, A: Element>(
    d: usize,
    n: usize,
    kr: &[A],
    ldk: usize,
    qt: &[f32],
    ld: usize,
    st: &mut [f32],
    part: Option<Part<'_>>,
    j: usize,
    i0: usize,
) -> usize {
    let full = j + S::SMR <= n;
    let nj = if full { S::SMR } else { 1 };
    // Left unwritten: the mask step sets every masked score to −∞.
    if part.is_some_and(|pt| pt.masked(j, nj, i0, S::SNR)) {
        return nj;
    }
    for p0 in (0..d).step_by(KC) {
        let kc = KC.min(d - p0);
        let init = if p0 == 0 { Init::Zero } else { Init::Add };
        let (a, b) = (&kr[j * ldk + p0..], &qt[p0 * ld + i0..]);
        let c = &mut st[j * ld + i0..];
        if full {
            S::scores_mn(kc, a, ldk, b, ld, c, ld, init);
        } else {
            S::scores_1n(kc, a, ldk, b, ld, c, ld, init);
        }
    }
    nj
}

/// `Sᵀ[j][i] = Σ_p K[j][p] · Qᵀ[p][i]` for `j < n` keys (rows of `kr`, stride `ldk`) and
/// `i < width` (a multiple of `SNR`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scores<S: Simd, A: Element>(
    d: usize,
    n: usize,
    kr: &[A],
    ldk: usize,
    qt: &[f32],
    ld: usize,
    width: usize,
    st: &mut [f32],
    part: Option<Part<'_>>,
) {
    // Query strips outside, key groups inside: the strip of Qᵀ (d × SNR) stays in L1 while the
    // K rows stream past it (measured 1–4% faster than the other order, AVX2 and AVX-512).
    for i0 in (0..width).step_by(S::SNR) {
        let mut j = 0;
        while j < n {
            j += score_tile::<S, A>(d, n, kr, ldk, qt, ld, st, part, j, i0);
        }
    }
}

/// `O[r][c] = O[r][c]·corr[r] + Σ_{j<n} P[j][r] · V[j][c]` for `r < rows` (a multiple of `MR`),
/// all `c < dv`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv<S: Simd, B: Element>(
    n: usize,
    st: &[f32],
    ld: usize,
    rows: usize,
    vr: &[B],
    ldv: usize,
    dv: usize,
    o: &mut [f32],
    corr: &[f32],
    part: Option<Part<'_>>,
) {
    for r0 in (0..rows).step_by(S::MR) {
        let init = Init::Scale(&corr[r0..]);
        // Keys outside the row tile's span have P = 0 (and V is finite here): leave them out.
        let (j0, j1) = match part.map_or((0, n), |pt| pt.keys_of(r0, S::MR)) {
            (j0, j1) if j0 < j1 => (j0, j1),
            _ => (0, 0),
        };
        let (n, st, vr) = (j1 - j0, &st[j0 * ld..], &vr[j0 * ldv..]);
        let mut c0 = 0;
        while c0 + S::NR <= dv {
            S::cols_mn(
                n,
                &st[r0..],
                ld,
                &vr[c0..],
                ldv,
                &mut o[r0 * dv + c0..],
                dv,
                init,
            );
            c0 += S::NR;
        }
        while c0 + S::LANES <= dv {
            S::cols_mw(
                n,
                &st[r0..],
                ld,
                &vr[c0..],
                ldv,
                &mut o[r0 * dv + c0..],
                dv,
                init,
            );
            c0 += S::LANES;
        }
        for c0 in c0..dv {
            S::cols_m1(
                n,
                &st[r0..],
                ld,
                &vr[c0..],
                ldv,
                &mut o[r0 * dv + c0..],
                dv,
                init,
            );
        }
    }
}

/// [`pv`] for one query row over its own keys `j0..j1` of the tile: used on partial tiles whose
/// V holds non-finite values, so that a masked key's `0 · NaN` cannot reach the row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pv_row<S: Simd, B: Element>(
    r: usize,
    j0: usize,
    j1: usize,
    st: &[f32],
    ld: usize,
    vr: &[B],
    ldv: usize,
    dv: usize,
    o: &mut [f32],
    corr: &[f32],
) {
    let n = j1 - j0;
    let init = Init::Scale(&corr[r..]);
    let a = &st[j0 * ld + r..];
    let b = &vr[j0 * ldv..];
    let mut c0 = 0;
    while c0 + S::NR <= dv {
        S::cols_1n(n, a, ld, &b[c0..], ldv, &mut o[r * dv + c0..], dv, init);
        c0 += S::NR;
    }
    while c0 + S::LANES <= dv {
        S::cols_1w(n, a, ld, &b[c0..], ldv, &mut o[r * dv + c0..], dv, init);
        c0 += S::LANES;
    }
    for c0 in c0..dv {
        S::cols_11(n, a, ld, &b[c0..], ldv, &mut o[r * dv + c0..], dv, init);
    }
}

/// Widens `n` rows of `width` elements (row stride `ld`) into a contiguous f32 tile.
#[inline(always)]
fn widen<T: Element>(src: &[T], ld: usize, n: usize, width: usize, dst: &mut [f32]) {
    for j in 0..n {
        let s = &src[j * ld..j * ld + width];
        for (d, x) in dst[j * width..(j + 1) * width].iter_mut().zip(s) {
            *d = x.to_f32();
        }
    }
}

/// Whether every element of `n` rows of `width` (row stride `ld`) is finite.
#[inline(always)]
fn all_finite<T: Element>(src: &[T], ld: usize, n: usize, width: usize) -> bool {
    (0..n).all(|j| {
        src[j * ld..j * ld + width]
            .iter()
            .all(|x| x.to_f32().is_finite())
    })
}

/// Computes one item into the scratch's `o` (normalised) and `l` (replaced by LSE).
#[inline(always)]
fn compute<S: Simd, T: Element>(cx: &Ctx<'_, T>, it: Item, sc: &mut Scratch) {
    let p = cx.p;
    let s: &Sequence = &p.sequences()[it.seq];
    let (d, dv) = (p.head_dim(), p.head_dim_v());
    let hk = it.head / p.group();
    let m: SeqMask = p.seq_mask(s);
    let bn = cx.t.block_n;
    let ld = sc.ld;
    let rows = it.rows;
    let range = it.row0..it.row0 + rows;
    // Queries are processed in whole register tiles and softmax chunks: the padding columns
    // hold zero queries and their results are never read.
    let width = round_up(rows, sc.align);
    let softcap = p.softcap();
    let wide = T::DTYPE != DType::F32;
    let (ql, kl, vl) = (p.q_layout(), p.k_layout(), p.v_layout());

    // (scale·Q)ᵀ, 16 query rows at a time so that the stores run along `ld`.
    let scale = p.scale();
    const QROWS: usize = 16;
    for r0 in (0..width).step_by(QROWS) {
        let mut src: [&[T]; QROWS] = [&[]; QROWS];
        for (rr, row) in src.iter_mut().enumerate() {
            if r0 + rr < rows {
                let off = ql.offset(s.batch_index, s.q_start + it.row0 + r0 + rr, it.head);
                *row = &cx.q[off..off + d];
            }
        }
        for c in 0..d {
            let dst = &mut sc.qt[c * ld + r0..c * ld + r0 + QROWS];
            for (x, row) in dst.iter_mut().zip(&src) {
                *x = row.get(c).map_or(0.0, |q| q.to_f32() * scale);
            }
        }
    }
    sc.mx[..width].fill(f32::NEG_INFINITY);
    sc.ml[..width].fill(0.0);
    sc.sh[..width].fill(0.0);
    sc.l[..width].fill(0.0);
    sc.o[..width * dv].fill(0.0);

    let (ldk, ldv) = (kl.strides[1], vl.strides[1]);
    for kb in m.key_blocks(range.clone(), bn) {
        let keys = kb * bn..((kb + 1) * bn).min(s.k_len);
        let kind = m.tile_kind(range.clone(), keys.clone());
        if kind == TileKind::Masked {
            continue;
        }
        let n = keys.len();
        let koff = kl.offset(s.batch_index, s.k_start + keys.start, hk);
        let voff = vl.offset(s.batch_index, s.k_start + keys.start, hk);

        // 1. Sᵀ = K · Qᵀ, K read in place (f32) or widened first (16-bit).
        let part = (kind == TileKind::Partial).then_some(Part {
            mask: &m,
            row0: it.row0,
            rows,
            keys: &keys,
        });
        if wide {
            widen(&cx.k[koff..], ldk, n, d, &mut sc.kt);
            scores::<S, f32>(d, n, &sc.kt, d, &sc.qt, ld, width, &mut sc.st, part);
        } else {
            scores::<S, T>(
                d,
                n,
                &cx.k[koff..],
                ldk,
                &sc.qt,
                ld,
                width,
                &mut sc.st,
                part,
            );
        }
        if let Some(cap) = softcap {
            for x in sc.st[..n * ld].iter_mut() {
                *x = cap * (*x / cap).tanh();
            }
        }

        // 2. Mask, on partial tiles only: each query's allowed keys are one interval.
        if kind == TileKind::Partial {
            for r in 0..rows {
                let (lo, hi) = local_range(&m, it.row0 + r, &keys);
                for j in (0..lo).chain(hi..n) {
                    sc.st[j * ld + r] = f32::NEG_INFINITY;
                }
            }
        }

        // 3. Online softmax, down the columns, CHUNK queries at a time.
        for i0 in (0..width).step_by(CHUNK) {
            let mut mt = [0f32; CHUNK];
            mt.copy_from_slice(&sc.mx[i0..i0 + CHUNK]);
            for j in 0..n {
                let row = &sc.st[j * ld + i0..j * ld + i0 + CHUNK];
                for (m, &x) in mt.iter_mut().zip(row) {
                    // NaN scores do not raise the maximum; they reach O and LSE through P.
                    *m = if x > *m { x } else { *m };
                }
            }
            sc.mt[i0..i0 + CHUNK].copy_from_slice(&mt);
        }
        for i0 in (0..width).step_by(CHUNK) {
            let exact = sc.mt[i0..i0 + CHUNK]
                .iter()
                .any(|m| m.is_finite() && m.abs() > FAST_MAX_SCORE);
            sc.exact[i0 / CHUNK] = exact;
            for i in i0..i0 + CHUNK {
                let (m_old, m_new) = (sc.mx[i], sc.mt[i]);
                let base = if m_new.is_finite() { m_new } else { 0.0 };
                let (ml_new, sh_new) = if exact {
                    (base, f64::from(base) * f64::from(LOG2E))
                } else {
                    let ml = base * LOG2E;
                    (ml, f64::from(ml))
                };
                // Before any allowed key the accumulator holds only zeros (or NaN): rescale by
                // 0. The difference of shifts is formed in f64, exactly, whichever form each
                // shift had (in the fast form alone it equals the f32 difference).
                sc.corr[i] = if m_old == f32::NEG_INFINITY {
                    0.0
                } else {
                    exp2::<S>((sc.sh[i] - sh_new) as f32)
                };
                sc.mx[i] = m_new;
                sc.ml[i] = ml_new;
                sc.sh[i] = sh_new;
            }
        }
        for i0 in (0..width).step_by(CHUNK) {
            let mut sh = [0f32; CHUNK];
            sh.copy_from_slice(&sc.ml[i0..i0 + CHUNK]);
            let mut sum = [0f32; CHUNK];
            if sc.exact[i0 / CHUNK] {
                for j in 0..n {
                    let row = &mut sc.st[j * ld + i0..j * ld + i0 + CHUNK];
                    for ((x, &m), acc) in row.iter_mut().zip(&sh).zip(sum.iter_mut()) {
                        let e = exp2::<S>((*x - m) * LOG2E);
                        *x = e;
                        *acc += e;
                    }
                }
            } else {
                for j in 0..n {
                    let row = &mut sc.st[j * ld + i0..j * ld + i0 + CHUNK];
                    for ((x, &sh), acc) in row.iter_mut().zip(&sh).zip(sum.iter_mut()) {
                        let e = exp2::<S>(S::fmadd(*x, LOG2E, -sh));
                        *x = e;
                        *acc += e;
                    }
                }
            }
            sc.ls[i0..i0 + CHUNK].copy_from_slice(&sum);
        }
        for i in 0..width {
            sc.l[i] = sc.l[i] * sc.corr[i] + sc.ls[i];
        }

        // 4. O = O·corr + P·V.
        let tile = Tile {
            st: &sc.st,
            ld,
            corr: &sc.corr,
            mask: &m,
            it,
            keys: &keys,
            kind,
            width,
            dv,
        };
        if wide {
            widen(&cx.v[voff..], ldv, n, dv, &mut sc.vt);
            tile.update_o::<S, f32>(&sc.vt, dv, &mut sc.o);
        } else {
            tile.update_o::<S, T>(&cx.v[voff..], ldv, &mut sc.o);
        }
    }

    // Normalise; rows that saw no allowed key give O = 0 and LSE = −∞.
    for r in 0..rows {
        let orow = &mut sc.o[r * dv..(r + 1) * dv];
        let l = sc.l[r];
        if l == 0.0 {
            orow.fill(0.0);
            sc.l[r] = f32::NEG_INFINITY;
        } else {
            let inv = 1.0 / l;
            for x in orow.iter_mut() {
                *x *= inv;
            }
            let lse2 = sc.sh[r] + f64::from(l).log2();
            sc.l[r] = (lse2 / f64::from(LOG2E)) as f32;
        }
    }
}

/// The keys of tile `keys` that query row `row` may attend to, as a range local to the tile.
#[inline(always)]
fn local_range(m: &SeqMask, row: usize, keys: &std::ops::Range<usize>) -> (usize, usize) {
    let kr = m.key_range(row);
    let lo = kr.start.clamp(keys.start, keys.end) - keys.start;
    let hi = kr.end.clamp(keys.start, keys.end) - keys.start;
    (lo, hi.max(lo))
}

/// One key tile's probabilities, for step 4 of [`compute`].
struct Tile<'a> {
    /// `Pᵀ`, `n × ld`.
    st: &'a [f32],
    ld: usize,
    corr: &'a [f32],
    mask: &'a SeqMask,
    it: Item,
    keys: &'a std::ops::Range<usize>,
    kind: TileKind,
    width: usize,
    dv: usize,
}

impl Tile<'_> {
    /// `O = O·corr + P·V` with V rows `vr` (row stride `ldv`).
    #[inline(always)]
    fn update_o<S: Simd, B: Element>(&self, vr: &[B], ldv: usize, o: &mut [f32]) {
        let (n, dv) = (self.keys.len(), self.dv);
        // A masked key's P is 0, but 0 · NaN is NaN: where a partial tile's V is not all
        // finite, each row multiplies only its own keys.
        if self.kind == TileKind::Partial && !all_finite(vr, ldv, n, dv) {
            for r in 0..self.it.rows {
                let (lo, hi) = local_range(self.mask, self.it.row0 + r, self.keys);
                pv_row::<S, B>(r, lo, hi, self.st, self.ld, vr, ldv, dv, o, self.corr);
            }
        } else {
            let part = (self.kind == TileKind::Partial).then_some(Part {
                mask: self.mask,
                row0: self.it.row0,
                rows: self.it.rows,
                keys: self.keys,
            });
            pv::<S, B>(
                n, self.st, self.ld, self.width, vr, ldv, dv, o, self.corr, part,
            );
        }
    }
}

/// Writes one computed item into O and LSE.
fn write<T: Element>(cx: &Ctx<'_, T>, it: Item, sc: &Scratch) {
    let p = cx.p;
    let s = &p.sequences()[it.seq];
    let dv = p.head_dim_v();
    // A poisoned lock only means another worker panicked; its rows are its own.
    let mut guard = cx.out.lock().unwrap_or_else(|e| e.into_inner());
    let out = &mut *guard;
    for r in 0..it.rows {
        let off = p
            .o_layout()
            .offset(s.batch_index, s.q_start + it.row0 + r, it.head);
        for (dst, &x) in out.o[off..off + dv].iter_mut().zip(&sc.o[r * dv..]) {
            *dst = T::from_f32(x);
        }
        if let Some(l) = out.lse.as_deref_mut() {
            l[p.lse_offset(s, it.head, it.row0 + r)] = sc.l[r];
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::check::{check, random_qkv, Report};
    use crate::mask::Mask;
    use crate::problem::Options;
    use crate::tensor::Layout;

    /// Runs one random problem (2 query heads on 1 KV head) on `isa` with `tiles`, with V row
    /// `bad.0` set to `bad.1` if given, and judges it by the tolerance rule.
    fn case<T: Element>(
        isa: Isa,
        (sq, sk, d): (usize, usize, usize),
        mask: Mask,
        tiles: CpuTiles,
        bad: Option<(usize, f32)>,
    ) -> Report {
        let ql = Layout::new("q", &[1, sq, 2, d], None).unwrap();
        let kl = Layout::new("k", &[1, sk, 1, d], None).unwrap();
        let opts = Options::new().mask(mask);
        let p = Problem::new(T::DTYPE, &ql, &kl, &kl, &ql, None, None, &opts).unwrap();
        let mut rng = StdRng::seed_from_u64((sq * 1000 + sk * 10 + d) as u64);
        let (mut q, mut k, mut v) = (
            vec![T::NAN; ql.numel()],
            vec![T::NAN; kl.numel()],
            vec![T::NAN; kl.numel()],
        );
        random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
        if let Some((row, x)) = bad {
            v[row * d + 3] = T::from_f32(x);
        }
        let mut o = vec![T::NAN; ql.numel()];
        let mut lse = vec![f32::NAN; p.lse_len()];
        forward_on(isa, &p, tiles, &q, &k, &v, &mut o, Some(&mut lse));
        check(&p, &q, &k, &v, &o, Some(&lse)).unwrap()
    }

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
        let tiles = [
            CpuTiles {
                block_m: 96,
                block_n: 96,
            },
            CpuTiles {
                block_m: 17,
                block_n: 13,
            },
        ];
        for isa in Isa::all_available() {
            for mask in masks {
                for t in tiles {
                    for shape in [(150, 150, 80), (40, 130, 33)] {
                        let r = case::<f32>(isa, shape, mask, t, None);
                        assert!(r.passed(), "{isa:?} {mask:?} {t:?} {shape:?}: {r}");
                        let r = case::<bf16>(isa, shape, mask, t, None);
                        assert!(r.passed(), "bf16 {isa:?} {mask:?} {t:?} {shape:?}: {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn non_finite_v_reaches_only_the_rows_that_attend_to_it() {
        let t = CpuTiles {
            block_m: 96,
            block_n: 96,
        };
        for isa in Isa::all_available() {
            for x in [f32::NAN, f32::INFINITY] {
                // Key 100 sits inside a diagonal (partial) tile of the causal mask.
                let r = case::<f32>(isa, (150, 150, 64), Mask::Causal, t, Some((100, x)));
                assert!(r.passed(), "{isa:?} V = {x}: {r}");
            }
        }
    }

    /// Runs a random problem (40 × 60, d = 64, 2 query heads on 1 KV head, odd tiles so that
    /// rows and keys span several tiles and chunks) after `edit` changes Q and K, and judges it.
    fn edited<T: Element>(
        isa: Isa,
        opts: Options,
        edit: impl Fn(&mut [f32], &mut [f32]),
    ) -> Report {
        let (sq, sk, d) = (40, 60, 64);
        let ql = Layout::new("q", &[1, sq, 2, d], None).unwrap();
        let kl = Layout::new("k", &[1, sk, 1, d], None).unwrap();
        let p = Problem::new(T::DTYPE, &ql, &kl, &kl, &ql, None, None, &opts).unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        let (mut q, mut k, mut v) = (
            vec![0f32; ql.numel()],
            vec![0f32; kl.numel()],
            vec![0f32; kl.numel()],
        );
        random_qkv(&mut rng, &mut q, &mut k, &mut v, d, d);
        edit(&mut q, &mut k);
        let round = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
        let (q, k, v) = (round(q), round(k), round(v));
        let mut o = vec![T::NAN; ql.numel()];
        let mut lse = vec![f32::NAN; p.lse_len()];
        let t = CpuTiles {
            block_m: 17,
            block_n: 13,
        };
        forward_on(isa, &p, t, &q, &k, &v, &mut o, Some(&mut lse));
        assert!(o.iter().all(|x| x.to_f32().is_finite()), "O not finite");
        assert!(lse.iter().all(|x| x.is_finite()), "LSE not finite");
        check(&p, &q, &k, &v, &o, Some(&lse)).unwrap()
    }

    /// Scores of 1e8–1e12 lost the exponent in `exp2(s·log2e − round(m·log2e))`: NaN rows and
    /// LSE +inf (Q element 1e12, scale 1e10) or O = 0 and LSE −inf (scale 1e9). Also rows whose
    /// maximum moves between huge and ordinary from one key tile to the next.
    #[test]
    fn huge_finite_scores_give_finite_answers() {
        let d = 64;
        let q_element = |q: &mut [f32], _: &mut [f32]| q[5 * 2 * d] = 1e12; // row 5, head 0
        let none = |_: &mut [f32], _: &mut [f32]| {};
        let tiles_swing = |q: &mut [f32], k: &mut [f32]| {
            // Q ≥ 0; keys 0..13 (the first key tile) ≤ −1e8, keys 26..39 ≥ 1e8: row maxima go
            // huge negative, ordinary, huge positive.
            q.iter_mut().for_each(|x| *x = x.abs());
            for j in 0..13 {
                k[j * d..(j + 1) * d]
                    .iter_mut()
                    .for_each(|x| *x = -x.abs() * 1e8);
            }
            for j in 26..39 {
                k[j * d..(j + 1) * d]
                    .iter_mut()
                    .for_each(|x| *x = x.abs() * 1e8);
            }
        };
        for isa in Isa::all_available() {
            let r = edited::<f32>(isa, Options::new(), q_element);
            assert!(r.passed(), "{isa:?} Q element 1e12: {r}");
            let r = edited::<bf16>(isa, Options::new(), q_element);
            assert!(r.passed(), "bf16 {isa:?} Q element 1e12: {r}");
            for scale in [1e9, 1e10, -1e10, 3e30] {
                let r = edited::<f32>(isa, Options::new().scale(scale), none);
                assert!(r.passed(), "{isa:?} scale {scale}: {r}");
            }
            let r = edited::<f32>(isa, Options::new(), tiles_swing);
            assert!(r.passed(), "{isa:?} maxima swinging between tiles: {r}");
            let r = edited::<f32>(isa, Options::new().causal(), tiles_swing);
            assert!(r.passed(), "{isa:?} causal, maxima swinging: {r}");
        }
    }
}
