//! The GPU backward timed the fair way, driven line by line on stdin by `bench/sweep.py
//! --backward` (one process per build or environment, rounds interleaved: fa4 against fa4) and
//! by `bench/profile.sh bwd` (under Nsight Compute); fa4 beside its peers is `bench/peers.py bwd`:
//!
//! - `shape D SEQLEN CAUSAL BATCH HEADS [DETERMINISTIC]`: bf16 inputs drawn at random, the
//!   forward on the GPU for O and LSE, a random dO, warm-up calls; answers `ready FLOPS`
//!   (2.5 × the forward's `Problem::flops`);
//! - `round CALLS`: one CUDA event pair around CALLS back-to-back backward calls; answers the
//!   milliseconds per call.
//!
//! `bwd_bench --precompile` fills the kernel cache ($FA4_CACHE_DIR) for an H200 without a GPU
//! (`bench/device_build.sh` with `FA4_PRECOMPILE=bwd`): the Hopper and Ampere-class backward
//! kernels of the gradient matrix at every head dim the GPU tests take, and the 16-bit Hopper
//! forward kernels of the forward matrix, so that a device call spends no time in NVRTC.

use std::io::{BufRead, Write};

use cudarc::driver::sys::CUevent_flags;
use fa4::check::random_fill;
use fa4::cuda::backward::{BwdDeviceInputs, BwdDeviceOutputs};
use fa4::cuda::CudaBackend;
use fa4::tensor::Layout;
use fa4::{Options, Problem};
use half::bf16;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// `--precompile`: compiles (rayon, every core) what the GPU tests of the backward and the
/// 16-bit forward matrix will ask for, into the kernel cache.
fn precompile() -> Result<(), Box<dyn std::error::Error>> {
    use fa4::config::{bwd, bwd_sm90, sm90};
    use fa4::cuda::compile::compile;
    use fa4::DType;
    use rayon::prelude::*;
    let h200 = fa4::arch::H200;
    let dtypes = [DType::F16, DType::Bf16];
    let mut hopper = Vec::new();
    let mut rows = Vec::new();
    let head_dims = [8, 40, 64, 80, 96, 112, 128, 136, 192, 248, 256];
    for case in fa4::check::grad::grad_matrix(&dtypes, &head_dims) {
        let p = case.problem()?;
        for det in [false, true] {
            if let Ok(plan) = bwd_sm90::plan(&p, &h200, "sm_90", det) {
                hopper.push(plan.spec);
                rows.push(plan.pre.0);
                rows.push(plan.convert.0);
            }
            if let Ok(plan) = bwd::plan(&p, &h200, "sm_90", det, None) {
                rows.extend(plan.launches.iter().map(|l| l.0));
            }
        }
    }
    let mut fwd = Vec::new();
    for case in fa4::check::matrix(&dtypes, &[32, 64, 80, 96, 128, 192, 256]) {
        if let Ok(plan) = sm90::plan(&case.problem()?, &h200, "sm_90a", None) {
            fwd.push(plan.spec);
        }
    }
    hopper.sort_by_key(|s| s.to_string());
    hopper.dedup();
    rows.sort_by_key(|s| s.to_string());
    rows.dedup();
    fwd.sort_by_key(|s| s.to_string());
    fwd.dedup();
    println!(
        "precompiling {} Hopper backward, {} other backward, {} forward kernels",
        hopper.len(),
        rows.len(),
        fwd.len()
    );
    hopper.par_iter().try_for_each(|s| compile(s).map(|_| ()))?;
    rows.par_iter().try_for_each(|s| compile(s).map(|_| ()))?;
    fwd.par_iter().try_for_each(|s| compile(s).map(|_| ()))?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("--precompile") {
        return precompile();
    }
    let cuda = CudaBackend::new(0)?;
    let ctx = cuda.context().clone();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut state = None;
    for line in stdin.lock().lines() {
        let line = line?;
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.first().copied() {
            Some("shape") => {
                let n: Vec<usize> = w[1..].iter().map(|x| x.parse()).collect::<Result<_, _>>()?;
                let (d, s, causal, b, h) = (n[0], n[1], n[2] == 1, n[3], n[4]);
                let det = n.get(5) == Some(&1);
                let l = Layout::new("q", &[b, s, h, d], None)?;
                let opts = if causal {
                    Options::new().causal()
                } else {
                    Options::new()
                };
                let p = Problem::new(fa4::DType::Bf16, &l, &l, &l, &l, None, None, &opts)?;
                let len = b * s * h * d;
                let mut rng = StdRng::seed_from_u64(1);
                let mut host = || {
                    let mut v = vec![bf16::ZERO; len];
                    random_fill(&mut rng, &mut v, d, 1.0);
                    v
                };
                let (q, k, v, d_out) = (
                    cuda.upload(&host())?,
                    cuda.upload(&host())?,
                    cuda.upload(&host())?,
                    cuda.upload(&host())?,
                );
                let mut o = cuda.alloc::<bf16>(len)?;
                let mut lse = cuda.alloc::<f32>(p.lse_len())?;
                cuda.forward_device(&p, &q, &k, &v, None, &mut o, Some(&mut lse))?;
                let grads = [
                    cuda.alloc::<bf16>(len)?,
                    cuda.alloc::<bf16>(len)?,
                    cuda.alloc::<bf16>(len)?,
                ];
                eprintln!("{}", cuda.plan_backward(&p, det)?);
                state = Some((p, [q, k, v, d_out, o], lse, grads, det));
                let (p, x, lse, g, det) = state.as_mut().unwrap();
                for _ in 0..3 {
                    run(&cuda, p, x, lse, g, *det)?;
                }
                cuda.synchronize()?;
                writeln!(out, "ready {}", 2.5 * p.flops())?;
            }
            Some("round") => {
                let calls: usize = w.get(1).map_or(Ok(10), |x| x.parse())?;
                let (p, x, lse, g, det) = state.as_mut().ok_or("round before shape")?;
                let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                cuda.synchronize()?;
                start.record(cuda.stream())?;
                for _ in 0..calls {
                    run(&cuda, p, x, lse, g, *det)?;
                }
                end.record(cuda.stream())?;
                cuda.synchronize()?;
                writeln!(out, "{}", f64::from(start.elapsed_ms(&end)?) / calls as f64)?;
            }
            _ => return Err(format!("unknown request `{line}`").into()),
        }
        out.flush()?;
    }
    Ok(())
}

fn run(
    cuda: &CudaBackend,
    p: &Problem,
    x: &[cudarc::driver::CudaSlice<bf16>; 5],
    lse: &cudarc::driver::CudaSlice<f32>,
    g: &mut [cudarc::driver::CudaSlice<bf16>; 3],
    det: bool,
) -> fa4::Result<()> {
    let [dq, dk, dv] = g;
    let inputs = BwdDeviceInputs {
        q: &x[0],
        k: &x[1],
        v: &x[2],
        out: &x[4],
        lse,
        d_out: &x[3],
        d_out_layout: *p.o_layout(),
        cu_seqlens: None,
    };
    let mut outputs = BwdDeviceOutputs {
        dq,
        dq_layout: *p.q_layout(),
        dk,
        dk_layout: *p.k_layout(),
        dv,
        dv_layout: *p.v_layout(),
    };
    cuda.backward_device(p, &inputs, &mut outputs, det)
}
