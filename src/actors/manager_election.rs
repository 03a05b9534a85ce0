//! The `ManagerElection` actor: holds (or waits for) the manager advisory lock and runs the
//! [`ShardManager`] child only while it holds it.
//!
//! - The lock is a session-level `pg_try_advisory_lock` on a **dedicated** connection (never
//!   pooled) opened with TCP keepalive GUCs, `tcp_user_timeout` and `idle_session_timeout`,
//!   so PostgreSQL frees the lock soon after the holder's host vanishes.
//! - As leader it pings the lock connection (`SELECT 1`) every `lock_ping_interval`. Any
//!   error or timeout: kill the manager child at once (no graceful drain) and drop the
//!   connection. Writes of a manager that has not noticed yet are refused by the term fence.
//! - On winning it bumps the manager term *before* spawning the manager, so every write of
//!   the new manager carries a term no predecessor holds.
//! - Mode [`ElectionMode::Standby`] (embedded): retries every `lock_retry_interval`.
//!   Mode [`ElectionMode::FailClosed`] (standalone `graviton manager`): the lock is taken
//!   once up front by [`crate::actors::run_standalone_manager`], which fails closed if
//!   another manager holds it. Losing the lock later does *not* leave the process idle:
//!   it becomes a standby and retries every `lock_retry_interval`, so a cluster with
//!   `embedded_manager = false` regains a manager without an external restart.
//!
//! Supervision: overrides `handle_supervisor_evt`: a manager that stops or fails means
//! leadership is lost; the lock is released and (standby mode) the election continues.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tokio_util::task::AbortOnDropHandle;

use crate::actors::shard_manager::{ShardManager, ShardManagerArgs, ShardManagerMsg};
use crate::ids::NodeId;
use crate::placement::Term;
use crate::storage::pg::connection;
use crate::storage::pg::placement::PlacementStore;

/// What to do when the lock is not (or no longer) held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElectionMode {
    /// Keep trying: a hot standby (embedded mode, every node).
    Standby,
    /// Stop the election actor: a standalone manager fails closed.
    FailClosed,
}

#[derive(Debug, ractor_cluster::RactorMessage)]
pub enum ElectionMsg {
    /// Try the lock (follower) or ping it (leader).
    Tick,
    /// Report the current term (0 when not leading).
    Term(ractor::RpcReplyPort<Term>),
}

pub struct ElectionArgs {
    pub node: NodeId,
    pub mode: ElectionMode,
    pub lock_options: PgConnectOptions,
    /// A connection that already holds the lock (standalone mode).
    pub held: Option<PgConnection>,
    pub manager: ShardManagerArgs,
    pub lock_retry_interval: Duration,
    pub lock_ping_interval: Duration,
}

pub struct ManagerElection;

pub struct ElectionState {
    args: ElectionArgs,
    conn: Option<PgConnection>,
    leading: Option<(Term, ActorRef<ShardManagerMsg>)>,
    timer: Option<AbortOnDropHandle<()>>,
    timer_period: Duration,
}

impl ManagerElection {
    fn schedule(myself: &ActorRef<ElectionMsg>, state: &mut ElectionState, period: Duration) {
        if state.timer.is_some() && state.timer_period == period {
            return;
        }
        if let Some(t) = state.timer.take() {
            t.abort();
        }
        state.timer = Some(AbortOnDropHandle::new(
            myself.send_interval(period, || ElectionMsg::Tick),
        ));
        state.timer_period = period;
    }

    async fn become_leader(
        myself: &ActorRef<ElectionMsg>,
        state: &mut ElectionState,
    ) -> Result<(), ActorProcessingErr> {
        let store: &PlacementStore = &state.args.manager.store;
        let term = match store.bump_term(&state.args.node).await {
            Ok(term) => term,
            Err(err) => {
                tracing::warn!(component = "manager_election", error = %err, "term bump failed; releasing the lock");
                Self::step_down(state).await;
                return Ok(());
            }
        };
        let args = ShardManagerArgs {
            term,
            ..state.args.manager.clone()
        };
        match Actor::spawn_linked(None, ShardManager, args, myself.get_cell()).await {
            Ok((manager, _)) => {
                tracing::info!(component = "manager_election", node_id = %state.args.node, term = term.0, "won the manager lock");
                state.leading = Some((term, manager));
                let period = state.args.lock_ping_interval;
                Self::schedule(myself, state, period);
            }
            Err(err) => {
                tracing::warn!(component = "manager_election", error = %err, "manager failed to start");
                Self::step_down(state).await;
            }
        }
        Ok(())
    }

