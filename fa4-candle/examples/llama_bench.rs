//! Prefill and decode-step time of a Llama-shaped model (random weights) with candle's
//! attention against fa4-candle's: the same model code ([`model::Model`], which is
//! candle-transformers' Llama operation for operation, tests/llama.rs checks it), so the
//! attention is all that differs.
//!
//! ```text
//! cargo run --release -p fa4-candle --features cuda --example llama_bench -- [PROMPT] [ROUNDS]
//! ```
//!
//! Timing: `synchronize` around each measured span (one prefill; `STEPS` back-to-back decode
//! steps), the implementations interleaved within every round, the median of the rounds
//! reported, after one untimed warm-up of each. Decode steps are fed a fixed token (no argmax,
//! no host read between steps), so they queue back to back as a serving loop's would.

#[path = "llama/model.rs"]
mod model;

use std::time::{Duration, Instant};

use candle::{DType, Device, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama::Config;

use model::{max_diff, small_config, tokens, AttnImpl, KvCache, Model};

/// Decode steps per timed span.
const STEPS: usize = 16;

fn arg(args: &[String], i: usize, name: &str, default: usize) -> usize {
    match args.get(i) {
        None => default,
        Some(a) => a.parse().unwrap_or_else(|_| {
            eprintln!("error: {name} must be a positive integer, got `{a}`");
            std::process::exit(2);
        }),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let prompt = arg(&args, 0, "PROMPT", 2048);
    let rounds = arg(&args, 1, "ROUNDS", 5);
    if prompt == 0 || rounds == 0 {
        eprintln!("error: PROMPT and ROUNDS must be positive");
        std::process::exit(2);
    }
    let dev = Device::new_cuda(0)?;
    let dtype = DType::BF16;
    // A 1B-class shape: hidden 2048, 16 heads of 128 (GQA 4:1), 4 layers.
    let cfg = Config {
        hidden_size: 2048,
        intermediate_size: 5632,
        vocab_size: 32000,
        num_hidden_layers: 4,
        num_attention_heads: 16,
        num_key_value_heads: 4,
        max_position_embeddings: prompt + STEPS * (rounds + 1) + 1,
        ..small_config()
    };
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &dev);
    let impls = [
        (
            "candle",
            Model::load(vb.clone(), &cfg, dtype, AttnImpl::Candle)?,
        ),
        ("fa4", Model::load(vb.clone(), &cfg, dtype, AttnImpl::Fa4)?),
        (
            "fa4 paged",
            Model::load(vb, &cfg, dtype, AttnImpl::Fa4Paged { page_size: 16 })?,
        ),
    ];
    let batch = 1;
    let ids = tokens(batch, prompt, cfg.vocab_size, &dev)?;
    let step_ids = Tensor::from_vec(vec![7u32; batch], (batch, 1), &dev)?;
    let sync = || dev.synchronize();

    // Prefill: a fresh cache each time. The paged model's prefill writes its pages key by
    // key (the example's simple cache), so it is timed for decode only.
    let mut prefill = vec![Vec::new(); 2];
    let mut logits = Vec::new();
    for round in 0..=rounds {
        for (i, (_, m)) in impls[..2].iter().enumerate() {
            sync()?;
            let t = Instant::now();
            let l = m.forward(&ids, 0, &mut KvCache::new(m))?;
            sync()?;
            if round > 0 {
                prefill[i].push(t.elapsed());
            } else {
                logits.push(l);
            }
        }
    }
    let (d, mag) = max_diff(&logits[1], &logits[0])?;
    println!("prefill logits, fa4 vs candle attention: max |Δ| {d:.3e} (max |logit| {mag:.3})");

    // Decode: each model's cache holds the prompt, then STEPS steps per span.
    // A model whose prefill fails (reported) is left out of the decode timing.
    let mut caches = Vec::new();
    for (name, m) in &impls {
        let mut c = KvCache::new(m);
        match m.forward(&ids, 0, &mut c) {
            Ok(_) => caches.push(Some(c)),
            Err(e) => {
                println!("{name}: prefill failed, no decode timing: {e}");
                caches.push(None);
            }
        }
    }
    let mut pos = prompt;
    let mut decode = vec![Vec::new(); impls.len()];
    for round in 0..=rounds {
        for (i, (_, m)) in impls.iter().enumerate() {
            let Some(cache) = caches[i].as_mut() else {
                continue;
            };
            sync()?;
            let t = Instant::now();
            for s in 0..STEPS {
                m.forward(&step_ids, pos + s, cache)?;
            }
            sync()?;
            if round > 0 {
                decode[i].push(t.elapsed() / STEPS as u32);
            }
        }
        pos += STEPS;
    }
    println!(
        "Llama bf16, hidden {}, {} layers, {} heads of {} (kv {}), batch {batch}, prompt {prompt}; median of {rounds} rounds",
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.hidden_size / cfg.num_attention_heads,
        cfg.num_key_value_heads
    );
    for (i, (name, _)) in impls.iter().enumerate() {
        let p = match prefill.get(i) {
            Some(t) => format!("{:.2?}", median(t.clone())),
            None => "-".into(),
        };
        let d = match decode[i].is_empty() {
            true => "-".into(),
            false => format!("{:.2?}", median(decode[i].clone())),
        };
        println!("{name:>10}: prefill {p:>10}, decode step {d:>10} (cache {prompt}..{pos})");
    }
    Ok(())
}
