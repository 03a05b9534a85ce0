//! `LeaseHolder`: one actor per node that keeps every admitted transfer's cluster lease
//! alive, renews it and releases it.
//!
//! A transfer's lease is handed over with [`LeaseHolderMsg::Hold`] and given back with
//! [`LeaseHolderMsg::Release`] (the permit's drop or `finish`); the holder owns the
//! fencing tokens and is the only one to present them. Per lease:
//!
//! * It renews every `renew_interval`. After each successful renewal the *safe deadline*
//!   is `send time + lease TTL`, which is never later than the server's expiry (the server
//!   computed its expiry after the request was sent).
//! * A renewal that fails transiently (Redis down, timeout) is retried every
//!   `retry_interval`.
//! * The *loss deadline* is `safe deadline - renew_interval`, on the local monotonic
//!   clock. The holder checks it on every tick (every `retry_interval`), whether or not a
//!   renew call is still hanging (Redis paused or partitioned, the client retrying): the
//!   loss is declared within one `retry_interval` of the deadline, which is still
//!   `renew_interval - retry_interval > 0` before the safe deadline (validation requires
//!   `retry_interval < renew_interval`).
//! * A definitive answer (`LOST`, `STALE`, `EXPIRED`) is a loss at once: the lease was
//!   released, reaped, or belongs to another token.
//! * On loss: the loss hook runs (a metric), a warning is logged with the lease id and
//!   operation only (never the tenant), and per [`LeaseLossPolicy`] the transfer's
//!   [`CancellationToken`] is cancelled (default) or the loss is only reported.
//! * On release the lease is released with the outcome the transfer recorded (completed,
//!   failed, or interrupted when it was dropped without one), unless it was lost. When the
//!   holder stops (node shutdown), every lease it still holds is released as recorded.
//!
//! One actor for all leases (instead of one per transfer, as before) costs a transfer two
//! messages instead of an actor spawn, a supervision link and a timer task per renewal;
//! renewals and releases run as tasks so a slow call never blocks the holder's ticks.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;
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
/// Called with the release reply (or error) of every release.
pub type ReleaseHook = Arc<dyn Fn(Result<ReleaseReply, &Error>) + Send + Sync>;

/// What the holder needs for all its leases; built by the admission facade.
pub struct LeaseHolderArgs {
    pub backend: Arc<dyn LeaseBackend>,
    pub timing: LeaseTiming,
    pub policy: LeaseLossPolicy,
    pub on_loss: LossHook,
    pub on_release: ReleaseHook,
}

/// One admitted transfer's lease, handed to the holder.
pub struct HeldLease {
    pub lease_id: LeaseId,
    pub token: FencingToken,
    /// Send time of the admitting acquire.
    pub sent_at: Instant,
    pub operation: Operation,
    pub cancel: CancellationToken,
    /// Written by the permit, read at release.
    pub outcome: Arc<AtomicU8>,
}

/// Messages of the holder (local only; never serialized). Leases are named by a key the
/// caller picks (unique per holder, see `Admission`).
pub enum LeaseHolderMsg {
    Hold(u64, HeldLease),
    /// Release the lease; `done` is answered once the release call finished.
    Release(u64, Option<oneshot::Sender<()>>),
    Tick,
    /// A renew call of the lease sent at the instant finished.
    Renewed(u64, Instant, Result<RenewReply, Error>),
}

impl ractor::Message for LeaseHolderMsg {}

struct Entry {
    lease: HeldLease,
    safe_deadline: Instant,
    next_renew: Instant,
    renewing: bool,
    lost: bool,
}

pub struct LeaseHolderState {
    args: Arc<LeaseHolderArgs>,
    leases: HashMap<u64, Entry>,
}

/// A holder that ends without `post_stop` (killed, or a panic) cannot renew or release
/// what it still holds: each such lease is a loss (cancelled per policy), so no transfer
/// runs on past a lease nobody renews. After `post_stop` the map is empty.
impl Drop for LeaseHolderState {
    fn drop(&mut self) {
        for entry in self.leases.values_mut().filter(|entry| !entry.lost) {
            LeaseHolder::declare_loss(&self.args, entry, "the lease holder stopped abruptly");
        }
    }
}

pub struct LeaseHolder;

