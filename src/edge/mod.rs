//! The edge below `http` and `grpc`: what every listener shares.
//!
//! - [`error`]: the one error vocabulary ([`ErrorCode`], [`ApiError`], [`Answer`]): every
//!   status, `Retry-After` and gRPC code a client sees.

pub mod error;

pub use error::{Answer, ApiError, ErrorCode};
