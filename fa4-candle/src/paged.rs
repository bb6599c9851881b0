//! Attention over a paged KV cache (decode, speculative decode, chunked prefill), on fa4's
//! paged decode: [`fa4::Backend::run_paged`] on the CPU, `CudaBackend::forward_paged_device` on
//! candle's stream for CUDA tensors (`cuda.rs`).
//!
//! The page table and the key lengths are read on the host, checked here for what only the
//! candle side knows (ranks, integer dtypes, values that do not fit fa4's `i32`), then validated
//! by fa4 ([`PagedCache::new`], [`PagedProblem::new`]), whose errors name the argument. Every
//! error also names the entry the caller used (`flash_attn_paged`, `attention_paged`, …).

use candle::{DType, Layout, Result, Shape, Tensor};

use fa4::paged::{PagedCache, PagedProblem};
use fa4::{Backend, Options};

use crate::op::{apply, custom_op3, fa4_layout, fa4_options, host_ints, AttnOp, LseSlot};
use crate::AttnOptions;

/// The paged attention op: options, the host copy of the table and lengths, and (if asked) a
/// slot for the LSE.
pub(crate) struct Fa4Paged {
    /// The public entry the caller used, for error messages.
    pub(crate) entry: &'static str,
    opts: Options,
    table: Vec<i32>,
    max_pages: usize,
    seqlens: Vec<i32>,
    pub(crate) num_splits: Option<usize>,
    lse: Option<LseSlot>,
}

impl AttnOp for Fa4Paged {
    type Problem = PagedProblem;
    const ARGS: [&'static str; 3] = ["q", "k_cache", "v_cache"];

    fn context(&self) -> String {
        format!("fa4-candle: {}", self.entry)
    }

    fn problem(
        &self,
        dtype: fa4::DType,
        ql: &Layout,
        kl: &Layout,
        vl: &Layout,
    ) -> Result<(PagedProblem, Shape)> {
        let (q, k, v) = (
            fa4_layout("q", ql)?,
            fa4_layout("k_cache", kl)?,
            fa4_layout("v_cache", vl)?,
        );
        let cache = PagedCache::new(&k, &v, &self.table, self.max_pages, &self.seqlens)
            .map_err(|e| self.err(e))?;
        let mut out_dims = ql.dims().to_vec();
        out_dims[3] = cache.head_dim_v();
        let o = fa4::tensor::Layout::new("out", &out_dims, None).map_err(|e| self.err(e))?;
        let p =
            PagedProblem::new(dtype, &q, &o, &cache, None, &self.opts).map_err(|e| self.err(e))?;
        Ok((p, Shape::from(out_dims)))
    }

    fn lse_slot(&self) -> Option<&LseSlot> {
        self.lse.as_ref()
    }

    fn run_cpu<T: fa4::Element>(
        &self,
        p: &PagedProblem,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> fa4::Result<()> {
        Backend::Cpu
            .run_paged(p, q, k, v, out, lse, self.num_splits)
            .map(drop)
    }
}

custom_op3!(Fa4Paged, "fa4-paged-attention");

/// Attention of new queries over a paged KV cache: `softmax(q·kᵀ·softmax_scale [+ causal
/// mask])·v` over each sequence's keys, gathered from their pages.
///
/// - `q`: `[batch, seqlen_q, heads_q, head_dim]` (seqlen_q 1 for decode; more for speculative
///   decode or chunked prefill)
/// - `k_cache`: `[num_pages, page_size, heads_kv, head_dim]`, `heads_q % heads_kv == 0`
/// - `v_cache`: `[num_pages, page_size, heads_kv, head_dim_v]`
/// - `page_table`: `[batch, max_pages_per_seq]`, integers (i64, u32, i32, …): key `j` of
///   sequence `b` is slot `j % page_size` of page `page_table[b][j / page_size]`. Only the
///   first `ceil(seqlens_k[b] / page_size)` entries of a row are read (they must be in
///   `0..num_pages`); the rest may hold anything (−1, stale pages).
/// - `seqlens_k`: `[batch]` integers, the keys of each sequence, at most `max_pages_per_seq ·
///   page_size`; 0 gives zeros (and an LSE of `-inf`)
///
/// The causal mask aligns to the bottom-right corner: the queries are the last `seqlen_q`
/// positions of each sequence. Returns `[batch, seqlen_q, heads_q, head_dim_v]` in `q`'s dtype.
/// `page_table` and `seqlens_k` are read on the host (a CUDA tensor costs a device-to-host copy,
/// which waits for the stream: keep them on the CPU). On CUDA (f16/bf16, head dims 64, 128,
/// 256) the caches must start at their storage's first element (a cache tensor of its own).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_paged(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let opts = AttnOptions::new(softmax_scale).causal_if(causal);
    let call = PagedCall::new(
        "flash_attn_paged",
        q,
        k_cache,
        v_cache,
        page_table,
        seqlens_k,
    );
    run(&call, &opts, None, false).map(|(o, _)| o)
}

/// [`flash_attn_paged`] that also returns the LSE `[batch, heads_q, seqlen_q]` (f32, natural
/// log).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_paged_with_lse(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let opts = AttnOptions::new(softmax_scale).causal_if(causal);
    let call = PagedCall::new(
        "flash_attn_paged_with_lse",
        q,
        k_cache,
        v_cache,
        page_table,
        seqlens_k,
    );
    with_lse(&call, run(&call, &opts, None, true)?)
}

