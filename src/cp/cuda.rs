//! The ring on GPUs: one process driving `N` devices, K/V blocks moved by NCCL on a
//! communication stream per device while the block in hand is computed on the compute stream.
//!
//! Per rank and step `t`:
//!
//! 1. communication stream: wait until the compute of step `t − 1` has finished reading the
//!    spare buffers, then (one NCCL group for all ranks, send and receive together) send the
//!    block in hand to rank `r + 1` and receive rank `r − 1`'s into the spare buffers; record
//!    `received[t]`;
//! 2. compute stream (the backend's): wait for `received[t − 1]`, run the step's calls (one
//!    per (query piece, key piece) product, each a plain fa4 forward on whole pieces) into that
//!    step's partial O and LSE buffers; record `computed[t]`;
//! 3. host: copy step `t − 1`'s partials back on a third stream and fold them into the rank's
//!    running result with [`crate::combine`], while the GPU runs step `t`.
//!
//! Each rank's Q, K and V are kept per piece (a zigzag rank has two) because the kernels take
//! whole buffers: a call on the second piece then needs no offset. So a zigzag step after the
//! first is two calls here (one fused call on the CPU). Partial O are in the storage dtype (the
//! kernels' output), so the merge adds up to `N` roundings of it; the LSE are f32.
//!
//! The merge on the host is the known bottleneck of this first version (it reads every partial
//! O back over PCIe): the scaling targets need the merge on the device. This path has not run
//! yet (no multi-GPU machine was lent); `bench/device_check.sh DIR cp` is what runs it.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use crate::cuda::CudaBackend;
use crate::error::{Error, Result};
use crate::problem::{Options, Problem};
use crate::tensor::{Element, Layout};

use super::cpu::{merge_into, LocalOutputs, Shape};
use super::nccl::NcclRing;
use super::transport::Transport;
use super::{Operand, Ring};

/// Times of a GPU ring, milliseconds, from CUDA events.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuTimings {
    /// `compute_ms[r][t]`: rank `r`'s calls of step `t` on its compute stream.
    pub compute_ms: Vec<Vec<f64>>,
    /// `exchange_ms[r][t]`: rank `r`'s send/recv of the block for step `t + 1`.
    pub exchange_ms: Vec<Vec<f64>>,
    /// Wall time of the whole ring (host clock, inputs already on the devices, merge included).
    pub total_ms: f64,
    /// Wall time of the host merges that did not overlap GPU work (the last step's).
    pub tail_merge_ms: f64,
}

fn err(op: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::cuda(op, e)
}

/// Rows `rows` of every batch entry of a local `[b, len, heads, dim]` buffer, contiguous.
fn piece_rows<T: Copy>(
    local: &[T],
    b: usize,
    len: usize,
    row: usize,
    rows: std::ops::Range<usize>,
) -> Vec<T> {
    let mut out = Vec::with_capacity(b * rows.len() * row);
    for bi in 0..b {
        out.extend_from_slice(&local[(bi * len + rows.start) * row..(bi * len + rows.end) * row]);
    }
    out
}

struct RankState<T> {
    /// The global rank.
    rank: usize,
    q: Vec<CudaSlice<T>>,
    comm: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    /// `parts[t][j]`: O and LSE of product `j` of step `t`.
    parts: Vec<Vec<(CudaSlice<T>, CudaSlice<f32>)>>,
    computed: Vec<CudaEvent>,
    timing: Vec<(CudaEvent, CudaEvent, CudaEvent, CudaEvent)>,
    acc_o: Vec<f32>,
    acc_lse: Vec<f32>,
}

/// Checks what every GPU ring needs: `seqlen_q == seqlen_k` (every product is then a whole
/// piece against a whole piece).
fn check_ring(ring: &Ring) -> Result<()> {
    let (qs, ks) = (ring.schedule().q_split(), ring.schedule().k_split());
    if qs.len() != ks.len() {
        return Err(Error::invalid(
            "seqlen_k",
            format!(
                "the GPU ring needs seqlen_q == seqlen_k (got {} and {}); the CPU ring takes both",
                qs.len(),
                ks.len()
            ),
        ));
    }
    Ok(())
}

