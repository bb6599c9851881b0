//! Attention over a paged KV cache: decode, speculative decode and chunked prefill.
//!
//! A serving engine keeps each sequence's keys and values in fixed-size pages of one shared pool
//! (the layout of vLLM and FlashAttention):
//!
//! - `k_cache`: `[num_pages, page_size, heads_kv, head_dim]`, `v_cache`: `[num_pages, page_size,
//!   heads_kv, head_dim_v]` (last dim contiguous, other strides free; any `page_size ≥ 1`)
//! - `page_table`: `[batch, max_pages_per_seq]` int32, row-major: key `j` of sequence `b` is slot
//!   `j % page_size` of page `page_table[b][j / page_size]`
//! - `seqlens_k`: `[batch]` int32, the keys of each sequence
//!
//! Queries are `[batch, seqlen_q, heads_q, head_dim]`, or packed `[total_q, heads_q, head_dim]`
//! with `cu_seqlens_q` (`batch + 1` offsets); O has Q's shape with `head_dim_v`; LSE (natural
//! log) is `[batch, heads_q, seqlen_q]` or `[heads_q, total_q]`, as in [`Backend::forward`].
//! Masks, softcap, scale and GQA are the forward's ([`Options`]), and masks align to the
//! bottom-right corner of each sequence's `seqlen_q × seqlens_k[b]` (the new queries are the
//! last keys' positions).
//!
//! Validation ([`PagedKv::new`]): every page a sequence uses (the first
//! `ceil(seqlens_k[b] / page_size)` entries of its row) must lie in `0..num_pages`, else an error
//! names `page_table`; `seqlens_k[b]` must be in `0..=max_pages_per_seq · page_size`, else an error
//! names `seqlens_k`. Entries past the pages a sequence uses are neither read nor validated
//! (engines leave them stale or −1). A page may appear in several rows or twice in one row
//! (prefix sharing, or any table whose maths is well defined): reads never conflict. Writes do:
//! [`append`] rejects a call that would write one slot twice.
//!
//! ```
//! use fa4::paged::{PagedKv, PagedOptions};
//! use fa4::{Backend, Options, Tensor, TensorMut};
//!
//! // Two sequences of 5 and 2 keys in pages of 4: sequence 0 owns pages 2 and 0, sequence 1
//! // page 1 (its second table entry is unused and may be anything).
//! let (pages, page_size, heads_kv, d) = (3, 4, 1, 8);
//! let k = vec![0.5f32; pages * page_size * heads_kv * d];
//! let v = vec![1.0f32; pages * page_size * heads_kv * d];
//! let kv = PagedKv::new(
//!     Tensor::new(&k, &[pages, page_size, heads_kv, d])?,
//!     Tensor::new(&v, &[pages, page_size, heads_kv, d])?,
//!     &[2, 0, 1, -1], // page_table [batch 2, max_pages_per_seq 2]
//!     2,
//!     &[5, 2],        // seqlens_k
//! )?;
//! // One decode step: seqlen_q 1, 4 query heads sharing the KV head (GQA).
//! let q = vec![0.1f32; 2 * 4 * d];
//! let mut o = vec![0f32; 2 * 4 * d];
//! let mut lse = vec![0f32; 2 * 4];
//! let plan = Backend::Cpu.forward_paged(
//!     &Tensor::new(&q, &[2, 1, 4, d])?,
//!     &kv,
//!     None,
//!     &mut TensorMut::new(&mut o, &[2, 1, 4, d])?,
//!     Some(&mut lse),
//!     &PagedOptions::new(Options::new().causal()).num_splits(2),
//! )?;
//! assert_eq!(plan.num_splits, 2);
//! assert!(o.iter().all(|&x| (x - 1.0).abs() < 1e-6)); // every value row is 1
//! // Equal scores: LSE = score + ln(keys).
//! let score = 0.1 * 0.5 * d as f32 / (d as f32).sqrt();
//! assert!((lse[0] - (score + 5f32.ln())).abs() < 1e-5);
//! # Ok::<(), fa4::Error>(())
//! ```
//!
//! What runs where: the CPU backend ([`Backend::Cpu`]) runs everything here (paged gather, GQA
//! packing, split-KV merged by [`crate::combine`]); [`Backend::Cuda`] runs the GPU decode
//! kernels (fp16/bf16 queries, head dims 64/128/256, a cache of the queries' type or fp8 e4m3;
//! see [`crate::cuda::decode`] and [`crate::config::decode_gpu`]) and refuses other problems
//! with an error naming the argument (no silent fallback to the CPU: a caller that asked for
//! the GPU should know it did not get it).

