//! Egress charging of a download stream, the one rule every download path (HTTP `GET`,
//! gRPC `GetBlob`) applies: each piece is charged to the tenant's egress quota
//! immediately before it is handed on, and the transfer's admission permit is held until
//! the stream ends or is dropped.
//!
//! The stream ends early, with an [`EgressStop`], when
//! - the source fails ([`EgressStop::Source`]),
//! - the transfer's lease was lost ([`EgressStop::LeaseLost`]), checked before each piece,
//! - the egress charge is refused or the coordinator fails ([`EgressStop::Refused`]).
//!
//! Exactly the pieces that were charged are yielded: a refused piece is never sent. The
//! next piece is pulled from the source only when the consumer polls for it, so the
//! consumer's flow control is the back-pressure and nothing is buffered here. The
//! permit's outcome is set once: `Completed` as soon as the last of the `expected` bytes
//! was charged and handed on (an HTTP/1 server stops polling a body once it has its
//! `Content-Length` bytes and drops it, so "the stream ended" is never seen there),
//! `Failed` on a source error or a refusal, `Interrupted` on a lost lease; dropped before
//! its last byte, the permit records the drop itself (`interrupted`).

use std::pin::Pin;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use super::{Admission, AdmissionPermit, Error, Outcome};
use crate::ids::TenantId;

/// Why a charged download stream ended before its source did.
#[derive(Debug, thiserror::Error)]
pub enum EgressStop<E> {
    #[error("{0}")]
    Source(E),
    #[error("transfer admission lease lost")]
    LeaseLost,
    #[error("{0}")]
    Refused(Error),
}

struct Charged<S> {
    inner: Pin<Box<S>>,
    admission: Admission,
    tenant: Option<TenantId>,
    permit: Option<AdmissionPermit>,
    /// Bytes the consumer is owed in all, and those charged and handed on so far.
    expected: u64,
    sent: u64,
    done: bool,
}

impl<S> Charged<S> {
    fn finish(&mut self, outcome: Outcome) {
        self.done = true;
        if let Some(permit) = self.permit.take() {
            permit.set_outcome(outcome);
        }
    }
}

impl<S> Drop for Charged<S> {
    fn drop(&mut self) {
        // Every byte handed on (also a zero-length read that was never polled): complete.
        if !self.done && self.sent == self.expected {
            self.finish(Outcome::Completed);
        }
    }
}

/// Charge every piece of `inner` to `tenant`'s egress quota just before it is yielded
/// (no charge without a tenant), holding `permit` until the end (module doc). `expected`
/// is the number of bytes `inner` yields in all (the response's length).
pub fn charge_egress<S, E>(
    inner: S,
    admission: Admission,
    tenant: Option<TenantId>,
    permit: Option<AdmissionPermit>,
    expected: u64,
) -> impl Stream<Item = Result<Bytes, EgressStop<E>>> + Send + 'static
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Send + 'static,
{
    let state = Charged {
        inner: Box::pin(inner),
        admission,
        tenant,
        permit,
        expected,
        sent: 0,
        done: false,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        match st.inner.next().await {
            None => {
                st.finish(Outcome::Completed);
                None
            }
            Some(Err(err)) => {
                st.finish(Outcome::Failed);
                Some((Err(EgressStop::Source(err)), st))
            }
            Some(Ok(bytes)) => {
                if st
                    .permit
                    .as_ref()
                    .is_some_and(|p| p.cancellation().is_cancelled())
                {
                    st.finish(Outcome::Interrupted);
                    return Some((Err(EgressStop::LeaseLost), st));
                }
                if let Some(tenant) = &st.tenant
                    && let Err(err) = st.admission.charge_egress(tenant, bytes.len() as u64).await
                {
                    tracing::info!(outcome = err.outcome(), "download stopped by admission");
                    st.finish(Outcome::Failed);
                    return Some((Err(EgressStop::Refused(err)), st));
                }
                st.sent += bytes.len() as u64;
                if st.sent >= st.expected {
                    // The last byte: the consumer may drop the stream without polling again.
                    st.finish(Outcome::Completed);
                }
                Some((Ok(bytes), st))
            }
        }
    })
}
