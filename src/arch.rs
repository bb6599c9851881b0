//! Descriptions of the GPUs fa4 plans for.
//!
//! Planners read every hardware limit from here (never a bare number): shared memory per SM and
//! per block, the per-block reservation of the CUDA runtime, TMEM where the part has it.
//! Figures are the vendor's published ones; the CUDA backend reads the live device's values and
//! checks them against the description it plans with.

/// A CUDA compute capability, `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComputeCapability {
    /// Major version (8 = Ampere/Ada, 9 = Hopper, 10 = datacenter Blackwell, 12 = consumer Blackwell).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl std::fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// The architecture family, which decides the kernel family a problem can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// sm_80 / sm_86 / sm_89: `mma.sync`, `cp.async`, `ldmatrix`.
    Ampere,
    /// sm_90: adds TMA, `wgmma`, warp specialisation with `setmaxnreg`.
    Hopper,
    /// sm_100: adds `tcgen05` MMAs into tensor memory (TMEM).
    Blackwell,
    /// sm_120: consumer Blackwell; runs the Ampere-class kernels (`mma.sync`), has no TMEM and
    /// no `wgmma`.
    ConsumerBlackwell,
}

/// One GPU model's limits, as planners need them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuArch {
    /// Marketing name.
    pub name: &'static str,
    /// Architecture family.
    pub family: Family,
    /// Compute capability.
    pub compute_capability: ComputeCapability,
    /// The NVRTC/ptxas target for the family-specific instructions (`sm_90a`, `sm_100a`, …).
    pub target: &'static str,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Shared memory per SM, bytes.
    pub smem_per_sm: u32,
    /// Shared memory the CUDA runtime reserves in every block, bytes.
    pub smem_reserved_per_block: u32,
    /// 32-bit registers per SM.
    pub registers_per_sm: u32,
    /// Resident threads per SM.
    pub max_threads_per_sm: u32,
    /// Tensor-memory columns per SM (128 lanes each, 32-bit cells); `None` before sm_100.
    pub tmem_cols: Option<u32>,
}

impl GpuArch {
    /// The most dynamic shared memory one block can opt into: what the SM has, less the runtime's
    /// reservation for that block.
    pub const fn max_smem_per_block(&self) -> u32 {
        self.smem_per_sm - self.smem_reserved_per_block
    }
}

const KIB: u32 = 1024;

/// NVIDIA B200 (datacenter Blackwell, sm_100a).
pub const B200: GpuArch = GpuArch {
    name: "B200",
    family: Family::Blackwell,
    compute_capability: ComputeCapability {
        major: 10,
        minor: 0,
    },
    target: "sm_100a",
    sm_count: 148,
    smem_per_sm: 228 * KIB,
    smem_reserved_per_block: KIB,
    registers_per_sm: 65536,
    max_threads_per_sm: 2048,
    tmem_cols: Some(512),
};

/// NVIDIA H100 SXM (Hopper, sm_90a).
pub const H100: GpuArch = GpuArch {
    name: "H100 SXM",
    family: Family::Hopper,
    compute_capability: ComputeCapability { major: 9, minor: 0 },
    target: "sm_90a",
    sm_count: 132,
    smem_per_sm: 228 * KIB,
    smem_reserved_per_block: KIB,
    registers_per_sm: 65536,
    max_threads_per_sm: 2048,
    tmem_cols: None,
};

/// NVIDIA H200 SXM: the H100's processor with more, faster memory.
pub const H200: GpuArch = GpuArch {
    name: "H200 SXM",
    ..H100
};

/// NVIDIA A100 (Ampere, sm_80).
pub const A100: GpuArch = GpuArch {
    name: "A100",
    family: Family::Ampere,
    compute_capability: ComputeCapability { major: 8, minor: 0 },
    target: "sm_80",
    sm_count: 108,
    smem_per_sm: 164 * KIB,
    smem_reserved_per_block: KIB,
    registers_per_sm: 65536,
    max_threads_per_sm: 2048,
    tmem_cols: None,
};

/// NVIDIA GeForce RTX 5090 (consumer Blackwell, sm_120).
pub const RTX_5090: GpuArch = GpuArch {
    name: "GeForce RTX 5090",
    family: Family::ConsumerBlackwell,
    compute_capability: ComputeCapability {
        major: 12,
        minor: 0,
    },
    target: "sm_120",
    sm_count: 170,
    smem_per_sm: 100 * KIB,
    smem_reserved_per_block: KIB,
    registers_per_sm: 65536,
    max_threads_per_sm: 1536,
    tmem_cols: None,
};

/// Every described part, for lookups and sweeps.
pub const ALL: [GpuArch; 5] = [B200, H100, H200, A100, RTX_5090];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carveouts_follow_from_the_descriptions() {
        assert_eq!(B200.max_smem_per_block(), 232_448);
        assert_eq!(H100.max_smem_per_block(), 232_448);
        assert_eq!(A100.max_smem_per_block(), 166_912);
        assert_eq!(RTX_5090.max_smem_per_block(), 101_376);
    }

    #[test]
    fn only_sm100_has_tensor_memory() {
        for a in ALL {
            assert_eq!(
                a.tmem_cols.is_some(),
                a.family == Family::Blackwell,
                "{}",
                a.name
            );
        }
        assert_eq!(B200.compute_capability.to_string(), "sm_100");
    }
}