mod cpu;
mod fp8;
pub mod random;
pub mod reference;

use crate::backend::Backend;
use crate::config::decode::{self, DecodePlan, DecodeShape};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::mask::SeqMask;
use crate::problem::{Options, Sequence, MAX_HEAD_DIM};
use crate::tensor::{Element, Layout, Tensor, TensorMut};

pub use cpu::CPU_TILES;
pub use fp8::{append_fp8, quantize_cache, KvScales};

/// Options of a paged call: the attention options and, optionally, a forced split count.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PagedOptions {
    /// Mask, scale, softcap.
    pub attention: Options,
    /// Splits over the keys, `1..=MAX_SPLITS`; `None` asks the planner ([`crate::config::decode`]).
    pub num_splits: Option<usize>,
}

impl PagedOptions {
    /// The planner's split count.
    pub fn new(attention: Options) -> Self {
        PagedOptions {
            attention,
            num_splits: None,
        }
    }
    /// Forces the split count.
    pub fn num_splits(mut self, n: usize) -> Self {
        self.num_splits = Some(n);
        self
    }
}

/// The cache's shape and the validated page table, independent of the element type.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedCache {
    k: Layout,
    v: Layout,
    num_pages: usize,
    page_size: usize,
    heads_kv: usize,
    head_dim: usize,
    head_dim_v: usize,
    max_pages: usize,
    /// `[batch][max_pages]`, entries past a sequence's used pages unvalidated.
    table: Vec<i32>,
    seqlens: Vec<usize>,
}

/// Checks `n ≤ i32::MAX` for int32 inputs' arithmetic.
fn i32_len(name: &str, v: i32, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid(name, format!("{what} is negative ({v})")))
}