impl LeaseHolder {
    fn declare_loss(args: &LeaseHolderArgs, entry: &mut Entry, reason: &'static str) {
        entry.lost = true;
        (args.on_loss)(entry.lease.operation);
        tracing::warn!(
            lease = %entry.lease.lease_id,
            operation = %entry.lease.operation,
            reason,
            policy = ?args.policy,
            "cluster admission lease lost"
        );
        if args.policy == LeaseLossPolicy::Cancel {
            entry.lease.cancel.cancel();
        }
    }

    /// Release `lease` with its recorded outcome (in a task), then answer `done`.
    fn release(args: &Arc<LeaseHolderArgs>, lease: HeldLease, done: Option<oneshot::Sender<()>>) {
        let args = args.clone();
        tokio::spawn(async move {
            release_now(&args, &lease).await;
            if let Some(done) = done {
                let _ = done.send(());
            }
        });
    }

    fn tick(myself: &ActorRef<LeaseHolderMsg>, state: &mut LeaseHolderState) {
        let now = Instant::now();
        let args = &state.args;
        let timing = args.timing;
        for (key, entry) in &mut state.leases {
            if entry.lost {
                continue;
            }
            // The loss deadline, on this process's monotonic clock: one renew interval
            // before the safe deadline, whether or not a renew call is still hanging.
            if now + timing.renew_interval >= entry.safe_deadline {
                let reason = if entry.renewing {
                    "renewal did not answer before the loss deadline"
                } else {
                    "could not renew before the safe deadline"
                };
                Self::declare_loss(args, entry, reason);
                continue;
            }
            if entry.renewing || now < entry.next_renew {
                continue;
            }
            entry.renewing = true;
            let (key, id, token) = (
                *key,
                entry.lease.lease_id.clone(),
                entry.lease.token.duplicate(),
            );
            let (backend, myself) = (args.backend.clone(), myself.clone());
            tokio::spawn(async move {
                let reply = backend.renew(&id, &token).await;
                let _ = myself.send_message(LeaseHolderMsg::Renewed(key, now, reply));
            });
        }
    }

    fn renewed(
        state: &mut LeaseHolderState,
        key: u64,
        sent: Instant,
        reply: Result<RenewReply, Error>,
    ) {
        let args = &state.args;
        let Some(entry) = state.leases.get_mut(&key) else {
            return;
        };
        entry.renewing = false;
        if entry.lost {
            return;
        }
        let timing = args.timing;
        match reply {
            Ok(RenewReply::Renewed { .. }) => {
                entry.safe_deadline = sent + timing.ttl;
                entry.next_renew = Instant::now() + timing.renew_interval;
            }
            Ok(RenewReply::Lost) => Self::declare_loss(args, entry, "lease no longer exists"),
            Ok(RenewReply::Stale) => {
                Self::declare_loss(args, entry, "lease held under another fencing token")
            }
            Ok(RenewReply::Expired) => {
                Self::declare_loss(args, entry, "lease expired before renewal")
            }
            Err(err) => {
                tracing::debug!(lease = %entry.lease.lease_id, error = %err, "lease renewal failed; retrying");
                entry.next_renew = Instant::now() + timing.retry_interval;
            }
        }
    }
}