/// Elements of each buffer of each rank's K/V block: `(K, V)` of each piece in order.
pub fn block_counts(ring: &Ring) -> Vec<Vec<usize>> {
    let p = ring.problem();
    let (b, hkv, d, dv) = (ring.batch(), p.heads_kv(), p.head_dim(), p.head_dim_v());
    let ks = ring.schedule().k_split();
    (0..ring.ranks())
        .map(|r| {
            ks.pieces(r)
                .iter()
                .flat_map(|pc| {
                    let m = b * pc.global.len() * hkv;
                    [m * d, m * dv]
                })
                .collect()
        })
        .collect()
}

/// Computes the whole problem of `ring` on `backends` (rank `r` on `backends[r]`, distinct
/// devices, one process driving them all) from host inputs laid out as the problem says,
/// writing O and LSE on the host.
///
/// Needs `seqlen_q == seqlen_k`, f16 or bf16 (the CUDA kernels), and NCCL ≥ 2.7
/// ([`super::nccl`]).
#[allow(clippy::too_many_arguments)]
pub fn forward<T: Element>(
    ring: &Ring,
    backends: &[CudaBackend],
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: Option<&mut [f32]>,
) -> Result<GpuTimings> {
    let n = ring.ranks();
    if backends.len() != n {
        return Err(Error::invalid(
            "cp",
            format!("{n} ranks need {n} GPUs, {} given", backends.len()),
        ));
    }
    let mut ordinals: Vec<usize> = backends.iter().map(|b| b.info().ordinal).collect();
    ordinals.sort_unstable();
    ordinals.dedup();
    if ordinals.len() != n {
        return Err(Error::invalid("cp", "every rank needs its own GPU"));
    }
    check_ring(ring)?;
    ring.problem().check_buffers(
        T::DTYPE,
        q.len(),
        k.len(),
        v.len(),
        out.len(),
        lse.as_deref().map(<[f32]>::len),
    )?;
    if ring.problem().o_layout().numel() == 0 {
        // Nothing to compute or write (batch 0 or no query rows).
        return Ok(GpuTimings::default());
    }
    let (lq, lk, lv) = (
        ring.shard(Operand::Q, q)?,
        ring.shard(Operand::K, k)?,
        ring.shard(Operand::V, v)?,
    );
    let locals: Vec<usize> = (0..n).collect();
    let (local, timings) = run_local(ring, &locals, backends, &lq, &lk, &lv, |streams, counts| {
        NcclRing::all(streams, counts)
    })?;
    ring.gather(&local, out, lse)?;
    Ok(timings)
}

/// One rank of a ring with one process per GPU: this process computes rank `rank` on
/// `backend` from its local Q, K and V (as [`Ring::shard`] cuts them), the communicator named
/// by `id` (from [`super::nccl::unique_id`] on one rank, handed to all by the caller). Returns
/// the rank's O `[batch, q_len, heads_q, head_dim_v]` and LSE `[batch, heads_q, q_len]`.
#[allow(clippy::too_many_arguments)]
pub fn forward_rank<T: Element>(
    ring: &Ring,
    rank: usize,
    backend: &CudaBackend,
    id: &super::nccl::UniqueId,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
) -> Result<(Vec<T>, Vec<f32>, GpuTimings)> {
    let n = ring.ranks();
    if rank >= n {
        return Err(Error::invalid(
            "rank",
            format!("{rank} is not below the ring's {n} ranks"),
        ));
    }
    check_ring(ring)?;
    for (name, which, x) in [
        ("q", Operand::Q, &q),
        ("k", Operand::K, &k),
        ("v", Operand::V, &v),
    ] {
        if x.len() != ring.local_numel(which, rank) {
            return Err(Error::invalid(
                name,
                format!(
                    "rank {rank}'s buffer holds {} elements, expected {}",
                    x.len(),
                    ring.local_numel(which, rank)
                ),
            ));
        }
    }
    if ring.problem().o_layout().numel() == 0 {
        // Batch 0 or no query rows: the rank's O and LSE are empty.
        return Ok((Vec::new(), Vec::new(), GpuTimings::default()));
    }
    let (mut local, timings) = run_local(
        ring,
        &[rank],
        std::slice::from_ref(backend),
        &[q],
        &[k],
        &[v],
        |mut streams, counts| NcclRing::rank(streams.remove(0), id, rank, n, counts),
    )?;
    Ok((local.o.remove(0), local.lse.remove(0), timings))
}