impl PagedCache {
    /// Validates the cache layouts, `page_table` (`[seqlens_k.len(), max_pages_per_seq]`) and
    /// `seqlens_k` (see the module docs).
    pub fn new(
        k_cache: &Layout,
        v_cache: &Layout,
        page_table: &[i32],
        max_pages_per_seq: usize,
        seqlens_k: &[i32],
    ) -> Result<PagedCache> {
        for (name, l) in [("k_cache", k_cache), ("v_cache", v_cache)] {
            if l.packed {
                return Err(Error::invalid(
                    name,
                    format!(
                        "expected [num_pages, page_size, heads_kv, dim], got rank 3 {:?}",
                        &l.dims[1..]
                    ),
                ));
            }
        }
        let [num_pages, page_size, heads_kv, head_dim] = k_cache.dims;
        let [vp, vs, vh, head_dim_v] = v_cache.dims;
        if page_size == 0 {
            return Err(Error::invalid("k_cache", "page_size (dim 1) must be ≥ 1"));
        }
        if heads_kv == 0 {
            return Err(Error::invalid("k_cache", "heads_kv (dim 2) must be ≥ 1"));
        }
        for (name, d) in [("k_cache", head_dim), ("v_cache", head_dim_v)] {
            if !(1..=MAX_HEAD_DIM).contains(&d) {
                return Err(Error::invalid(
                    name,
                    format!("head dim {d} is outside 1..={MAX_HEAD_DIM}"),
                ));
            }
        }
        if (vp, vs, vh) != (num_pages, page_size, heads_kv) {
            return Err(Error::invalid(
                "v_cache",
                format!(
                    "expected [{num_pages}, {page_size}, {heads_kv}, head_dim_v] like k_cache, got {:?}",
                    v_cache.dims
                ),
            ));
        }
        let batch = seqlens_k.len();
        let cells = batch.checked_mul(max_pages_per_seq);
        if cells != Some(page_table.len()) {
            return Err(Error::invalid(
                "page_table",
                format!(
                    "expected [batch {batch}, max_pages_per_seq {max_pages_per_seq}] = {} \
                     entries, got {}",
                    cells.map_or("overflowing".into(), |c| c.to_string()),
                    page_table.len()
                ),
            ));
        }
        let capacity = max_pages_per_seq.checked_mul(page_size);
        let mut seqlens = Vec::with_capacity(batch);
        for (b, &len) in seqlens_k.iter().enumerate() {
            let len = i32_len("seqlens_k", len, &format!("entry {b}"))?;
            if capacity.is_some_and(|c| len > c) {
                return Err(Error::invalid(
                    "seqlens_k",
                    format!(
                        "entry {b} is {len}, more than max_pages_per_seq {max_pages_per_seq} × \
                         page_size {page_size} = {} keys",
                        capacity.unwrap_or(usize::MAX)
                    ),
                ));
            }
            let used = len.div_ceil(page_size);
            let row = &page_table[b * max_pages_per_seq..b * max_pages_per_seq + used];
            if let Some((j, &page)) = row
                .iter()
                .enumerate()
                .find(|&(_, &p)| p < 0 || p as usize >= num_pages)
            {
                return Err(Error::invalid(
                    "page_table",
                    format!(
                        "entry [{b}, {j}] is page {page}, outside 0..{num_pages} (num_pages); \
                         sequence {b} uses its first {used} entries"
                    ),
                ));
            }
            seqlens.push(len);
        }
        k_cache
            .extent()
            .ok_or_else(|| Error::invalid("k_cache", "shape and strides overflow usize"))?;
        v_cache
            .extent()
            .ok_or_else(|| Error::invalid("v_cache", "shape and strides overflow usize"))?;
        Ok(PagedCache {
            k: *k_cache,
            v: *v_cache,
            num_pages,
            page_size,
            heads_kv,
            head_dim,
            head_dim_v,
            max_pages: max_pages_per_seq,
            table: page_table.to_vec(),
            seqlens,
        })
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.seqlens.len()
    }
    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }
    /// Keys per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// KV heads.
    pub fn heads_kv(&self) -> usize {
        self.heads_kv
    }
    /// Head dim of K.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Head dim of V.
    pub fn head_dim_v(&self) -> usize {
        self.head_dim_v
    }
    /// Entries per row of the page table.
    pub fn max_pages_per_seq(&self) -> usize {
        self.max_pages
    }
    /// Keys of each sequence.
    pub fn seqlens_k(&self) -> &[usize] {
        &self.seqlens
    }
    /// Layout of the K cache.
    pub fn k_layout(&self) -> &Layout {
        &self.k
    }
    /// Layout of the V cache.
    pub fn v_layout(&self) -> &Layout {
        &self.v
    }
    /// The page table, `[batch, max_pages_per_seq]` row-major (entries past a sequence's used
    /// pages unvalidated).
    pub fn page_table(&self) -> &[i32] {
        &self.table
    }
    /// The page holding key `j` of sequence `b` (`j < seqlens_k[b]`: validated).
    #[inline]
    pub fn page(&self, b: usize, j: usize) -> usize {
        self.table[b * self.max_pages + j / self.page_size] as usize
    }
    /// Element offset in the K cache of key `j`, KV head `h` of sequence `b`.
    #[inline]
    pub fn k_offset(&self, b: usize, j: usize, h: usize) -> usize {
        self.k.offset(self.page(b, j), j % self.page_size, h)
    }
    /// Element offset in the V cache of key `j`, KV head `h` of sequence `b`.
    #[inline]
    pub fn v_offset(&self, b: usize, j: usize, h: usize) -> usize {
        self.v.offset(self.page(b, j), j % self.page_size, h)
    }
    /// Bytes of K and V a call reads: every key of every sequence, all KV heads (the decode
    /// bandwidth's numerator).
    pub fn kv_bytes(&self, elem_bytes: usize) -> f64 {
        let keys: usize = self.seqlens.iter().sum();
        keys as f64
            * self.heads_kv as f64
            * (self.head_dim + self.head_dim_v) as f64
            * elem_bytes as f64
    }
}

