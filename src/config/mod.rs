//! Planners: pure functions from a problem's static shape to a kernel configuration.
//!
//! Each GPU family has its planner; the planner alone decides tile sizes, stage counts, thread
//! counts and shared-memory bytes, and kernels receive those numbers from it.
//!
//! - [`sm100`]: [`sm100::FA4Config`], the FlashAttention-4 plan for Blackwell (the seed).
//! - [`sm90`]: the Hopper plan (TMA, `wgmma`, warp specialisation): tiles, warpgroup roles and
//!   register budgets, shared memory, and which kernel a problem gets on an sm_90 GPU.
//! - [`sm80`]: the Ampere-class `mma.sync` kernel, which runs on every GPU from sm_80 on.
//! - [`decode`]: split-KV and GQA packing of decode over a paged KV cache (CPU and GPU).
//! - [`decode_gpu`]: the GPU decode kernels' specs (split-KV, combine, append) and launch grid.

pub mod bwd;
pub mod bwd_sm90;
pub mod decode;
pub mod decode_gpu;
pub mod prelude;
pub mod sm100;
pub mod sm100_kernel;
pub mod sm100_protocol;
pub mod sm80;
pub mod sm90;

use crate::error::{Error, Result};
use crate::problem::Problem;

/// A kernel family, or the CPU: what a dispatch decision names (printed and serialized as
/// `sm80`, `sm90`, `cpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelKind {
    /// The Ampere-class `mma.sync` kernel (every GPU from sm_80 on).
    Sm80,
    /// The Hopper TMA + wgmma kernel.
    Sm90,
    /// The Blackwell tcgen05 kernel FA4Config plans (only when asked for; not run on hardware).
    Sm100,
    /// No CUDA kernel computes the problem: the CPU backend.
    Cpu,
}

impl std::fmt::Display for KernelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KernelKind::Sm80 => "sm80",
            KernelKind::Sm90 => "sm90",
            KernelKind::Sm100 => "sm100",
            KernelKind::Cpu => "cpu",
        })
    }
}

/// Most K and V bytes (16-bit) the heads of one launch-order group read ([`tile_order`]).
pub const GROUP_KV_BYTES: usize = 32 << 20;

/// The launch of the Ampere-class kernel: one CTA per tile (query block of `block_m` rows of the
/// longest sequence × head × sequence), grid `(group, query blocks, groups)`. The hardware starts
/// CTAs x fastest, so tiles run in groups of `group` (sequence, head) pairs, and in a group the
/// query blocks go last first across the group's pairs (`kernels/sm80/fwd.cu`).
///
/// Under a causal mask (or a window) the last query blocks are the longest, so every group
/// starts its longest tiles first and the tiles that start last are short. A simulation of the
/// hardware's in-order dispatch gave 12–14% longer launches at 1k–4k causal with one head per
/// group than with groups of about twice the CTAs resident at once (`resident`), split evenly.
/// But the heads of a group run at once and compete for L2: on an H200, groups whose K and V
/// passed ~40 MB lost 5% at 16k causal (d128, d256). So a group that would hold more than
/// [`GROUP_KV_BYTES`] of K and V is one pair, and so is every group without a mask (every tile
/// the same length): its query blocks share its K and V in L2.
pub(crate) fn tile_order(
    p: &Problem,
    block_m: usize,
    head_dim: usize,
    resident: usize,
) -> Result<(u32, u32, u32)> {
    let max_q = p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0);
    let m_blocks = max_q.div_ceil(block_m);
    let pairs = p.heads_q().saturating_mul(p.sequences().len());
    let max_k = p.sequences().iter().map(|s| s.k_len).max().unwrap_or(0);
    let kv_bytes = (4 * head_dim).saturating_mul(max_k).max(1);
    let mut group = 1;
    if p.mask().is_restrictive() && pairs > 0 {
        // About twice the resident CTAs per group, in groups of equal size: a short last group
        // starts its long tiles last (the simulation's worst cases were such ragged splits).
        let target = (2 * resident).div_ceil(m_blocks.max(1)).clamp(1, pairs);
        let even = pairs.div_ceil(pairs.div_ceil(target));
        if even.saturating_mul(kv_bytes) <= GROUP_KV_BYTES {
            group = even;
        }
    }
    // The grid's y and z are at most 65535: more pairs than that many groups widen the groups.
    group = group.max(pairs.div_ceil(65_535));
    let y = u32::try_from(m_blocks)
        .ok()
        .filter(|&y| y <= 65_535)
        .ok_or_else(|| {
            Error::invalid(
                "q",
                format!(
                    "seqlen_q {max_q} exceeds the kernel's 65535 query blocks of {block_m} rows"
                ),
            )
        })?;
    // The kernel numbers pairs in int32 (z · x + x stays below 2^31).
    if pairs > i32::MAX as usize / 2 {
        return Err(Error::invalid(
            "q",
            format!("{pairs} (sequence, head) pairs exceed the CUDA kernel's 2^30"),
        ));
    }
    Ok((group as u32, y, pairs.div_ceil(group) as u32))
}

