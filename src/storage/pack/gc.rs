//! GC (placeholder).
