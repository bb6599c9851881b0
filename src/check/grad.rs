//! Judging a backend's gradients against the float64 oracle ([`crate::cpu::reference_grad`])
//! by the gradient tolerance rule of `docs/backward.md`, for each of dQ, dK and dV:
//!
//! ```text
//! 16-bit storage:  max|dX − dX_ref| ≤ lowp + atol + max(lowp, floor),
//!                  lowp = max|dX_lowp − dX_ref|, atol = max|round_to_dtype(dX_ref) − dX_ref|,
//!                  floor = what f32 sums of dP and D in another order can change
//! f32 storage:     max|dX − dX_ref| ≤ 1e-4 · max(1, max|dX_ref|)
//! ```
//! and no element differs in finiteness from the oracle. `dX_lowp` is the naive evaluation in
//! the storage precision ([`crate::cpu::reference_grad::grad_lowp`]), with D taken from the O
//! the backend was given; `floor` is its [`f32_floor`](reference_grad::LowpGrads::f32_floor).
//! Where the floor is below `lowp` (nearly always), this is `2 · lowp + atol`, the forward's
//! rule for O.

use std::fmt;

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::matrix::{matrix, setup, Case, Seqlens};
use super::random_fill;
use crate::backend::Backend;
use crate::backward::BackwardOptions;
use crate::cpu::reference_grad::{self, contiguous, Grads};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::mask::Mask;
use crate::problem::Problem;
use crate::tensor::{Element, Layout, Tensor, TensorMut};

/// Relative bound on f32 gradients (of `max(1, max|dX_ref|)`). The gradients sum products of
/// P, dP − D and the inputs over a whole sequence, with the cancellation in `dP − D`; measured
/// on the test matrix, the CPU backward's f32 errors stay below about 3e-6 of that scale, and a
/// plain f32 evaluation's below 1e-5.
pub const F32_GRAD_RTOL: f64 = 1e-4;

/// Which gradient an element belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// dQ.
    Dq,
    /// dK.
    Dk,
    /// dV.
    Dv,
}

impl fmt::Display for Which {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Which::Dq => "dQ",
            Which::Dk => "dK",
            Which::Dv => "dV",
        })
    }
}

/// Where an element of a gradient sits: sequence, row within it, head, column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradPosition {
    /// Sequence of the batch.
    pub seq: usize,
    /// Row within the sequence (a query row for dQ, a key row for dK and dV).
    pub row: usize,
    /// Head (query head for dQ, KV head for dK and dV).
    pub head: usize,
    /// Column.
    pub col: usize,
}

/// The verdict on one gradient tensor and its evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorReport {
    /// Which gradient.
    pub which: Which,
    /// Elements compared.
    pub elements: usize,
    /// `max|dX − dX_ref|` over elements where both are finite.
    pub max_err: f64,
    /// `max|dX_ref|` over finite elements.
    pub max_ref: f64,
    /// The bound `max_err` must not exceed.
    pub bound: f64,
    /// `max|dX_lowp − dX_ref|` (16-bit storage).
    pub lowp_err: f64,
    /// `max|round(dX_ref) − dX_ref|` (16-bit storage).
    pub atol: f64,
    /// The f32 floor (16-bit storage): what f32 sums of `dP` and `D` in another order can
    /// change (see [`reference_grad::LowpGrads::f32_floor`]); it replaces the rule's second
    /// `lowp_err` where it is larger.
    pub f32_floor: f64,
    /// Elements whose finiteness differs from the oracle.
    pub finiteness_mismatches: usize,
    /// The first element out of bounds or of the wrong finiteness, with (got, want).
    pub first_bad: Option<(GradPosition, f64, f64)>,
}

impl TensorReport {
    /// Whether this gradient passes.
    pub fn passed(&self) -> bool {
        self.first_bad.is_none() && self.finiteness_mismatches == 0 && self.max_err <= self.bound
    }
}

/// The verdict on dQ, dK and dV.
#[derive(Debug, Clone, PartialEq)]
pub struct GradReport {
    /// Storage dtype judged.
    pub dtype: DType,
    /// dQ, dK, dV.
    pub tensors: [TensorReport; 3],
}

impl GradReport {
    /// Whether every gradient passes.
    pub fn passed(&self) -> bool {
        self.tensors.iter().all(TensorReport::passed)
    }
}

