//! `fa4 run` over an fp8 e4m3 paged cache (`--kv-dtype fp8`): queries in bf16, fp16 or f32,
//! pages of e4m3 bytes with one scale per KV head (`fa4::paged::KvScales`). On the GPU (`--backend
//! cuda`, or `auto` where one works) the decode kernels' fp8 variants run it (bf16 and fp16
//! queries, head dims 64/128/256); under `auto` a problem they do not cover runs on the CPU, with
//! a note, as the 16-bit paged run does.
//!
//! `--paged` draws the usual random problem and quantizes its cache with per-KV-head amax / 448
//! scales (reported). From files, `--k-cache` and `--v-cache` are uint8 .npy of e4m3 bytes and
//! `--k-scale`, `--v-scale` give the scales (one value for every KV head, or one per head).

use fa4::fp8::F8E4M3;
use fa4::paged::{quantize_cache, KvScales, PagedKv, PagedOptions};
use fa4::Tensor;

use super::*;

/// `--k-scale` / `--v-scale` values, comma-separated (counted against the cache's heads once
/// it is read).
#[derive(Debug, Clone, PartialEq)]
pub struct Scales(pub Vec<f32>);

pub(super) fn parse_scales(s: &str) -> std::result::Result<Scales, String> {
    s.split(',')
        .map(|x| x.trim().parse::<f32>().map_err(|e| format!("`{x}`: {e}")))
        .collect::<std::result::Result<Vec<f32>, String>>()
        .map(Scales)
}

/// One cache's scales: `given` (one value for every head, or `heads_kv` values; absent: ones),
/// each finite and > 0; errors name `flag`.
fn scales_for(flag: &str, given: &Option<Scales>, heads_kv: usize) -> Result<Vec<f32>> {
    let s = match given {
        None => vec![1.0; heads_kv],
        Some(Scales(v)) if v.len() == 1 => vec![v[0]; heads_kv],
        Some(Scales(v)) => v.clone(),
    };
    fa4::fp8::check_descale(flag, &s, heads_kv).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => Error::invalid(
            flag,
            format!("{reason} (one value, or one per KV head: {heads_kv})"),
        ),
        e => e,
    })?;
    Ok(s)
}

