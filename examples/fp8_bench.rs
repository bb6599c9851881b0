//! Times the e4m3 Hopper forward beside fa4's own bf16 forward on the FlashAttention grid (16k
//! tokens, hidden 2048: batch = 16384 / seqlen, heads = 2048 / d; d 64/128/256, seqlen
//! 1k/4k/16k, causal and not): device-resident random inputs (float draws quantized per
//! (sequence, head)), one event pair around 10 back-to-back calls per round, the median of
//! ROUNDS rounds, fp8 and bf16 rounds interleaved. One line per shape: TFLOP/s of each, their
//! ratio, and the rounds' spread (IQR / median). Each fp8 call includes its Vᵀ pass and the
//! fixup check (what a user's call costs).
//!
//! `fp8_bench [ROUNDS] [--tiles T] [--dims D,…]`: `--tiles` is a `--sm90-tiles` override for
//! the fp8 runs (`fa4 bench --help` spells it; a shape it does not fit says so and is skipped),
//! `--dims` the head dims timed (default 64,128,256). `fp8_bench --sweep [ROUNDS]`: the tile
//! candidates of [`SWEEP`] on the 4k and 16k shapes of their head dim, fp8 only. `fp8_bench --precompile`: fills the kernel cache
//! ($FA4_CACHE_DIR) for an H200 without a GPU (`bench/device_build.sh` with FA4_PRECOMPILE):
//! every e4m3 variant the planner emits, those of the fp8 correctness matrix, and the grid's
//! fp8 and bf16 kernels. fa4 beside cuDNN's and FlashAttention-3's fp8 forwards, in
//! one process, is `bench/peers.py fp8`.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use fa4::cuda::bench::Spread;
use fa4::cuda::fp8::DeviceDescales;
use fa4::cuda::CudaBackend;
use fa4::fp8::F8E4M3;
use fa4::tensor::Layout;
use fa4::{DType, Options, Problem};
use half::bf16;

const CALLS: usize = 10;

/// Tile candidates timed by `--sweep`: (head dim, `--sm90-tiles` override).
const SWEEP: [(usize, &str); 12] = [
    (128, "128,2,2,40,232,0,1,0,0,0,0,0,0,0,1"),
    (128, "128,2,2,40,232,0,1,1,0,0,0,0,0,0,1"),
    (128, "128,2,3,40,232,0,1,0,0,0,0,0,0,0,1"),
    (128, "128,2,2,40,232,0,1,0,0,2,0,0,0,0,1"),
    (128, "256,2,2,40,232,0,0,1,0,0,0,0,0,0,1"),
    (128, "256,2,2,40,232,0,0,0,0,2,0,0,0,0,1"),
    (256, "128,2,2,40,232,0,0,0,0,0,0,0,0,0,1"),
    (256, "128,2,2,40,232,0,0,1,0,0,0,0,0,0,1"),
    (256, "128,2,2,40,232,0,0,0,0,2,0,0,0,0,1"),
    (64, "128,2,2,40,232,0,1,0,0,0,0,0,0,0,1"),
    (64, "128,3,2,32,160,0,0,0,0,0,0,0,0,0,1"),
    (64, "256,2,2,40,232,0,0,1,0,0,0,0,0,0,1"),
];

