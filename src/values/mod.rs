//! The value types every configuration section is written in: byte sizes and durations in
//! human units ([`units`]), secrets that never print ([`secret`]), and the validation
//! [`Problem`] that names a key ([`problem`]).
//!
//! A leaf: it imports nothing from the crate. Sections (`admission::config`,
//! `storage::config`, `http::config`, ...) use these types for their settings, and
//! `config` assembles the sections into one [`Config`](crate::config::Config), so the
//! dependency runs one way: `config` → sections → `values`.

pub mod problem;
pub mod secret;
pub mod units;

pub use problem::Problem;
pub use secret::Secret;
pub use units::{ByteSize, HumanDuration, UnitError};
