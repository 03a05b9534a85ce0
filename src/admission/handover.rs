//! Hand-over of one admission between two requests of the same transfer.
//!
//! A forwarded upload is two requests to the owner: the forwarder's pre-flight (`HEAD`,
//! before the client's body is read) and the `POST` that carries the body. The owner
//! admits in the pre-flight, so a refusal reaches the client before the edge reads a byte,
//! and parks the resulting admission permit here under a random reservation id that
//! the forwarder repeats on the `POST`. The `POST` adopts it instead of admitting again:
//! one cluster lease per transfer.
//!
//! A reservation is bound to a tag (the session) and lives at most [`PARK_TTL`]; a
//! reservation never adopted (the forwarder died, the client went away) is dropped then,
//! which returns its local permits and releases its lease as `interrupted`. Parked
//! permits are real permits, so their number is bounded by the local budget.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// How long a parked admission waits for its `POST`. The forwarder sends the `POST`
/// right after the pre-flight answers, so this only bounds abandoned reservations.
pub const PARK_TTL: Duration = Duration::from_secs(10);

struct Entry<P> {
    tag: String,
    permit: P,
}

/// The parked admissions of one node (`P` is the admission permit; dropping it releases
/// the admission).
pub struct Parked<P>(Arc<Mutex<HashMap<String, Entry<P>>>>);

impl<P> Clone for Parked<P> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<P> Default for Parked<P> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<P: Send + 'static> Parked<P> {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry<P>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Park `permit` under a fresh id; it is dropped after [`PARK_TTL`] unless adopted.
    pub fn park(&self, permit: P, tag: String) -> String {
        self.park_for(permit, tag, PARK_TTL)
    }

    fn park_for(&self, permit: P, tag: String, ttl: Duration) -> String {
        let id = uuid::Uuid::new_v4().simple().to_string();
        self.lock().insert(id.clone(), Entry { tag, permit });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let parked = self.clone();
            let key = id.clone();
            runtime.spawn(async move {
                tokio::time::sleep(ttl).await;
                let expired = parked.lock().remove(&key);
                if expired.is_some() {
                    tracing::debug!("a parked admission was never adopted; released");
                }
            });
        }
        id
    }

    /// Take the permit parked under `id`, if it is still there and carries `tag`.
    pub fn adopt(&self, id: &str, tag: &str) -> Option<P> {
        let mut map = self.lock();
        if map.get(id).is_some_and(|e| e.tag == tag) {
            map.remove(id).map(|e| e.permit)
        } else {
            None
        }
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{
        Admission, AdmissionConfig, AdmissionMetrics, Footprint, Operation, TransferRequest,
    };
    use crate::values::ByteSize;

    fn admission() -> Admission {
        let config = AdmissionConfig {
            process_bytes: ByteSize::mib(4),
            tenant_bytes: ByteSize::mib(4),
            ..AdmissionConfig::default()
        };
        Admission::new(&config, AdmissionMetrics::default()).unwrap()
    }

    fn request() -> TransferRequest {
        TransferRequest {
            operation: Operation::Upload,
            tenant: None,
            backend: "fs".into(),
            footprint: Footprint::new(4 << 20).unwrap(),
        }
    }

    #[tokio::test]
    async fn a_parked_permit_is_adopted_once_and_only_with_its_tag() {
        let admission = admission();
        let permit = admission.admit(request()).await.unwrap();
        let id = admission.park(permit, "session-a".into());
        assert_eq!(admission.parked(), 1);
        assert!(admission.adopt(&id, "session-b").is_none(), "wrong tag");
        let adopted = admission.adopt(&id, "session-a").expect("adopted");
        assert!(admission.adopt(&id, "session-a").is_none(), "only once");
        drop(adopted);
        // The whole budget is free again: a second 4 MiB transfer is admitted at once.
        admission.admit(request()).await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_unadopted_permit_is_dropped_after_its_ttl() {
        let admission = admission();
        let parked: Parked<crate::admission::AdmissionPermit> = Parked::default();
        let permit = admission.admit(request()).await.unwrap();
        let id = parked.park_for(permit, "s".into(), Duration::from_secs(1));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(parked.is_empty());
        assert!(parked.adopt(&id, "s").is_none());
        // Its local permits came back.
        admission.admit(request()).await.unwrap();
    }
}
