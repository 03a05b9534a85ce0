//! Transfer admission: before an upload or download pulls a byte it holds process-local
//! permits and, in a cluster, one Redis lease reserving five dimensions atomically.
//!
//! This module owns the admission *policy*: what a transfer reserves, how long it waits,
//! how it backs off, when it gives up, and what a lost lease means. `storage::redis` only
//! runs the script and parses its replies.
//!
//! Pure parts (no I/O): [`config`] (sections and validation), [`footprint`] (what each
//! operation reserves), [`limits`] (cluster-wide limits stored in Redis: the file
//! comparison and update checks), [`error`] (errors; their HTTP answers are in `edge::error`).
//! Stateful parts: [`budget`] (the local `TransferBudget`), [`metrics`], [`acquire`] (the
//! wait for a cluster lease: polls, back-off, timeout decision, abandon), [`lease`] (the
//! `LeaseBackend` port of the `LeaseHolder` actor, and [`Outcome`]), [`lease_holder`] (the
//! `LeaseHolder` actor, one per node: holds every admitted transfer's cluster lease, renews
//! it, reports loss, releases it when the permit ends; admission's own actor, linked under
//! the node supervisor by `Admission::supervise_under`), [`handover`] (permits parked
//! between a forwarder's pre-flight and its POST), [`transfer`] (what each transfer asks
//! for), and [`service`] (the [`Admission`] facade, which drives `storage::redis` and the
//! `LeaseHolder` actor).
//! The protocol is described in `docs/admission.md`.

pub mod acquire;
pub mod budget;
pub mod config;
pub mod egress;
pub mod error;
pub mod footprint;
pub mod handover;
pub mod lease;
pub mod lease_holder;
pub mod limits;
pub mod metrics;
pub mod service;
pub mod transfer;

pub use crate::storage::redis::reply::{Dimension, FencingToken, LeaseId, Occupancy};
pub use budget::{LocalPermit, LocalSnapshot, TransferBudget};
pub use config::{AdmissionConfig, LeaseLossPolicy, RedisAdmissionConfig};
pub use error::{Error, QuotaKind};
pub use footprint::{Footprint, Operation};
pub use lease::Outcome;
pub use limits::{Disagreement, LimitsUpdate};
pub use metrics::AdmissionMetrics;
pub use service::{
    Admission, AdmissionPermit, AdmissionSnapshot, LeaseInfo, TenantOverride, TransferRequest,
};
pub use transfer::BACKEND;