/// Paged attention with every option (shapes as [`flash_attn_paged`]): windows, softcap, and
/// `num_splits`, the number of splits over the keys (`None` lets fa4's decode planner choose;
/// `Some(n)` forces `n`, within fa4's `1..=MAX_SPLITS`).
#[allow(clippy::too_many_arguments)]
pub fn attention_paged(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    opts: &AttnOptions,
    num_splits: Option<usize>,
) -> Result<Tensor> {
    let call = PagedCall::new(
        "attention_paged",
        q,
        k_cache,
        v_cache,
        page_table,
        seqlens_k,
    );
    run(&call, opts, num_splits, false).map(|(o, _)| o)
}

/// [`attention_paged`] that also returns the LSE `[batch, heads_q, seqlen_q]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged_with_lse(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    page_table: &Tensor,
    seqlens_k: &Tensor,
    opts: &AttnOptions,
    num_splits: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let call = PagedCall::new(
        "attention_paged_with_lse",
        q,
        k_cache,
        v_cache,
        page_table,
        seqlens_k,
    );
    with_lse(&call, run(&call, opts, num_splits, true)?)
}

/// The tensors of one call and the entry's name.
struct PagedCall<'a> {
    entry: &'static str,
    q: &'a Tensor,
    k_cache: &'a Tensor,
    v_cache: &'a Tensor,
    page_table: &'a Tensor,
    seqlens_k: &'a Tensor,
}

impl<'a> PagedCall<'a> {
    fn new(
        entry: &'static str,
        q: &'a Tensor,
        k_cache: &'a Tensor,
        v_cache: &'a Tensor,
        page_table: &'a Tensor,
        seqlens_k: &'a Tensor,
    ) -> Self {
        PagedCall {
            entry,
            q,
            k_cache,
            v_cache,
            page_table,
            seqlens_k,
        }
    }
}

fn with_lse(call: &PagedCall<'_>, r: (Tensor, Option<Tensor>)) -> Result<(Tensor, Tensor)> {
    match r {
        (o, Some(lse)) => Ok((o, lse)),
        (_, None) => candle::bail!("fa4-candle: {}: the op returned no LSE", call.entry),
    }
}