fn precompile() -> Result<(), Box<dyn std::error::Error>> {
    use fa4::config::sm90::fp8::{all_fp8_specs, plan_fp8};
    use fa4::config::sm90::{plan, KernelSpec};
    use fa4::cuda::compile::compile;
    use rayon::prelude::*;
    let h200 = fa4::arch::H200;
    let mut specs: Vec<KernelSpec> = all_fp8_specs(&h200, "sm_90a");
    // (A case the kernel does not take, a scale ≤ 0 say, has no kernel to compile.)
    for case in fa4::check::matrix(&[DType::Fp8E4M3], &[32, 64, 80, 96, 128, 192, 256]) {
        if let Ok(f) = plan_fp8(&case.problem()?, &h200, "sm_90a", None) {
            specs.push(f.plan.spec);
        }
    }
    for d in [64usize, 128, 256] {
        for seqlen in [1024usize, 4096, 16384] {
            for causal in [false, true] {
                let (p8, p16) = grid_problems(d, seqlen, causal)?;
                specs.push(plan_fp8(&p8, &h200, "sm_90a", None)?.plan.spec);
                specs.push(plan(&p16, &h200, "sm_90a", None)?.spec);
            }
        }
    }
    for (d, t) in SWEEP {
        let tiles: fa4::config::sm90::Tiles = t.parse()?;
        for seqlen in [4096usize, 16384] {
            for causal in [false, true] {
                let (p8, _) = grid_problems(d, seqlen, causal)?;
                specs.push(plan_fp8(&p8, &h200, "sm_90a", Some(tiles))?.plan.spec);
            }
        }
    }
    specs.sort();
    specs.dedup();
    let failures: Vec<String> = specs
        .par_iter()
        .filter_map(|s| compile(s).err().map(|e| format!("{s}: {e}")))
        .collect();
    println!(
        "precompiled {} kernels, {} failed",
        specs.len(),
        failures.len()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n").into())
    }
}

/// `--sweep`: each [`SWEEP`] candidate on its head dim's 4k and 16k shapes.
fn sweep(rounds: usize) -> Result<(), Box<dyn std::error::Error>> {
    let cuda = CudaBackend::new(0)?;
    println!(
        "device {} ({rounds} rounds of {CALLS} calls)",
        cuda.info().name
    );
    let st = cuda.stream().clone();
    for (d, t) in SWEEP {
        let b = cuda.with_sm90_tiles(Some(t.parse()?));
        for seqlen in [4096usize, 16384] {
            for causal in [false, true] {
                let (p8, _) = grid_problems(d, seqlen, causal)?;
                let n = p8.q_layout().numel();
                let g8 = st.clone_htod(&draw(n))?;
                let mut o8 = cuda.alloc::<bf16>(n)?;
                let ones = DeviceDescales::<CudaSlice<f32>> {
                    q: None,
                    k: None,
                    v: None,
                };
                let mut run = || {
                    b.forward_fp8_device(
                        &p8,
                        &g8,
                        &g8,
                        &g8,
                        &ones,
                        &mut o8,
                        None::<&mut CudaSlice<f32>>,
                    )
                };
                if let Err(e) = run() {
                    println!("d{d} {seqlen} causal={causal} [{t}]: {e}");
                    continue;
                }
                let mut ms = Vec::new();
                for _ in 0..rounds {
                    ms.push(round(&cuda, &mut run)?);
                }
                let s = Spread::of(&ms)?;
                println!(
                    "d{d:<3} {seqlen:<5} causal={causal:<5} [{t}] {:>6.0} TFLOP/s (spread {:.3})",
                    p8.flops() / (s.median * 1e-3) / 1e12,
                    s.iqr_rel()
                );
            }
        }
    }
    Ok(())
}

/// `n` e4m3 inputs: values in [−2, 2] on a 1/500 grid, varied by position, rounded to e4m3.
fn draw(n: usize) -> Vec<F8E4M3> {
    (0..n)
        .map(|i| F8E4M3::from_f32((((i * 2654435761) >> 7) % 2001) as f32 / 500.0 - 2.0))
        .collect()
}

/// One round: an event pair around [`CALLS`] back-to-back calls of `f`; milliseconds per call.
fn round(
    cuda: &CudaBackend,
    f: &mut dyn FnMut() -> fa4::Result<()>,
) -> Result<f64, Box<dyn std::error::Error>> {
    let ev = || {
        cuda.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
    };
    let (a, z) = (ev()?, ev()?);
    a.record(cuda.stream())?;
    for _ in 0..CALLS {
        f()?;
    }
    z.record(cuda.stream())?;
    z.synchronize()?;
    Ok(f64::from(a.elapsed_ms(&z)?) / CALLS as f64)
}

