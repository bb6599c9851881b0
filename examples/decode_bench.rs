//! Times the GPU decode kernels on the decode grid (bf16, 32 query / 8 KV heads, d128):
//! one event pair around 10 back-to-back calls, the median of 9 rounds, the caches rotated over
//! enough copies that the calls of a round read more than 400 MB (the H200's L2 is 50 MB).
//! Prints one line per case: page size, seqlen_q, batch, keys, splits, µs per call, TB/s of K+V
//! read, and the rounds' spread. Usage: `decode_bench [ROUNDS]`. The caches hold zeros (the
//! kernels' memory traffic does not depend on the values); `bench/decode_peers.py` times cuDNN
//! the same way on contiguous caches.

use cudarc::driver::sys::CUevent_flags;
use fa4::cuda::CudaBackend;
use fa4::paged::{PagedCache, PagedProblem};
use fa4::tensor::Layout;
use fa4::{DType, Options};
use half::bf16;

const CALLS: usize = 10;
const ROTATE_BYTES: f64 = 4e8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(9);
    let cuda = CudaBackend::new(0)?;
    let (hq, hkv, d) = (32usize, 8usize, 128usize);
    let shapes = [
        (1usize, 32768usize),
        (8, 8192),
        (8, 32768),
        (32, 4096),
        (4, 131072),
    ];
    println!("page | sq | batch | keys | splits | us/call | TB/s | host us/call | spread");
    for (page, sq) in [(16usize, 1usize), (64, 1), (256, 1), (16, 4), (1, 1)] {
        for &(batch, keys) in &shapes {
            let per_seq = keys.div_ceil(page);
            let num_pages = batch * per_seq;
            // A shuffled pool: page i of sequence b is a pseudo-random permutation's entry.
            let mut table: Vec<i32> = (0..num_pages as i32).collect();
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            for i in (1..table.len()).rev() {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                table.swap(i, (state >> 33) as usize % (i + 1));
            }
            let kl = Layout::new("k_cache", &[num_pages, page, hkv, d], None)?;
            let seqlens = vec![keys as i32; batch];
            let cache = PagedCache::new(&kl, &kl, &table, per_seq, &seqlens)?;
            let ql = Layout::new("q", &[batch, sq, hq, d], None)?;
            let opts = if sq > 1 {
                Options::new().causal()
            } else {
                Options::new()
            };
            let p = PagedProblem::new(DType::Bf16, &ql, &ql, &cache, None, &opts)?;
            let bytes = cache.kv_bytes(2);
            let copies = ((ROTATE_BYTES / bytes).ceil() as usize).max(2);
            let elems = num_pages * page * hkv * d;
            let ks: Vec<_> = (0..copies)
                .map(|_| cuda.alloc::<bf16>(elems))
                .collect::<fa4::Result<_>>()?;
            let vs: Vec<_> = (0..copies)
                .map(|_| cuda.alloc::<bf16>(elems))
                .collect::<fa4::Result<_>>()?;
            let q = cuda.alloc::<bf16>(batch * sq * hq * d)?;
            let mut o = cuda.alloc::<bf16>(batch * sq * hq * d)?;
            let mut lse = cuda.alloc::<f32>(p.lse_len())?;
            let mut tables = cuda.paged_tables(&p)?;
            let mut i = 0usize;
            let mut call = |o: &mut _, lse: &mut _| {
                i += 1;
                cuda.forward_paged_device(
                    &p,
                    &mut tables,
                    &q,
                    &ks[i % copies],
                    &vs[i % copies],
                    o,
                    Some(lse),
                    None,
                )
            };
            let mut splits = 0;
            for _ in 0..3 {
                splits = call(&mut o, &mut lse)?.num_splits;
            }
            cuda.synchronize()?;
            let ctx = cuda.context();
            let mut samples = Vec::new();
            let mut host = Vec::new();
            for _ in 0..rounds {
                let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
                let (a, b) = (ev()?, ev()?);
                a.record(cuda.stream())?;
                let t0 = std::time::Instant::now();
                for _ in 0..CALLS {
                    call(&mut o, &mut lse)?;
                }
                host.push(t0.elapsed().as_secs_f64() * 1e6 / CALLS as f64);
                b.record(cuda.stream())?;
                cuda.synchronize()?;
                samples.push(f64::from(a.elapsed_ms(&b)?) * 1e3 / CALLS as f64);
            }
            samples.sort_by(f64::total_cmp);
            host.sort_by(f64::total_cmp);
            let med = samples[samples.len() / 2];
            println!(
                "{page} | {sq} | {batch} | {keys} | {splits} | {med:.1} | {:.2} | {:.1} | {:.1}-{:.1}",
                bytes / (med * 1e-6) / 1e12,
                host[host.len() / 2],
                samples[0],
                samples[samples.len() - 1]
            );
        }
    }
    Ok(())
}
