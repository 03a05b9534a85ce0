//! `LeaseHolder`: one actor per admitted transfer that keeps its cluster lease alive.
//!
//! * Renews every `renew_interval`. After each successful renewal the *safe deadline* is
//!   `send time + lease TTL`, which is never later than the server's expiry (the server
//!   computed its expiry after the request was sent).
//! * A renewal that fails transiently (Redis down, timeout) is retried every
//!   `retry_interval` until `now + renew_interval` reaches the safe deadline; the lease is
//!   then declared lost, at least one renewal interval before the server could expire it.
//! * The *loss deadline* is `safe deadline - renew_interval`, on the local monotonic
//!   clock. Every renew call is raced against it: a call still hanging then (Redis paused
//!   or partitioned, the client retrying) is a loss at that instant, not when the call
//!   finally returns.
//! * A definitive answer (`LOST`, `STALE`, `EXPIRED`) is a loss at once: the lease was
//!   released, reaped, or belongs to another token.
//! * On loss: the loss hook runs (a metric), a warning is logged with the lease id and
//!   operation only (never the tenant), and per [`LeaseLossPolicy`] the transfer's
//!   [`CancellationToken`] is cancelled (default) or the loss is only reported.
//! * `post_stop` releases the lease with the outcome the transfer recorded (completed,
//!   failed, or interrupted when it was dropped without one), unless it was lost.
//!
//! The fencing token lives in the actor state and is presented only by this actor.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::admission::config::LeaseLossPolicy;
use crate::admission::lease::{LeaseBackend, Outcome};
use crate::admission::{Error, FencingToken, LeaseId, Operation};
use crate::storage::redis::reply::{ReleaseReply, RenewReply};

/// Lease timing, from `[admission.redis]`.
#[derive(Debug, Clone, Copy)]
pub struct LeaseTiming {
    pub ttl: Duration,
    pub renew_interval: Duration,
    pub retry_interval: Duration,
}

/// Called once when a lease is lost (a metric increment).
pub type LossHook = Arc<dyn Fn(Operation) + Send + Sync>;
/// Called with the release reply (or error) in `post_stop`.
pub type ReleaseHook = Arc<dyn Fn(Result<ReleaseReply, &Error>) + Send + Sync>;

/// Everything a holder needs; built by the admission facade.
pub struct LeaseHolderArgs {
    pub backend: Arc<dyn LeaseBackend>,
    pub lease_id: LeaseId,
    pub token: FencingToken,
    /// Send time of the admitting acquire.
    pub sent_at: Instant,
    pub timing: LeaseTiming,
    pub policy: LeaseLossPolicy,
    pub operation: Operation,
    pub cancel: CancellationToken,
    /// Written by the permit, read in `post_stop`.
    pub outcome: Arc<AtomicU8>,
    pub on_loss: LossHook,
    pub on_release: ReleaseHook,
}

pub struct LeaseHolderState {
    args: LeaseHolderArgs,
    safe_deadline: Instant,
    lost: bool,
}

/// Messages of the holder (local only; never serialized).
#[derive(Debug)]
pub enum LeaseHolderMsg {
    Renew,
}

impl ractor::Message for LeaseHolderMsg {}

pub struct LeaseHolder;

impl LeaseHolder {
    fn schedule(myself: &ActorRef<LeaseHolderMsg>, after: Duration) {
        ractor::time::send_after(after, myself.get_cell(), || LeaseHolderMsg::Renew);
    }

    fn declare_loss(state: &mut LeaseHolderState, reason: &'static str) {
        state.lost = true;
        (state.args.on_loss)(state.args.operation);
        tracing::warn!(
            lease = %state.args.lease_id,
            operation = %state.args.operation,
            reason,
            policy = ?state.args.policy,
            "cluster admission lease lost"
        );
        if state.args.policy == LeaseLossPolicy::Cancel {
            state.args.cancel.cancel();
        }
    }
}

