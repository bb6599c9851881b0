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

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