/// A paged KV cache over host slices: [`PagedCache`] plus the data.
#[derive(Debug, Clone)]
pub struct PagedKv<'a, T> {
    cache: PagedCache,
    k: &'a [T],
    v: &'a [T],
}

impl<'a, T: crate::tensor::Storage> PagedKv<'a, T> {
    /// Validates a cache (see the module docs): `k_cache` `[num_pages, page_size, heads_kv,
    /// head_dim]`, `v_cache` `[num_pages, page_size, heads_kv, head_dim_v]`, `page_table`
    /// `[seqlens_k.len(), max_pages_per_seq]` row-major, `seqlens_k` `[batch]`.
    pub fn new(
        k_cache: Tensor<'a, T>,
        v_cache: Tensor<'a, T>,
        page_table: &[i32],
        max_pages_per_seq: usize,
        seqlens_k: &[i32],
    ) -> Result<Self> {
        let cache = PagedCache::new(
            k_cache.layout(),
            v_cache.layout(),
            page_table,
            max_pages_per_seq,
            seqlens_k,
        )?;
        Ok(PagedKv {
            cache,
            k: k_cache.data(),
            v: v_cache.data(),
        })
    }
    /// The validated shape and table.
    pub fn cache(&self) -> &PagedCache {
        &self.cache
    }
    /// The K cache's elements.
    pub fn k_data(&self) -> &'a [T] {
        self.k
    }
    /// The V cache's elements.
    pub fn v_data(&self) -> &'a [T] {
        self.v
    }
}

/// A validated paged attention problem (queries, output and cache shape); backends trust it.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedProblem {
    dtype: DType,
    kv_dtype: DType,
    cache: PagedCache,
    heads_q: usize,
    q: Layout,
    o: Layout,
    varlen: bool,
    seqs: Vec<Sequence>,
    total_q: usize,
    lse_batch_stride: usize,
    lse_head_stride: usize,
    opts: Options,
    scale: f32,
    softcap: Option<f32>,
}

