//! fp8 (e4m3) inputs on the GPU: the Hopper kernel's e4m3 variant ([`crate::config::sm90::fp8`]).
//!
//! One call enqueues three launches of one module on the backend's stream: the Vᵀ pass
//! (`kernels/sm90/vt_fp8.cu`: V transposed into a scratch buffer, the descales gathered), the
//! forward, and the exact fixup (a no-op unless the forward flagged a row). The scratch buffers
//! (Vᵀ, the gathered descales, a varlen batch's Vᵀ offsets) are allocated per call.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};

use super::family::{map_spec, ExactFixup, Launch, Launchable};
use super::params::{FwdParams, Sm90Params};
use super::tma::{self, MapElem};
use super::{make_params, offsets, CudaBackend};
use crate::config::sm90::fp8::{plan_fp8, Fp8Plan, VT_CHUNK, VT_ENTRY, VT_THREADS};
use crate::config::sm90::KernelSpec;
use crate::error::{Error, Result};
use crate::fp8::{Descales, Operand, F8E4M3};
use crate::problem::Problem;
use crate::tensor::{Element, Layout};

/// Launch parameters of the Vᵀ pass (`VtParams` in `kernels/sm90/vt_fp8.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct VtParams {
    pub v: u64,
    pub vt: u64,
    pub cu_seqlens_k: u64,
    pub cu_vt: u64,
    pub q_descale: u64,
    pub k_descale: u64,
    pub v_descale: u64,
    pub descales: u64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub batch: i32,
    pub seqlen_k: i32,
    pub vt_seq_keys: i32,
    pub total_cols: i32,
    pub descale_plane: i32,
    pub pad0: i32,
}

/// The header's `FA4_VT_PARAMS_SIZE`.
pub const VT_PARAMS_SIZE: usize = 112;
const _: () = assert!(std::mem::size_of::<VtParams>() == VT_PARAMS_SIZE);
const _: () = assert!(std::mem::offset_of!(VtParams, batch) == 88);
// SAFETY: #[repr(C)] plain integers, laid out like the header (size asserted on both sides).
unsafe impl DeviceRepr for VtParams {}

/// The exact fixup's argument in an e4m3 module (`ExactFp8Params` in `kernels/common/exact.cuh`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExactFp8Params {
    pub p: FwdParams,
    pub descales: u64,
    pub descale_plane: i32,
    pub pad0: i32,
}

/// The header's `FA4_EXACT_FP8_PARAMS_SIZE`.
pub const EXACT_FP8_PARAMS_SIZE: usize = 240;
const _: () = assert!(std::mem::size_of::<ExactFp8Params>() == EXACT_FP8_PARAMS_SIZE);
// SAFETY: as VtParams; FwdParams is DeviceRepr.
unsafe impl DeviceRepr for ExactFp8Params {}

/// The Vᵀ pass of one launch: one CTA per (128-column chunk, KV head).
struct VtPass<'a> {
    module: &'a KernelSpec,
    grid: (u32, u32, u32),
}

// SAFETY: `plan_fp8` sized the Vᵀ buffer's columns (`vt_cols`, a multiple of VT_CHUNK, below
// 2^30) and the per-sequence offsets from the validated problem; the caller allocates the buffer
// as heads_kv × head_dim_v × vt_cols bytes and the descale buffer as 3 × batch × heads_kv f32.
// CTA (x, y) reads V rows of one sequence below its k_len (at 8-byte aligned offsets: the
// planner checked V's strides are multiples of 8 and head_dim_v is one), and writes Vᵀ columns
// [128x, 128x + 128) of head y's rows: inside the buffer. CTA (0, 0) also reads each given
// descale array's batch × heads_kv entries (checked against the problem by the caller) and
// writes the descale buffer. Static shared memory only (128 × head_dim_v ≤ 32 KiB).
unsafe impl Launchable for VtPass<'_> {
    fn launch(&self) -> Launch<'_> {
        Launch {
            kernel: self.module,
            entry: VT_ENTRY,
            grid: self.grid,
            threads: VT_THREADS,
            smem_bytes: 0,
        }
    }
}

/// Device descales of an fp8 call: each `[sequences, heads_kv]` f32, `None` for ones.
pub struct DeviceDescales<'a, D: DevicePtr<f32>> {
    /// Q's.
    pub q: Option<&'a D>,
    /// K's.
    pub k: Option<&'a D>,
    /// V's.
    pub v: Option<&'a D>,
}

impl CudaBackend {
    /// The e4m3 kernel's plan for an fp8 problem on this GPU (a Hopper GPU; elsewhere an error
    /// naming `dtype`).
    pub fn plan_fp8(&self, p: &Problem) -> Result<Fp8Plan> {
        let info = self.info();
        let target = match info.target {
            "sm_90" => "sm_90a",
            other => other,
        };
        plan_fp8(p, &info.arch, target, self.overrides.sm90)
    }

