//! Readiness: whether this node should receive traffic (`/readyz`, the console, the
//! control plane's loss), one flag shared by every listener and the node.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this node should receive traffic. In embedded mode it becomes ready once the
/// stores are open and the actors run (every shard is local), and stops being ready when
/// shutdown begins.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    ready: Arc<AtomicBool>,
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}