async fn release_now(args: &LeaseHolderArgs, lease: &HeldLease) {
    let outcome = Outcome::from_u8(lease.outcome.load(Ordering::Acquire));
    let result = args
        .backend
        .release(&lease.lease_id, &lease.token, outcome)
        .await;
    (args.on_release)(result.as_ref().map(|r| *r));
    match result {
        Ok(ReleaseReply::Released) => {}
        Ok(other) => {
            tracing::debug!(lease = %lease.lease_id, reply = ?other, "lease was already gone at release")
        }
        Err(err) => tracing::warn!(
            lease = %lease.lease_id,
            error = %err,
            "lease release failed; it will expire by TTL"
        ),
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
        ractor::time::send_interval(args.timing.retry_interval, myself.get_cell(), || {
            LeaseHolderMsg::Tick
        });
        Ok(LeaseHolderState {
            args: Arc::new(args),
            leases: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            LeaseHolderMsg::Hold(key, lease) => {
                let timing = state.args.timing;
                let entry = Entry {
                    safe_deadline: lease.sent_at + timing.ttl,
                    next_renew: lease.sent_at + timing.renew_interval,
                    renewing: false,
                    lost: false,
                    lease,
                };
                state.leases.insert(key, entry);
            }
            LeaseHolderMsg::Release(key, done) => match state.leases.remove(&key) {
                Some(entry) if !entry.lost => Self::release(&state.args, entry.lease, done),
                _ => {
                    if let Some(done) = done {
                        let _ = done.send(());
                    }
                }
            },
            LeaseHolderMsg::Tick => Self::tick(&myself, state),
            LeaseHolderMsg::Renewed(key, sent, reply) => Self::renewed(state, key, sent, reply),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let releases = state
            .leases
            .drain()
            .filter(|(_, entry)| !entry.lost)
            .map(|(_, entry)| {
                let args = state.args.clone();
                async move { release_now(&args, &entry.lease).await }
            });
        futures_util::future::join_all(releases).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The holder against an in-memory backend (the Redis-backed behaviour is covered by
    //! `tests/admission_redis.rs` and `tests/admission_lease.rs`).
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

    impl Harness {
        /// Release lease 1 and wait until the release call finished.
        async fn release(&self) {
            let (done, finished) = oneshot::channel();
            self.actor
                .send_message(LeaseHolderMsg::Release(1, Some(done)))
                .unwrap();
            finished.await.unwrap();
        }
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
            timing: LeaseTiming {
                ttl,
                renew_interval: renew,
                retry_interval: Duration::from_millis(20),
            },
            policy,
            on_loss: Arc::new(move |_| {
                counter.fetch_add(1, Ordering::SeqCst);
            }),
            on_release: Arc::new(|_| {}),
        };
        let (actor, join) = Actor::spawn(None, LeaseHolder, args).await.unwrap();
        let lease = HeldLease {
            lease_id: LeaseId::random(),
            token: FencingToken::for_test(1),
            sent_at: Instant::now(),
            operation: Operation::Upload,
            cancel: cancel.clone(),
            outcome: outcome.clone(),
        };
        actor.send_message(LeaseHolderMsg::Hold(1, lease)).unwrap();
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
        h.release().await;
        assert_eq!(*h.fake.released.lock().unwrap(), [Outcome::Completed]);
        assert_eq!(h.losses.load(Ordering::SeqCst), 0);
        h.actor.stop(None);
        h.join.await.unwrap();
        assert_eq!(h.fake.released.lock().unwrap().len(), 1, "released once");
    }

    #[tokio::test]
    async fn definitive_loss_cancels_the_transfer_and_skips_release() {
        let h = start(Some(RenewReply::Lost), LeaseLossPolicy::Cancel).await;
        tokio::time::timeout(Duration::from_secs(2), h.cancel.cancelled())
            .await
            .unwrap();
        assert_eq!(h.losses.load(Ordering::SeqCst), 1);
        h.release().await;
        h.actor.stop(None);
        h.join.await.unwrap();
        assert!(h.fake.released.lock().unwrap().is_empty());
    }

    // ADM-3: failing renewals are a loss before the server could expire the lease.
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
        // up one renewal interval (400 ms) before that, within one tick (20 ms).
        assert!(at < started + ttl, "loss declared after {:?}", at - started);
        assert!(
            h.fake.renews.load(Ordering::SeqCst) >= 2,
            "it retried before giving up"
        );
        assert!(!h.cancel.is_cancelled(), "report policy does not cancel");
        assert_eq!(h.losses.load(Ordering::SeqCst), 1, "declared once");
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
        h.release().await;
        assert_eq!(*h.fake.released.lock().unwrap(), [Outcome::Interrupted]);
    }

    /// A holder that renews, once it has taken its lease (its first renewal shows that).
    async fn holding() -> Harness {
        let h = start(
            Some(RenewReply::Renewed { expires_at_ms: 1 }),
            LeaseLossPolicy::Cancel,
        )
        .await;
        while h.fake.renews.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        h
    }

    #[tokio::test]
    async fn a_killed_holder_declares_its_leases_lost() {
        let h = holding().await;
        // No post_stop: nobody will renew or release the lease any more.
        h.actor.kill();
        let _ = h.join.await;
        tokio::time::timeout(Duration::from_secs(2), h.cancel.cancelled())
            .await
            .unwrap();
        assert_eq!(h.losses.load(Ordering::SeqCst), 1);
        assert!(h.fake.released.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn stopping_the_holder_releases_every_lease_it_still_holds() {
        let h = holding().await;
        h.actor.stop(None);
        h.join.await.unwrap();
        assert_eq!(*h.fake.released.lock().unwrap(), [Outcome::Interrupted]);
    }
}