impl PagedProblem {
    /// Validates queries `q` (`[batch, seqlen_q, heads_q, head_dim]`, or `[total_q, heads_q,
    /// head_dim]` with `cu_seqlens_q`) and output `o` against a cache.
    pub fn new(
        dtype: DType,
        q: &Layout,
        o: &Layout,
        cache: &PagedCache,
        cu_seqlens_q: Option<&[i32]>,
        opts: &Options,
    ) -> Result<PagedProblem> {
        if dtype == DType::Fp8E4M3 {
            return Err(Error::invalid(
                "dtype",
                "fp8 is planned for but not computed yet",
            ));
        }
        let [qb, sq, hq, d] = q.dims;
        let batch = cache.batch();
        if hq == 0 || hq % cache.heads_kv != 0 {
            return Err(Error::invalid(
                "q",
                format!(
                    "heads_q {hq} must be a positive multiple of the cache's heads_kv {} (GQA/MQA)",
                    cache.heads_kv
                ),
            ));
        }
        if d != cache.head_dim {
            return Err(Error::invalid(
                "q",
                format!("head_dim {d} differs from k_cache's {}", cache.head_dim),
            ));
        }
        if o.packed != q.packed {
            return Err(Error::invalid(
                "out",
                "must have q's rank (3 with cu_seqlens_q, else 4)",
            ));
        }
        if (o.dims[0], o.dims[1], o.dims[2], o.dims[3]) != (qb, sq, hq, cache.head_dim_v) {
            let want: Vec<usize> = if q.packed {
                vec![sq, hq, cache.head_dim_v]
            } else {
                vec![qb, sq, hq, cache.head_dim_v]
            };
            return Err(Error::invalid(
                "out",
                format!(
                    "expected shape {want:?}, got {:?}",
                    if o.packed { &o.dims[1..] } else { &o.dims[..] }
                ),
            ));
        }
        let overlap_free = non_overlapping(o);
        if !overlap_free {
            return Err(Error::invalid(
                "out",
                format!(
                    "strides {:?} make distinct elements overlap (heads within a row, rows \
                     within a sequence)",
                    o.strides
                ),
            ));
        }
        let seqs: Vec<Sequence> = if q.packed {
            let Some(cu) = cu_seqlens_q else {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    "packed [total_q, heads_q, head_dim] queries need cu_seqlens_q",
                ));
            };
            if cu.len() != batch + 1 {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    format!(
                        "has {} entries; seqlens_k's batch {batch} needs batch + 1",
                        cu.len()
                    ),
                ));
            }
            if cu[0] != 0 {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    format!("must start at 0, starts at {}", cu[0]),
                ));
            }
            let mut seqs = Vec::with_capacity(batch);
            for b in 0..batch {
                if cu[b + 1] < cu[b] {
                    return Err(Error::invalid(
                        "cu_seqlens_q",
                        format!(
                            "must be non-decreasing: entry {} is {} after {}",
                            b + 1,
                            cu[b + 1],
                            cu[b]
                        ),
                    ));
                }
                seqs.push(Sequence {
                    batch_index: 0,
                    q_start: cu[b] as usize,
                    q_len: (cu[b + 1] - cu[b]) as usize,
                    k_start: 0,
                    k_len: cache.seqlens[b],
                });
            }
            if cu[batch] as usize != sq {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    format!("last entry {} must equal q's total rows {sq}", cu[batch]),
                ));
            }
            seqs
        } else {
            if cu_seqlens_q.is_some() {
                return Err(Error::invalid(
                    "cu_seqlens_q",
                    "given with [batch, seqlen_q, heads_q, head_dim] queries; varlen queries are \
                     packed [total_q, heads_q, head_dim]",
                ));
            }
            if qb != batch {
                return Err(Error::invalid(
                    "q",
                    format!("batch {qb} differs from seqlens_k's {batch}"),
                ));
            }
            (0..batch)
                .map(|b| Sequence {
                    batch_index: b,
                    q_start: 0,
                    q_len: sq,
                    k_start: 0,
                    k_len: cache.seqlens[b],
                })
                .collect()
        };
        let total_q = if q.packed {
            sq
        } else {
            qb.checked_mul(sq)
                .ok_or_else(|| Error::invalid("q", "shape overflows"))?
        };
        total_q
            .checked_mul(hq)
            .and_then(|x| x.checked_mul(d.max(cache.head_dim_v)))
            .ok_or_else(|| Error::invalid("q", "shape overflows"))?;
        let (lse_batch_stride, lse_head_stride) = if q.packed { (0, sq) } else { (hq * sq, sq) };
        let scale = match opts.get_scale() {
            None => 1.0 / (d as f32).sqrt(),
            Some(s) if s.is_finite() => s,
            Some(s) => return Err(Error::invalid("scale", format!("must be finite, got {s}"))),
        };
        let softcap = match opts.get_softcap() {
            None => None,
            Some(c) if c.is_finite() && c > 0.0 => Some(c),
            Some(c) => {
                return Err(Error::invalid(
                    "softcap",
                    format!("must be finite and > 0, got {c}"),
                ))
            }
        };
        Ok(PagedProblem {
            dtype,
            kv_dtype: dtype,
            cache: cache.clone(),
            heads_q: hq,
            q: *q,
            o: *o,
            varlen: q.packed,
            seqs,
            total_q,
            lse_batch_stride,
            lse_head_stride,
            opts: *opts,
            scale,
            softcap,
        })
    }

    /// Storage dtype of the queries and O (and of the cache, unless [`Self::kv_dtype`] says
    /// fp8).
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The same problem over an fp8 e4m3 cache (bytes in the cache's layouts, with per-KV-head
    /// scales: [`KvScales`]); the queries and O keep [`Self::dtype`]. What
    /// [`Backend::forward_paged_fp8`] runs, and the GPU's fp8 entries
    /// (`CudaBackend::forward_paged_fp8_device`) take.
    pub fn with_fp8_cache(mut self) -> PagedProblem {
        self.kv_dtype = DType::Fp8E4M3;
        self
    }
    /// The cache's element type: [`Self::dtype`], or fp8 e4m3 for a problem made
    /// [`Self::with_fp8_cache`].
    pub fn kv_dtype(&self) -> DType {
        self.kv_dtype
    }
    /// The cache.
    pub fn cache(&self) -> &PagedCache {
        &self.cache
    }
    /// Query heads.
    pub fn heads_q(&self) -> usize {
        self.heads_q
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads_q / self.cache.heads_kv
    }
    /// Layout of Q.
    pub fn q_layout(&self) -> &Layout {
        &self.q
    }
    /// Layout of O.
    pub fn o_layout(&self) -> &Layout {
        &self.o
    }
    /// Whether the queries are packed varlen.
    pub fn is_varlen(&self) -> bool {
        self.varlen
    }
    /// The sequences (`k_start` is 0: keys live in pages; `k_len` is `seqlens_k[b]`).
    pub fn sequences(&self) -> &[Sequence] {
        &self.seqs
    }
    /// The attention options as given.
    pub fn options(&self) -> &Options {
        &self.opts
    }
    /// The mask bound to one sequence (bottom-right against its `seqlens_k`).
    pub fn seq_mask(&self, s: &Sequence) -> SeqMask {
        self.opts.get_mask().for_sequence(s.q_len, s.k_len)
    }
    /// Resolved scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }
    /// Softcap, if any.
    pub fn softcap(&self) -> Option<f32> {
        self.softcap
    }
    /// Query rows over all sequences.
    pub fn total_q(&self) -> usize {
        self.total_q
    }
    /// Elements of the LSE output.
    pub fn lse_len(&self) -> usize {
        self.heads_q * self.total_q
    }
    /// Shape of the LSE output.
    pub fn lse_shape(&self) -> Vec<usize> {
        if self.varlen {
            vec![self.heads_q, self.total_q]
        } else {
            vec![self.seqs.len(), self.heads_q, self.q.dims[1]]
        }
    }
    /// Offset in the LSE output of `(sequence, head, row)`.
    #[inline]
    pub fn lse_offset(&self, s: &Sequence, head: usize, row: usize) -> usize {
        s.batch_index * self.lse_batch_stride + head * self.lse_head_stride + s.q_start + row
    }
    /// The decode shape the planner sees (longest sequences).
    pub fn decode_shape(&self) -> DecodeShape {
        DecodeShape {
            batch: self.seqs.len(),
            seqlen_q: self.seqs.iter().map(|s| s.q_len).max().unwrap_or(0),
            seqlen_k: self.seqs.iter().map(|s| s.k_len).max().unwrap_or(0),
            heads_q: self.heads_q,
            heads_kv: self.cache.heads_kv,
        }
    }
    /// Checks buffer sizes and the element type before a backend touches them.
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
        self.cache.k.check_fits("k_cache", k)?;
        self.cache.v.check_fits("v_cache", v)?;
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
}

