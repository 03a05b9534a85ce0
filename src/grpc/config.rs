//! `[grpc]`: the gRPC listener (`graviton.v1.Blobs`, see `grpc`). Off unless `listen` is set.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::config::problem::Problem;

/// `[grpc]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Address of the gRPC listener (HTTP/2, plaintext). Absent: no gRPC listener.
    pub listen: Option<SocketAddr>,
    /// Most concurrent calls (HTTP/2 streams) on one connection.
    pub max_concurrent_streams: u32,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            listen: None,
            max_concurrent_streams: 128,
        }
    }
}

impl GrpcConfig {
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.max_concurrent_streams == 0 {
            problems.push(Problem::new(
                "grpc.max_concurrent_streams",
                "must be at least 1",
            ));
        }
        problems
    }
}
