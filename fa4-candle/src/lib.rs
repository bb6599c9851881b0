//! # fa4-candle: fa4 attention for candle
//!
//! A drop-in for `candle-flash-attn`: the same function names, arguments and tensor shapes, so
//! switching is a change of `use` line. Beyond it: the log-sum-exp of every row (`*_with_lse`),
//! softcap (through [`AttnOptions`]), and a CPU implementation, so the same model code runs
//! without a GPU.
//!
//! | entry | shapes |
//! |---|---|
//! | [`flash_attn`], [`flash_attn_windowed`] | `q` `[batch, seqlen_q, heads_q, head_dim]`, `k` `[batch, seqlen_k, heads_kv, head_dim]`, `v` `[batch, seqlen_k, heads_kv, head_dim_v]` → `[batch, seqlen_q, heads_q, head_dim_v]` |
//! | [`flash_attn_varlen`], [`flash_attn_varlen_windowed`] | packed `[total, heads, dim]`, `seqlens_*` cumulative `[batch + 1]` → `[total_q, heads_q, head_dim_v]` |
//! | `*_with_lse` | also the LSE, f32: `[batch, heads_q, seqlen_q]` (fixed) or `[heads_q, total_q]` (varlen) |
//! | [`attention`], [`attention_varlen`] (+ `_with_lse`) | every option at once: scale, window, softcap |
//! | [`attention_fp8`] | `F8E4M3` `q`, `k`, `v` as [`flash_attn`]'s, descales `[batch, heads_kv]` ([`Fp8Descales`]) → bf16; the CPU, and Hopper GPUs (`cuda`) |
//! | [`flash_attn_paged`], [`attention_paged`] (+ `_with_lse`) | `q` `[batch, seqlen_q, heads_q, head_dim]` over a paged cache `[num_pages, page_size, heads_kv, dim]`, `page_table` `[batch, max_pages]`, `seqlens_k` `[batch]` → `[batch, seqlen_q, heads_q, head_dim_v]` |
//!
//! GQA/MQA follows from the head counts (`heads_q % heads_kv == 0`; query head `h` reads KV head
//! `h / (heads_q / heads_kv)`). Causal masks and windows align to the bottom-right corner, as in
//! FlashAttention ≥ 2.1; a row with no allowed key gets zeros and an LSE of `-inf`. The exact
//! definition and the tolerance rule are in the fa4 repository's `docs/attention.md`.
//!
//! Devices and dtypes: the CPU computes f32, f16 and bf16 (fa4's tiled CPU backend, f32
//! accumulation); CUDA tensors (the `cuda` feature) compute f16 and bf16 with fa4's kernels,
//! launched on candle's own stream, and `F8E4M3` ([`attention_fp8`]) on Hopper GPUs. Non-contiguous tensors are fine as long as their last
//! dimension is contiguous (strides are passed through, no copy); otherwise the error says to
//! call `.contiguous()`.
//!
//! fa4 has no ALiBi, so the `_alibi` forms of candle-flash-attn are absent. The ops are forward
//! only: a backward pass through them is an error, not a silent zero gradient.
//!
//! ```
//! use candle::{DType, Device, Tensor};
//!
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1., (1, 16, 4, 64), &dev)?;
//! let k = Tensor::randn(0f32, 1., (1, 16, 2, 64), &dev)?; // GQA: 2 KV heads
//! let v = Tensor::randn(0f32, 1., (1, 16, 2, 64), &dev)?;
//! let (out, lse) = fa4_candle::flash_attn_with_lse(&q, &k, &v, 0.125, true)?;
//! assert_eq!(out.dims(), &[1, 16, 4, 64]);
//! assert_eq!((lse.dims(), lse.dtype()), (&[1usize, 4, 16][..], DType::F32));
//! # Ok::<(), candle::Error>(())
//! ```

#[cfg(feature = "cuda")]
mod cuda;
mod fp8;
mod op;
mod paged;

use candle::{DType, Result, Tensor};

use op::{Fa4Attn, HostSeqlens};

pub use fp8::{attention_fp8, Fp8Descales};
pub use paged::{
    attention_paged, attention_paged_with_lse, flash_attn_paged, flash_attn_paged_with_lse,
};

