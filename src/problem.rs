//! The attention problem: shapes, strides, dtype, mask, scale, softcap and sequence lengths,
//! validated once and then trusted by every backend.
//!
//! The function itself is defined in `docs/attention.md`; [`Problem::new`] checks everything a
//! backend relies on and names the offending argument in its error.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::mask::{Mask, SeqMask};
use crate::tensor::Layout;

/// Largest head dimension the API accepts. Backends may accept less and say so.
pub const MAX_HEAD_DIM: usize = 1024;

/// Options of one attention call, built fluently:
/// `Options::new().causal().softcap(30.0)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Options {
    mask: Mask,
    scale: Option<f32>,
    softcap: Option<f32>,
}

impl Options {
    /// No mask, scale `1/sqrt(head_dim)`, no softcap.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the mask.
    pub fn mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }

    /// Causal mask, aligned to the bottom-right corner.
    pub fn causal(self) -> Self {
        self.mask(Mask::Causal)
    }

    /// Local window: `left` keys before the diagonal and `right` after; `None` is unbounded.
    pub fn window(self, left: Option<usize>, right: Option<usize>) -> Self {
        self.mask(Mask::Window { left, right })
    }

    /// Score scale (default `1/sqrt(head_dim)`); must be finite.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Softcap: scores become `softcap · tanh(s / softcap)`; must be finite and > 0.
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }

    /// The mask.
    pub fn get_mask(&self) -> Mask {
        self.mask
    }

    /// The scale as given (`None`: `1/sqrt(head_dim)`, resolved by the problem).
    pub fn get_scale(&self) -> Option<f32> {
        self.scale
    }

    /// The softcap as given.
    pub fn get_softcap(&self) -> Option<f32> {
        self.softcap
    }
}

/// One sequence of the batch, as backends iterate it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sequence {
    /// Index into the batch axis of the tensors (always 0 for packed varlen tensors).
    pub batch_index: usize,
    /// First query row in the sequence axis (0 for fixed-length batches, `cu_seqlens_q[b]`).
    pub q_start: usize,
    /// Query rows.
    pub q_len: usize,
    /// First key row.
    pub k_start: usize,
    /// Key rows.
    pub k_len: usize,
}

/// A validated attention problem. Construct with [`Problem::new`]; backends trust it.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    dtype: DType,
    out_dtype: DType,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    head_dim_v: usize,
    q: Layout,
    k: Layout,
    v: Layout,
    o: Layout,
    varlen: bool,
    seqs: Vec<Sequence>,
    total_q: usize,
    lse_batch_stride: usize,
    lse_head_stride: usize,
    mask: Mask,
    scale: f32,
    softcap: Option<f32>,
}

fn dims_name(packed: bool) -> &'static str {
    if packed {
        "[total, heads, dim]"
    } else {
        "[batch, seqlen, heads, dim]"
    }
}

/// Parses `cu_seqlens`: starts at 0, non-decreasing, ends at `total`.
fn cu_seqlens(name: &str, cu: &[i32], total: usize) -> Result<Vec<usize>> {
    if cu.is_empty() {
        return Err(Error::invalid(
            name,
            "must hold batch + 1 ≥ 1 entries, got none",
        ));
    }
    if cu[0] != 0 {
        return Err(Error::invalid(
            name,
            format!("must start at 0, starts at {}", cu[0]),
        ));
    }
    let mut out = Vec::with_capacity(cu.len());
    for (i, &c) in cu.iter().enumerate() {
        if i > 0 && c < cu[i - 1] {
            return Err(Error::invalid(
                name,
                format!(
                    "must be non-decreasing: entry {i} is {c} after {}",
                    cu[i - 1]
                ),
            ));
        }
        out.push(c as usize);
    }
    let last = *out.last().expect("non-empty");
    if last != total {
        return Err(Error::invalid(
            name,
            format!("last entry {last} must equal the tensor's total rows {total}"),
        ));
    }
    Ok(out)
}