/// True when no two distinct elements of the layout share an offset (axes sorted by stride,
/// each must start past the extent of the smaller ones).
fn non_overlapping(l: &Layout) -> bool {
    let first = if l.packed { 1 } else { 0 };
    // No element, no overlap: a batch of zero query rows is a valid (empty) problem.
    if l.dims[first..].contains(&0) {
        return true;
    }
    let mut axes: Vec<(usize, usize)> = (first..3)
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

impl Backend {
    /// Attention of new queries over a paged KV cache (see the [module docs](crate::paged)):
    ///
    /// - `q`: `[batch, seqlen_q, heads_q, head_dim]`, or `[total_q, heads_q, head_dim]` with
    ///   `cu_seqlens_q` (`batch + 1` offsets from 0, non-decreasing, ending at `total_q`)
    /// - `kv`: the validated cache, `heads_q % heads_kv == 0`
    /// - `out`: Q's shape with `head_dim_v`, written
    /// - `lse`: `[batch, heads_q, seqlen_q]` or `[heads_q, total_q]` f32, written if given
    ///
    /// Returns the plan that ran (split count and why). On [`Backend::Cuda`] the GPU decode
    /// kernels run it (fp16/bf16, head dims 64/128/256, else an error naming the argument).
    pub fn forward_paged<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        kv: &PagedKv<'_, T>,
        cu_seqlens_q: Option<&[i32]>,
        out: &mut TensorMut<'_, T>,
        lse: Option<&mut [f32]>,
        opts: &PagedOptions,
    ) -> Result<DecodePlan> {
        let (o, ol) = out.parts();
        let p = PagedProblem::new(
            T::DTYPE,
            q.layout(),
            &ol,
            kv.cache(),
            cu_seqlens_q,
            &opts.attention,
        )?;
        self.run_paged(
            &p,
            q.data(),
            kv.k_data(),
            kv.v_data(),
            o,
            lse,
            opts.num_splits,
        )
    }

    /// Runs a validated paged problem on slices laid out as it says.
    #[allow(clippy::too_many_arguments)]
    pub fn run_paged<T: Element>(
        &self,
        p: &PagedProblem,
        q: &[T],
        k_cache: &[T],
        v_cache: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        p.check_buffers(
            T::DTYPE,
            q.len(),
            k_cache.len(),
            v_cache.len(),
            out.len(),
            lse.as_deref().map(<[f32]>::len),
        )?;
        if p.kv_dtype() != T::DTYPE {
            return Err(Error::invalid(
                "k_cache",
                format!(
                    "the problem's cache is {}: Backend::forward_paged_fp8 runs an fp8 cache",
                    p.kv_dtype()
                ),
            ));
        }
        let threads = match self {
            Backend::Cpu => rayon::current_num_threads(),
            Backend::CpuWith(c) => c.threads.unwrap_or_else(rayon::current_num_threads),
            Backend::Cuda(cuda) => {
                return cuda.forward_paged_host(p, q, k_cache, v_cache, out, lse, num_splits)
            }
        };
        let plan = decode::plan(p.decode_shape(), CPU_TILES, threads, num_splits)?;
        let run = || cpu::forward(p, &plan, q, k_cache, v_cache, out, lse);
        match self {
            Backend::CpuWith(c) if c.threads.is_some() => {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .map_err(|e| Error::invalid("threads", e.to_string()))?;
                pool.install(run);
            }
            _ => run(),
        }
        Ok(plan)
    }
}

