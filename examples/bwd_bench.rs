//! The GPU backward timed the fair way, driven line by line on stdin by `bench/sweep.py
//! --backward` (one process per build or environment, rounds interleaved: fa4 against fa4) and
//! by `bench/profile.sh bwd` (under Nsight Compute); fa4 beside its peers is `bench/peers.py bwd`:
//!
//! - `shape D SEQLEN CAUSAL BATCH HEADS [DETERMINISTIC]`: bf16 inputs drawn at random, the
//!   forward on the GPU for O and LSE, a random dO, warm-up calls; answers `ready FLOPS`
//!   (2.5 × the forward's `Problem::flops`);
//! - `round CALLS`: one CUDA event pair around CALLS back-to-back backward calls; answers the
//!   milliseconds per call.

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
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