pub(super) fn run(
    args: &RunArgs,
    backend: &Backend,
    opts: &Options,
    policy: CheckPolicy,
) -> Result<ExitCode> {
    let pa = &args.paged;
    let files = pa.k_cache.is_some()
        || pa.v_cache.is_some()
        || pa.page_table.is_some()
        || pa.seqlens_k.is_some();
    match (pa.paged, files) {
        (false, false) => return Err(Error::invalid(
            "--kv-dtype",
            "belongs to a paged run: give --paged, or --k-cache/--v-cache/--page-table/--seqlens-k",
        )),
        (false, true) => return from_files(args, backend, opts, policy),
        (true, true) => {
            return Err(Error::invalid(
                "--paged",
                "draws a random problem; with --k-cache/--v-cache/--page-table/--seqlens-k the \
                 problem comes from files",
            ))
        }
        (true, false) => {}
    }
    refuse_given(
        &[
            ("--k-scale", pa.k_scale.is_some()),
            ("--v-scale", pa.v_scale.is_some()),
        ],
        "belongs to a paged run on files; --paged quantizes its cache with scales of its own",
    )?;
    let (spec, mut rng, dtype) = random_spec(args)?;
    match dtype {
        DType::F32 => typed::<f32>(&spec, &mut rng, backend, opts, policy, args),
        DType::F16 => typed::<f16>(&spec, &mut rng, backend, opts, policy, args),
        DType::Bf16 => typed::<bf16>(&spec, &mut rng, backend, opts, policy, args),
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
    let auto = matches!(args.backend, BackendArg::Auto);
    let backend = &backend_for(
        backend,
        &p.clone().with_fp8_cache(),
        args.paged.num_splits,
        auto,
    )?;
    let (k8, ks) = quantize_cache(&x.k_cache, spec.heads_kv, spec.head_dim);
    let (v8, vs) = quantize_cache(&x.v_cache, spec.heads_kv, spec.head_dim_v);
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
    println!("backend  {}", backend_text(backend));
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
    verify(&p, &x.q, [&k8, &v8], &scales, (&o, &lse), policy)
}

/// A paged run on files over an fp8 cache: `--k-cache`/`--v-cache` uint8 e4m3 bytes, the
/// scales from `--k-scale`/`--v-scale`; O (as float32) and LSE written as the other runs do.
pub(super) fn files(
    args: &RunArgs,
    p: PagedProblem,
    [qa, ka, va]: [Array; 3],
    backend: &Backend,
    policy: CheckPolicy,
    (out, lse_path): (&Path, Option<&Path>),
) -> Result<ExitCode> {
    match p.dtype() {
        DType::F32 => files_typed::<f32>(args, p, [qa, ka, va], backend, policy, (out, lse_path)),
        DType::F16 => files_typed::<f16>(args, p, [qa, ka, va], backend, policy, (out, lse_path)),
        _ => files_typed::<bf16>(args, p, [qa, ka, va], backend, policy, (out, lse_path)),
    }
}

fn files_typed<T: Element>(
    args: &RunArgs,
    p: PagedProblem,
    [qa, ka, va]: [Array; 3],
    backend: &Backend,
    policy: CheckPolicy,
    (out, lse_path): (&Path, Option<&Path>),
) -> Result<ExitCode> {
    let c = p.cache();
    let ks = scales_for("--k-scale", &args.paged.k_scale, c.heads_kv())?;
    let vs = scales_for("--v-scale", &args.paged.v_scale, c.heads_kv())?;
    let auto = matches!(args.backend, BackendArg::Auto);
    let backend = &backend_for(
        backend,
        &p.clone().with_fp8_cache(),
        args.paged.num_splits,
        auto,
    )?;
    let bytes = |a: Array| match a.data {
        Data::U8(x) => x.into_iter().map(F8E4M3::from_bits).collect::<Vec<_>>(),
        _ => unreachable!("read_as admits only uint8 for an fp8 cache"),
    };
    let (q_shape, k_shape, v_shape) = (qa.shape.clone(), ka.shape.clone(), va.shape.clone());
    let q: Vec<T> = convert(qa);
    let (k8, v8) = (bytes(ka), bytes(va));
    let kv = PagedKv::new(
        Tensor::with_name("k_cache", &k8, &k_shape, None)?,
        Tensor::with_name("v_cache", &v8, &v_shape, None)?,
        c.page_table(),
        c.max_pages_per_seq(),
        &c.seqlens_k().iter().map(|&n| n as i32).collect::<Vec<_>>(),
    )
    .map_err(flag_error)?;
    let scales = KvScales { k: &ks, v: &vs };
    let mut o = alloc("out", p.o_layout().numel(), T::NAN)?;
    let mut lse = alloc("lse", p.lse_len(), f32::NAN)?;
    let mut o_shape = q_shape.clone();
    *o_shape.last_mut().expect("rank >= 3") = c.head_dim_v();
    let mut popts = PagedOptions::new(*p.options());
    if let Some(n) = args.paged.num_splits {
        popts = popts.num_splits(n);
    }
    let cu: Option<Vec<i32>> = p.is_varlen().then(|| {
        std::iter::once(0)
            .chain(p.sequences().iter().map(|s| (s.q_start + s.q_len) as i32))
            .collect()
    });
    let t0 = Instant::now();
    let plan = backend
        .forward_paged_fp8(
            &Tensor::new(&q, &q_shape)?,
            &kv,
            &scales,
            cu.as_deref(),
            &mut fa4::TensorMut::new(&mut o, &o_shape)?,
            Some(&mut lse),
            &popts,
        )
        .map_err(flag_error)?;
    let elapsed = t0.elapsed();
    // Every output under a temporary name first, renamed only when all are written.
    let of: Vec<f32> = o.iter().map(|x| x.to_f32()).collect();
    let mut staged = vec![npy::stage(out, "--out", &o_shape, &of)?];
    let mut wrote = vec![format!(
        "O {o_shape:?} ({} values) as float32 to `{}`",
        T::DTYPE,
        out.display()
    )];
    if let Some(path) = lse_path {
        let shape = p.lse_shape();
        staged.push(npy::stage(path, "--lse", &shape, &lse)?);
        wrote.push(format!("LSE {shape:?} float32 to `{}`", path.display()));
    }
    for s in staged {
        s.commit()?;
    }
    let bytes_read = c.kv_bytes(1);
    println!(
        "problem  {} (fp8 e4m3 cache, K+V {:.3} MB)",
        describe(&p),
        bytes_read / 1e6
    );
    println!("scales   k_scale {:?}, v_scale {:?}", ks, vs);
    println!("backend  {}", backend_text(backend));
    println!(
        "plan     num_splits {}{}",
        plan.num_splits,
        if plan.forced { " (forced)" } else { "" }
    );
    println!("time     {:.3} ms (one call)", elapsed.as_secs_f64() * 1e3);
    for w in &wrote {
        println!("wrote    {w}");
    }
    verify(&p, &q, [&k8, &v8], &scales, (&o, &lse), policy)
}

/// The check of both forms against the paged fp8 oracle (or why it is skipped); exit code 1 if
/// it fails.
fn verify<T: Element>(
    p: &PagedProblem,
    q: &[T],
    [k8, v8]: [&[F8E4M3]; 2],
    scales: &KvScales,
    (o, lse): (&[T], &[f32]),
    policy: CheckPolicy,
) -> Result<ExitCode> {
    if let Some(why) = skip_reason(policy, check_cost(p)) {
        println!("check    {why}");
        return Ok(ExitCode::SUCCESS);
    }
    let t0 = Instant::now();
    let report = reference::check_fp8(p, q, k8, v8, scales, o, Some(lse))?;
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
