//! The correctness matrix, held as data, and the runner that applies the tolerance rule to
//! one case on any backend. `cargo test` and `fa4 check` run the same matrix.

use std::fmt;

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{check, check_fp8, random_qkv, Report};
use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::Result;
use crate::mask::Mask;
use crate::problem::{Options, Problem};
use crate::tensor::{Element, Layout};

/// Sequence lengths of a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seqlens {
    /// A fixed-length batch.
    Fixed {
        /// Batch size.
        batch: usize,
        /// Queries per sequence.
        q: usize,
        /// Keys per sequence.
        k: usize,
    },
    /// A packed variable-length batch: per-sequence lengths.
    Varlen {
        /// Queries of each sequence.
        q: Vec<usize>,
        /// Keys of each sequence.
        k: Vec<usize>,
    },
}

/// One cell of the matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// Storage dtype.
    pub dtype: DType,
    /// Sequence lengths.
    pub seqlens: Seqlens,
    /// Query heads.
    pub heads_q: usize,
    /// KV heads.
    pub heads_kv: usize,
    /// Head dim of Q and K.
    pub head_dim: usize,
    /// Head dim of V and O.
    pub head_dim_v: usize,
    /// Mask.
    pub mask: Mask,
    /// Softcap.
    pub softcap: Option<f32>,
    /// Custom scale.
    pub scale: Option<f32>,
    /// Q, K, V and O are views with padded head strides (a slice of a wider buffer).
    pub strided: bool,
    /// Put a NaN into one key row.
    pub nan: bool,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} d={}", self.dtype, self.head_dim)?;
        if self.head_dim_v != self.head_dim {
            write!(f, "/{}", self.head_dim_v)?;
        }
        write!(f, " h={}/{}", self.heads_q, self.heads_kv)?;
        match &self.seqlens {
            Seqlens::Fixed { batch, q, k } => write!(f, " b={batch} sq={q} sk={k}")?,
            Seqlens::Varlen { q, k } => write!(f, " varlen q={q:?} k={k:?}")?,
        }
        match self.mask {
            Mask::None => {}
            Mask::Causal => write!(f, " causal")?,
            Mask::Window { left, right } => write!(
                f,
                " window({},{})",
                left.map_or(-1, |x| x as i64),
                right.map_or(-1, |x| x as i64)
            )?,
        }
        if let Some(c) = self.softcap {
            write!(f, " softcap={c}")?;
        }
        if let Some(s) = self.scale {
            write!(f, " scale={s}")?;
        }
        if self.strided {
            write!(f, " strided")?;
        }
        if self.nan {
            write!(f, " nan")?;
        }
        Ok(())
    }
}

impl Case {
    /// The problem the case runs (for an fp8 case the e4m3 one with O in bf16), without its data.
    pub fn problem(&self) -> Result<Problem> {
        let f32_case = Case {
            dtype: DType::F32,
            ..self.clone()
        };
        let (p, _) = setup::<f32>(&f32_case, 0)?;
        match self.dtype {
            DType::Fp8E4M3 => p.as_fp8(DType::Bf16),
            DType::F32 => Ok(p),
            d => Ok(p.with_dtype(d)),
        }
    }

    fn base(dtype: DType, d: usize, seqlens: Seqlens) -> Case {
        Case {
            dtype,
            seqlens,
            heads_q: 2,
            heads_kv: 2,
            head_dim: d,
            head_dim_v: d,
            mask: Mask::None,
            softcap: None,
            scale: None,
            strided: false,
            nan: false,
        }
    }

    /// The options of this case.
    pub fn options(&self) -> Options {
        let mut o = Options::new().mask(self.mask);
        if let Some(c) = self.softcap {
            o = o.softcap(c);
        }
        if let Some(s) = self.scale {
            o = o.scale(s);
        }
        o
    }
}