/// True when no two distinct elements of the layout share an offset (an empty layout has no
/// elements, so none overlap whatever its strides).
pub(crate) fn non_overlapping(l: &Layout) -> bool {
    if l.dims.contains(&0) {
        return true;
    }
    let mut axes: Vec<(usize, usize)> = (0..3)
        .map(|a| (l.strides[a], l.dims[a]))
        .chain(std::iter::once((1, l.dims[3])))
        .filter(|&(_, n)| n > 1)
        .collect();
    axes.sort_unstable();
    let mut covered = 1usize;
    for (stride, n) in axes {
        if stride < covered {
            return false;
        }
        covered = match stride.checked_mul(n) {
            Some(c) => c,
            None => return true,
        };
    }
    true
}

/// This machine's memory in bytes (`MemTotal` of /proc/meminfo), where the OS says.
fn physical_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// An empty list with room for `n` sequences, or an error naming `name` with the bytes asked:
/// a batch of 10⁹ would otherwise abort the process inside the allocator.
fn sequence_list(name: &str, n: usize) -> Result<Vec<Sequence>> {
    let mut seqs = Vec::new();
    // Where the kernel overcommits memory (the H200 machine does), a reservation far past the
    // machine's memory succeeds and the list then takes hours to fill: refuse those first.
    let past_memory = n
        .checked_mul(std::mem::size_of::<Sequence>())
        .is_none_or(|b| physical_memory().is_some_and(|m| b as u64 > m));
    if past_memory || seqs.try_reserve_exact(n).is_err() {
        let bytes = n
            .checked_mul(std::mem::size_of::<Sequence>())
            .map_or_else(|| "more than usize::MAX".to_string(), |b| b.to_string());
        return Err(Error::invalid(
            name,
            format!("a batch of {n} sequences cannot be allocated ({bytes} bytes of per-sequence records)"),
        ));
    }
    Ok(seqs)
}

