//! The Blackwell (SM100) forward kernel that [`FA4Config`] plans: what it is compiled for
//! ([`KernelSpec`]), its generated prelude, which problems it covers, and a compile report
//! (`fa4 plan --depth D --compile`).
//!
//! **Not run on hardware.** No Blackwell GPU was available to this project: the kernel
//! (`kernels/sm100/fwd.cu`) is compiled for `sm_100a` by NVRTC in CI, its shared-memory layout
//! and TMEM map are `static_assert`ed against the plan's numbers, which the prelude carries, and
//! its barrier protocol is the one [`super::sm100_protocol`] models and checks on the CPU. It is
//! used only when asked for (`--kernel sm100`, `FA4_KERNEL=sm100`) on an SM100 device.

use std::fmt;

use super::prelude::{Prelude, RoleWarps};
use super::sm100::{FA4Config, FA4Inputs, Swizzle};
use super::sm100_protocol::Protocol;
use crate::arch::GpuArch;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Registers per thread of each role (`setmaxnreg`): the two softmax warpgroups 184, the
/// correction warpgroup 96, the MMA/load warpgroup 48 — 2·128·184 + 128·96 + 128·48 = 65 536,
/// the SM's register file, as FlashAttention-4 splits it.
pub const SOFTMAX_REGS: usize = 184;
/// Registers of the correction warpgroup.
pub const CORRECTION_REGS: usize = 96;
/// Registers of the MMA and load warps' warpgroup.
pub const OTHER_REGS: usize = 48;

/// Exponential pairs of every 8 the softmax computes on the FMA units (FlashAttention-4's software
/// exp2, `common/softmax.cuh`'s `exp2_poly`) rather than MUFU: a quarter, as upstream balances
/// the two units. Not tuned: the kernel has not run.
pub const POLY_EXP2: usize = 2;

/// The kernel's warp roles, in warp order: (name, warps).
pub const ROLES: [(&str, usize); 6] = [
    ("SOFTMAX0", 4),
    ("SOFTMAX1", 4),
    ("CORRECTION", 4),
    ("MMA", 1),
    ("LOAD", 1),
    ("IDLE", 2),
];

/// Head dims the kernel is built for: every depth FA4Config supports for 16-bit inputs.
pub const HEAD_DIMS: [usize; 5] = [64, 80, 96, 112, 128];

/// What one SM100 kernel is specialised on (with the source hash and NVRTC version, the
/// compile-cache key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// NVRTC target (`sm_100a`: tcgen05 needs the `a` target).
    pub target: &'static str,
    /// bf16 (true) or fp16 (false).
    pub bf16: bool,
    /// Head dim.
    pub head_dim: usize,
    /// Causal or window bounds apply.
    pub window: bool,
    /// Softcap applied to the scores.
    pub softcap: bool,
    /// The plan.
    pub cfg: FA4Config,
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sm100 {} d{} BN {} stages {}{}{} ({})",
            if self.bf16 { "bf16" } else { "fp16" },
            self.head_dim,
            self.cfg.bn(),
            self.cfg.num_kv_stages(),
            if self.window { " window" } else { "" },
            if self.softcap { " softcap" } else { "" },
            self.target
        )
    }
}