/// The matrix: dtypes × head dims 32/64/80/96/128/192/256 × scenarios (masks, GQA ratios,
/// seqlens 1, 17, block ± 1, sq ≠ sk both ways, ragged batches with zero-length sequences,
/// rows with no allowed key, NaN inputs, strided views).
pub fn matrix(dtypes: &[DType], head_dims: &[usize]) -> Vec<Case> {
    let fixed = |batch, q, k| Seqlens::Fixed { batch, q, k };
    let mut out = Vec::new();
    for &dtype in dtypes {
        for &d in head_dims {
            let c = |s| Case::base(dtype, d, s);
            let scenarios = vec![
                c(fixed(2, 17, 17)),
                Case {
                    mask: Mask::Causal,
                    ..c(fixed(1, 65, 65))
                },
                // sq > sk, causal: the first rows see no key (O = 0, LSE = −inf).
                Case {
                    mask: Mask::Causal,
                    heads_q: 4,
                    heads_kv: 2,
                    ..c(fixed(2, 40, 17))
                },
                // sq < sk, causal, MQA.
                Case {
                    mask: Mask::Causal,
                    heads_q: 3,
                    heads_kv: 1,
                    ..c(fixed(1, 17, 130))
                },
                Case {
                    mask: Mask::Window {
                        left: Some(9),
                        right: Some(3),
                    },
                    ..c(fixed(1, 63, 129))
                },
                Case {
                    mask: Mask::Window {
                        left: None,
                        right: Some(0),
                    },
                    softcap: Some(5.0),
                    ..c(fixed(1, 1, 64))
                },
                Case {
                    mask: Mask::Window {
                        left: Some(0),
                        right: None,
                    },
                    scale: Some(0.1),
                    ..c(fixed(1, 33, 1))
                },
                Case {
                    seqlens: Seqlens::Varlen {
                        q: vec![5, 0, 64, 1, 31],
                        k: vec![7, 3, 65, 0, 31],
                    },
                    heads_q: 4,
                    heads_kv: 1,
                    mask: Mask::Causal,
                    ..c(fixed(0, 0, 0))
                },
                Case {
                    seqlens: Seqlens::Varlen {
                        q: vec![0, 17, 63],
                        k: vec![4, 0, 90],
                    },
                    heads_q: 4,
                    heads_kv: 2,
                    softcap: Some(20.0),
                    ..c(fixed(0, 0, 0))
                },
                Case {
                    strided: true,
                    heads_q: 4,
                    heads_kv: 2,
                    mask: Mask::Causal,
                    ..c(fixed(2, 33, 47))
                },
                // A window side far past the sequence (the kernels get it as unbounded; int32
                // bound arithmetic on it would overflow).
                Case {
                    mask: Mask::Window {
                        left: Some(usize::MAX),
                        right: Some(1),
                    },
                    ..c(fixed(1, 30, 45))
                },
                // A negative scale (the CUDA kernel negates Q once and runs with |scale|).
                Case {
                    scale: Some(-0.2),
                    heads_q: 2,
                    heads_kv: 1,
                    ..c(fixed(1, 70, 70))
                },
                Case {
                    nan: true,
                    mask: Mask::Causal,
                    ..c(fixed(1, 20, 20))
                },
            ];
            out.extend(scenarios);
        }
    }
    out
}

pub(super) struct Data<T> {
    pub(super) q: Vec<T>,
    pub(super) k: Vec<T>,
    pub(super) v: Vec<T>,
    pub(super) o: Vec<T>,
    pub(super) lse: Vec<f32>,
}

