//! The placement store: I/O on `placement_meta`, `placement_nodes` and `placement_shards`.
//!
//! No policy lives here: the manager decides, this module writes. Guarantees:
//! - Heartbeats use the database clock (`now()`), never the node's.
//! - Every manager write runs in a [`FencedTx`]: the transaction first takes a share lock on
//!   the meta row and checks `manager_term`; a term bump (which needs the row lock
//!   exclusively) therefore either happens before the check (the write is refused with
//!   [`PlacementStoreError::Fenced`]) or after the commit. A zombie manager cannot write.
//! - Epochs only change through `SET epoch = epoch + 1 ... RETURNING epoch`, conditional
//!   on the epoch the caller read.
//! - Every change sends a small NOTIFY on [`NOTIFY_CHANNEL`] (delivered on commit).

use std::collections::BTreeMap;

use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::ids::NodeId;
use crate::placement::config::ClusterTimings;
use crate::placement::model::{Epoch, NodeInfo, NodeState, ShardEntry, ShardId, ShardTable, Term};

/// LISTEN/NOTIFY channel of placement changes. Payloads: `shards`, `nodes`, `ack`, `term`.
pub const NOTIFY_CHANNEL: &str = "graviton_placement";

/// Key of the session-level advisory lock held by the one shard manager.
pub const MANAGER_LOCK_KEY: i64 = 0x4752_4156_504c_4d31; // "GRAVPLM1"

/// Errors of the placement store.
#[derive(Debug, thiserror::Error)]
pub enum PlacementStoreError {
    #[error("invalid PostgreSQL URL")]
    InvalidUrl,
    /// Not a `#[source]`: the message already carries the cause, and a chain printed
    /// with its sources would repeat it.
    #[error("PostgreSQL: {0}")]
    Database(sqlx::Error),
    /// The first connection failed: where, why, and the key to change.
    #[error("cannot connect to PostgreSQL at {endpoint} (cluster.database_url): {cause}")]
    Unreachable { endpoint: String, cause: String },
    #[error("migration failed: {0}")]
    Migration(String),
    #[error("manager term {held} is no longer current (current term {current}); write refused")]
    Fenced { held: Term, current: Term },
    #[error(
        "the cluster was bootstrapped with {stored} shards but this node is configured with {configured} (cluster.shard_count); the shard count cannot change"
    )]
    ShardCountMismatch { configured: u32, stored: u32 },
    #[error(
        "PostgreSQL {found} is too old: Graviton needs PostgreSQL 14 or later (the manager lock connection uses idle_session_timeout)"
    )]
    UnsupportedServer { found: String },
    #[error("the placement database is not bootstrapped")]
    NotBootstrapped,
    #[error("corrupt placement row: {0}")]
    Corrupt(&'static str),
}

impl From<sqlx::Error> for PlacementStoreError {
    fn from(err: sqlx::Error) -> Self {
        Self::Database(err)
    }
}

/// What a node registers about itself.
#[derive(Clone, Debug)]
pub struct NodeRegistration {
    pub id: NodeId,
    pub public_addr: String,
    pub internal_addr: String,
    pub control_addr: String,
    pub version: String,
    /// A random token chosen once per process ([`NodeRegistration::new_process_token`]):
    /// tells this process's own registrations from another process's with the same id.
    pub process: String,
}

impl NodeRegistration {
    /// A fresh process token (not secret; it only has to differ between processes).
    pub fn new_process_token() -> String {
        uuid::Uuid::new_v4().simple().to_string()
    }
}

/// The answer to a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeartbeatReply {
    /// Recorded; the node's current state.
    Alive(NodeState),
    /// The row was declared dead (by the manager): register again.
    Dead,
    /// A live row with another incarnation: another process registered this node id.
    Superseded { incarnation: i64 },
    /// A live row with another incarnation registered by this same process: a
    /// re-registration whose answer was lost (its deadline fired after the commit).
    /// Register again; the newer incarnation was never learned.
    Unconfirmed { incarnation: i64 },
    /// No row (deleted by an operator): register again.
    Missing,
}