impl KernelSpec {
    /// The spec of a 16-bit problem with head dim `head_dim` (the plan for 32 query heads; the
    /// kernel's numbers do not depend on the head counts), or why the plan cannot run it.
    pub fn new(head_dim: usize, bf16: bool, window: bool, softcap: bool) -> Result<KernelSpec> {
        let depth = u32::try_from(head_dim)
            .map_err(|_| Error::invalid("head_dim", format!("{head_dim} is too large")))?;
        let cfg = FA4Config::new(FA4Inputs {
            num_q_heads: 32,
            group: 1,
            depth,
            dtype_size: 2,
            swizzle_mode: Swizzle::B128,
        })?;
        if !cfg.supported() {
            let why: Vec<String> = cfg
                .unsupported_reasons()
                .iter()
                .map(ToString::to_string)
                .collect();
            return Err(Error::invalid(
                "head_dim",
                format!(
                    "FA4Config does not support depth {head_dim} with 16-bit inputs: {}",
                    why.join("; ")
                ),
            ));
        }
        if cfg.split_m() {
            return Err(Error::invalid("head_dim", format!(
                "depth {head_dim}: the split-M plan (depth > 128) is not built into the sm100 kernel"
            )));
        }
        if !head_dim.is_multiple_of(16) {
            return Err(Error::invalid(
                "head_dim",
                format!("depth {head_dim}: the kernel contracts the depth in k16 steps"),
            ));
        }
        Ok(KernelSpec {
            target: "sm_100a",
            bf16,
            head_dim,
            window,
            softcap,
            cfg,
        })
    }

    /// Threads per CTA.
    pub fn threads(&self) -> usize {
        FA4Config::NUM_THREADS as usize
    }

    /// Dynamic shared memory of a launch: the plan's `smem_used` (the kernel asserts that its
    /// layout adds up to it).
    pub fn smem_bytes(&self) -> usize {
        self.cfg.smem_used() as usize
    }

    /// The entry point.
    pub fn entry(&self) -> &'static str {
        "fa4_sm100_fwd"
    }

    /// TMEM columns allocated: the smallest power of two ≥ the plan's use (allocation unit).
    pub fn tmem_alloc_cols(&self) -> u64 {
        self.cfg.tmem_used().next_power_of_two().max(32)
    }

    /// The role table in warps.
    pub fn role_warps() -> Vec<RoleWarps> {
        let mut first = 0;
        ROLES
            .iter()
            .map(|&(name, warps)| {
                let r = RoleWarps {
                    name: name.to_string(),
                    first_warp: first,
                    warps,
                };
                first += warps;
                r
            })
            .collect()
    }

    /// The constants the kernel is compiled with: FA4Config's tiles, TMEM map and shared-memory
    /// total, the roles, the register split and the protocol's barrier table.
    pub fn prelude(&self) -> String {
        let c = &self.cfg;
        Prelude::new("config::sm100_kernel", self)
            .int("HEAD_DIM", self.head_dim)
            .int("PD", c.padded_depth())
            .int("BM", c.bm())
            .int("MMA_M", c.mma_m())
            .int("BN", c.bn())
            .int("BLOCK_N", c.bn())
            .int("KV_STAGES", c.num_kv_stages())
            .int("TMEM_S0", FA4Config::TMEM_S0.raw())
            .int("TMEM_S1", c.tmem_s1().raw())
            .int("TMEM_P0", c.tmem_p0().raw())
            .int("TMEM_P1", c.tmem_p1().raw())
            .int("TMEM_C0", c.tmem_c0().raw())
            .int("TMEM_C1", c.tmem_c1().raw())
            .int("TMEM_O0", c.tmem_o0().raw())
            .int("TMEM_O1", c.tmem_o1().raw())
            .int("TMEM_USED", c.tmem_used())
            .int("TMEM_ALLOC_COLS", self.tmem_alloc_cols())
            .int("SOFTMAX_REGS", SOFTMAX_REGS)
            .int("CORRECTION_REGS", CORRECTION_REGS)
            .int("OTHER_REGS", OTHER_REGS)
            .flag("IS_BF16", self.bf16)
            .flag("HAS_WINDOW", self.window)
            .flag("HAS_SOFTCAP", self.softcap)
            .flag("LAZY_RESCALE", true)
            .int("POLY_EXP2", POLY_EXP2)
            .define("FA4_SMEM_USED", c.smem_used())
            .roles(&Self::role_warps())
            .raw(&Protocol::new(c).prelude())
            .finish()
    }
}

/// A planned launch of the SM100 kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The kernel to compile.
    pub spec: KernelSpec,
    /// Grid: (query blocks of BM rows, heads_q, batch).
    pub grid: (u32, u32, u32),
}

