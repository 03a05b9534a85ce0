//! ractor actors: thin message handlers over pure logic.

pub mod lease_holder;