/// Cluster meta row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterMeta {
    pub shard_count: u32,
    pub manager_term: Term,
    pub manager_node: Option<String>,
}

/// The placement store over a pool.
#[derive(Clone, Debug)]
pub struct PlacementStore {
    pool: PgPool,
}

/// A transaction that holds a share lock on the meta row at a checked manager term.
pub struct FencedTx {
    tx: Transaction<'static, Postgres>,
    term: Term,
}

impl PlacementStore {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Create the meta row and the shard rows if absent; refuse a different shard count.
    pub async fn bootstrap(&self, shard_count: u32) -> Result<ClusterMeta, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO placement_meta (id, shard_count) VALUES (1, $1) ON CONFLICT (id) DO NOTHING")
            .bind(shard_count as i32)
            .execute(&mut *tx)
            .await?;
        let stored: i32 = sqlx::query_scalar("SELECT shard_count FROM placement_meta WHERE id = 1")
            .fetch_one(&mut *tx)
            .await?;
        if stored as u32 != shard_count {
            tx.rollback().await?;
            return Err(PlacementStoreError::ShardCountMismatch {
                configured: shard_count,
                stored: stored as u32,
            });
        }
        sqlx::query(
            "INSERT INTO placement_shards (shard) SELECT generate_series(0, $1 - 1) ON CONFLICT (shard) DO NOTHING",
        )
        .bind(shard_count as i32)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.meta().await
    }

    /// Store `proposed` as the cluster's timings if none are stored yet, and return the
    /// stored ones.
    pub async fn agree_timings(
        &self,
        proposed: ClusterTimings,
    ) -> Result<ClusterTimings, PlacementStoreError> {
        let (fence, ttl): (i64, i64) = sqlx::query_as(
            "UPDATE placement_meta SET self_fence_ms = COALESCE(self_fence_ms, $1),
                                       node_ttl_ms = COALESCE(node_ttl_ms, $2)
             WHERE id = 1 RETURNING self_fence_ms, node_ttl_ms",
        )
        .bind(proposed.self_fence.as_millis() as i64)
        .bind(proposed.node_ttl.as_millis() as i64)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(PlacementStoreError::NotBootstrapped)?;
        let ms = |v: i64| std::time::Duration::from_millis(v.max(0) as u64);
        Ok(ClusterTimings {
            self_fence: ms(fence),
            node_ttl: ms(ttl),
        })
    }

    pub async fn meta(&self) -> Result<ClusterMeta, PlacementStoreError> {
        let row = sqlx::query(
            "SELECT shard_count, manager_term, manager_node FROM placement_meta WHERE id = 1",
        )
        .fetch_optional(&self.pool)
        .await?
        .ok_or(PlacementStoreError::NotBootstrapped)?;
        Ok(ClusterMeta {
            shard_count: row.try_get::<i32, _>("shard_count")? as u32,
            manager_term: Term(row.try_get("manager_term")?),
            manager_node: row.try_get("manager_node")?,
        })
    }

    /// Register a node at process start: state `joining`, a new incarnation, a fresh
    /// heartbeat. Returns the incarnation, which the node's heartbeats must quote.
    pub async fn register_node(&self, node: &NodeRegistration) -> Result<i64, PlacementStoreError> {
        self.register(node, false).await
    }

    /// Register again from a running process that lost its registration (declared dead):
    /// like [`Self::register_node`], but a drain requested before stays requested.
    pub async fn reregister_node(
        &self,
        node: &NodeRegistration,
    ) -> Result<i64, PlacementStoreError> {
        self.register(node, true).await
    }

    async fn register(
        &self,
        node: &NodeRegistration,
        keep_drain: bool,
    ) -> Result<i64, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        let incarnation: i64 = sqlx::query_scalar(
            "INSERT INTO placement_nodes (id, public_addr, internal_addr, control_addr, version, state, process)
             VALUES ($1, $2, $3, $4, $5, 'joining', $7)
             ON CONFLICT (id) DO UPDATE SET
                public_addr = EXCLUDED.public_addr, internal_addr = EXCLUDED.internal_addr,
                control_addr = EXCLUDED.control_addr, version = EXCLUDED.version,
                process = EXCLUDED.process,
                state = CASE WHEN $6 AND (placement_nodes.state = 'draining' OR placement_nodes.drain_requested)
                             THEN 'draining' ELSE 'joining' END,
                drain_requested = $6 AND (placement_nodes.state = 'draining' OR placement_nodes.drain_requested),
                incarnation = placement_nodes.incarnation + 1,
                registered_at = now(), heartbeat_at = now()
             RETURNING incarnation",
        )
        .bind(node.id.as_str())
        .bind(&node.public_addr)
        .bind(&node.internal_addr)
        .bind(&node.control_addr)
        .bind(&node.version)
        .bind(keep_drain)
        .bind(&node.process)
        .fetch_one(&mut *tx)
        .await?;
        notify(&mut tx, "nodes").await?;
        tx.commit().await?;
        Ok(incarnation)
    }

    /// Refresh the heartbeat of `node`'s registration at `incarnation` (database clock),
    /// and say why if it was refused.
    pub async fn heartbeat_reply(
        &self,
        node: &NodeRegistration,
        incarnation: i64,
    ) -> Result<HeartbeatReply, PlacementStoreError> {
        let row = sqlx::query(
            "WITH beat AS (
                UPDATE placement_nodes SET heartbeat_at = now()
                WHERE id = $1 AND incarnation = $2 AND state <> 'dead' RETURNING state)
             SELECT (SELECT state FROM beat) AS beat_state, n.state, n.incarnation, n.process
             FROM placement_nodes n WHERE n.id = $1",
        )
        .bind(node.id.as_str())
        .bind(incarnation)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(HeartbeatReply::Missing);
        };
        let parse =
            |s: String| NodeState::parse(&s).ok_or(PlacementStoreError::Corrupt("node state"));
        if let Some(state) = row.try_get::<Option<String>, _>("beat_state")? {
            return Ok(HeartbeatReply::Alive(parse(state)?));
        }
        let row_incarnation: i64 = row.try_get("incarnation")?;
        let state = parse(row.try_get("state")?)?;
        let process: String = row.try_get("process")?;
        Ok(
            if row_incarnation == incarnation || state == NodeState::Dead {
                HeartbeatReply::Dead
            } else if process == node.process {
                HeartbeatReply::Unconfirmed {
                    incarnation: row_incarnation,
                }
            } else {
                HeartbeatReply::Superseded {
                    incarnation: row_incarnation,
                }
            },
        )
    }

    /// Refresh the heartbeat of `node`'s registration at `incarnation` (database clock).
    /// `None`: the row is gone, belongs to another incarnation, or was declared dead.
    pub async fn heartbeat(
        &self,
        node: &NodeRegistration,
        incarnation: i64,
    ) -> Result<Option<NodeState>, PlacementStoreError> {
        Ok(match self.heartbeat_reply(node, incarnation).await? {
            HeartbeatReply::Alive(state) => Some(state),
            _ => None,
        })
    }

    /// Ask for `node` to be drained (state `draining`). Not term-fenced: any node or operator
    /// may request it; the manager acts on it. Returns false for an unknown or dead node.
    pub async fn request_drain(&self, node: &NodeId) -> Result<bool, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        let state: Option<String> = sqlx::query_scalar(
            "UPDATE placement_nodes SET state = CASE WHEN state = 'dead' THEN state ELSE 'draining' END,
                    drain_requested = drain_requested OR state <> 'dead'
             WHERE id = $1 RETURNING state",
        )
        .bind(node.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        notify(&mut tx, "nodes").await?;
        tx.commit().await?;
        Ok(state.as_deref() == Some("draining"))
    }

    /// Acknowledge several revocations in one statement and one notification. Each
    /// `(shard, epoch)` is acknowledged only if `node` (at `incarnation`) still owns it at
    /// that epoch with a move pending. Returns how many were acknowledged.
    pub async fn ack_revocations(
        &self,
        node: &NodeId,
        incarnation: i64,
        acks: &[(ShardId, Epoch)],
    ) -> Result<u64, PlacementStoreError> {
        if acks.is_empty() {
            return Ok(0);
        }
        let shards: Vec<i32> = acks.iter().map(|(s, _)| s.0 as i32).collect();
        let epochs: Vec<i64> = acks.iter().map(|(_, e)| e.0).collect();
        let mut tx = self.pool.begin().await?;
        let n = sqlx::query(
            "UPDATE placement_shards s SET revoke_acked = true, updated_at = now()
             FROM unnest($2::int[], $3::bigint[]) AS a(shard, epoch)
             WHERE s.shard = a.shard AND s.epoch = a.epoch AND s.node_id = $1
               AND s.moving_to IS NOT NULL AND NOT s.revoke_acked
               AND EXISTS (SELECT 1 FROM placement_nodes WHERE id = $1 AND incarnation = $4)",
        )
        .bind(node.as_str())
        .bind(&shards)
        .bind(&epochs)
        .bind(incarnation)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n > 0 {
            notify(&mut tx, "ack").await?;
        }
        tx.commit().await?;
        Ok(n)
    }

    /// The owner acknowledges the revocation of `shard` at `epoch`: it ingests nothing more.
    pub async fn ack_revocation(
        &self,
        shard: ShardId,
        epoch: Epoch,
        node: &NodeId,
        incarnation: i64,
    ) -> Result<bool, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "UPDATE placement_shards SET revoke_acked = true, updated_at = now()
             WHERE shard = $1 AND epoch = $2 AND node_id = $3 AND moving_to IS NOT NULL
               AND EXISTS (SELECT 1 FROM placement_nodes WHERE id = $3 AND incarnation = $4)",
        )
        .bind(shard.0 as i32)
        .bind(epoch.0)
        .bind(node.as_str())
        .bind(incarnation)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if done {
            notify(&mut tx, "ack").await?;
        }
        tx.commit().await?;
        Ok(done)
    }

    /// Read meta, nodes (with heartbeat ages by the database clock) and shards in one
    /// consistent snapshot.
    pub async fn read_table(&self) -> Result<ShardTable, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let term: Option<i64> =
            sqlx::query_scalar("SELECT manager_term FROM placement_meta WHERE id = 1")
                .fetch_optional(&mut *tx)
                .await?;
        let term = Term(term.ok_or(PlacementStoreError::NotBootstrapped)?);
        let nodes = read_nodes(&mut tx).await?;
        let rows = sqlx::query(
            "SELECT shard, node_id, epoch, moving_to, revoke_acked FROM placement_shards ORDER BY shard",
        )
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut shards = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let shard: i32 = row.try_get("shard")?;
            if shard as usize != i {
                return Err(PlacementStoreError::Corrupt(
                    "shard numbers are not contiguous",
                ));
            }
            shards.push(ShardEntry {
                shard: ShardId(shard as u32),
                owner: node_column(row.try_get("node_id")?, "placement_shards.node_id")?,
                epoch: Epoch(row.try_get("epoch")?),
                moving_to: node_column(row.try_get("moving_to")?, "placement_shards.moving_to")?,
                revoke_acked: row.try_get("revoke_acked")?,
            });
        }
        Ok(ShardTable {
            shards,
            nodes,
            manager_term: term,
        })
    }

    /// All node rows.
    pub async fn nodes(&self) -> Result<BTreeMap<NodeId, NodeInfo>, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        let nodes = read_nodes(&mut tx).await?;
        tx.commit().await?;
        Ok(nodes)
    }

    /// Start a new manager term (called right after winning the advisory lock).
    pub async fn bump_term(&self, manager: &NodeId) -> Result<Term, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        let term: Option<i64> = sqlx::query_scalar(
            "UPDATE placement_meta SET manager_term = manager_term + 1, manager_node = $1, term_started_at = now()
             WHERE id = 1 RETURNING manager_term",
        )
        .bind(manager.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let term = Term(term.ok_or(PlacementStoreError::NotBootstrapped)?);
        notify(&mut tx, "term").await?;
        tx.commit().await?;
        Ok(term)
    }

    /// Begin a manager write at `term`; fails with [`PlacementStoreError::Fenced`] if the term moved on.
    pub async fn fenced(&self, term: Term) -> Result<FencedTx, PlacementStoreError> {
        let mut tx = self.pool.begin().await?;
        let current: Option<i64> =
            sqlx::query_scalar("SELECT manager_term FROM placement_meta WHERE id = 1 FOR SHARE")
                .fetch_optional(&mut *tx)
                .await?;
        let current = Term(current.ok_or(PlacementStoreError::NotBootstrapped)?);
        if current != term {
            tx.rollback().await?;
            return Err(PlacementStoreError::Fenced {
                held: term,
                current,
            });
        }
        Ok(FencedTx { tx, term })
    }
}