/// The grid's fp8 (O in bf16) and bf16 problems of head dim `d`, `seqlen` tokens per sequence.
fn grid_problems(d: usize, seqlen: usize, causal: bool) -> fa4::Result<(Problem, Problem)> {
    let (b, h) = (16384 / seqlen, 2048 / d);
    let l = Layout::new("q", &[b, seqlen, h, d], None)?;
    let opts = if causal {
        Options::new().causal()
    } else {
        Options::new()
    };
    Ok((
        Problem::new_fp8(DType::Bf16, &l, &l, &l, &l, None, None, &opts)?,
        Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts)?,
    ))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--precompile") {
        return precompile();
    }
    if args.first().map(String::as_str) == Some("--sweep") {
        let rounds = args.get(1).map_or(Ok(3), |r| r.parse())?;
        return sweep(rounds);
    }
    let rounds: usize = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .map(|a| a.parse().expect("ROUNDS is an integer"))
        .unwrap_or(7);
    let tiles = args
        .iter()
        .position(|a| a == "--tiles")
        .map(|i| args[i + 1].parse::<fa4::config::sm90::Tiles>())
        .transpose()?;
    let dims: Vec<usize> = args
        .iter()
        .position(|a| a == "--dims")
        .map(|i| {
            args[i + 1]
                .split(',')
                .map(|d| d.parse().expect("--dims: integers"))
                .collect()
        })
        .unwrap_or_else(|| vec![64, 128, 256]);
    let cuda = CudaBackend::new(0)?;
    let fp8 = cuda.with_sm90_tiles(tiles);
    println!(
        "device {} ({} rounds of {CALLS} calls)",
        cuda.info().name,
        rounds
    );
    println!("d    seqlen causal  fp8 TFLOP/s  bf16 TFLOP/s  fp8/bf16  spread fp8/bf16");
    let st = cuda.stream().clone();
    for &d in &dims {
        for seqlen in [1024usize, 4096, 16384] {
            for causal in [false, true] {
                let (p8, p16) = grid_problems(d, seqlen, causal)?;
                if let Err(e) = fp8.plan_fp8(&p8) {
                    println!("{d:<4} {seqlen:<6} {causal:<6} skipped: {e}");
                    continue;
                }
                let n = p16.q_layout().numel();
                let bytes = draw(n);
                let halfs: Vec<bf16> = bytes.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
                let g8 = st.clone_htod(&bytes)?;
                let g16 = cuda.upload(&halfs)?;
                let mut o8 = cuda.alloc::<bf16>(n)?;
                let mut o16 = cuda.alloc::<bf16>(n)?;
                let ones = DeviceDescales::<CudaSlice<f32>> {
                    q: None,
                    k: None,
                    v: None,
                };
                let mut run8 = || {
                    fp8.forward_fp8_device(
                        &p8,
                        &g8,
                        &g8,
                        &g8,
                        &ones,
                        &mut o8,
                        None::<&mut CudaSlice<f32>>,
                    )
                };
                let mut run16 = || {
                    cuda.forward_device(
                        &p16,
                        &g16,
                        &g16,
                        &g16,
                        None,
                        &mut o16,
                        None::<&mut CudaSlice<f32>>,
                    )
                };
                for _ in 0..3 {
                    run8()?;
                    run16()?;
                }
                let time = |f: &mut dyn FnMut() -> fa4::Result<()>| round(&cuda, f);
                let (mut t8, mut t16) = (Vec::new(), Vec::new());
                for r in 0..rounds {
                    if r % 2 == 0 {
                        t8.push(time(&mut run8)?);
                        t16.push(time(&mut run16)?);
                    } else {
                        t16.push(time(&mut run16)?);
                        t8.push(time(&mut run8)?);
                    }
                }
                let (s8, s16) = (Spread::of(&t8)?, Spread::of(&t16)?);
                let tf = |ms: f64| p16.flops() / (ms * 1e-3) / 1e12;
                println!(
                    "{d:<4} {seqlen:<6} {:<6} {:>11.0}  {:>12.0}  {:>8.2}  {:.3}/{:.3}",
                    causal,
                    tf(s8.median),
                    tf(s16.median),
                    s16.median / s8.median,
                    s8.iqr_rel(),
                    s16.iqr_rel()
                );
            }
        }
    }
    Ok(())
}