/// Checks what candle would report without naming the argument (rank, dtype, device), reads the
/// table and lengths to the host, and applies the op.
fn run(
    call: &PagedCall<'_>,
    opts: &AttnOptions,
    num_splits: Option<usize>,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let entry = call.entry;
    let (q, k, v) = (call.q, call.k_cache, call.v_cache);
    for (name, t, form) in [
        ("q", q, "[batch, seqlen_q, heads_q, head_dim]"),
        ("k_cache", k, "[num_pages, page_size, heads_kv, head_dim]"),
        ("v_cache", v, "[num_pages, page_size, heads_kv, head_dim_v]"),
    ] {
        if t.rank() != 4 {
            candle::bail!(
                "fa4-candle: {entry}: `{name}` must have rank 4, {form}; got shape {:?}",
                t.dims()
            );
        }
    }
    if !matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        candle::bail!(
            "fa4-candle: {entry}: `q` has dtype {:?}; supported are f32, f16 and bf16 (f16 and bf16 on CUDA)",
            q.dtype()
        );
    }
    for (name, t) in [("k_cache", k), ("v_cache", v)] {
        if t.dtype() != q.dtype() {
            candle::bail!(
                "fa4-candle: {entry}: `{name}` has dtype {:?} but `q` has {:?}; they must match",
                t.dtype(),
                q.dtype()
            );
        }
        if !t.device().same_device(q.device()) {
            candle::bail!(
                "fa4-candle: {entry}: `{name}` is on {:?} but `q` is on {:?}",
                t.device().location(),
                q.device().location()
            );
        }
    }
    let seqlens = read_seqlens(entry, call.seqlens_k)?;
    let (table, max_pages) = read_table(entry, call.page_table, &seqlens, k.dim(1)?)?;
    let op = Fa4Paged {
        entry,
        opts: fa4_options(opts)?,
        table,
        max_pages,
        seqlens,
        num_splits,
        lse: want_lse.then(LseSlot::default),
    };
    apply(op, q, k, v)
}

/// An integer tensor's values on the host, after the checks that name the argument.
fn host_ints_of(entry: &str, name: &str, t: &Tensor, rank: usize, form: &str) -> Result<Vec<i64>> {
    if t.rank() != rank {
        candle::bail!(
            "fa4-candle: {entry}: `{name}` must have rank {rank}, {form}; got shape {:?}",
            t.dims()
        );
    }
    if !t.dtype().is_int() {
        candle::bail!(
            "fa4-candle: {entry}: `{name}` has dtype {:?}; it holds integers (i64, u32 or i32)",
            t.dtype()
        );
    }
    host_ints(t)
}

/// `seqlens_k` `[batch]`: every entry in `0..=i32::MAX` (fa4 checks the upper bound against the
/// table's capacity).
fn read_seqlens(entry: &str, t: &Tensor) -> Result<Vec<i32>> {
    let values = host_ints_of(entry, "seqlens_k", t, 1, "[batch]")?;
    values
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            i32::try_from(len).ok().filter(|&l| l >= 0).ok_or_else(|| {
                candle::Error::Msg(format!(
                    "fa4-candle: {entry}: `seqlens_k` entry {b} is {len}; key counts are in 0..={}",
                    i32::MAX
                ))
            })
        })
        .collect()
}

/// `page_table` `[batch, max_pages_per_seq]` as fa4's i32 table. An entry a sequence uses that
/// does not fit i32 is an error here (fa4 would only see it truncated); an unused one becomes −1
/// (fa4 neither reads nor checks unused entries, and u32 tables often mark them `u32::MAX`).
fn read_table(
    entry: &str,
    t: &Tensor,
    seqlens: &[i32],
    page_size: usize,
) -> Result<(Vec<i32>, usize)> {
    let values = host_ints_of(entry, "page_table", t, 2, "[batch, max_pages_per_seq]")?;
    let (batch, max_pages) = t.dims2()?;
    if batch != seqlens.len() {
        candle::bail!(
            "fa4-candle: {entry}: `page_table` has {batch} rows but `seqlens_k` has {} entries; both are [batch]",
            seqlens.len()
        );
    }
    let table = values
        .iter()
        .enumerate()
        .map(|(i, &page)| {
            let (b, j) = (i / max_pages.max(1), i % max_pages.max(1));
            match i32::try_from(page) {
                Ok(p) => Ok(p),
                // page_size 0 is fa4's error to report (on `k_cache`); until then, nothing is
                // "used".
                Err(_) if page_size > 0 && j < (seqlens[b] as usize).div_ceil(page_size) => {
                    candle::bail!(
                        "fa4-candle: {entry}: `page_table` entry [{b}, {j}] is page {page}, outside the cache's pages; sequence {b} uses it"
                    )
                }
                Err(_) => Ok(-1),
            }
        })
        .collect::<Result<Vec<i32>>>()?;
    Ok((table, max_pages))
}