impl Problem {
    /// Validates a problem from the layouts of Q, K, V and O.
    ///
    /// - Fixed-length: Q `[batch, seqlen_q, heads_q, head_dim]`, K `[batch, seqlen_k, heads_kv,
    ///   head_dim]`, V `[batch, seqlen_k, heads_kv, head_dim_v]`, O `[batch, seqlen_q, heads_q,
    ///   head_dim_v]`; `cu_seqlens_*` are `None`; LSE holds `batch · heads_q · seqlen_q`.
    /// - Varlen: the same tensors packed as `[total, heads, dim]` with `cu_seqlens_q/k` of
    ///   `batch + 1` entries; LSE holds `heads_q · total_q`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dtype: DType,
        q: &Layout,
        k: &Layout,
        v: &Layout,
        o: &Layout,
        cu_seqlens_q: Option<&[i32]>,
        cu_seqlens_k: Option<&[i32]>,
        opts: &Options,
    ) -> Result<Problem> {
        if dtype == DType::Fp8E4M3 {
            return Err(Error::invalid(
                "dtype",
                "fp8 problems have their own constructor, Problem::new_fp8 (O is bf16 or fp16, \
                 and the call takes descales: Backend::forward_fp8)",
            ));
        }
        Self::build(dtype, q, k, v, o, cu_seqlens_q, cu_seqlens_k, opts)
    }

    /// An fp8 e4m3 problem (`docs/attention.md`, "FP8 (e4m3) inputs"): Q, K and V in e4m3, O
    /// in `out_dtype` (bf16 or fp16, else an error naming `out`); shapes as [`Problem::new`].
    #[allow(clippy::too_many_arguments)]
    pub fn new_fp8(
        out_dtype: DType,
        q: &Layout,
        k: &Layout,
        v: &Layout,
        o: &Layout,
        cu_seqlens_q: Option<&[i32]>,
        cu_seqlens_k: Option<&[i32]>,
        opts: &Options,
    ) -> Result<Problem> {
        Self::build(DType::F32, q, k, v, o, cu_seqlens_q, cu_seqlens_k, opts)?.as_fp8(out_dtype)
    }

    /// The same shapes as an fp8 problem with O in `out_dtype` (bf16 or fp16, else an error
    /// naming `out`).
    pub fn as_fp8(&self, out_dtype: DType) -> Result<Problem> {
        if !matches!(out_dtype, DType::Bf16 | DType::F16) {
            return Err(Error::invalid(
                "out",
                format!("O of fp8 inputs is bf16 or fp16, not {out_dtype}"),
            ));
        }
        Ok(Problem {
            dtype: DType::Fp8E4M3,
            out_dtype,
            ..self.clone()
        })
    }

    /// The same problem with other storage dtypes (the CPU's fp8 path runs it in f32).
    pub(crate) fn with_dtype(&self, dtype: DType) -> Problem {
        Problem {
            dtype,
            out_dtype: dtype,
            ..self.clone()
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        dtype: DType,
        q: &Layout,
        k: &Layout,
        v: &Layout,
        o: &Layout,
        cu_seqlens_q: Option<&[i32]>,
        cu_seqlens_k: Option<&[i32]>,
        opts: &Options,
    ) -> Result<Problem> {
        let packed = q.packed;
        for (name, l) in [("k", k), ("v", v), ("out", o)] {
            if l.packed != packed {
                return Err(Error::invalid(
                    name,
                    format!(
                        "is {} but q is {}: all tensors must use the same form",
                        dims_name(l.packed),
                        dims_name(packed)
                    ),
                ));
            }
        }
        let [b, sq, hq, d] = q.dims;
        let [bk, sk, hkv, dk] = k.dims;
        let [bv, skv, hv, dv] = v.dims;
        let [bo, so, ho, dvo] = o.dims;
        let shape_err = |name: &str, want: String, got: [usize; 4]| {
            let got = if packed {
                got[1..].to_vec()
            } else {
                got.to_vec()
            };
            Error::invalid(name, format!("expected shape {want}, got {got:?}"))
        };
        let fmt = |bb: usize, s: usize, h: usize, dd: usize| {
            if packed {
                format!("[{s}, {h}, {dd}]")
            } else {
                format!("[{bb}, {s}, {h}, {dd}]")
            }
        };
        if hq == 0 {
            return Err(Error::invalid("q", "heads_q must be at least 1"));
        }
        if hkv == 0 || hq % hkv != 0 {
            return Err(Error::invalid(
                "k",
                format!("heads_kv {hkv} must be ≥ 1 and divide heads_q {hq} (GQA/MQA)"),
            ));
        }
        if !(1..=MAX_HEAD_DIM).contains(&d) {
            return Err(Error::invalid(
                "q",
                format!("head_dim {d} is outside 1..={MAX_HEAD_DIM}"),
            ));
        }
        if (bk, dk) != (b, d) {
            return Err(shape_err("k", fmt(b, sk, hkv, d), k.dims));
        }
        if !(1..=MAX_HEAD_DIM).contains(&dv) {
            return Err(Error::invalid(
                "v",
                format!("head_dim_v {dv} is outside 1..={MAX_HEAD_DIM}"),
            ));
        }
        if (bv, skv, hv) != (b, sk, hkv) {
            return Err(shape_err("v", fmt(b, sk, hkv, dv), v.dims));
        }
        if (bo, so, ho, dvo) != (b, sq, hq, dv) {
            return Err(shape_err("out", fmt(b, sq, hq, dv), o.dims));
        }
        if !non_overlapping(o) {
            return Err(Error::invalid(
                "out",
                format!("strides {:?} make distinct elements overlap", o.strides),
            ));
        }

        let (seqs, total_q, lse_batch_stride, lse_head_stride) = if packed {
            let (Some(cq), Some(ck)) = (cu_seqlens_q, cu_seqlens_k) else {
                let missing = if cu_seqlens_q.is_none() {
                    "cu_seqlens_q"
                } else {
                    "cu_seqlens_k"
                };
                return Err(Error::invalid(
                    missing,
                    "packed [total, heads, dim] tensors need cu_seqlens_q and cu_seqlens_k",
                ));
            };
            let cq = cu_seqlens("cu_seqlens_q", cq, sq)?;
            let ck = cu_seqlens("cu_seqlens_k", ck, sk)?;
            if cq.len() != ck.len() {
                return Err(Error::invalid(
                    "cu_seqlens_k",
                    format!(
                        "has {} entries but cu_seqlens_q has {}: both are batch + 1",
                        ck.len(),
                        cq.len()
                    ),
                ));
            }
            let mut seqs = sequence_list("cu_seqlens_q", cq.len() - 1)?;
            seqs.extend((0..cq.len() - 1).map(|i| Sequence {
                batch_index: 0,
                q_start: cq[i],
                q_len: cq[i + 1] - cq[i],
                k_start: ck[i],
                k_len: ck[i + 1] - ck[i],
            }));
            (seqs, sq, 0, sq)
        } else {
            for (name, cu) in [
                ("cu_seqlens_q", cu_seqlens_q),
                ("cu_seqlens_k", cu_seqlens_k),
            ] {
                if cu.is_some() {
                    return Err(Error::invalid(
                        name,
                        "given with [batch, seqlen, heads, dim] tensors; varlen tensors are packed [total, heads, dim]",
                    ));
                }
            }
            let hs = hq.checked_mul(sq);
            let total = hs.and_then(|x| x.checked_mul(b));
            let (Some(hs), Some(total)) = (hs, total) else {
                return Err(Error::invalid("q", "shape overflows"));
            };
            let mut seqs = sequence_list("q", b)?;
            seqs.extend((0..b).map(|bi| Sequence {
                batch_index: bi,
                q_start: 0,
                q_len: sq,
                k_start: 0,
                k_len: sk,
            }));
            (seqs, total / hq, hs, sq)
        };

        let scale = match opts.scale {
            None => 1.0 / (d as f32).sqrt(),
            Some(s) if s.is_finite() => s,
            Some(s) => return Err(Error::invalid("scale", format!("must be finite, got {s}"))),
        };
        let softcap = match opts.softcap {
            None => None,
            Some(c) if c.is_finite() && c > 0.0 => Some(c),
            Some(c) => {
                return Err(Error::invalid(
                    "softcap",
                    format!("must be finite and > 0, got {c}"),
                ))
            }
        };

        Ok(Problem {
            dtype,
            out_dtype: dtype,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            head_dim_v: dv,
            q: *q,
            k: *k,
            v: *v,
            o: *o,
            varlen: packed,
            seqs,
            total_q,
            lse_batch_stride,
            lse_head_stride,
            mask: opts.mask,
            scale,
            softcap,
        })
    }

    /// Storage dtype of O: [`Problem::dtype`] but for fp8 problems (bf16 or fp16).
    pub fn out_dtype(&self) -> DType {
        self.out_dtype
    }

    /// [`Problem::check_buffers`] for an fp8 problem whose O buffer holds elements of `out`
    /// (which must be [`Problem::out_dtype`]; an error naming `out` otherwise).
    pub fn check_fp8_buffers(
        &self,
        out: DType,
        q: usize,
        k: usize,
        v: usize,
        o: usize,
        lse: Option<usize>,
    ) -> Result<()> {
        if self.out_dtype != out {
            return Err(Error::invalid(
                "out",
                format!(
                    "element type {out} does not match the problem's O ({})",
                    self.out_dtype
                ),
            ));
        }
        self.check_buffers(DType::Fp8E4M3, q, k, v, o, lse)
    }

    /// Storage dtype of Q, K, V and O.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Query heads.
    pub fn heads_q(&self) -> usize {
        self.heads_q
    }
    /// Key/value heads.
    pub fn heads_kv(&self) -> usize {
        self.heads_kv
    }
    /// Query heads per KV head; query head `h` reads KV head `h / group`.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    /// Head dimension of Q and K.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Head dimension of V and O.
    pub fn head_dim_v(&self) -> usize {
        self.head_dim_v
    }
    /// Layout of Q.
    pub fn q_layout(&self) -> &Layout {
        &self.q
    }
    /// Layout of K.
    pub fn k_layout(&self) -> &Layout {
        &self.k
    }
    /// Layout of V.
    pub fn v_layout(&self) -> &Layout {
        &self.v
    }
    /// Layout of O.
    pub fn o_layout(&self) -> &Layout {
        &self.o
    }
    /// Whether the batch is packed variable-length.
    pub fn is_varlen(&self) -> bool {
        self.varlen
    }
    /// The sequences of the batch.
    pub fn sequences(&self) -> &[Sequence] {
        &self.seqs
    }
    /// The mask.
    pub fn mask(&self) -> Mask {
        self.mask
    }
    /// The mask bound to one sequence.
    pub fn seq_mask(&self, s: &Sequence) -> SeqMask {
        self.mask.for_sequence(s.q_len, s.k_len)
    }
    /// Score scale (resolved: `1/sqrt(head_dim)` unless given).
    pub fn scale(&self) -> f32 {
        self.scale
    }
    /// Softcap, if any.
    pub fn softcap(&self) -> Option<f32> {
        self.softcap
    }
    /// Elements the LSE output holds: `batch · heads_q · seqlen_q`, or `heads_q · total_q`.
    pub fn lse_len(&self) -> usize {
        self.heads_q * self.total_q
    }
    /// Offset in the LSE output of `(sequence, head, row)`.
    #[inline]
    pub fn lse_offset(&self, s: &Sequence, head: usize, row: usize) -> usize {
        s.batch_index * self.lse_batch_stride + head * self.lse_head_stride + s.q_start + row
    }
    /// `(batch, head)` element strides of the LSE output (rows are contiguous from a sequence's
    /// `q_start`).
    pub fn lse_strides(&self) -> (usize, usize) {
        (self.lse_batch_stride, self.lse_head_stride)
    }
    /// The shape of the LSE output as the spec writes it.
    pub fn lse_shape(&self) -> Vec<usize> {
        if self.varlen {
            vec![self.heads_q, self.total_q]
        } else {
            vec![self.seqs.len(), self.heads_q, self.q.dims[1]]
        }
    }
    /// Checks buffers against the problem before a backend touches them: the element type, and
    /// that Q, K, V and O hold their layouts' extents and LSE (if any) its length.
    pub fn check_buffers(
        &self,
        dtype: DType,
        q: usize,
        k: usize,
        v: usize,
        out: usize,
        lse: Option<usize>,
    ) -> Result<()> {
        if dtype != self.dtype {
            return Err(Error::invalid(
                "q",
                format!(
                    "element type {dtype} does not match the problem's {}",
                    self.dtype
                ),
            ));
        }
        self.q.check_fits("q", q)?;
        self.k.check_fits("k", k)?;
        self.v.check_fits("v", v)?;
        self.o.check_fits("out", out)?;
        match lse {
            Some(n) if n != self.lse_len() => Err(Error::invalid(
                "lse",
                format!(
                    "expected {} elements (shape {:?}), got {n}",
                    self.lse_len(),
                    self.lse_shape()
                ),
            )),
            _ => Ok(()),
        }
    }
    /// Floating-point operations by the FlashAttention papers' convention, the one number every
    /// benchmark divides by: `2·sq·sk·(d + dv)` per head and sequence (`4·sq·sk·d` when
    /// `dv = d`), halved for causal; a window counts its allowed score elements exactly.
    pub fn flops(&self) -> f64 {
        let per_pair = 2.0 * (self.head_dim + self.head_dim_v) as f64 * self.heads_q as f64;
        let pairs: f64 = self
            .seqs
            .iter()
            .map(|s| match self.mask {
                // In f64: `q_len · k_len` can overflow usize when both are huge.
                Mask::None => s.q_len as f64 * s.k_len as f64,
                Mask::Causal => s.q_len as f64 * s.k_len as f64 / 2.0,
                Mask::Window { .. } => {
                    let m = self.seq_mask(s);
                    (0..s.q_len).map(|i| m.key_range(i).len() as f64).sum()
                }
            })
            .sum();
        per_pair * pairs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(shape: &[usize]) -> Layout {
        Layout::new("t", shape, None).unwrap()
    }

    #[test]
    fn overlap_detection() {
        assert!(non_overlapping(&l(&[2, 3, 4, 5])));
        let mut x = l(&[2, 3, 4, 5]);
        x.strides[2] = 0;
        assert!(!non_overlapping(&x));
        x.strides[2] = 4;
        assert!(!non_overlapping(&x));
        // A view into a wider buffer (fused QKV) is fine.
        let y = Layout::new("t", &[2, 3, 4, 5], Some(&[3 * 4 * 15, 4 * 15, 15, 1])).unwrap();
        assert!(non_overlapping(&y));
    }

    #[test]
    fn flops_match_the_convention() {
        let (q, k) = (l(&[2, 64, 4, 32]), l(&[2, 64, 2, 32]));
        let p = Problem::new(DType::F32, &q, &k, &k, &q, None, None, &Options::new()).unwrap();
        assert_eq!(p.flops(), 4.0 * 2.0 * 4.0 * 64.0 * 64.0 * 32.0);
        let p = Problem::new(
            DType::F32,
            &q,
            &k,
            &k,
            &q,
            None,
            None,
            &Options::new().causal(),
        )
        .unwrap();
        assert_eq!(p.flops(), 4.0 * 2.0 * 4.0 * 64.0 * 64.0 * 32.0 / 2.0);
    }
}