    /// fp8 attention on host slices (checked by [`crate::Backend::run_fp8`]): copies in, the
    /// three launches, copies out, waits.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fp8_host<O: Element>(
        &self,
        p: &Problem,
        q: &[F8E4M3],
        k: &[F8E4M3],
        v: &[F8E4M3],
        descales: &Descales,
        out: &mut [O],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        self.plan_fp8(p)?;
        descales.validate(p)?;
        let stream = self.stream();
        let extent = |l: &Layout| l.extent().unwrap_or(0).max(1);
        let up8 = |name: &str, x: &[F8E4M3], l: &Layout| {
            stream
                .clone_htod(&x[..extent(l).min(x.len())])
                .map_err(|e| Error::cuda(format!("upload {name}"), e))
        };
        let dq = up8("q", q, p.q_layout())?;
        let dk = up8("k", k, p.k_layout())?;
        let dv = up8("v", v, p.v_layout())?;
        let on = extent(p.o_layout()).min(out.len());
        // The output is uploaded too: elements between strided rows must survive.
        let mut dout = self.upload(&out[..on])?;
        let mut dlse = match &lse {
            Some(l) => Some(self.upload::<f32>(l)?),
            None => None,
        };
        let host = |op| descales_of(descales, op);
        let dd: Vec<Option<CudaSlice<f32>>> = [Operand::Q, Operand::K, Operand::V]
            .into_iter()
            .map(|op| host(op).map(|a| self.upload::<f32>(a)).transpose())
            .collect::<Result<_>>()?;
        let ds = DeviceDescales {
            q: dd[0].as_ref(),
            k: dd[1].as_ref(),
            v: dd[2].as_ref(),
        };
        self.forward_fp8_device(p, &dq, &dk, &dv, &ds, &mut dout, dlse.as_mut())?;
        stream
            .memcpy_dtoh(&dout, &mut out[..on])
            .map_err(|e| Error::cuda("download out", e))?;
        if let (Some(l), Some(d)) = (lse, dlse) {
            stream
                .memcpy_dtoh(&d, l)
                .map_err(|e| Error::cuda("download lse", e))?;
        }
        self.synchronize()
    }

    /// fp8 attention on device buffers laid out as the validated problem `p`
    /// ([`Problem::new_fp8`]) says; O (bf16 or fp16, `p.out_dtype()`) and the LSE are written.
    /// Asynchronous on [`CudaBackend::stream`]. The descales are not read back: a device
    /// descale that is not finite and positive makes the rows it scales NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fp8_device<O: Element, D: DevicePtr<f32>>(
        &self,
        p: &Problem,
        q: &impl DevicePtr<F8E4M3>,
        k: &impl DevicePtr<F8E4M3>,
        v: &impl DevicePtr<F8E4M3>,
        descales: &DeviceDescales<'_, D>,
        out: &mut impl DevicePtrMut<O>,
        lse: Option<&mut impl DevicePtrMut<f32>>,
    ) -> Result<()> {
        p.check_fp8_buffers(
            O::DTYPE,
            q.len(),
            k.len(),
            v.len(),
            out.len(),
            lse.as_deref().map(|l| l.len()),
        )?;
        let heads_kv = p.heads_q() / p.group();
        let batch = p.sequences().len();
        let plane = batch * heads_kv;
        for (name, d) in [
            ("q_descale", descales.q),
            ("k_descale", descales.k),
            ("v_descale", descales.v),
        ] {
            if let Some(d) = d {
                if d.len() != plane {
                    return Err(Error::invalid(
                        name,
                        format!(
                            "{} entries, expected [{batch}, {heads_kv}] = {plane}",
                            d.len()
                        ),
                    ));
                }
            }
        }
        let f = self.plan_fp8(p)?;
        let plan = &f.plan;
        if plan.grid.0 == 0 || batch == 0 {
            return Ok(());
        }
        let stream = self.stream().clone();
        let dv = p.head_dim_v();
        // SAFETY: uninitialised device memory, written whole by the Vᵀ pass (every column of
        // every row, padding included; CTA (0, 0) every descale) before the forward, which is
        // ordered after it on the stream, reads any of it.
        let (mut vt, mut packed): (CudaSlice<u8>, CudaSlice<f32>) = unsafe {
            (
                stream
                    .alloc(heads_kv * dv * f.vt_cols)
                    .map_err(|e| Error::cuda("alloc vt", e))?,
                stream
                    .alloc(3 * plane)
                    .map_err(|e| Error::cuda("alloc descales", e))?,
            )
        };
        // A varlen batch's offsets: the problem's (cu_seqlens_q, cu_seqlens_k) and Vᵀ's.
        let cu = if p.is_varlen() {
            let (cq, ck) = offsets(p);
            Some((
                self.upload_i32(&cq)?,
                self.upload_i32(&ck)?,
                self.upload_i32(&f.cu_vt)?,
            ))
        } else {
            None
        };

        let (q_ptr, _q_sync) = q.device_ptr(&stream);
        let (k_ptr, _k_sync) = k.device_ptr(&stream);
        let (v_ptr, _v_sync) = v.device_ptr(&stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = match lse {
            Some(l) => {
                let (ptr, sync) = l.device_ptr_mut(&stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let dq = descales.q.map(|d| d.device_ptr(&stream));
        let dk = descales.k.map(|d| d.device_ptr(&stream));
        let dvs = descales.v.map(|d| d.device_ptr(&stream));
        let addr = |x: &Option<(u64, _)>| x.as_ref().map_or(0, |(a, _)| *a);
        let (vt_ptr, _vt_sync) = vt.device_ptr_mut(&stream);
        let (packed_ptr, _packed_sync) = packed.device_ptr_mut(&stream);
        let (ck_ptr, cu_vt_ptr, _cu_sync) = match &cu {
            Some((_, ck, cv)) => {
                let (a, sa) = ck.device_ptr(&stream);
                let (b, sb) = cv.device_ptr(&stream);
                (a, b, Some((sa, sb)))
            }
            None => (0, 0, None),
        };
        // Q and K go through TMA maps; the planner checked their strides.
        for (name, ptr) in [("q", q_ptr), ("k", k_ptr), ("v", v_ptr), ("out", o_ptr)] {
            if ptr % 16 != 0 {
                return Err(Error::invalid(
                    name,
                    "device buffer must be 16-byte aligned",
                ));
            }
        }
        let (cuq_ptr, _cuq_sync) = match &cu {
            Some((cq, _, _)) => {
                let (a, s) = cq.device_ptr(&stream);
                (a, Some(s))
            }
            None => (0, None),
        };
        let common = make_params(p, [q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cuq_ptr, ck_ptr]);
        let vl = p.v_layout();
        let vtp = VtParams {
            v: v_ptr,
            vt: vt_ptr,
            cu_seqlens_k: ck_ptr,
            cu_vt: cu_vt_ptr,
            q_descale: addr(&dq),
            k_descale: addr(&dk),
            v_descale: addr(&dvs),
            descales: packed_ptr,
            v_batch_stride: vl.strides[0] as i64,
            v_row_stride: vl.strides[1] as i64,
            v_head_stride: vl.strides[2] as i64,
            batch: batch as i32,
            seqlen_k: common.seqlen_k,
            vt_seq_keys: f.vt_seq_keys as i32,
            total_cols: f.vt_cols as i32,
            descale_plane: plane as i32,
            pad0: 0,
        };
        let t = &plan.spec.tiles;
        let sqk = plan.spec.slab_maps_qk();
        let map = |name: &str, ptr: u64, l: &Layout, box_rows: usize| {
            let mut m = map_spec(ptr, true, l, box_rows);
            m.elem = MapElem::Byte;
            if sqk {
                tma::encode_slabs(name, &m)
            } else {
                tma::encode(name, &m)
            }
        };
        let args = Sm90Params {
            tq: map("q", q_ptr, p.q_layout(), t.block_m())?,
            // A batch without keys loads no K (every tile's key range is empty): its map only
            // has to be valid, and a tensor of no rows makes none, so Q's stands in.
            tk: if p.k_layout().dims[1] == 0 {
                map("k", q_ptr, p.q_layout(), t.block_n)?
            } else {
                map("k", k_ptr, p.k_layout(), t.block_n)?
            },
            tv: tma::encode_vt(vt_ptr, f.vt_cols, dv, heads_kv)?,
            p: common,
            tiles: plan.tiles as i32,
            vt_seq_keys: f.vt_seq_keys as i32,
            cu_vt: cu_vt_ptr,
            descales: packed_ptr,
            descale_plane: plane as i32,
            pad0: 0,
            to: Default::default(),
        };
        let pass = VtPass {
            module: &plan.spec,
            grid: ((f.vt_cols / VT_CHUNK) as u32, heads_kv as u32, 1),
        };
        // The forward and its fixup share the module's flag: no other forward of this module
        // may come between them on the stream.
        let _order = self.exact_order();
        self.launch(&pass, &vtp)?;
        self.launch(plan, &args)?;
        self.launch(
            &ExactFixup::new(&plan.spec, &common, self.info().sm_count),
            &ExactFp8Params {
                p: common,
                descales: packed_ptr,
                descale_plane: plane as i32,
                pad0: 0,
            },
        )
    }
}

fn descales_of<'a>(d: &Descales<'a>, op: Operand) -> Option<&'a [f32]> {
    match op {
        Operand::Q => d.q,
        Operand::K => d.k,
        Operand::V => d.v,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_headers_state_the_same_sizes() {
        let vt = crate::cuda::compile::SM90_VT_FP8_SRC;
        assert!(vt.contains(&format!(
            "#define FA4_VT_PARAMS_SIZE {}",
            super::VT_PARAMS_SIZE
        )));
        // `vt_smem_bytes`, which `fa4 plan` reports, mirrors the pass's one shared array.
        assert_eq!(crate::config::sm90::fp8::vt_smem_bytes(64), 128 * 68);
        assert!(vt.contains("constexpr int ROW_BYTES = O_DIM + 4;"));
        assert!(vt.contains("rows[VT_CHUNK * ROW_BYTES]"));
        let exact = crate::cuda::compile::EXACT_SRC;
        assert!(exact.contains(&format!(
            "#define FA4_EXACT_FP8_PARAMS_SIZE {}",
            super::EXACT_FP8_PARAMS_SIZE
        )));
    }
}