/// Options of one attention call, beyond what the candle-flash-attn names carry.
///
/// `AttnOptions::new(scale).causal().softcap(30.0)`; windows are `(left, right)` keys around
/// the diagonal, `None` unbounded on that side (`(None, Some(0))` is causal).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnOptions {
    /// Multiplies `q·k` before the softcap and the softmax; must be finite.
    pub softmax_scale: f32,
    /// Keys allowed before the diagonal, `None` = unbounded.
    pub window_size_left: Option<usize>,
    /// Keys allowed after the diagonal, `None` = unbounded.
    pub window_size_right: Option<usize>,
    /// Gemma-style softcap: scores become `softcap · tanh(s / softcap)`; finite and > 0.
    pub softcap: Option<f32>,
}

impl AttnOptions {
    /// No mask, no softcap, scores scaled by `softmax_scale`.
    pub fn new(softmax_scale: f32) -> Self {
        AttnOptions {
            softmax_scale,
            window_size_left: None,
            window_size_right: None,
            softcap: None,
        }
    }

    /// Causal mask (bottom-right aligned): the window `(None, Some(0))`.
    pub fn causal(self) -> Self {
        self.window(None, Some(0))
    }

    /// A local window of `left` keys before the diagonal and `right` after.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window_size_left = left;
        self.window_size_right = right;
        self
    }

    /// Softcap the scores at `softcap`.
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }

    fn causal_if(self, causal: bool) -> Self {
        if causal {
            self.causal()
        } else {
            self
        }
    }
}

/// The sequence boundaries of a packed (varlen) batch, as candle-flash-attn takes them.
#[derive(Debug, Clone, Copy)]
pub struct Varlen<'a> {
    /// Cumulative query lengths, rank 1, `batch + 1` integers from 0 to `total_q` (u32 as in
    /// candle-flash-attn, or any integer dtype).
    pub seqlens_q: &'a Tensor,
    /// Cumulative key lengths, `batch + 1` integers from 0 to `total_k`.
    pub seqlens_k: &'a Tensor,
    /// An upper bound on any sequence's query length.
    pub max_seqlen_q: usize,
    /// An upper bound on any sequence's key length.
    pub max_seqlen_k: usize,
}

impl<'a> Varlen<'a> {
    /// The boundaries in candle-flash-attn's argument order.
    pub fn new(
        seqlens_q: &'a Tensor,
        seqlens_k: &'a Tensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Self {
        Varlen {
            seqlens_q,
            seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
        }
    }
}

/// Attention over a fixed-length batch: `softmax(q·kᵀ·softmax_scale [+ causal mask])·v`.
///
/// - `q`: `[batch, seqlen_q, heads_q, head_dim]`
/// - `k`: `[batch, seqlen_k, heads_kv, head_dim]`, `heads_q % heads_kv == 0`
/// - `v`: `[batch, seqlen_k, heads_kv, head_dim_v]`
///
/// Returns `[batch, seqlen_q, heads_q, head_dim_v]` in `q`'s dtype.
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    attention(q, k, v, &AttnOptions::new(softmax_scale).causal_if(causal))
}

/// [`flash_attn`] with a local window: `window_size_left` keys before the diagonal and
/// `window_size_right` after (`None` = unbounded; `(None, Some(0))` is causal).
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let opts = AttnOptions::new(softmax_scale).window(window_size_left, window_size_right);
    attention(q, k, v, &opts)
}

/// Attention over a packed variable-length batch.
///
/// - `q`: `[total_q, heads_q, head_dim]`, `k`: `[total_k, heads_kv, head_dim]`,
///   `v`: `[total_k, heads_kv, head_dim_v]`
/// - `seqlens_q`, `seqlens_k`: cumulative lengths, `batch + 1` entries (`0, len_1,
///   len_1 + len_2, …`); sequence `b` is rows `seqlens[b] .. seqlens[b + 1]`
/// - `max_seqlen_q`, `max_seqlen_k`: upper bounds on the sequences' lengths (checked)
///
/// Returns `[total_q, heads_q, head_dim_v]`. The boundaries are read on the host: a CUDA
/// `seqlens_*` tensor costs one device-to-host copy (and a wait); pass them on the CPU to
/// avoid it.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let varlen = Varlen::new(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    let opts = AttnOptions::new(softmax_scale).causal_if(causal);
    attention_varlen(q, k, v, &varlen, &opts)
}