impl Actor for LeaseHolder {
    type Msg = LeaseHolderMsg;
    type State = LeaseHolderState;
    type Arguments = LeaseHolderArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: LeaseHolderArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Self::schedule(&myself, args.timing.renew_interval);
        let safe_deadline = args.sent_at + args.timing.ttl;
        Ok(LeaseHolderState {
            args,
            safe_deadline,
            lost: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let LeaseHolderMsg::Renew = message;
        if state.lost {
            return Ok(());
        }
        let timing = state.args.timing;
        let sent = Instant::now();
        // The loss deadline, on this process's monotonic clock: one renew interval before
        // the safe deadline. A renew call that has not answered by then (Redis paused,
        // partitioned, retrying) is a loss now, however long the call would still take.
        let loss_deadline = state.safe_deadline - timing.renew_interval;
        let renew = state
            .args
            .backend
            .renew(&state.args.lease_id, &state.args.token);
        let Ok(reply) = tokio::time::timeout_at(loss_deadline, renew).await else {
            Self::declare_loss(state, "renewal did not answer before the loss deadline");
            return Ok(());
        };
        match reply {
            Ok(RenewReply::Renewed { .. }) => {
                state.safe_deadline = sent + timing.ttl;
                Self::schedule(&myself, timing.renew_interval);
            }
            Ok(RenewReply::Lost) => Self::declare_loss(state, "lease no longer exists"),
            Ok(RenewReply::Stale) => {
                Self::declare_loss(state, "lease held under another fencing token")
            }
            Ok(RenewReply::Expired) => Self::declare_loss(state, "lease expired before renewal"),
            Err(err) => {
                let now = Instant::now();
                if now + timing.renew_interval >= state.safe_deadline {
                    Self::declare_loss(state, "could not renew before the safe deadline");
                } else {
                    tracing::debug!(lease = %state.args.lease_id, error = %err, "lease renewal failed; retrying");
                    let latest = state.safe_deadline - timing.renew_interval;
                    Self::schedule(&myself, timing.retry_interval.min(latest - now));
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if state.lost {
            return Ok(());
        }
        let outcome = Outcome::from_u8(state.args.outcome.load(Ordering::Acquire));
        let result = state
            .args
            .backend
            .release(&state.args.lease_id, &state.args.token, outcome)
            .await;
        (state.args.on_release)(result.as_ref().map(|r| *r));
        match result {
            Ok(ReleaseReply::Released) => {}
            Ok(other) => {
                tracing::debug!(lease = %state.args.lease_id, reply = ?other, "lease was already gone at release")
            }
            Err(err) => tracing::warn!(
                lease = %state.args.lease_id,
                error = %err,
                "lease release failed; it will expire by TTL"
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The holder against an in-memory backend (the Redis-backed behaviour is covered by
    //! `tests/admission_redis.rs`).
    use super::*;
    use futures_util::future::BoxFuture;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Fake {
        renews: AtomicUsize,
        /// Reply to renewals: None = transport error.
        renew_reply: Mutex<Option<RenewReply>>,
        released: Mutex<Vec<Outcome>>,
    }

    impl LeaseBackend for Fake {
        fn renew<'a>(
            &'a self,
            _: &'a LeaseId,
            _: &'a FencingToken,
        ) -> BoxFuture<'a, Result<RenewReply, Error>> {
            self.renews.fetch_add(1, Ordering::SeqCst);
            let reply = *self.renew_reply.lock().unwrap();
            Box::pin(async move { reply.ok_or_else(|| Error::Unavailable("io".into())) })
        }

        fn release<'a>(
            &'a self,
            _: &'a LeaseId,
            _: &'a FencingToken,
            outcome: Outcome,
        ) -> BoxFuture<'a, Result<ReleaseReply, Error>> {
            self.released.lock().unwrap().push(outcome);
            Box::pin(async { Ok(ReleaseReply::Released) })
        }
    }

    struct Harness {
        fake: Arc<Fake>,
        cancel: CancellationToken,
        losses: Arc<AtomicUsize>,
        outcome: Arc<AtomicU8>,
        actor: ActorRef<LeaseHolderMsg>,
        join: tokio::task::JoinHandle<()>,
    }

    async fn start(reply: Option<RenewReply>, policy: LeaseLossPolicy) -> Harness {
        start_with(
            reply,
            policy,
            Duration::from_millis(600),
            Duration::from_millis(150),
        )
        .await
    }

    async fn start_with(
        reply: Option<RenewReply>,
        policy: LeaseLossPolicy,
        ttl: Duration,
        renew: Duration,
    ) -> Harness {
        let fake = Arc::new(Fake {
            renew_reply: Mutex::new(reply),
            ..Fake::default()
        });
        let cancel = CancellationToken::new();
        let losses = Arc::new(AtomicUsize::new(0));
        let outcome = Arc::new(AtomicU8::new(Outcome::Interrupted.to_u8()));
        let counter = losses.clone();
        let args = LeaseHolderArgs {
            backend: fake.clone(),
            lease_id: LeaseId::random(),
            token: FencingToken::for_test(1),
            sent_at: Instant::now(),
            timing: LeaseTiming {
                ttl,
                renew_interval: renew,
                retry_interval: Duration::from_millis(20),
            },
            policy,
            operation: Operation::Upload,
            cancel: cancel.clone(),
            outcome: outcome.clone(),
            on_loss: Arc::new(move |_| {
                counter.fetch_add(1, Ordering::SeqCst);
            }),
            on_release: Arc::new(|_| {}),
        };
        let (actor, join) = Actor::spawn(None, LeaseHolder, args).await.unwrap();
        Harness {
            fake,
            cancel,
            losses,
            outcome,
            actor,
            join,
        }
    }

    #[tokio::test]
    async fn renews_and_releases_with_the_recorded_outcome() {
        let h = start(
            Some(RenewReply::Renewed { expires_at_ms: 1 }),
            LeaseLossPolicy::Cancel,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            h.fake.renews.load(Ordering::SeqCst) >= 3,
            "renewed past the original TTL"
        );
        assert!(!h.cancel.is_cancelled());
        h.outcome
            .store(Outcome::Completed.to_u8(), Ordering::Release);
        h.actor.stop(None);
        h.join.await.unwrap();
        assert_eq!(*h.fake.released.lock().unwrap(), [Outcome::Completed]);
        assert_eq!(h.losses.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn definitive_loss_cancels_the_transfer_and_skips_release() {
        let h = start(Some(RenewReply::Lost), LeaseLossPolicy::Cancel).await;
        tokio::time::timeout(Duration::from_secs(2), h.cancel.cancelled())
            .await
            .unwrap();
        assert_eq!(h.losses.load(Ordering::SeqCst), 1);
        h.actor.stop(None);
        h.join.await.unwrap();
        assert!(h.fake.released.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn transient_failures_become_a_loss_before_the_server_expiry() {
        let started = Instant::now();
        let ttl = Duration::from_millis(1500);
        let h = start_with(
            None,
            LeaseLossPolicy::Report,
            ttl,
            Duration::from_millis(400),
        )
        .await;
        let declared = async {
            while h.losses.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Instant::now()
        };
        let at = tokio::time::timeout(Duration::from_secs(5), declared)
            .await
            .unwrap();
        // The server would expire the lease no earlier than sent_at + ttl; the holder gives
        // up one renewal interval (400 ms) before that.
        assert!(at < started + ttl, "loss declared after {:?}", at - started);
        assert!(
            h.fake.renews.load(Ordering::SeqCst) >= 2,
            "it retried before giving up"
        );
        assert!(!h.cancel.is_cancelled(), "report policy does not cancel");
        h.actor.stop(None);
        h.join.await.unwrap();
    }

    #[tokio::test]
    async fn dropped_without_outcome_releases_as_interrupted() {
        let h = start(
            Some(RenewReply::Renewed { expires_at_ms: 1 }),
            LeaseLossPolicy::Cancel,
        )
        .await;
        h.actor.stop(None);
        h.join.await.unwrap();
        assert_eq!(*h.fake.released.lock().unwrap(), [Outcome::Interrupted]);
    }
}
