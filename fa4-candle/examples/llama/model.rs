//! A Llama-style decoder that loads candle-transformers' Llama weights (same names, same
//! shapes, from the same `VarBuilder`) and computes attention with either candle ops or
//! fa4-candle.
//!
//! candle-transformers' `llama::Llama` has no hook to replace its attention (its only
//! alternative is `candle-flash-attn`, behind a cargo feature and CUDA-only), and its layers are
//! private; so this file repeats its arithmetic step for step (RMSNorm, RoPE on `[b, h, s, d]`,
//! SwiGLU MLP, the KV cache along the sequence axis) and swaps only the attention. Run with
//! [`AttnImpl::Candle`] it reproduces candle-transformers' logits exactly, which is what makes
//! the fa4 comparison a comparison of attention alone.

use candle::{DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::{embedding, linear_no_bias, rms_norm, Embedding, Linear, RmsNorm, VarBuilder};
use candle_transformers::models::llama::Config;

/// Which attention the decoder uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnImpl {
    /// candle ops, as candle-transformers writes them: f32 scores, `masked_fill`, softmax.
    Candle,
    /// `fa4_candle::flash_attn` on `[b, s, h, d]` views (GQA by head counts, no `repeat_kv`).
    Fa4,
    /// `fa4_candle::flash_attn_paged` over a paged KV cache of `page_size`-key pages, handed
    /// out to the sequences in a shuffled order (as a serving engine's allocator would).
    Fa4Paged {
        /// Keys per page.
        page_size: usize,
    },
}

struct Layer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    input_norm: RmsNorm,
    post_norm: RmsNorm,
}

/// The decoder and its RoPE tables.
pub struct Model {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    attn: AttnImpl,
}

/// Per layer: keys and values so far, `[b, kv_heads, seq, head_dim]` each (non-paged), or
/// the paged cache of an [`AttnImpl::Fa4Paged`] model.
pub struct KvCache {
    kvs: Vec<Option<(Tensor, Tensor)>>,
    paged: Option<PagedCache>,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Self {
        KvCache {
            kvs: vec![None; model.layers.len()],
            paged: None,
        }
    }
}

/// A paged KV cache: per layer `[num_pages, page_size, kv_heads, head_dim]` pools for K and V,
/// one page table `[batch, max_pages]` (u32) shared by the layers, and the keys so far.
struct PagedCache {
    page_size: usize,
    max_pages: usize,
    /// `[batch][max_pages]`: the page holding keys `j·page_size..` of sequence `b`.
    table: Vec<u32>,
    table_t: Tensor,
    pools: Vec<(Tensor, Tensor)>,
}