/// Plans `p` on the SM100 kernel, or names the argument it cannot take. The kernel runs
/// fixed-length fp16/bf16 batches with a head dim of [`HEAD_DIMS`], `head_dim_v == head_dim`,
/// a positive scale and strides in multiples of 8 elements, on a GPU with tensor memory.
pub fn plan(p: &Problem, arch: &GpuArch) -> Result<Plan> {
    if arch.tmem_cols.is_none() {
        return Err(Error::invalid(
            "--kernel",
            format!(
                "sm100 needs a Blackwell (SM100) GPU with tensor memory; this is {}",
                arch.name
            ),
        ));
    }
    let bf16 = match p.dtype() {
        DType::Bf16 => true,
        DType::F16 => false,
        other => {
            return Err(Error::invalid(
                "dtype",
                format!("the sm100 kernel computes fp16 and bf16, not {other}"),
            ))
        }
    };
    if p.is_varlen() {
        return Err(Error::invalid(
            "cu_seqlens_q",
            "the sm100 kernel runs fixed-length batches only",
        ));
    }
    if p.head_dim_v() != p.head_dim() {
        return Err(Error::invalid(
            "v",
            "the sm100 kernel needs head_dim_v == head_dim",
        ));
    }
    if !HEAD_DIMS.contains(&p.head_dim()) {
        return Err(Error::invalid(
            "q",
            format!(
                "the sm100 kernel is built for head dims {HEAD_DIMS:?}, not {}",
                p.head_dim()
            ),
        ));
    }
    if p.scale().is_nan() || p.scale() <= 0.0 {
        return Err(Error::invalid(
            "scale",
            "the sm100 kernel needs a positive scale",
        ));
    }
    // TMA: 16-byte aligned strides below 2^40 bytes.
    for (name, l) in [
        ("q", p.q_layout()),
        ("k", p.k_layout()),
        ("v", p.v_layout()),
    ] {
        if let Some(&bad) = l.strides.iter().find(|&&st| st % 8 != 0 || st >= 1 << 39) {
            return Err(Error::invalid(
                name,
                format!("the sm100 kernel's TMA needs strides in multiples of 8 elements below 2^39, got {bad}"),
            ));
        }
    }
    let spec = KernelSpec::new(
        p.head_dim(),
        bf16,
        p.mask().is_restrictive(),
        p.softcap().is_some(),
    )?;
    let max_q = p.sequences().iter().map(|s| s.q_len).max().unwrap_or(0);
    let blocks = max_q.div_ceil(spec.cfg.bm() as usize);
    let dim = |n: usize, what: &str, max: usize| {
        u32::try_from(n)
            .ok()
            .filter(|&x| x as usize <= max)
            .ok_or_else(|| {
                Error::invalid("q", format!("{n} {what} exceed the grid's limit of {max}"))
            })
    };
    Ok(Plan {
        grid: (
            dim(blocks, "query blocks", u32::MAX as usize)?,
            dim(p.heads_q(), "heads", 65_535)?,
            dim(p.sequences().len(), "sequences", 65_535)?,
        ),
        spec,
    })
}

/// Every variant CI compiles: each supported 16-bit depth × dtype × mask × softcap.
pub fn all_specs() -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for d in HEAD_DIMS {
        for bf16 in [true, false] {
            for window in [false, true] {
                for softcap in [false, true] {
                    out.push(
                        KernelSpec::new(d, bf16, window, softcap)
                            .expect("every listed depth is supported"),
                    );
                }
            }
        }
    }
    out
}

/// What `fa4 plan --compile` reports of one compiled kernel.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CompileReport {
    /// NVRTC target.
    pub target: &'static str,
    /// Registers per thread (ptxas).
    pub registers: usize,
    /// Static plus dynamic shared memory of a launch, bytes.
    pub smem_bytes: usize,
    /// Static shared memory (ptxas), bytes: 0, the kernel uses only dynamic shared memory.
    pub static_smem_bytes: usize,
    /// Size of the cubin, bytes.
    pub cubin_bytes: usize,
}