impl FencedTx {
    pub fn term(&self) -> Term {
        self.term
    }

    /// One shard-row UPDATE conditional on the epoch the manager read: `$1` is the shard,
    /// `$2` that epoch, `$3…` the `nodes`. True when the row matched.
    async fn update_shard(
        &mut self,
        sql: &'static str,
        shard: ShardId,
        read_epoch: Epoch,
        nodes: &[&NodeId],
    ) -> Result<bool, PlacementStoreError> {
        let mut query = sqlx::query(sql).bind(shard.0 as i32).bind(read_epoch.0);
        for node in nodes {
            query = query.bind(node.as_str());
        }
        Ok(query.execute(&mut *self.tx).await?.rows_affected() == 1)
    }

    /// Declare `node` dead if (by the database clock) its heartbeat is older than `ttl_ms`.
    pub async fn mark_dead_if_silent(
        &mut self,
        node: &NodeId,
        ttl_ms: i64,
    ) -> Result<bool, PlacementStoreError> {
        let n = sqlx::query(
            "UPDATE placement_nodes SET state = 'dead'
             WHERE id = $1 AND state <> 'dead' AND heartbeat_at < now() - make_interval(secs => $2::float8 / 1000.0)",
        )
        .bind(node.as_str())
        .bind(ttl_ms)
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    /// Promote a joining node to active.
    pub async fn activate(&mut self, node: &NodeId) -> Result<bool, PlacementStoreError> {
        let n = sqlx::query(
            "UPDATE placement_nodes SET state = 'active' WHERE id = $1 AND state = 'joining'",
        )
        .bind(node.as_str())
        .execute(&mut *self.tx)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    /// Assign a shard with no live owner directly: `epoch + 1`, any move cleared.
    pub async fn assign_now(
        &mut self,
        shard: ShardId,
        read_epoch: Epoch,
        to: &NodeId,
    ) -> Result<Option<Epoch>, PlacementStoreError> {
        let moved = self.assign_many(&[(shard, read_epoch, to.clone())]).await?;
        Ok(moved.first().map(|m| m.1))
    }

    /// Request the revocation of a shard from its live owner towards `to`.
    pub async fn revoke(
        &mut self,
        shard: ShardId,
        read_epoch: Epoch,
        owner: &NodeId,
        to: &NodeId,
    ) -> Result<bool, PlacementStoreError> {
        let revoked = self
            .revoke_many(&[(shard, read_epoch, owner.clone(), to.clone())])
            .await?;
        Ok(!revoked.is_empty())
    }

    /// Cancel a move in progress: the owner keeps the shard at the same epoch.
    pub async fn cancel_move(
        &mut self,
        shard: ShardId,
        read_epoch: Epoch,
        owner: &NodeId,
    ) -> Result<bool, PlacementStoreError> {
        self.update_shard(
            "UPDATE placement_shards SET moving_to = NULL, revoke_acked = false, updated_at = now()
             WHERE shard = $1 AND epoch = $2 AND node_id = $3",
            shard,
            read_epoch,
            &[owner],
        )
        .await
    }

    /// Complete a move: owner := moving_to, `epoch + 1`. The statement itself re-checks that
    /// the old owner acknowledged or is dead.
    pub async fn complete_move(
        &mut self,
        shard: ShardId,
        read_epoch: Epoch,
        to: &NodeId,
    ) -> Result<Option<Epoch>, PlacementStoreError> {
        let moved = self
            .complete_moves(&[(shard, read_epoch, to.clone())])
            .await?;
        Ok(moved.first().map(|m| m.1))
    }

    /// [`Self::assign_now`] for many shards in one statement: `(shard, read epoch, to)`.
    /// Returns the new epoch of every shard whose row matched.
    pub async fn assign_many(
        &mut self,
        moves: &[(ShardId, Epoch, NodeId)],
    ) -> Result<Vec<(ShardId, Epoch)>, PlacementStoreError> {
        self.move_many(
            "UPDATE placement_shards s SET node_id = m.target, epoch = s.epoch + 1, moving_to = NULL,
                    revoke_acked = false, updated_at = now()
             FROM unnest($1::int[], $2::bigint[], $3::text[]) AS m(shard, epoch, target)
             WHERE s.shard = m.shard AND s.epoch = m.epoch
             RETURNING s.shard, s.epoch",
            moves,
        )
        .await
    }

    /// [`Self::complete_move`] for many shards in one statement: `(shard, read epoch, to)`,
    /// with the same acknowledged-or-dead re-check per row. Returns the new epoch of every
    /// shard whose row matched.
    pub async fn complete_moves(
        &mut self,
        moves: &[(ShardId, Epoch, NodeId)],
    ) -> Result<Vec<(ShardId, Epoch)>, PlacementStoreError> {
        self.move_many(
            "UPDATE placement_shards s SET node_id = s.moving_to, epoch = s.epoch + 1, moving_to = NULL,
                    revoke_acked = false, updated_at = now()
             FROM unnest($1::int[], $2::bigint[], $3::text[]) AS m(shard, epoch, target)
             WHERE s.shard = m.shard AND s.epoch = m.epoch AND s.moving_to = m.target
               AND (s.revoke_acked OR NOT EXISTS (
                    SELECT 1 FROM placement_nodes n WHERE n.id = s.node_id AND n.state <> 'dead'))
             RETURNING s.shard, s.epoch",
            moves,
        )
        .await
    }

    /// [`Self::revoke`] for many shards in one statement: `(shard, read epoch, owner, to)`.
    /// Returns the shards whose row matched.
    pub async fn revoke_many(
        &mut self,
        moves: &[(ShardId, Epoch, NodeId, NodeId)],
    ) -> Result<Vec<ShardId>, PlacementStoreError> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        let shards: Vec<i32> = moves.iter().map(|m| m.0.0 as i32).collect();
        let epochs: Vec<i64> = moves.iter().map(|m| m.1.0).collect();
        let owners: Vec<&str> = moves.iter().map(|m| m.2.as_str()).collect();
        let targets: Vec<&str> = moves.iter().map(|m| m.3.as_str()).collect();
        let rows: Vec<i32> = sqlx::query_scalar(
            "UPDATE placement_shards s SET moving_to = m.target, updated_at = now()
             FROM unnest($1::int[], $2::bigint[], $3::text[], $4::text[]) AS m(shard, epoch, owner, target)
             WHERE s.shard = m.shard AND s.epoch = m.epoch AND s.node_id = m.owner
             RETURNING s.shard",
        )
        .bind(&shards)
        .bind(&epochs)
        .bind(&owners)
        .bind(&targets)
        .fetch_all(&mut *self.tx)
        .await?;
        Ok(rows.into_iter().map(|s| ShardId(s as u32)).collect())
    }

    /// A many-row ownership UPDATE over `unnest($1 shards, $2 read epochs, $3 targets)`
    /// returning `(shard, new epoch)` of the rows that matched.
    async fn move_many(
        &mut self,
        sql: &'static str,
        moves: &[(ShardId, Epoch, NodeId)],
    ) -> Result<Vec<(ShardId, Epoch)>, PlacementStoreError> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        let shards: Vec<i32> = moves.iter().map(|m| m.0.0 as i32).collect();
        let epochs: Vec<i64> = moves.iter().map(|m| m.1.0).collect();
        let targets: Vec<&str> = moves.iter().map(|m| m.2.as_str()).collect();
        let rows: Vec<(i32, i64)> = sqlx::query_as(sql)
            .bind(&shards)
            .bind(&epochs)
            .bind(&targets)
            .fetch_all(&mut *self.tx)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(s, e)| (ShardId(s as u32), Epoch(e)))
            .collect())
    }

    /// Lock a node row for the rest of the transaction and return its current state.
    /// Used before taking shards from a node believed dead: a concurrent re-registration
    /// either commits first (and is seen here) or waits for this transaction.
    pub async fn lock_node_state(
        &mut self,
        node: &NodeId,
    ) -> Result<Option<NodeState>, PlacementStoreError> {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM placement_nodes WHERE id = $1 FOR UPDATE")
                .bind(node.as_str())
                .fetch_optional(&mut *self.tx)
                .await?;
        state
            .map(|s| NodeState::parse(&s).ok_or(PlacementStoreError::Corrupt("node state")))
            .transpose()
    }

    /// Abandon the transaction (nothing to write).
    pub async fn rollback(self) -> Result<(), PlacementStoreError> {
        self.tx.rollback().await?;
        Ok(())
    }

    /// Notify listeners and commit.
    pub async fn commit(mut self, payload: &str) -> Result<(), PlacementStoreError> {
        notify(&mut self.tx, payload).await?;
        self.tx.commit().await?;
        Ok(())
    }
}