impl PagedCache {
    /// Room for `max_len` keys per sequence; every page belongs to one sequence, handed out
    /// interleaved and in reverse so that no sequence's pages are contiguous or in order.
    fn new(
        model: &Model,
        batch: usize,
        max_len: usize,
        page_size: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let max_pages = max_len.div_ceil(page_size);
        let num_pages = batch * max_pages;
        let table: Vec<u32> = (0..batch)
            .flat_map(|b| (0..max_pages).map(move |j| (num_pages - 1 - (j * batch + b)) as u32))
            .collect();
        // The table and lengths stay on the host: fa4 validates them there before each launch,
        // so a CUDA copy would cost a device-to-host read per call.
        let table_t = Tensor::from_vec(table.clone(), (batch, max_pages), &Device::Cpu)?;
        let shape = (num_pages, page_size, model.kv_heads, model.head_dim);
        let pools = (0..model.layers.len())
            .map(|_| {
                Ok((
                    Tensor::zeros(shape, dtype, dev)?,
                    Tensor::zeros(shape, dtype, dev)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedCache {
            page_size,
            max_pages,
            table,
            table_t,
            pools,
        })
    }

    /// Writes `k`, `v` (`[b, s, kv_heads, head_dim]`, positions `pos..pos + s`) into layer
    /// `layer`'s pages, in place.
    fn write(&self, layer: usize, k: &Tensor, v: &Tensor, pos: usize) -> Result<()> {
        let (b, s, hkv, d) = k.dims4()?;
        let (kp, vp) = &self.pools[layer];
        let slots = kp.dim(0)? * self.page_size;
        // Contiguous pools reshaped to [slots, kv_heads, head_dim] share their storage, so
        // slice_set writes into the pool itself.
        let (kf, vf) = (kp.reshape((slots, hkv, d))?, vp.reshape((slots, hkv, d))?);
        for bi in 0..b {
            for i in 0..s {
                let j = pos + i;
                let page = self.table[bi * self.max_pages + j / self.page_size] as usize;
                let slot = page * self.page_size + j % self.page_size;
                kf.slice_set(&k.i((bi, i..i + 1))?.contiguous()?, 0, slot)?;
                vf.slice_set(&v.i((bi, i..i + 1))?.contiguous()?, 0, slot)?;
            }
        }
        Ok(())
    }
}

impl Model {
    /// Loads the weights candle-transformers' `Llama::load` would load from `vb`.
    pub fn load(vb: VarBuilder, cfg: &Config, dtype: DType, attn: AttnImpl) -> Result<Self> {
        let (h, heads, kv_heads) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let head_dim = h / heads;
        let mut layers = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let vb = vb.pp(format!("model.layers.{i}"));
            let (a, m) = (vb.pp("self_attn"), vb.pp("mlp"));
            layers.push(Layer {
                q_proj: linear_no_bias(h, head_dim * heads, a.pp("q_proj"))?,
                k_proj: linear_no_bias(h, head_dim * kv_heads, a.pp("k_proj"))?,
                v_proj: linear_no_bias(h, head_dim * kv_heads, a.pp("v_proj"))?,
                o_proj: linear_no_bias(head_dim * heads, h, a.pp("o_proj"))?,
                gate_proj: linear_no_bias(h, cfg.intermediate_size, m.pp("gate_proj"))?,
                up_proj: linear_no_bias(h, cfg.intermediate_size, m.pp("up_proj"))?,
                down_proj: linear_no_bias(cfg.intermediate_size, h, m.pp("down_proj"))?,
                input_norm: rms_norm(h, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
                post_norm: rms_norm(h, cfg.rms_norm_eps, vb.pp("post_attention_layernorm"))?,
            });
        }
        // RoPE tables as candle-transformers' `Cache::new` computes them (default rope type).
        let dev = vb.device();
        let inv_freq: Vec<f32> = (0..head_dim)
            .step_by(2)
            .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / head_dim as f32))
            .collect();
        let n = inv_freq.len();
        let positions = Tensor::arange(0, cfg.max_position_embeddings as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((cfg.max_position_embeddings, 1))?;
        let angles = positions.matmul(&Tensor::from_vec(inv_freq, (1, n), dev)?)?;
        Ok(Model {
            embed: embedding(cfg.vocab_size, h, vb.pp("model.embed_tokens"))?,
            layers,
            norm: rms_norm(h, cfg.rms_norm_eps, vb.pp("model.norm"))?,
            lm_head: linear_no_bias(h, cfg.vocab_size, vb.pp("lm_head"))?,
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
            heads,
            kv_heads,
            head_dim,
            attn,
        })
    }

    /// Logits of the last position, `[b, vocab]` f32, for `tokens` `[b, s]` at positions
    /// `index_pos..index_pos + s`; appends the new keys and values to `cache`.
    pub fn forward(
        &self,
        tokens: &Tensor,
        index_pos: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (b, s) = tokens.dims2()?;
        if let (AttnImpl::Fa4Paged { page_size }, None) = (self.attn, &cache.paged) {
            let max_len = self.cos.dim(0)?;
            let dtype = self.cos.dtype();
            cache.paged = Some(PagedCache::new(
                self,
                b,
                max_len,
                page_size,
                dtype,
                tokens.device(),
            )?);
        }
        let mut x = self.embed.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let residual = &x;
            let a = self.attention(
                layer,
                &layer.input_norm.forward(&x)?,
                index_pos,
                &mut cache.kvs[i],
                cache.paged.as_ref().map(|p| (p, i)),
            )?;
            let x1 = (a + residual)?;
            let h = layer.post_norm.forward(&x1)?;
            let mlp = (candle_nn::ops::silu(&layer.gate_proj.forward(&h)?)?
                * layer.up_proj.forward(&h)?)?;
            x = (layer.down_proj.forward(&mlp)? + &x1)?;
        }
        let x = self.norm.forward(&x)?.i((.., s - 1, ..))?.contiguous()?;
        self.lm_head.forward(&x)?.to_dtype(DType::F32)
    }

    fn attention(
        &self,
        layer: &Layer,
        x: &Tensor,
        index_pos: usize,
        kv: &mut Option<(Tensor, Tensor)>,
        paged: Option<(&PagedCache, usize)>,
    ) -> Result<Tensor> {
        let (b, s, hidden) = x.dims3()?;
        let (h, hkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let heads_first =
            |t: Tensor, n: usize| t.reshape((b, s, n, d))?.transpose(1, 2)?.contiguous();
        let q = heads_first(layer.q_proj.forward(x)?, h)?;
        let k = heads_first(layer.k_proj.forward(x)?, hkv)?;
        let v = layer
            .v_proj
            .forward(x)?
            .reshape((b, s, hkv, d))?
            .transpose(1, 2)?;
        let (cos, sin) = (
            self.cos.narrow(0, index_pos, s)?,
            self.sin.narrow(0, index_pos, s)?,
        );
        let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
        let mut k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?;
        let mut v = v;
        if let Some((cache, li)) = paged {
            // The new keys go into their pages; attention reads every key through the table.
            let (k, v) = (k.transpose(1, 2)?, v.transpose(1, 2)?);
            cache.write(li, &k, &v, index_pos)?;
            let (kp, vp) = &cache.pools[li];
            let seqlens = Tensor::from_vec(vec![(index_pos + s) as u32; b], b, &Device::Cpu)?;
            let scale = 1f32 / (d as f32).sqrt();
            let q = q.transpose(1, 2)?;
            let y =
                fa4_candle::flash_attn_paged(&q, kp, vp, &cache.table_t, &seqlens, scale, s > 1)?;
            return layer.o_proj.forward(&y.reshape((b, s, hidden))?);
        }
        if let Some((ck, cv)) = kv.as_ref() {
            k = Tensor::cat(&[ck, &k], 2)?.contiguous()?;
            v = Tensor::cat(&[cv, &v], 2)?.contiguous()?;
        }
        *kv = Some((k.clone(), v.clone()));
        let y = match self.attn {
            AttnImpl::Fa4 => {
                // [b, h, s, d] tensors seen as [b, s, h, d] views: fa4 takes the strides as
                // they are. Causal is bottom-right aligned, which is what a cache needs.
                let scale = 1f32 / (d as f32).sqrt();
                let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
                fa4_candle::flash_attn(&q, &k, &v, scale, s > 1)?
            }
            AttnImpl::Fa4Paged { .. } => {
                candle::bail!("a paged model's forward builds its paged cache before attention")
            }
            AttnImpl::Candle => {
                let group = h / hkv;
                let repeat = |t: Tensor| -> Result<Tensor> {
                    candle_transformers::utils::repeat_kv(t, group)
                };
                let dtype = q.dtype();
                let (q, k, v) = (
                    q.to_dtype(DType::F32)?,
                    repeat(k)?.to_dtype(DType::F32)?,
                    repeat(v)?.to_dtype(DType::F32)?,
                );
                let att = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
                let att = if s == 1 {
                    att
                } else {
                    let mask =
                        candle_transformers::utils::build_causal_mask(s, index_pos, x.device())?
                            .broadcast_as(att.shape())?;
                    let ninf =
                        Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(att.shape())?;
                    mask.where_cond(&ninf, &att)?
                };
                let att = candle_nn::ops::softmax_last_dim(&att)?;
                att.matmul(&v.contiguous()?)?
                    .to_dtype(dtype)?
                    .transpose(1, 2)?
            }
        };
        layer.o_proj.forward(&y.reshape((b, s, hidden))?)
    }
}

/// A small Llama config (GQA 8:2, head_dim 32) for random weights.
pub fn small_config() -> Config {
    Config {
        hidden_size: 256,
        intermediate_size: 512,
        vocab_size: 1000,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
    }
}

/// Deterministic token ids `[batch, len]` below `vocab`.
pub fn tokens(batch: usize, len: usize, vocab: usize, dev: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = (0..batch * len)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    Tensor::from_vec(ids, (batch, len), dev)
}

/// Largest absolute difference of two tensors, and the largest magnitude of the second.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let d = (a - b)?
        .abs()?
        .flatten_all()?
        .max(D::Minus1)?
        .to_scalar::<f32>()?;
    let m = b.abs()?.flatten_all()?.max(D::Minus1)?.to_scalar::<f32>()?;
    Ok((d, m))
}