/// Reads `Used N registers` and `N bytes smem` from a ptxas `-v` report.
pub fn parse_ptxas(log: &str) -> Option<(usize, usize)> {
    let line = log.lines().find(|l| l.contains(" registers"))?;
    let words: Vec<&str> = line
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|w| !w.is_empty())
        .collect();
    let registers = words
        .iter()
        .position(|w| *w == "registers")
        .and_then(|i| words.get(i.checked_sub(1)?))
        .and_then(|w| w.parse().ok())?;
    let smem = words
        .windows(3)
        .find(|w| w[1] == "bytes" && w[2] == "smem")
        .and_then(|w| w[0].parse().ok())
        .unwrap_or(0);
    Some((registers, smem))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_reports_parse() {
        let log = "ptxas info    : Compiling entry function 'fa4_sm100_fwd' for 'sm_100a'\n\
                   ptxas info    : Used 128 registers, used 1 barriers, 16 bytes smem, 400 bytes cmem[0]\n";
        assert_eq!(parse_ptxas(log), Some((128, 16)));
        assert_eq!(parse_ptxas("nothing"), None);
    }

    #[test]
    fn every_supported_depth_has_a_spec_and_others_say_why() {
        assert_eq!(all_specs().len(), HEAD_DIMS.len() * 8);
        for d in HEAD_DIMS {
            let s = KernelSpec::new(d, true, false, false).unwrap();
            assert!(s
                .prelude()
                .contains(&format!("#define FA4_SMEM_USED {}", s.cfg.smem_used())));
            assert!(s.tmem_alloc_cols() >= s.cfg.tmem_used());
        }
        for d in [32, 48, 192, 256] {
            assert!(KernelSpec::new(d, true, false, false).is_err(), "d{d}");
        }
    }

    #[test]
    fn plan_refuses_what_the_kernel_does_not_cover() {
        use crate::arch::{B200, H200};
        use crate::problem::Options;
        use crate::tensor::Layout;
        let problem = |dtype: DType, d: usize, opts: Options| {
            let l = Layout::new("q", &[2, 300, 4, d], None).unwrap();
            Problem::new(dtype, &l, &l, &l, &l, None, None, &opts).unwrap()
        };
        let ok = plan(&problem(DType::Bf16, 128, Options::new().causal()), &B200).unwrap();
        assert_eq!(ok.grid, (2, 4, 2));
        assert!(ok.spec.window && !ok.spec.softcap);
        let name = |r: Result<Plan>| match r {
            Err(Error::InvalidArgument { name, .. }) => name,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            name(plan(&problem(DType::Bf16, 128, Options::new()), &H200)),
            "--kernel"
        );
        assert_eq!(
            name(plan(&problem(DType::F32, 128, Options::new()), &B200)),
            "dtype"
        );
        assert_eq!(
            name(plan(&problem(DType::Bf16, 256, Options::new()), &B200)),
            "q"
        );
        assert_eq!(
            name(plan(
                &problem(DType::F16, 64, Options::new().scale(-1.0)),
                &B200
            )),
            "scale"
        );
    }

    #[test]
    fn the_register_split_fills_the_register_file() {
        let wg = |name: &str| {
            ROLES
                .iter()
                .filter(|r| r.0 == name)
                .map(|r| r.1 * 32)
                .sum::<usize>()
        };
        let regs = (wg("SOFTMAX0") + wg("SOFTMAX1")) * SOFTMAX_REGS
            + wg("CORRECTION") * CORRECTION_REGS
            + (wg("MMA") + wg("LOAD") + wg("IDLE")) * OTHER_REGS;
        assert_eq!(regs, 65_536);
        assert_eq!(ROLES.iter().map(|r| r.1).sum::<usize>() * 32, 512);
    }
}
