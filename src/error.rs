//! The crate's one error type.
//!
//! Every fallible public function returns [`Result`]. Variants keep the evidence a user needs to
//! fix the call: the argument's name, what was expected and what came.

/// Everything that can go wrong in fa4, from argument validation to kernel compilation.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// An argument is out of its valid range or inconsistent with another argument.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The argument's name as the caller wrote it (`group`, `--depth`, `cu_seqlens_q`, …).
        name: String,
        /// What was expected and what came.
        reason: String,
    },
    /// A CUDA library could not be loaded: which one, and every name and place tried.
    #[error("CUDA is unavailable: {library} not found (tried {tried}); {hint}")]
    CudaUnavailable {
        /// `libcuda` (the driver) or `libnvrtc` (the run-time compiler).
        library: String,
        /// The file names and paths tried, joined.
        tried: String,
        /// What to do about it.
        hint: String,
    },
    /// A CUDA driver call (or NCCL, NVRTC) failed.
    #[error("CUDA error in {op}: {message}")]
    Cuda {
        /// The operation (`cuModuleLoadData`, `launch fa4_fwd_sm80`, …).
        op: String,
        /// The driver's `CUresult` as a number, where a driver call failed (`None` for NVRTC
        /// and NCCL failures, whose codes live in `message`). Callers match on it, e.g. 2
        /// (`CUDA_ERROR_OUT_OF_MEMORY`) to retry smaller.
        code: Option<u32>,
        /// The `CUresult`'s name (`CUDA_ERROR_OUT_OF_MEMORY`), empty where `code` is `None`.
        name: String,
        /// The driver's message.
        message: String,
    },
    /// NVRTC rejected a kernel: the spec, the options and the compiler's log.
    #[error("NVRTC failed to compile {spec} with options {options:?}:\n{log}")]
    Compile {
        /// The kernel spec.
        spec: String,
        /// The compiler options.
        options: Vec<String>,
        /// NVRTC's log.
        log: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            reason: reason.into(),
        }
    }
}

impl Error {
    /// A failure of `op`: a driver error keeps its `CUresult` ([`CudaFailure`]).
    pub(crate) fn cuda(op: impl Into<String>, e: impl CudaFailure) -> Self {
        Error::Cuda {
            op: op.into(),
            code: e.code(),
            name: e.name(),
            message: e.message(),
        }
    }

    /// The driver's `CUresult` of a [`Error::Cuda`] from a driver call.
    pub fn cuda_code(&self) -> Option<u32> {
        match self {
            Error::Cuda { code, .. } => *code,
            _ => None,
        }
    }
}

/// What [`Error::cuda`] keeps of a failure: a driver error's `CUresult` (code and name) and
/// message, or the message alone for failures without one (NVRTC, NCCL, fa4's own checks).
pub(crate) trait CudaFailure {
    /// The `CUresult` as a number.
    fn code(&self) -> Option<u32> {
        None
    }
    /// The `CUresult`'s name.
    fn name(&self) -> String {
        String::new()
    }
    /// The message.
    fn message(&self) -> String;
}

impl CudaFailure for cudarc::driver::DriverError {
    fn code(&self) -> Option<u32> {
        Some(self.0 as u32)
    }
    fn name(&self) -> String {
        // The enum's variant name is the CUresult's name: no driver call needed (a call could
        // fail, and the driver may be absent when a caller builds the error for a test).
        format!("{:?}", self.0)
    }
    fn message(&self) -> String {
        // cudarc's Display asks the driver for the description: only where one is loaded.
        if crate::cuda::driver_loaded() {
            self.to_string()
        } else {
            self.name()
        }
    }
}

impl CudaFailure for String {
    fn message(&self) -> String {
        self.clone()
    }
}

impl CudaFailure for &str {
    fn message(&self) -> String {
        (*self).to_owned()
    }
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;
    use cudarc::driver::DriverError;

    #[test]
    fn driver_errors_keep_their_cuda_result() {
        let e = Error::cuda(
            "cuMemAlloc",
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        match &e {
            Error::Cuda { op, code, name, .. } => {
                assert_eq!(op, "cuMemAlloc");
                assert_eq!(*code, Some(2));
                assert_eq!(name, "CUDA_ERROR_OUT_OF_MEMORY");
            }
            other => panic!("expected Error::Cuda, got {other:?}"),
        }
        assert_eq!(e.cuda_code(), Some(2));
        assert!(
            e.to_string().starts_with("CUDA error in cuMemAlloc: "),
            "{e}"
        );
        let e = Error::cuda(
            "launch x",
            DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        );
        assert_eq!(e.cuda_code(), Some(700));
    }

    #[test]
    fn other_failures_have_no_code() {
        let e = Error::cuda("nvrtcVersion", "NVRTC_ERROR_INTERNAL_ERROR".to_string());
        assert_eq!(e.cuda_code(), None);
        assert_eq!(
            e.to_string(),
            "CUDA error in nvrtcVersion: NVRTC_ERROR_INTERNAL_ERROR"
        );
        assert_eq!(Error::invalid("x", "y").cuda_code(), None);
    }
}