/// Where an append writes: each new row's `(page, slot)` in order of `cu_new`'s rows, and the
/// new `seqlens_k`. Validated by [`append_targets`]; [`append`] and the GPU append
/// (`CudaBackend::append_paged`) copy by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendTargets {
    /// `(page, slot)` of new row `r` (rows of all sequences, packed by `cu_new`).
    pub slots: Vec<(usize, usize)>,
    /// The new `seqlens_k`.
    pub seqlens_k: Vec<i32>,
}

/// Writes new K and V rows into their pages at each sequence's current length.
///
/// - `k_cache`, `v_cache`: the cache's slices (`cache`'s layouts), written
/// - `cache`: the cache as it is now; `seqlens_k[b]` is where sequence `b`'s new rows go
/// - `k_new`: `[total_new, heads_kv, head_dim]`, `v_new`: `[total_new, heads_kv, head_dim_v]`,
///   contiguous; sequence `b`'s rows are `cu_new[b]..cu_new[b + 1]` (`batch + 1` offsets)
///
/// Every page the new rows land in must already be in the page table (an error naming
/// `page_table` otherwise, and nothing is written), the new lengths must fit
/// `max_pages_per_seq · page_size` (an error naming `cu_new`), and no slot may be written twice
/// (two sequences sharing the page being filled: an error naming `page_table`). Returns the new
/// `seqlens_k`. The caller keeps `cache`'s table; build a new [`PagedCache`] with the returned
/// lengths for the next call.
pub fn append<T: Element>(
    cache: &PagedCache,
    k_cache: &mut [T],
    v_cache: &mut [T],
    k_new: &[T],
    v_new: &[T],
    cu_new: &[i32],
) -> Result<Vec<i32>> {
    let c = cache;
    let t = append_targets(
        c,
        k_cache.len(),
        v_cache.len(),
        k_new.len(),
        v_new.len(),
        cu_new,
    )?;
    let (hkv, d, dv) = (c.heads_kv, c.head_dim, c.head_dim_v);
    for (row, &(page, slot)) in t.slots.iter().enumerate() {
        for h in 0..hkv {
            let ko = c.k.offset(page, slot, h);
            k_cache[ko..ko + d]
                .copy_from_slice(&k_new[(row * hkv + h) * d..(row * hkv + h + 1) * d]);
            let vo = c.v.offset(page, slot, h);
            v_cache[vo..vo + dv]
                .copy_from_slice(&v_new[(row * hkv + h) * dv..(row * hkv + h + 1) * dv]);
        }
    }
    Ok(t.seqlens_k)
}

