//! An fp8 e4m3 KV cache (vLLM's `kv_cache_dtype="fp8_e4m3"`): 16-bit (or f32) queries against
//! pages of e4m3 bytes with one scale per KV head, `k_scale[h]` and `v_scale[h]`: a stored key
//! row of head `h` stands for `k_scale[h] · k` (`docs/attention.md`, "Paged KV cache").
//!
//! The CPU backend dequantizes the pages the sequences use (and only those) into f32 and runs
//! its paged path on them, the queries widened to f32 and O rounded once into the queries' type.
//! The CUDA backend runs the GPU decode kernels' fp8 variants, which read the bytes and widen
//! them in registers (`kernels/decode/fp8.cuh`; bf16 or fp16 queries, as the 16-bit cache), the
//! scales applied to the scores and to O. [`append_fp8`] quantizes new rows with the given
//! scales (on the GPU: `CudaBackend::append_paged_fp8`, the same bytes).

use super::{append_targets, PagedCache, PagedKv, PagedOptions, PagedProblem};
use crate::backend::Backend;
use crate::config::decode::DecodePlan;
use crate::dtype::DType;
use crate::error::Result;
use crate::fp8::{check_descale, F8E4M3};
use crate::tensor::{Element, Tensor, TensorMut};

/// The per-KV-head scales of an fp8 cache, `heads_kv` entries each, finite and > 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvScales<'a> {
    /// `k_scale[h]`: what one unit of a stored K byte of head `h` stands for.
    pub k: &'a [f32],
    /// `v_scale[h]`, likewise for V.
    pub v: &'a [f32],
}

impl KvScales<'_> {
    /// Checks both arrays against `heads_kv`; errors name `k_scale` or `v_scale`.
    pub fn validate(&self, heads_kv: usize) -> Result<()> {
        check_descale("k_scale", self.k, heads_kv)?;
        check_descale("v_scale", self.v, heads_kv)
    }
}

impl Backend {
    /// Paged attention over an fp8 e4m3 cache: `q`, `out` and `lse` as
    /// [`Backend::forward_paged`], `kv` holding e4m3 pages, `scales` one per KV head. The CPU
    /// backend computes it for f32, fp16 and bf16 queries; the CUDA backend for fp16 and bf16
    /// ones, where its decode kernels cover the problem (else an error naming the argument).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged_fp8<T: Element>(
        &self,
        q: &Tensor<'_, T>,
        kv: &PagedKv<'_, F8E4M3>,
        scales: &KvScales,
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
        )?
        .with_fp8_cache();
        p.cache()
            .k_layout()
            .check_fits("k_cache", kv.k_data().len())?;
        p.cache()
            .v_layout()
            .check_fits("v_cache", kv.v_data().len())?;
        scales.validate(p.cache().heads_kv())?;
        if let Backend::Cuda(cuda) = self {
            return cuda.forward_paged_fp8_host(
                &p,
                q.data(),
                kv.k_data(),
                kv.v_data(),
                scales,
                o,
                lse,
                opts.num_splits,
            );
        }
        forward_cpu(self, &p, q.data(), kv, scales, o, lse, opts.num_splits)
    }
}

/// The CPU path: the used pages dequantized into a compact f32 pool (the table remapped to it),
/// queries widened, the f32 paged path, O rounded into `T` on the sequences' rows.
#[allow(clippy::too_many_arguments)]
fn forward_cpu<T: Element>(
    backend: &Backend,
    p: &PagedProblem,
    q: &[T],
    kv: &PagedKv<'_, F8E4M3>,
    scales: &KvScales,
    out: &mut [T],
    lse: Option<&mut [f32]>,
    num_splits: Option<usize>,
) -> Result<DecodePlan> {
    let c = p.cache();
    let (ps, hkv, d, dv) = (c.page_size(), c.heads_kv(), c.head_dim(), c.head_dim_v());
    let max_pages = c.max_pages_per_seq();
    let mut compact = vec![usize::MAX; c.num_pages()];
    let mut used = Vec::new();
    let mut table = vec![0i32; c.page_table().len()];
    for (b, &len) in c.seqlens_k().iter().enumerate() {
        for e in 0..len.div_ceil(ps) {
            let page = c.page_table()[b * max_pages + e] as usize;
            if compact[page] == usize::MAX {
                compact[page] = used.len();
                used.push(page);
            }
            table[b * max_pages + e] = compact[page] as i32;
        }
    }
    let dequantize = |data: &[F8E4M3], l: &crate::tensor::Layout, w: usize, s: &[f32]| {
        let mut pool = vec![0f32; used.len() * ps * hkv * w];
        for (i, &page) in used.iter().enumerate() {
            for slot in 0..ps {
                for (h, &scale) in s.iter().enumerate() {
                    let src = l.offset(page, slot, h);
                    let dst = ((i * ps + slot) * hkv + h) * w;
                    for (o, x) in pool[dst..dst + w].iter_mut().zip(&data[src..src + w]) {
                        *o = x.to_f32() * scale;
                    }
                }
            }
        }
        pool
    };
    let k32 = dequantize(kv.k_data(), c.k_layout(), d, scales.k);
    let v32 = dequantize(kv.v_data(), c.v_layout(), dv, scales.v);
    let seqlens: Vec<i32> = c.seqlens_k().iter().map(|&n| n as i32).collect();
    let kv32 = PagedKv::new(
        Tensor::new(&k32, &[used.len(), ps, hkv, d])?,
        Tensor::new(&v32, &[used.len(), ps, hkv, dv])?,
        &table,
        max_pages,
        &seqlens,
    )?;
    let cu: Option<Vec<i32>> = p.is_varlen().then(|| {
        let mut cu = vec![0i32];
        for s in p.sequences() {
            cu.push((s.q_start + s.q_len) as i32);
        }
        cu
    });
    let p32 = PagedProblem::new(
        DType::F32,
        p.q_layout(),
        p.o_layout(),
        kv32.cache(),
        cu.as_deref(),
        p.options(),
    )?;
    let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
    let mut o32 = vec![0f32; out.len()];
    let plan = backend.run_paged(&p32, &q32, &k32, &v32, &mut o32, lse, num_splits)?;
    let ol = p.o_layout();
    for s in p.sequences() {
        for r in s.q_start..s.q_start + s.q_len {
            for h in 0..p.heads_q() {
                let off = ol.offset(s.batch_index, r, h);
                for (o, &x) in out[off..off + dv].iter_mut().zip(&o32[off..off + dv]) {
                    *o = T::from_f32(x);
                }
            }
        }
    }
    Ok(plan)
}

