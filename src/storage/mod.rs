//! I/O adapters that hold no policy.

pub mod redis;
