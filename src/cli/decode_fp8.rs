//! `fa4 run` over an fp8 e4m3 paged cache (`--kv-dtype fp8`): queries in bf16, fp16 or f32,
//! pages of e4m3 bytes with one scale per KV head (`fa4::paged::KvScales`), on the CPU backend.
//!
//! `--paged` draws the usual random problem and quantizes its cache with per-KV-head amax / 448
//! scales (reported). fp8 caches from files are not read yet.

use fa4::fp8::F8E4M3;
use fa4::paged::{KvScales, PagedKv, PagedOptions};
use fa4::Tensor;

use super::*;

/// Quantizes a cache per KV head (amax over the finite elements / 448; 1 for an empty head).
fn quantize<T: Element>(cache: &[T], heads_kv: usize, width: usize) -> (Vec<F8E4M3>, Vec<f32>) {
    let mut amax = vec![0f32; heads_kv];
    for (i, e) in cache.iter().enumerate() {
        let x = e.to_f32();
        if x.is_finite() {
            let h = (i / width) % heads_kv;
            amax[h] = amax[h].max(x.abs());
        }
    }
    let s: Vec<f32> = amax
        .iter()
        .map(|&a| if a > 0.0 { a / fa4::fp8::E4M3_MAX } else { 1.0 })
        .collect();
    let bytes = cache
        .iter()
        .enumerate()
        .map(|(i, e)| F8E4M3::from_f32(e.to_f32() / s[(i / width) % heads_kv]))
        .collect();
    (bytes, s)
}

pub(super) fn run(
    args: &RunArgs,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    let cpu = match backend {
        Backend::Cuda(_) if !matches!(args.backend, BackendArg::Auto) => {
            return Err(Error::invalid(
                "--kv-dtype",
                "an fp8 cache runs on the CPU backend; the GPU decode kernels read bf16 and fp16 \
                 caches only, for now (drop --backend cuda)",
            ))
        }
        Backend::Cuda(_) => {
            println!("note     an fp8 cache runs on the CPU backend (the GPU decode kernels read bf16 and fp16 caches only, for now)");
            Backend::Cpu
        }
        other => other.clone(),
    };
    let pa = &args.paged;
    if !pa.paged {
        return Err(Error::invalid(
            "--kv-dtype",
            "fp8 caches from files are not read yet; give --paged for a random problem",
        ));
    }
    let (spec, mut rng, dtype) = random_spec(args)?;
    match dtype {
        DType::F32 => typed::<f32>(&spec, &mut rng, &cpu, opts, policy, args),
        DType::F16 => typed::<f16>(&spec, &mut rng, &cpu, opts, policy, args),
        DType::Bf16 => typed::<bf16>(&spec, &mut rng, &cpu, opts, policy, args),
        DType::Fp8E4M3 => Err(Error::invalid(
            "--dtype",
            "the queries of a paged run are bf16, fp16 or f32; the cache's type is --kv-dtype",
        )),
    }
}

fn typed<T: Element>(
    spec: &PagedSpec,
    rng: &mut StdRng,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
    args: &RunArgs,
) -> Result<ExitCode> {
    let x = random_paged::<T, _>(rng, spec)?;
    let p = x.problem(opts)?;
    let (k8, ks) = quantize(&x.k_cache, spec.heads_kv, spec.head_dim);
    let (v8, vs) = quantize(&x.v_cache, spec.heads_kv, spec.head_dim_v);
    let scales = KvScales { k: &ks, v: &vs };
    let kv = PagedKv::new(
        Tensor::with_name("k_cache", &k8, &x.k_shape, None)?,
        Tensor::with_name("v_cache", &v8, &x.v_shape, None)?,
        &x.page_table,
        x.max_pages_per_seq,
        &x.seqlens_k,
    )?;
    let mut o = alloc("out", p.o_layout().numel(), T::NAN)?;
    let mut lse = alloc("lse", p.lse_len(), f32::NAN)?;
    let mut o_shape = x.q_shape.clone();
    *o_shape.last_mut().expect("rank 4") = spec.head_dim_v;
    let mut popts = PagedOptions::new(*opts);
    if let Some(n) = args.paged.num_splits {
        popts = popts.num_splits(n);
    }
    let t0 = Instant::now();
    let plan = backend
        .forward_paged_fp8(
            &Tensor::new(&x.q, &x.q_shape)?,
            &kv,
            &scales,
            None,
            &mut fa4::TensorMut::new(&mut o, &o_shape)?,
            Some(&mut lse),
            &popts,
        )
        .map_err(flag_error)?;
    let elapsed = t0.elapsed();
    let c = p.cache();
    let bytes = c.kv_bytes(1);
    println!(
        "problem  {} (fp8 e4m3 cache, K+V {:.3} MB)",
        describe(&p),
        bytes / 1e6
    );
    let span = |s: &[f32]| {
        let lo = s.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = s.iter().copied().fold(0f32, f32::max);
        format!("{lo:.4e}..{hi:.4e}")
    };
    println!(
        "scales   quantized by fa4, per KV head amax / 448: k_scale {}, v_scale {}",
        span(&ks),
        span(&vs)
    );
    println!("backend  cpu ({} threads)", rayon::current_num_threads());
    println!(
        "plan     num_splits {}{}",
        plan.num_splits,
        if plan.forced { " (forced)" } else { "" }
    );
    let secs = elapsed.as_secs_f64();
    println!(
        "time     {:.3} ms, {:.1} GB/s of K+V read (one call)",
        secs * 1e3,
        if secs > 0.0 { bytes / secs / 1e9 } else { 0.0 }
    );
    if let Some(why) = skip_reason(policy, check_cost(&p)) {
        println!("check    {why}");
        return Ok(ExitCode::SUCCESS);
    }
    let t0 = Instant::now();
    let report = reference::check_fp8(&p, &x.q, &k8, &v8, &scales, &o, Some(&lse))?;
    println!(
        "check    {report} (float64 paged oracle, {:.2} s)",
        t0.elapsed().as_secs_f64()
    );
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
