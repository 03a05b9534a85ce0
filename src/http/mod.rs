//! HTTP server: public API, ops endpoints, and the error mapping.

pub mod error;

pub use error::ApiError;
