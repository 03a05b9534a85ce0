//! Transfer admission: before an upload or download pulls a byte it holds process-local
//! permits and, in a cluster, one Redis lease reserving five dimensions atomically.
//!
//! Pure parts (no I/O): [`config`] (sections and validation), [`footprint`] (what each
//! operation reserves), [`hashing`] (keyed ids for Redis), [`reply`] (script replies,
//! fencing token), [`wait`] (retry delays), [`transfer`] (what each transfer asks for), [`error`] (errors and HTTP mapping). Stateful
//! parts: [`budget`] (the local `TransferBudget`), [`metrics`], and [`service`] (the
//! [`Admission`] facade, which drives `storage::redis` and the `LeaseHolder` actor).
//! The protocol is described in `docs/admission.md`.

pub mod budget;
pub mod config;
pub mod error;
pub mod footprint;
pub mod handover;
pub mod hashing;
pub mod metrics;
pub mod reply;
pub mod service;
pub mod transfer;
pub mod wait;

pub use crate::actors::lease_holder::Outcome;
pub use budget::{LocalPermit, LocalSnapshot, TransferBudget};
pub use config::{AdmissionConfig, LeaseLossPolicy, RedisAdmissionConfig};
pub use error::{Error, QuotaKind};
pub use footprint::{Footprint, Operation};
pub use metrics::AdmissionMetrics;
pub use reply::{Dimension, FencingToken, Occupancy};
pub use service::{
    Admission, AdmissionPermit, AdmissionSnapshot, LeaseInfo, TenantOverride, TransferRequest,
};
pub use transfer::BACKEND;
