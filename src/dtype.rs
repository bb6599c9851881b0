//! Element types of Q, K, V and O.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// A storage element type. Accumulation is always f32 (see `docs/attention.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// fp8 e4m3 ("fn": finite, ±448), inputs only: O is bf16 or fp16 (`docs/attention.md`,
    /// "FP8 (e4m3) inputs"); computed by the CPU backend.
    Fp8E4M3,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> u32 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8E4M3 => 1,
        }
    }

    /// The name used on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "fp16",
            DType::Bf16 => "bf16",
            DType::Fp8E4M3 => "fp8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "fp8" | "f8" | "e4m3" | "fp8e4m3" => Ok(DType::Fp8E4M3),
            _ => Err(Error::invalid(
                "dtype",
                format!("expected one of f32, fp16, bf16, fp8; got `{s}`"),
            )),
        }
    }
}