    /// Stop acting now: kill the manager, drop (and so unlock) the lock connection.
    async fn step_down(state: &mut ElectionState) {
        if let Some((term, manager)) = state.leading.take() {
            manager.kill();
            tracing::warn!(component = "manager_election", node_id = %state.args.node, term = term.0, "stepped down");
        }
        if let Some(mut conn) = state.conn.take() {
            let _ = tokio::time::timeout(
                Duration::from_millis(500),
                connection::unlock_all(&mut conn),
            )
            .await;
            let _ = tokio::time::timeout(Duration::from_millis(500), conn.close()).await;
        }
    }

    async fn lost(myself: &ActorRef<ElectionMsg>, state: &mut ElectionState) {
        Self::step_down(state).await;
        match state.args.mode {
            ElectionMode::Standby => {
                let period = state.args.lock_retry_interval;
                Self::schedule(myself, state, period)
            }
            ElectionMode::FailClosed => {
                tracing::warn!(component = "manager_election", node_id = %state.args.node, "standalone manager lost the lock; standing by to take it again");
                state.args.mode = ElectionMode::Standby;
                let period = state.args.lock_retry_interval;
                Self::schedule(myself, state, period)
            }
        }
    }
}

impl Actor for ManagerElection {
    type Msg = ElectionMsg;
    type State = ElectionState;
    type Arguments = ElectionArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ElectionMsg>,
        mut args: ElectionArgs,
    ) -> Result<ElectionState, ActorProcessingErr> {
        let held = args.held.take();
        let mut state = ElectionState {
            conn: None,
            leading: None,
            timer: None,
            timer_period: Duration::ZERO,
            args,
        };
        if let Some(conn) = held {
            state.conn = Some(conn);
            Self::become_leader(&myself, &mut state).await?;
            if state.leading.is_none() {
                return Err("the manager could not start after taking the lock".into());
            }
        } else {
            let period = state.args.lock_retry_interval;
            Self::schedule(&myself, &mut state, period);
            let _ = myself.cast(ElectionMsg::Tick);
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<ElectionMsg>,
        msg: ElectionMsg,
        state: &mut ElectionState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ElectionMsg::Term(reply) => {
                let _ = reply.send(state.leading.as_ref().map_or(Term(0), |(t, _)| *t));
            }
            ElectionMsg::Tick if state.leading.is_some() => {
                let ping = state.args.lock_ping_interval;
                let ok = match state.conn.as_mut() {
                    Some(conn) => matches!(
                        tokio::time::timeout(
                            ping.max(Duration::from_millis(200)),
                            connection::ping(conn)
                        )
                        .await,
                        Ok(Ok(_))
                    ),
                    None => false,
                };
                if !ok {
                    tracing::warn!(component = "manager_election", node_id = %state.args.node, "lock connection failed");
                    Self::lost(&myself, state).await;
                }
            }
            ElectionMsg::Tick => {
                if state.args.mode == ElectionMode::FailClosed {
                    return Ok(());
                }
                if state.conn.is_none() {
                    match tokio::time::timeout(
                        Duration::from_secs(2),
                        PgConnection::connect_with(&state.args.lock_options),
                    )
                    .await
                    {
                        Ok(Ok(conn)) => state.conn = Some(conn),
                        _ => return Ok(()),
                    }
                }
                let conn = state.conn.as_mut().expect("connection just set");
                match connection::try_lock(conn).await {
                    Ok(true) => Self::become_leader(&myself, state).await?,
                    Ok(false) => {}
                    Err(_) => {
                        // Broken connection: reconnect next tick.
                        state.conn = None;
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<ElectionMsg>,
        event: SupervisionEvent,
        state: &mut ElectionState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorTerminated(cell, _, _)
            | SupervisionEvent::ActorFailed(cell, _) => {
                let ours = state
                    .leading
                    .as_ref()
                    .is_some_and(|(_, m)| m.get_id() == cell.get_id());
                if ours {
                    tracing::warn!(component = "manager_election", node_id = %state.args.node, "shard manager exited; releasing the lock");
                    Self::lost(&myself, state).await;
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ElectionMsg>,
        state: &mut ElectionState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.timer.take() {
            t.abort();
        }
        if let Some((_, manager)) = state.leading.as_ref() {
            let _ = manager
                .stop_and_wait(None, Some(Duration::from_secs(2)))
                .await;
        }
        Self::step_down(state).await;
        Ok(())
    }
}