/// The validation of [`append`] on buffer lengths alone (elements of `k_cache`, `v_cache`,
/// `k_new`, `v_new`): every check and error of [`append`], and where each new row goes.
pub fn append_targets(
    cache: &PagedCache,
    k_cache: usize,
    v_cache: usize,
    k_new: usize,
    v_new: usize,
    cu_new: &[i32],
) -> Result<AppendTargets> {
    let c = cache;
    c.k.check_fits("k_cache", k_cache)?;
    c.v.check_fits("v_cache", v_cache)?;
    let batch = c.batch();
    if cu_new.len() != batch + 1 || cu_new[0] != 0 {
        return Err(Error::invalid(
            "cu_new",
            format!(
                "expected batch + 1 = {} offsets starting at 0, got {:?}",
                batch + 1,
                &cu_new[..cu_new.len().min(4)]
            ),
        ));
    }
    let mut counts = Vec::with_capacity(batch);
    for b in 0..batch {
        if cu_new[b + 1] < cu_new[b] {
            return Err(Error::invalid(
                "cu_new",
                format!(
                    "must be non-decreasing: entry {} is {} after {}",
                    b + 1,
                    cu_new[b + 1],
                    cu_new[b]
                ),
            ));
        }
        counts.push((cu_new[b + 1] - cu_new[b]) as usize);
    }
    let total = cu_new[batch] as usize;
    let (hkv, d, dv) = (c.heads_kv, c.head_dim, c.head_dim_v);
    for (name, len, w) in [("k_new", k_new, d), ("v_new", v_new, dv)] {
        let want = total.checked_mul(hkv).and_then(|x| x.checked_mul(w));
        if want != Some(len) {
            return Err(Error::invalid(
                name,
                format!("expected [{total}, {hkv}, {w}] (cu_new's total rows), got {len} elements"),
            ));
        }
    }
    // Validate every target before writing anything.
    let capacity = c.max_pages.saturating_mul(c.page_size);
    let mut new_lens = Vec::with_capacity(batch);
    let mut targets = Vec::with_capacity(total);
    for (b, &count) in counts.iter().enumerate() {
        let old = c.seqlens[b];
        let new = old
            .checked_add(count)
            .filter(|&n| n <= capacity && n <= i32::MAX as usize);
        let Some(new) = new else {
            return Err(Error::invalid(
                "cu_new",
                format!(
                    "sequence {b} would grow from {old} to {} keys, past max_pages_per_seq {} × \
                     page_size {} = {capacity}",
                    old.saturating_add(count),
                    c.max_pages,
                    c.page_size
                ),
            ));
        };
        for j in old..new {
            let entry = c.table[b * c.max_pages + j / c.page_size];
            if entry < 0 || entry as usize >= c.num_pages {
                return Err(Error::invalid(
                    "page_table",
                    format!(
                        "entry [{b}, {}] is page {entry}, outside 0..{} (num_pages): sequence {b} \
                         needs it for key {j}",
                        j / c.page_size,
                        c.num_pages
                    ),
                ));
            }
            targets.push((entry as usize, j % c.page_size));
        }
        new_lens.push(new as i32);
    }
    let mut sorted = targets.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(
            "page_table",
            format!(
                "slot {} of page {} would be written twice in one append (a page shared by two \
                 sequences, or repeated in one row, where new keys go)",
                w[0].1, w[0].0
            ),
        ));
    }
    Ok(AppendTargets {
        slots: targets,
        seqlens_k: new_lens,
    })
}
