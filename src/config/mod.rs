//! Planners: pure functions from a problem's static shape to a kernel configuration.
//!
//! Each GPU family has its planner; the planner alone decides tile sizes, stage counts, thread
//! counts and shared-memory bytes, and kernels receive those numbers from it.
//!
//! - [`sm100`]: [`sm100::FA4Config`], the FlashAttention-4 plan for Blackwell (the seed).
//! - [`sm90`]: the Hopper plan (TMA, `wgmma`, warp specialisation): tiles, warpgroup roles and
//!   register budgets, shared memory, and which kernel a problem gets on an sm_90 GPU.
//! - [`sm80`]: the Ampere-class `mma.sync` kernel, which runs on every GPU from sm_80 on.

pub mod sm100;
pub mod sm80;
pub mod sm90;

use crate::error::{Error, Result};
use crate::problem::Problem;

/// The launch grid of the CUDA kernels: (query blocks of `block_m` rows of the longest
/// sequence, heads_q, batch), each within the CUDA grid limits, or an error naming `q`.
pub(crate) fn grid(p: &Problem, block_m: usize) -> Result<(u32, u32, u32)> {
    let max_q = p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0);
    let batch = p.sequences().len();
    let too_big = |what: &str, v: usize| {
        Error::invalid("q", format!("{what} {v} exceeds the CUDA grid limit"))
    };
    let x = u32::try_from(max_q.div_ceil(block_m)).map_err(|_| too_big("seqlen_q", max_q))?;
    let y = u32::try_from(p.heads_q())
        .ok()
        .filter(|&y| y <= 65_535)
        .ok_or_else(|| too_big("heads_q", p.heads_q()))?;
    let z = u32::try_from(batch)
        .ok()
        .filter(|&z| z <= 65_535)
        .ok_or_else(|| too_big("batch", batch))?;
    Ok((x, y, z))
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