/// The ring for the ranks `locals` of this process (`backends[i]` and the inputs `q[i]`, …
/// belong to rank `locals[i]`); `transport` makes the NCCL ring from the local communication
/// streams and the block counts.
#[allow(clippy::too_many_arguments)]
fn run_local<T: Element>(
    ring: &Ring,
    locals: &[usize],
    backends: &[CudaBackend],
    lq: &[Vec<T>],
    lk: &[Vec<T>],
    lv: &[Vec<T>],
    transport: impl FnOnce(Vec<Arc<CudaStream>>, Vec<Vec<usize>>) -> Result<NcclRing<T>>,
) -> Result<(LocalOutputs<T>, GpuTimings)> {
    let n = ring.ranks();
    let p = ring.problem();
    let (qs, ks) = (ring.schedule().q_split(), ring.schedule().k_split());
    let (b, hq, hkv, d, dv) = (
        ring.batch(),
        p.heads_q(),
        p.heads_kv(),
        p.head_dim(),
        p.head_dim_v(),
    );
    let counts = block_counts(ring);
    let spare_len: Vec<usize> = (0..counts[0].len())
        .map(|i| counts.iter().map(|c| c[i]).max().unwrap_or(0).max(1))
        .collect();

    let mut ranks: Vec<RankState<T>> = Vec::with_capacity(locals.len());
    let mut cur: Vec<Vec<CudaSlice<T>>> = Vec::with_capacity(locals.len());
    let mut next: Vec<Vec<CudaSlice<T>>> = Vec::with_capacity(locals.len());
    for (i, (&r, be)) in locals.iter().zip(backends).enumerate() {
        let ctx = be.context();
        let lenq = ring.q_len(r);
        // A zero-length piece still gets a one-element buffer (never read; NCCL sends 0 bytes
        // of it), as the driver refuses zero-byte allocations.
        let up = |x: Vec<T>| {
            if x.is_empty() {
                be.alloc::<T>(1)
            } else {
                be.upload(&x)
            }
        };
        let q_pieces = qs
            .pieces(r)
            .iter()
            .map(|pc| up(piece_rows(&lq[i], b, lenq, hq * d, pc.local())))
            .collect::<Result<Vec<_>>>()?;
        let lenk = ring.k_len(r);
        let mut blk = Vec::new();
        for pc in ks.pieces(r) {
            blk.push(up(piece_rows(&lk[i], b, lenk, hkv * d, pc.local()))?);
            blk.push(up(piece_rows(&lv[i], b, lenk, hkv * dv, pc.local()))?);
        }
        cur.push(blk);
        next.push(
            spare_len
                .iter()
                .map(|&m| be.alloc::<T>(m))
                .collect::<Result<Vec<_>>>()?,
        );
        let mut parts = Vec::with_capacity(n);
        for t in 0..n {
            let step = ring.schedule().step(r, t);
            parts.push(
                step.products
                    .iter()
                    .map(|pr| {
                        let rows = pr.q_global.len();
                        Ok((
                            be.alloc::<T>((b * rows * hq * dv).max(1))?,
                            be.alloc::<f32>(b * hq * rows)?,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let timing = (0..n)
            .map(|_| Ok((ev()?, ev()?, ev()?, ev()?)))
            .collect::<std::result::Result<Vec<_>, cudarc::driver::DriverError>>()
            .map_err(err("cuEventCreate"))?;
        ranks.push(RankState {
            rank: r,
            q: q_pieces,
            comm: ctx.new_stream().map_err(err("cuStreamCreate"))?,
            copy: ctx.new_stream().map_err(err("cuStreamCreate"))?,
            parts,
            computed: Vec::new(),
            timing,
            acc_o: vec![0.0; b * lenq * hq * dv],
            acc_lse: vec![f32::NEG_INFINITY; b * lenq * hq],
        });
    }
    for be in backends {
        be.synchronize()?;
    }
    let mut transport = transport(ranks.iter().map(|s| s.comm.clone()).collect(), counts)?;

    let t_start = std::time::Instant::now();
    let mut received: Vec<Option<CudaEvent>> = (0..locals.len()).map(|_| None).collect();
    for t in 0..n {
        // 1. The exchange for step t + 1, once step t − 1's compute is done with the spares.
        if t + 1 < n {
            for st in &ranks {
                if t >= 1 {
                    st.comm
                        .wait(&st.computed[t - 1])
                        .map_err(err("cuStreamWaitEvent"))?;
                }
                st.timing[t]
                    .2
                    .record(&st.comm)
                    .map_err(err("cuEventRecord"))?;
            }
            transport.shift(t, &cur, &mut next)?;
            for (i, st) in ranks.iter().enumerate() {
                st.timing[t]
                    .3
                    .record(&st.comm)
                    .map_err(err("cuEventRecord"))?;
                received[i] = Some(st.comm.record_event(None).map_err(err("cuEventRecord"))?);
            }
        }
        // 2. The step's calls on each compute stream.
        for (i, (st, be)) in ranks.iter_mut().zip(backends).enumerate() {
            let r = st.rank;
            let stream = be.stream();
            st.timing[t]
                .0
                .record(stream)
                .map_err(err("cuEventRecord"))?;
            let step = ring.schedule().step(r, t);
            let src_pieces = ks.pieces(step.source);
            for (j, pr) in step.products.iter().enumerate() {
                let qi = qs
                    .pieces(r)
                    .iter()
                    .position(|pc| pc.local() == pr.q_local)
                    .ok_or_else(|| Error::invalid("cp", "a product is not a whole query piece"))?;
                let ki = src_pieces
                    .iter()
                    .position(|pc| pc.local() == pr.k_local)
                    .ok_or_else(|| Error::invalid("cp", "a product is not a whole key piece"))?;
                let (rows, keys) = (pr.q_global.len(), pr.k_global.len());
                let lay = |name: &str, s: usize, h: usize, dim: usize| {
                    Layout::new(name, &[b, s, h, dim], None)
                };
                let mut opts = Options::new().mask(pr.kind.mask()).scale(p.scale());
                if let Some(c) = p.softcap() {
                    opts = opts.softcap(c);
                }
                let cp = Problem::new(
                    T::DTYPE,
                    &lay("q", rows, hq, d)?,
                    &lay("k", keys, hkv, d)?,
                    &lay("v", keys, hkv, dv)?,
                    &lay("out", rows, hq, dv)?,
                    None,
                    None,
                    &opts,
                )?;
                let (po, pl) = &mut st.parts[t][j];
                be.forward_device(
                    &cp,
                    &st.q[qi],
                    &cur[i][2 * ki],
                    &cur[i][2 * ki + 1],
                    None,
                    po,
                    Some(pl),
                )?;
            }
            st.timing[t]
                .1
                .record(stream)
                .map_err(err("cuEventRecord"))?;
            st.computed
                .push(stream.record_event(None).map_err(err("cuEventRecord"))?);
            // The next step's compute reads the received block.
            if let Some(ev) = received[i].take() {
                stream.wait(&ev).map_err(err("cuStreamWaitEvent"))?;
            }
        }
        // 3. Merge step t − 1 on the host while the GPUs run step t.
        if t >= 1 {
            merge_step(ring, &mut ranks, t - 1)?;
        }
        std::mem::swap(&mut cur, &mut next);
    }
    let tail = std::time::Instant::now();
    merge_step(ring, &mut ranks, n - 1)?;
    let tail_merge_ms = tail.elapsed().as_secs_f64() * 1e3;
    for be in backends {
        be.synchronize()?;
    }
    let total_ms = t_start.elapsed().as_secs_f64() * 1e3;
    let mut timings = GpuTimings {
        total_ms,
        tail_merge_ms,
        ..Default::default()
    };
    for st in &ranks {
        let ms = |a: &CudaEvent, z: &CudaEvent| a.elapsed_ms(z).map(f64::from).unwrap_or(0.0);
        timings
            .compute_ms
            .push(st.timing.iter().map(|e| ms(&e.0, &e.1)).collect());
        timings
            .exchange_ms
            .push(st.timing[..n - 1].iter().map(|e| ms(&e.2, &e.3)).collect());
    }
    drop(transport);
    let local = LocalOutputs {
        o: ranks
            .iter()
            .map(|s| s.acc_o.iter().map(|&x| T::from_f32(x)).collect())
            .collect(),
        lse: ranks
            .iter()
            .map(|s| {
                let len = ring.q_len(s.rank);
                let mut l = vec![0f32; b * hq * len];
                for bi in 0..b {
                    for i in 0..len {
                        for h in 0..hq {
                            l[(bi * hq + h) * len + i] = s.acc_lse[(bi * len + i) * hq + h];
                        }
                    }
                }
                l
            })
            .collect(),
    };
    Ok((local, timings))
}

/// Copies step `t`'s partials of every local rank back (after its compute) and merges them.
fn merge_step<T: Element>(ring: &Ring, ranks: &mut [RankState<T>], t: usize) -> Result<()> {
    let p = ring.problem();
    let (b, hq, dv) = (ring.batch(), p.heads_q(), p.head_dim_v());
    for st in ranks.iter_mut() {
        st.copy
            .wait(&st.computed[t])
            .map_err(err("cuStreamWaitEvent"))?;
        let step = ring.schedule().step(st.rank, t);
        for (j, pr) in step.products.iter().enumerate() {
            let rows = pr.q_global.len();
            let (po, pl) = &st.parts[t][j];
            let mut o = vec![T::from_f32(0.0); po.len()];
            let mut l = vec![0f32; pl.len()];
            st.copy.memcpy_dtoh(po, &mut o).map_err(err("download"))?;
            st.copy.memcpy_dtoh(pl, &mut l).map_err(err("download"))?;
            st.copy.synchronize().map_err(err("synchronize"))?;
            let o32: Vec<f32> = o[..b * rows * hq * dv].iter().map(|x| x.to_f32()).collect();
            merge_into(
                &mut st.acc_o,
                &mut st.acc_lse,
                Shape {
                    lq: ring.q_len(st.rank),
                    hq,
                    dv,
                },
                pr.q_local.clone(),
                &o32,
                &l,
            )?;
        }
    }
    Ok(())
}

/// Opens `n` CUDA devices for a ring, or says that there are fewer (naming `--cp`).
pub fn open_devices(n: usize) -> Result<Vec<CudaBackend>> {
    let first = CudaBackend::new(0)?;
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|e| Error::cuda("cuDeviceGetCount", e))? as usize;
    if count < n {
        return Err(Error::invalid(
            "--cp",
            format!(
                "{n} ranks need {n} CUDA GPUs, this machine has {count} (--backend cpu \
                 simulates the ranks)"
            ),
        ));
    }
    let mut out = vec![first];
    for i in 1..n {
        out.push(CudaBackend::new(i)?);
    }
    Ok(out)
}