/// [`flash_attn_varlen`] with a local window (`None` = unbounded on that side).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let varlen = Varlen::new(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    let opts = AttnOptions::new(softmax_scale).window(window_size_left, window_size_right);
    attention_varlen(q, k, v, &varlen, &opts)
}

/// [`flash_attn`] that also returns the LSE `[batch, heads_q, seqlen_q]` (f32, natural log).
pub fn flash_attn_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    attention_with_lse(q, k, v, &AttnOptions::new(softmax_scale).causal_if(causal))
}

/// [`flash_attn_windowed`] that also returns the LSE `[batch, heads_q, seqlen_q]`.
pub fn flash_attn_windowed_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let opts = AttnOptions::new(softmax_scale).window(window_size_left, window_size_right);
    attention_with_lse(q, k, v, &opts)
}

/// [`flash_attn_varlen`] that also returns the LSE `[heads_q, total_q]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let varlen = Varlen::new(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    let opts = AttnOptions::new(softmax_scale).causal_if(causal);
    attention_varlen_with_lse(q, k, v, &varlen, &opts)
}

/// [`flash_attn_varlen_windowed`] that also returns the LSE `[heads_q, total_q]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_windowed_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let varlen = Varlen::new(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k);
    let opts = AttnOptions::new(softmax_scale).window(window_size_left, window_size_right);
    attention_varlen_with_lse(q, k, v, &varlen, &opts)
}

/// Attention over a fixed-length batch with every option (shapes as [`flash_attn`]).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttnOptions) -> Result<Tensor> {
    run(q, k, v, None, opts, false).map(|(o, _)| o)
}

/// [`attention`] that also returns the LSE `[batch, heads_q, seqlen_q]`.
pub fn attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttnOptions,
) -> Result<(Tensor, Tensor)> {
    let (o, lse) = run(q, k, v, None, opts, true)?;
    Ok((o, lse.ok_or_else(no_lse)?))
}

/// Attention over a packed variable-length batch with every option (shapes as
/// [`flash_attn_varlen`]).
pub fn attention_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: &Varlen<'_>,
    opts: &AttnOptions,
) -> Result<Tensor> {
    run(q, k, v, Some(varlen), opts, false).map(|(o, _)| o)
}

/// [`attention_varlen`] that also returns the LSE `[heads_q, total_q]`.
pub fn attention_varlen_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: &Varlen<'_>,
    opts: &AttnOptions,
) -> Result<(Tensor, Tensor)> {
    let (o, lse) = run(q, k, v, Some(varlen), opts, true)?;
    Ok((o, lse.ok_or_else(no_lse)?))
}

/// Checks what candle would otherwise report without naming the argument (rank, dtype, device),
/// reads the varlen boundaries, and applies the op.
fn run(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: Option<&Varlen<'_>>,
    opts: &AttnOptions,
    want_lse: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let rank = if varlen.is_some() { 3 } else { 4 };
    let form = if varlen.is_some() {
        "[total, heads, head_dim] (varlen)"
    } else {
        "[batch, seqlen, heads, head_dim]"
    };
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != rank {
            candle::bail!(
                "fa4-candle: `{name}` must have rank {rank}, {form}; got shape {:?}",
                t.dims()
            );
        }
    }
    if !matches!(q.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        candle::bail!(
            "fa4-candle: `q` has dtype {:?}; supported are f32, f16 and bf16 (f16 and bf16 on CUDA)",
            q.dtype()
        );
    }
    for (name, t) in [("k", k), ("v", v)] {
        if t.dtype() != q.dtype() {
            candle::bail!(
                "fa4-candle: `{name}` has dtype {:?} but `q` has {:?}; they must match",
                t.dtype(),
                q.dtype()
            );
        }
        if !t.device().same_device(q.device()) {
            candle::bail!(
                "fa4-candle: `{name}` is on {:?} but `q` is on {:?}",
                t.device().location(),
                q.device().location()
            );
        }
    }
    let seqlens = match varlen {
        Some(vl) => Some(HostSeqlens::read(vl, q.dim(0)?, k.dim(0)?)?),
        None => None,
    };
    op::apply(Fa4Attn::new(opts, seqlens, want_lse)?, q, k, v)
}

fn no_lse() -> candle::Error {
    candle::Error::Msg("fa4-candle: the attention op returned no LSE".into())
}