impl fmt::Display for GradReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", if self.passed() { "pass" } else { "FAIL" })?;
        for (i, t) in self.tensors.iter().enumerate() {
            let sep = if i == 0 { " " } else { "; " };
            write!(
                f,
                "{sep}{} {:.2e} (bound {:.2e}",
                t.which, t.max_err, t.bound
            )?;
            if self.dtype != DType::F32 {
                write!(f, ", lowp {:.2e}", t.lowp_err)?;
                if t.f32_floor > t.lowp_err {
                    write!(f, ", f32 floor {:.2e}", t.f32_floor)?;
                }
            }
            write!(f, ")")?;
            if t.finiteness_mismatches > 0 {
                write!(f, " {} finiteness mismatches", t.finiteness_mismatches)?;
            }
            if let Some((pos, got, want)) = t.first_bad {
                write!(
                    f,
                    " first bad {}[seq {}, row {}, head {}, col {}]: got {got}, want {want}",
                    t.which, pos.seq, pos.row, pos.head, pos.col
                )?;
            }
        }
        Ok(())
    }
}

fn same_class(a: f64, b: f64) -> bool {
    if a.is_finite() || b.is_finite() {
        a.is_finite() == b.is_finite()
    } else {
        (a.is_nan() && b.is_nan()) || a == b
    }
}

/// The gradients a backend wrote, with their layouts (the dims of Q, K and V).
#[derive(Debug, Clone, Copy)]
pub struct GradsView<'a, T> {
    /// dQ and its layout.
    pub dq: (&'a [T], &'a Layout),
    /// dK and its layout.
    pub dk: (&'a [T], &'a Layout),
    /// dV and its layout.
    pub dv: (&'a [T], &'a Layout),
}

/// Applies the gradient tolerance rule to `got`, computing the oracle and the storage-precision
/// evaluation from the same inputs: `out` (laid out as `p.o_layout()`) is the O the backend was
/// given, `d_out` (laid out as `d_out_layout`, O's dims) the upstream gradient.
#[allow(clippy::too_many_arguments)]
pub fn check_grads<T: Element>(
    p: &Problem,
    q: &[T],
    k: &[T],
    v: &[T],
    out: &[T],
    d_out: &[T],
    d_out_layout: &Layout,
    got: GradsView<'_, T>,
) -> GradReport {
    let want = reference_grad::grad_f64(p, q, k, v, d_out, d_out_layout);
    let low = (T::DTYPE != DType::F32)
        .then(|| reference_grad::grad_lowp(p, q, k, v, out, p.o_layout(), d_out, d_out_layout));
    let pick = |g: &Grads<f64>, w: Which| match w {
        Which::Dq => g.dq.clone(),
        Which::Dk => g.dk.clone(),
        Which::Dv => g.dv.clone(),
    };
    let tensors = [
        (Which::Dq, got.dq, p.q_layout()),
        (Which::Dk, got.dk, p.k_layout()),
        (Which::Dv, got.dv, p.v_layout()),
    ]
    .map(|(which, (data, layout), input)| {
        let want = pick(&want, which);
        let low = low.as_ref().map(|l| {
            let (g, floor) = (&l.grads, l.f32_floor);
            match which {
                Which::Dq => (&g.dq, floor[0]),
                Which::Dk => (&g.dk, floor[1]),
                Which::Dv => (&g.dv, floor[2]),
            }
        });
        judge(p, which, data, layout, input, &want, low)
    });
    GradReport {
        dtype: T::DTYPE,
        tensors,
    }
}