async fn notify(
    tx: &mut Transaction<'static, Postgres>,
    payload: &str,
) -> Result<(), PlacementStoreError> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(payload)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn read_nodes(
    tx: &mut Transaction<'static, Postgres>,
) -> Result<BTreeMap<NodeId, NodeInfo>, PlacementStoreError> {
    let rows = sqlx::query(
        "SELECT id, public_addr, internal_addr, control_addr, version, state, incarnation,
                (EXTRACT(EPOCH FROM (now() - heartbeat_at)) * 1000)::bigint AS age_ms
         FROM placement_nodes ORDER BY id",
    )
    .fetch_all(&mut **tx)
    .await?;
    let mut nodes = BTreeMap::new();
    for row in rows {
        let id = NodeId::parse(row.try_get::<String, _>("id")?)
            .map_err(|_| PlacementStoreError::Corrupt("placement_nodes.id"))?;
        let state: String = row.try_get("state")?;
        nodes.insert(
            id.clone(),
            NodeInfo {
                id,
                public_addr: row.try_get("public_addr")?,
                internal_addr: row.try_get("internal_addr")?,
                control_addr: row.try_get("control_addr")?,
                version: row.try_get("version")?,
                state: NodeState::parse(&state)
                    .ok_or(PlacementStoreError::Corrupt("node state"))?,
                incarnation: row.try_get("incarnation")?,
                heartbeat_age_ms: row.try_get("age_ms")?,
            },
        );
    }
    Ok(nodes)
}

/// A nullable node id column; a value that is not a valid node id is a corrupt row.
fn node_column(
    value: Option<String>,
    column: &'static str,
) -> Result<Option<NodeId>, PlacementStoreError> {
    value
        .map(|text| NodeId::parse(text).map_err(|_| PlacementStoreError::Corrupt(column)))
        .transpose()
}