/// Every `(tensor, axis, element stride)` of the problem's Q, K, V and output layouts, for the
/// CUDA kernels' stride rules.
pub(crate) fn strides(
    p: &Problem,
) -> impl Iterator<Item = (&'static str, &'static str, usize)> + '_ {
    [
        ("q", p.q_layout()),
        ("k", p.k_layout()),
        ("v", p.v_layout()),
        ("out", p.o_layout()),
    ]
    .into_iter()
    .flat_map(|(name, l)| {
        ["batch stride", "row stride", "head stride"]
            .into_iter()
            .zip(l.strides)
            .map(move |(axis, st)| (name, axis, st))
    })
}

/// The `(bf16, window, softcap)` specialisations each head dim of a CUDA kernel is built in.
pub(crate) fn feature_variants() -> impl Iterator<Item = (bool, bool, bool)> {
    [false, true].into_iter().flat_map(|bf16| {
        [false, true]
            .into_iter()
            .flat_map(move |window| [false, true].map(|softcap| (bf16, window, softcap)))
    })
}

/// The `N` comma-separated integers of a tile override (`--tiles`, `--sm90-tiles`); errors
/// name `what`.
pub(crate) fn override_fields<const N: usize>(s: &str, what: &str) -> Result<[usize; N]> {
    let bad = || {
        Error::invalid(
            what,
            format!("expected {N} comma-separated integers, got `{s}`"),
        )
    };
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad())?;
    v.try_into().map_err(|_| bad())
}

/// A 0/1 field of a tile override.
pub(crate) fn override_flag(x: usize, name: &str, what: &str) -> Result<bool> {
    match x {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(Error::invalid(
            what,
            format!("{name} must be 0 or 1, got {x}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Layout;
    use crate::{DType, Options};

    /// The hardware's dispatch order (x fastest) and the kernel's decode of a CTA
    /// (`kernels/sm80/fwd.cu`): (query block, pair); a pair past the last is a spare place.
    fn decode(grid: (u32, u32, u32), t: usize) -> (usize, usize) {
        let (x, y) = (grid.0 as usize, grid.1 as usize);
        let (bx, by, bz) = (t % x, (t / x) % y, t / (x * y));
        (y - 1 - by, bz * x + bx)
    }

    #[test]
    fn the_launch_order_covers_every_tile_once_longest_first_per_group() {
        for (seqlen, heads, batch, resident) in [
            (1024, 8, 16, 132),
            (4096, 8, 4, 132),
            (16384, 16, 1, 264),
            (1000, 3, 5, 132),
            (64, 2, 3, 132),
            (200_000, 1, 1, 132),
            (2048, 7, 1, 40), // groups of 4 and 3: one spare place per query block
        ] {
            let l = Layout::new("q", &[batch, seqlen, heads, 64], None).unwrap();
            let opts = Options::new().causal();
            let p = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts).unwrap();
            let grid = tile_order(&p, 128, 64, resident).unwrap();
            let (m_blocks, pairs) = (seqlen.div_ceil(128), heads * batch);
            let group = grid.0 as usize;
            assert_eq!(grid.1 as usize, m_blocks);
            assert_eq!(grid.2 as usize, pairs.div_ceil(group));
            let total = (grid.0 * grid.1 * grid.2) as usize;
            assert!(group >= 1 && group <= pairs);
            assert!(
                group * m_blocks >= resident.min(total) || group == 1,
                "{seqlen} {group}"
            );
            assert!(group == 1 || group * 4 * seqlen * 64 <= GROUP_KV_BYTES);
            let mut seen = vec![false; m_blocks * pairs];
            let mut last = (usize::MAX, usize::MAX);
            for t in 0..total {
                let (m, pair) = decode(grid, t);
                if pair >= pairs {
                    continue; // the kernel returns at once
                }
                assert!(m < m_blocks);
                assert!(
                    !std::mem::replace(&mut seen[m * pairs + pair], true),
                    "tile {t} twice"
                );
                // In a group the query blocks never grow; a new group starts at the last block.
                let grp = pair / group;
                if grp == last.0 {
                    assert!(m <= last.1, "{seqlen}: tile {t}");
                } else {
                    assert_eq!(m, m_blocks - 1);
                }
                last = (grp, m);
            }
            assert!(seen.iter().all(|&s| s), "every tile runs");
        }
    }

    #[test]
    fn unmasked_and_l2_heavy_launches_keep_one_head_per_group_and_limits_are_named() {
        let plan = |s: usize, h: usize, d: usize, causal: bool| {
            let l = Layout::new("q", &[1, s, h, d], None).unwrap();
            let opts = if causal {
                Options::new().causal()
            } else {
                Options::new()
            };
            let p = Problem::new(DType::Bf16, &l, &l, &l, &l, None, None, &opts).unwrap();
            tile_order(&p, 128, d, 132)
        };
        // Causal 1k: groups of all 8 heads; no mask: one head per group.
        assert_eq!(plan(1024, 8, 256, true).unwrap(), (8, 8, 1));
        assert_eq!(plan(1024, 8, 256, false).unwrap(), (1, 8, 8));
        // Causal 16k at d256: three heads would read 48 MB of K and V at once.
        assert_eq!(plan(16384, 8, 256, true).unwrap(), (1, 128, 8));
        let e = plan(65_535 * 128 + 1, 1, 64, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("seqlen_q") && e.contains("65535"), "{e}");
    }
}