fn judge<T: Element>(
    p: &Problem,
    which: Which,
    data: &[T],
    layout: &Layout,
    input: &Layout,
    want: &[f64],
    low: Option<(&Vec<f32>, f64)>,
) -> TensorReport {
    let finite = |x: &&f64| x.is_finite();
    let max_ref = want.iter().filter(finite).fold(0f64, |m, x| m.max(x.abs()));
    let (lowp_err, atol, f32_floor, bound) = match low {
        Some((low, floor)) => {
            let lowp_err = low
                .iter()
                .zip(want)
                .filter(|(a, b)| a.is_finite() && b.is_finite())
                .map(|(&a, &b)| (f64::from(a) - b).abs())
                .fold(0.0, f64::max);
            let atol = want
                .iter()
                .filter(finite)
                .map(|&x| (f64::from(T::from_f64(x).to_f32()) - x).abs())
                .fold(0.0, f64::max);
            // The floor, rounded to the dtype as a result is: relative 2⁻⁸ (bf16) covers
            // both dtypes' normal numbers, 2⁻²⁴ fp16's subnormal spacing.
            let floor = floor * (1.0 + 2f64.powi(-8)) + 2f64.powi(-24);
            (lowp_err, atol, floor, lowp_err + atol + lowp_err.max(floor))
        }
        None => (0.0, 0.0, 0.0, F32_GRAD_RTOL * max_ref.max(1.0)),
    };
    let cl = contiguous(input);
    let [_, _, heads, cols] = input.dims;
    let (mut max_err, mut elements, mut mismatches, mut first_bad) = (0f64, 0, 0, None);
    for (si, s) in p.sequences().iter().enumerate() {
        let (start, len) = match which {
            Which::Dq => (s.q_start, s.q_len),
            Which::Dk | Which::Dv => (s.k_start, s.k_len),
        };
        for r in 0..len {
            for h in 0..heads {
                let g0 = layout.offset(s.batch_index, start + r, h);
                let w0 = cl.offset(s.batch_index, start + r, h);
                for c in 0..cols {
                    let (g, w) = (f64::from(data[g0 + c].to_f32()), want[w0 + c]);
                    elements += 1;
                    let pos = GradPosition {
                        seq: si,
                        row: r,
                        head: h,
                        col: c,
                    };
                    if !same_class(g, w) {
                        mismatches += 1;
                        first_bad.get_or_insert((pos, g, w));
                    } else if g.is_finite() {
                        let e = (g - w).abs();
                        max_err = max_err.max(e);
                        if e > bound {
                            first_bad.get_or_insert((pos, g, w));
                        }
                    }
                }
            }
        }
    }
    TensorReport {
        which,
        elements,
        max_err,
        max_ref,
        bound,
        lowp_err,
        atol,
        f32_floor,
        finiteness_mismatches: mismatches,
        first_bad,
    }
}

/// The shape and strides a [`Tensor`] view of `l` is built from.
pub fn view_args(l: &Layout) -> (Vec<usize>, Vec<usize>) {
    if l.packed {
        (l.dims[1..].to_vec(), vec![l.strides[1], l.strides[2], 1])
    } else {
        (
            l.dims.to_vec(),
            vec![l.strides[0], l.strides[1], l.strides[2], 1],
        )
    }
}

/// Runs the backward of `p` through the public API on buffers laid out as the problem says
/// (dO in O's layout, dQ, dK, dV in those of Q, K, V).
#[allow(clippy::too_many_arguments)]
pub fn run_backward<T: Element>(
    backend: &Backend,
    p: &Problem,
    cu: Option<(&[i32], &[i32])>,
    [q, k, v, o]: [&[T]; 4],
    lse: &[f32],
    d_out: &[T],
    [dq, dk, dv]: [&mut [T]; 3],
    opts: &BackwardOptions,
) -> Result<()> {
    fn view<'b, T: Element>(name: &str, data: &'b [T], l: &Layout) -> Result<Tensor<'b, T>> {
        let (shape, strides) = view_args(l);
        Tensor::with_name(name, data, &shape, Some(&strides))
    }
    let qt = view("q", q, p.q_layout())?;
    let kt = view("k", k, p.k_layout())?;
    let vt = view("v", v, p.v_layout())?;
    let ot = view("out", o, p.o_layout())?;
    let gt = view("d_out", d_out, p.o_layout())?;
    fn mk<'b, T: Element>(name: &str, data: &'b mut [T], l: &Layout) -> Result<TensorMut<'b, T>> {
        let (shape, strides) = view_args(l);
        TensorMut::with_name(name, data, &shape, Some(&strides))
    }
    let mut dqt = mk("dq", dq, p.q_layout())?;
    let mut dkt = mk("dk", dk, p.k_layout())?;
    let mut dvt = mk("dv", dv, p.v_layout())?;
    match cu {
        None => backend.backward(
            &qt, &kt, &vt, &ot, lse, &gt, &mut dqt, &mut dkt, &mut dvt, opts,
        ),
        Some((cq, ck)) => backend.backward_varlen(
            &qt, &kt, &vt, cq, ck, &ot, lse, &gt, &mut dqt, &mut dkt, &mut dvt, opts,
        ),
    }
}

