//! The Hopper kernel (`kernels/sm90/`: TMA, `wgmma`, warp specialisation; planned by
//! [`crate::config::sm90`]), on sm_90 GPUs.

use super::{ForwardFamily, Launch, Launchable, Overrides, Refusal};
use crate::config::{sm90, KernelKind};
use crate::cuda::params::{FwdParams, Sm90Params};
use crate::cuda::{tma, DeviceInfo};
use crate::error::Result;
use crate::problem::Problem;
use crate::tensor::Layout;

/// The family.
pub struct Sm90;

// SAFETY: `config::sm90::plan` accepted only head dims that are multiples of 8 up to 256 (padded
// to tile widths of whole 64-column slabs, V's no wider than Q's) and 16-byte strides below
// 2^40; the TMA maps (`Sm90::params`) describe exactly the layouts' extents (reads past the end
// are zero-filled by the hardware, not performed), and the output is written only at rows below
// each sequence's length and columns below head_dim_v (a narrower tensor's 4-D map ends at its real columns, and the
// plain store checks them; a varlen batch's foreign rows are read,
// masked and their V zeroed, never written; the TMA-store epilogue's O map spans exactly O's
// layout, whose bounds clip a fixed-length batch's last block's rows past the sequence, and a
// varlen batch stores only blocks that end inside their sequence through it, the partial last
// block plainly). The grid is one CTA per tile or, persistent, at
// most one per SM; the kernel numbers the tiles from the params (the planner checked that they
// fit in int32) and visits each exactly once (`config::sm90::schedule` mirrors the walk and
// tests it). The planner's register split fits the CTA's launch allocation, so `setmaxnreg`
// cannot wait forever; the shared memory is the tiles' (static_asserted by the kernel).
unsafe impl Launchable for sm90::Plan {
    fn launch(&self) -> Launch<'_> {
        Launch::new(&self.spec, self.grid, self.spec.threads())
    }
}

impl ForwardFamily for Sm90 {
    const KIND: KernelKind = KernelKind::Sm90;
    type Plan = sm90::Plan;
    type Params = Sm90Params;

    fn covers(dev: &DeviceInfo, p: &Problem) -> std::result::Result<(), Refusal> {
        match sm90::uncovered_arg(&dev.arch, sm90::features(p)) {
            Some((argument, reason)) => Err(Refusal { argument, reason }),
            None => Ok(()),
        }
    }

    fn plan(dev: &DeviceInfo, p: &Problem, o: &Overrides) -> Result<sm90::Plan> {
        // wgmma and setmaxnreg need the architecture-specific target.
        let target = match dev.target {
            "sm_90" => "sm_90a",
            other => other,
        };
        sm90::plan(p, &dev.arch, target, o.sm90)
    }

    fn params(plan: &sm90::Plan, p: &Problem, common: FwdParams) -> Result<Sm90Params> {
        let t = &plan.spec.tiles;
        let bf16 = plan.spec.bf16;
        // A map per tensor over its whole layout: per batch entry for fixed-length batches,
        // the packed rows of every sequence for varlen ones. A tensor narrower than its tiles
        // gets the 4-D map of one slab per box over its real columns.
        let map = |name: &str, ptr: u64, l: &Layout, box_rows: usize, slabs: bool| {
            let m = super::map_spec(ptr, bf16, l, box_rows);
            if slabs {
                tma::encode_slabs(name, &m)
            } else {
                tma::encode(name, &m)
            }
        };
        let (sqk, sv) = (plan.spec.slab_maps_qk(), plan.spec.slab_maps_v());
        Ok(Sm90Params {
            tq: map("q", common.q, p.q_layout(), t.block_m(), sqk)?,
            tk: map("k", common.k, p.k_layout(), t.block_n, sqk)?,
            tv: map("v", common.v, p.v_layout(), t.block_n, sv)?,
            // A varlen batch's one packed map: the kernel stores only blocks that end inside
            // their sequence through it.
            to: if t.tma_store {
                let m = super::map_spec(common.o, bf16, p.o_layout(), sm90::ROWS_PER_CONSUMER);
                if sv {
                    tma::encode_slabs("o", &m)?
                } else {
                    tma::encode_store("o", &m)?
                }
            } else {
                Default::default()
            },
            p: common,
            tiles: plan.tiles as i32, // at most 2^30 (`sm90::plan`)
            vt_seq_keys: 0,
            cu_vt: 0,
            descales: 0,
            descale_plane: 0,
            pad0: 0,
        })
    }
}
