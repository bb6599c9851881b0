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
    /// A CUDA driver call failed.
    #[error("CUDA error in {op}: {message}")]
    Cuda {
        /// The operation (`cuModuleLoadData`, `launch fa4_fwd_sm80`, …).
        op: String,
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
    /// A driver error from `op`.
    pub(crate) fn cuda(op: impl Into<String>, e: impl std::fmt::Display) -> Self {
        Error::Cuda {
            op: op.into(),
            message: e.to_string(),
        }
    }
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
