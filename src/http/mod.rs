//! HTTP server: public API, ops endpoints, and the error mapping.

pub mod error;
pub mod forward;
pub mod internal;

pub use error::ApiError;