/// The `cu_seqlens` of a varlen problem (`None` for a fixed-length batch).
pub fn cu_seqlens(p: &Problem) -> Option<(Vec<i32>, Vec<i32>)> {
    p.is_varlen().then(|| {
        let seqs = p.sequences();
        let cq = std::iter::once(0)
            .chain(seqs.iter().map(|s| (s.q_start + s.q_len) as i32))
            .collect();
        let ck = std::iter::once(0)
            .chain(seqs.iter().map(|s| (s.k_start + s.k_len) as i32))
            .collect();
        (cq, ck)
    })
}

fn run_grad_typed<T: Element>(backend: &Backend, case: &Case, seed: u64) -> Result<GradReport> {
    let (p, mut x) = setup::<T>(case, seed)?;
    // The forward on the CPU: its O and LSE are the backward's inputs, whatever runs the
    // backward, so every backend's gradients are judged from the same O (the rule's model
    // takes D from it too).
    Backend::Cpu.run(&p, &x.q, &x.k, &x.v, &mut x.o, Some(&mut x.lse))?;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6772_6164);
    let mut d_out = vec![T::NAN; x.o.len()];
    random_fill(&mut rng, &mut d_out, case.head_dim_v, 1.0);
    let mut dq = vec![T::NAN; x.q.len()];
    let mut dk = vec![T::NAN; x.k.len()];
    let mut dv = vec![T::NAN; x.v.len()];
    let cu = cu_seqlens(&p);
    let cu_ref = cu.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
    run_backward(
        backend,
        &p,
        cu_ref,
        [&x.q, &x.k, &x.v, &x.o],
        &x.lse,
        &d_out,
        [&mut dq, &mut dk, &mut dv],
        &case.options().into(),
    )?;
    let got = GradsView {
        dq: (&dq, p.q_layout()),
        dk: (&dk, p.k_layout()),
        dv: (&dv, p.v_layout()),
    };
    Ok(check_grads(
        &p,
        &x.q,
        &x.k,
        &x.v,
        &x.o,
        &d_out,
        p.o_layout(),
        got,
    ))
}

/// Draws fresh random inputs and dO for `case` (from `seed`), runs the forward on the CPU and
/// the backward on `backend` into NaN-poisoned gradients, and applies the gradient rule.
pub fn run_grad_case(backend: &Backend, case: &Case, seed: u64) -> Result<GradReport> {
    match case.dtype {
        DType::F32 => run_grad_typed::<f32>(backend, case, seed),
        DType::F16 => run_grad_typed::<half::f16>(backend, case, seed),
        DType::Bf16 => run_grad_typed::<half::bf16>(backend, case, seed),
        DType::Fp8E4M3 => Err(Error::invalid("dtype", "fp8 is not computed yet")),
    }
}

/// The gradient matrix: the forward's [`matrix`] (masks, GQA/MQA, seqlens 1, 17, block ± 1,
/// sq ≠ sk both ways, ragged varlen batches with zero-length sequences, softcap, custom and
/// negative scales, strided views, a NaN key) plus, per dtype and head dim, cases with
/// `head_dim_v ≠ head_dim`: GQA 4/1 with a causal mask over a varlen batch, and a window with
/// a softcap.
pub fn grad_matrix(dtypes: &[DType], head_dims: &[usize]) -> Vec<Case> {
    let mut out = matrix(dtypes, head_dims);
    for &dtype in dtypes {
        for &d in head_dims {
            let Some(base) = matrix(&[dtype], &[d]).into_iter().next() else {
                continue;
            };
            let dv = d / 2 + 8;
            out.push(Case {
                head_dim_v: dv,
                heads_q: 4,
                heads_kv: 1,
                mask: Mask::Causal,
                seqlens: Seqlens::Varlen {
                    q: vec![0, 37, 100, 3],
                    k: vec![5, 40, 97, 0],
                },
                ..base.clone()
            });
            out.push(Case {
                head_dim_v: 2 * d,
                mask: Mask::Window {
                    left: Some(20),
                    right: Some(7),
                },
                softcap: Some(3.0),
                seqlens: Seqlens::Fixed {
                    batch: 1,
                    q: 100,
                    k: 120,
                },
                ..base
            });
        }
    }
    out
}