/// The problem of a case and buffers for it (strided cases pad each row by one head's width).
pub(super) fn setup<T: Element>(case: &Case, seed: u64) -> Result<(Problem, Data<T>)> {
    let (b, sq, sk, cu) = match &case.seqlens {
        Seqlens::Fixed { batch, q, k } => (*batch, *q, *k, None),
        Seqlens::Varlen { q, k } => {
            let cu = |v: &Vec<usize>| {
                std::iter::once(0)
                    .chain(v.iter().scan(0, |acc, &x| {
                        *acc += x;
                        Some(*acc as i32)
                    }))
                    .collect::<Vec<i32>>()
            };
            let (cq, ck) = (cu(q), cu(k));
            (
                1,
                *cq.last().unwrap() as usize,
                *ck.last().unwrap() as usize,
                Some((cq, ck)),
            )
        }
    };
    let packed = cu.is_some();
    let layout = |name: &str, s: usize, h: usize, d: usize| -> Result<(Layout, usize)> {
        // A pad of 16 elements keeps rows 16-byte aligned for every element size (fp8's TMA
        // maps need it).
        let pad = if case.strided { d + 16 } else { 0 };
        let (row, head) = (h * d + pad, d);
        let strides = [s * row, row, head, 1];
        let shape = [b, s, h, d];
        let (shape, strides): (&[usize], &[usize]) = if packed {
            (&shape[1..], &strides[1..])
        } else {
            (&shape, &strides)
        };
        let l = Layout::new(name, shape, Some(strides))?;
        let len = l.extent().unwrap_or(0);
        Ok((l, len))
    };
    let (ql, qn) = layout("q", sq, case.heads_q, case.head_dim)?;
    let (kl, kn) = layout("k", sk, case.heads_kv, case.head_dim)?;
    let (vl, vn) = layout("v", sk, case.heads_kv, case.head_dim_v)?;
    let (ol, on) = layout("out", sq, case.heads_q, case.head_dim_v)?;
    let p = Problem::new(
        case.dtype,
        &ql,
        &kl,
        &vl,
        &ol,
        cu.as_ref().map(|c| c.0.as_slice()),
        cu.as_ref().map(|c| c.1.as_slice()),
        &case.options(),
    )?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q = vec![T::NAN; qn];
    let mut k = vec![T::NAN; kn];
    let mut v = vec![T::NAN; vn];
    random_qkv(
        &mut rng,
        &mut q,
        &mut k,
        &mut v,
        case.head_dim,
        case.head_dim_v,
    );
    if case.nan && !k.is_empty() {
        let row = (kn / case.head_dim) / 2;
        k[row * case.head_dim] = T::NAN;
    }
    let o = vec![T::NAN; on];
    let lse = vec![f32::NAN; p.lse_len()];
    Ok((p, Data { q, k, v, o, lse }))
}

fn run_typed<T: Element>(backend: &Backend, case: &Case, seed: u64) -> Result<Report> {
    let (p, mut x) = setup::<T>(case, seed)?;
    backend.run(&p, &x.q, &x.k, &x.v, &mut x.o, Some(&mut x.lse))?;
    check(&p, &x.q, &x.k, &x.v, &x.o, Some(&x.lse))
}

/// Draws fresh random inputs for `case` (from `seed`), poisons the outputs with NaN, runs the
/// backend and applies the tolerance rule.
pub fn run_case(backend: &Backend, case: &Case, seed: u64) -> Result<Report> {
    match case.dtype {
        DType::F32 => run_typed::<f32>(backend, case, seed),
        DType::F16 => run_typed::<half::f16>(backend, case, seed),
        DType::Bf16 => run_typed::<half::bf16>(backend, case, seed),
        DType::Fp8E4M3 => run_fp8::<half::bf16>(backend, case, seed),
    }
}

/// An fp8 case: the f32 case's inputs (its random draws, the NaN key), quantized per (sequence,
/// KV head) as `docs/attention.md` says, O in `O`, judged by [`check_fp8`].
fn run_fp8<O: Element>(backend: &Backend, case: &Case, seed: u64) -> Result<Report> {
    use crate::fp8::{quantize, Descales, Operand};
    let f32_case = Case {
        dtype: DType::F32,
        ..case.clone()
    };
    let (f, x) = setup::<f32>(&f32_case, seed)?;
    let p = f.as_fp8(O::DTYPE)?;
    let (q, dq) = quantize(&p, Operand::Q, "q", &x.q)?;
    let (k, dk) = quantize(&p, Operand::K, "k", &x.k)?;
    let (v, dv) = quantize(&p, Operand::V, "v", &x.v)?;
    let ds = Descales::new(Some(&dq), Some(&dk), Some(&dv));
    let mut o = vec![O::NAN; x.o.len()];
    let mut lse = vec![f32::NAN; p.lse_len()];
    backend.run_fp8(&p, &q, &k, &v, &ds, &mut o, Some(&mut lse))?;
    check_fp8(&p, &q, &k, &v, &ds, &o, Some(&lse))
}
