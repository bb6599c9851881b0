//! candle-transformers' Llama (small config, random weights) against the same model with
//! fa4-candle's attention: prefill logits, then a greedy decode loop with a KV cache; then the
//! same decode with a paged KV cache (`flash_attn_paged`) against the contiguous one.
//!
//! ```text
//! cargo run --release -p fa4-candle --example llama            # CPU, f32
//! cargo run --release -p fa4-candle --example llama -- bf16    # CPU, bf16
//! cargo run --release -p fa4-candle --features cuda --example llama -- bf16 cuda
//! ```

mod model;

use std::time::Instant;

use candle::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama::{Cache, Llama};

use model::{max_diff, small_config, tokens, AttnImpl, KvCache, Model};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = match args.first().map(String::as_str) {
        None | Some("f32") => DType::F32,
        Some("f16") => DType::F16,
        Some("bf16") => DType::BF16,
        Some(other) => {
            eprintln!("error: unknown dtype `{other}` (expected f32, f16 or bf16)");
            std::process::exit(2);
        }
    };
    let dev = match args.get(1).map(String::as_str) {
        None | Some("cpu") => Device::Cpu,
        Some("cuda") => Device::new_cuda(0)?,
        Some(other) => {
            eprintln!("error: unknown device `{other}` (expected cpu or cuda)");
            std::process::exit(2);
        }
    };
    // On the GPU, head dim 64: fa4's paged decode kernels take 64, 128 and 256.
    let cfg = match dev.is_cuda() {
        true => candle_transformers::models::llama::Config {
            hidden_size: 512,
            intermediate_size: 1024,
            ..small_config()
        },
        false => small_config(),
    };
    // Random weights, created once in the VarMap by candle-transformers' loader and read back
    // by the fa4 model under the same names.
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &dev);
    let reference = Llama::load(vb.clone(), &cfg)?;
    let mirror = Model::load(vb.clone(), &cfg, dtype, AttnImpl::Candle)?;
    let fa4 = Model::load(vb.clone(), &cfg, dtype, AttnImpl::Fa4)?;
    let paged = Model::load(vb, &cfg, dtype, AttnImpl::Fa4Paged { page_size: 16 })?;

    let (batch, prompt, steps) = (2, 48, 16);
    let prompt_ids = tokens(batch, prompt, cfg.vocab_size, &dev)?;
    let mut ref_cache = Cache::new(true, dtype, &cfg, &dev)?;
    let mut fa4_cache = KvCache::new(&fa4);

    let t = Instant::now();
    let ref_logits = reference.forward(&prompt_ids, 0, &mut ref_cache)?;
    let t_ref = t.elapsed();
    let t = Instant::now();
    let fa4_logits = fa4.forward(&prompt_ids, 0, &mut fa4_cache)?;
    let t_fa4 = t.elapsed();
    // The mirror (candle's attention in fa4's model code) must be candle-transformers exactly.
    let mirror_logits = mirror.forward(&prompt_ids, 0, &mut KvCache::new(&mirror))?;
    let (mirror_d, _) = max_diff(&mirror_logits, &ref_logits)?;
    println!("mirror model with candle's attention: max |Δlogits| = {mirror_d:e} (expect 0)");
    let (d, m) = max_diff(&fa4_logits, &ref_logits)?;
    println!(
        "prefill {batch}×{prompt} {dtype:?} on {dev:?}: max |Δlogits| = {d:.3e} (max |logit| {m:.3}); \
         candle-transformers {t_ref:.2?}, fa4 {t_fa4:.2?}"
    );

    // Greedy decode, both models fed the reference's choice so the caches stay equal.
    let mut next = ref_logits.argmax(1)?.unsqueeze(1)?;
    let mut agree = 0;
    let mut worst = 0f32;
    for step in 0..steps {
        let pos = prompt + step;
        let r = reference.forward(&next, pos, &mut ref_cache)?;
        let f = fa4.forward(&next, pos, &mut fa4_cache)?;
        worst = worst.max(max_diff(&f, &r)?.0);
        let (rn, fnext) = (r.argmax(1)?, f.argmax(1)?);
        agree += (rn
            .eq(&fnext)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()?) as usize;
        next = rn.unsqueeze(1)?;
    }
    println!(
        "decode {steps} steps: max |Δlogits| = {worst:.3e}; greedy tokens agree {agree}/{}",
        steps * batch
    );

    // The same prompt and decode with a paged cache (pages of 16 keys, shuffled table), fed
    // the contiguous fa4 model's choices so both caches hold the same keys.
    let mut contiguous_cache = KvCache::new(&fa4);
    let mut paged_cache = KvCache::new(&paged);
    let c = fa4.forward(&prompt_ids, 0, &mut contiguous_cache)?;
    let p = paged.forward(&prompt_ids, 0, &mut paged_cache)?;
    let mut worst = max_diff(&p, &c)?.0;
    let mut next = c.argmax(1)?.unsqueeze(1)?;
    let (mut t_contiguous, mut t_paged) = (Default::default(), Default::default());
    for step in 0..steps {
        let pos = prompt + step;
        let t = Instant::now();
        let c = fa4.forward(&next, pos, &mut contiguous_cache)?;
        t_contiguous += t.elapsed();
        let t = Instant::now();
        let p = paged.forward(&next, pos, &mut paged_cache)?;
        t_paged += t.elapsed();
        worst = worst.max(max_diff(&p, &c)?.0);
        next = c.argmax(1)?.unsqueeze(1)?;
    }
    let per_step = |t: std::time::Duration| t / steps as u32;
    println!(
        "paged cache (pages of 16): prefill + {steps} decode steps, max |Δlogits| vs contiguous = {worst:.3e}; \
         step time contiguous {:.2?}, paged {:.2?}",
        per_step(t_contiguous),
        per_step(t_paged)
    );
    Ok(())
}