/// Quantizes a contiguous cache (`[num_pages, page_size, heads_kv, width]`, any float type)
/// per KV head: the scale of head `h` is the largest finite magnitude of its elements / 448 (1
/// when there is none), and each element becomes `x / scale[h]` rounded to e4m3. Returns the
/// bytes and the `heads_kv` scales. Both passes run on rayon's pool, rows (`heads_kv · width`
/// elements) in parallel; a maximum and an elementwise map, so the result does not depend on
/// the threads (serially, the K and V caches of 4 sequences of 128k keys, 1 GiB each, took 27 s:
/// most of `fa4 bench --decode --kv-dtype fp8`'s set-up at that shape).
pub fn quantize_cache<T: Element>(
    cache: &[T],
    heads_kv: usize,
    width: usize,
) -> (Vec<F8E4M3>, Vec<f32>) {
    use rayon::prelude::*;
    let (hk, w) = (heads_kv.max(1), width.max(1));
    let head = |i: usize| (i / w) % hk;
    let amax = cache
        .par_chunks(hk * w)
        .fold(
            || vec![0f32; heads_kv],
            |mut m, row| {
                for (i, e) in row.iter().enumerate() {
                    let x = e.to_f32();
                    if x.is_finite() {
                        m[i / w] = m[i / w].max(x.abs());
                    }
                }
                m
            },
        )
        .reduce(
            || vec![0f32; heads_kv],
            |a, b| a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect(),
        );
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| {
            if a > 0.0 {
                a / crate::fp8::E4M3_MAX
            } else {
                1.0
            }
        })
        .collect();
    let bytes = cache
        .par_iter()
        .enumerate()
        .map(|(i, e)| F8E4M3::from_f32(e.to_f32() / scales[head(i)]))
        .collect();
    (bytes, scales)
}

/// [`super::append`] into an fp8 cache: each new element `x` of KV head `h` is stored as
/// `x / scale[h]` rounded to e4m3 (nearest, ties to even, saturating at ±448). Validation and
/// errors are [`super::append`]'s, and the scales' (`k_scale`, `v_scale`).
pub fn append_fp8<T: Element>(
    cache: &PagedCache,
    k_cache: &mut [F8E4M3],
    v_cache: &mut [F8E4M3],
    k_new: &[T],
    v_new: &[T],
    cu_new: &[i32],
    scales: &KvScales,
) -> Result<Vec<i32>> {
    scales.validate(cache.heads_kv())?;
    let t = append_targets(
        cache,
        k_cache.len(),
        v_cache.len(),
        k_new.len(),
        v_new.len(),
        cu_new,
    )?;
    let (hkv, d, dv) = (cache.heads_kv(), cache.head_dim(), cache.head_dim_v());
    for (row, &(page, slot)) in t.slots.iter().enumerate() {
        for h in 0..hkv {
            let ko = cache.k_layout().offset(page, slot, h);
            let src = &k_new[(row * hkv + h) * d..(row * hkv + h + 1) * d];
            for (o, x) in k_cache[ko..ko + d].iter_mut().zip(src) {
                *o = F8E4M3::from_f32(x.to_f32() / scales.k[h]);
            }
            let vo = cache.v_layout().offset(page, slot, h);
            let src = &v_new[(row * hkv + h) * dv..(row * hkv + h + 1) * dv];
            for (o, x) in v_cache[vo..vo + dv].iter_mut().zip(src) {
                *o = F8E4M3::from_f32(x.to_f32() / scales.v[h]);
            }
        }
    }
    Ok(t.seqlens_k)
}
