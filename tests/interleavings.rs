//! Stateful property test of the upload path under interleavings (CAS-6, CAS-7, SES-3,
//! STO-23, TUS-5, TUS-6): two nodes share one upload ledger (redb, or real PostgreSQL),
//! one pack store and one manifest store (on PostgreSQL: the cluster's fenced manifest
//! store), as cluster nodes share PostgreSQL and S3, while each keeps its own hasher
//! cache, session region, admission budget and shard table. Random programs of client
//! operations run against them over real sockets:
//!
//! - tus create (clients choose the id, so an upload can be created again under the same
//!   id), partial and final PATCH, DELETE;
//! - client disconnects at any point: a PATCH whose body is cut at a random byte, and a
//!   PATCH whose request future is dropped at a random moment (before, during or after
//!   its body: the final commit may be in flight);
//! - one-shot uploads of contents that share pieces with the resumable ones (dedup hits,
//!   and the bytes a poisoned key would have named);
//! - expiry sweeps by either node, its clock moved past every expiry;
//! - collector runs with purge (mark, quarantine, purge), with `min_age` 0 when run alone
//!   and 2 s beside another operation (the grace an upload between its index commit and
//!   its manifest relies on);
//! - shard moves back and forth (PostgreSQL: the placement table gives every shard to the
//!   other node, whose fence then holds; the node that lost them still believes it owns
//!   them, as a node that has not yet learnt of a move does), and requests alternating
//!   between the nodes;
//! - pairs of operations run at the same time.
//!
//! After every step: every acknowledged key downloads exactly the bytes whose hash it
//! names; no key of any content the program used answers anything but 200-exact or 404
//! (a manifest whose blocks do not add up answers 500); no session is left busy, no
//! ingest permit is held on any shard, and the admission budget is whole again on both
//! nodes. A write refused to the node that lost the shards answers 503 `shard_moved` and,
//! run alone, leaves the ledger row as it was. At the end every content uploads in one
//! shot to its own key and downloads exactly.
//!
//! Replay: a failure prints the minimal program, and proptest stores its seed under
//! `tests/interleavings.proptest-regressions` (replayed first on every run).
//! Every run prints its seed (`interleavings: seed N`); `PROPTEST_RNG_SEED=N` replays
//! that run's programs. `GRAVITON_INTERLEAVING_CASES=500` runs a soak of 500 programs on
//! each ledger (default: 8 on redb, 6 on PostgreSQL, about 30 s).

#[allow(unused_imports)]
mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use graviton::cas::BlobKey;
use graviton::node::NodeOptions;
use graviton::storage::ManifestStore;
use graviton::storage::pack::gc::{self, GcOptions, Quiet};
use graviton::tus::UploadId;
use graviton::upload::ledger::UploadLedger;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use support::TestDatabase;
use support::node::{TestNode, random_bytes};

const TENANT: &str = "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11";
const OCTETS: &str = "application/offset+octet-stream";
/// Upload slots: each has a fixed session id, so creating again reuses the upload id.
const SLOTS: usize = 1;
/// Pieces contents are made of (shared between contents: dedup hits, poisoned pairs).
const PIECES: usize = 4;
const PIECE_LEN: usize = 150_000;

#[derive(Debug, Clone)]
enum Op {
    /// Create the slot's upload on a node with content `pieces`.
    Create {
        slot: usize,
        node: usize,
        pieces: Vec<usize>,
    },
    /// PATCH the next `part` bytes (the final PATCH when they reach the length).
    Patch {
        slot: usize,
        node: usize,
        part: usize,
    },
    /// PATCH whose client sends `sent` bytes of the next `part` and disconnects.
    CutPatch {
        slot: usize,
        node: usize,
        part: usize,
        sent: usize,
    },
    /// PATCH whose client drops the request after sending `sent` bytes of the next
    /// `part` and waiting `wait_ms` (the answer may be on its way, or the commit).
    DropPatch {
        slot: usize,
        node: usize,
        part: usize,
        sent: usize,
        wait_ms: u64,
    },
    Terminate {
        slot: usize,
        node: usize,
    },
    /// DELETE, then create again under the same id with content `pieces` (a client that
    /// restarts its upload).
    Recreate {
        slot: usize,
        node: usize,
        pieces: Vec<usize>,
    },
    /// The expiry sweep of a node, its clock past every expiry.
    Sweep {
        node: usize,
    },
    /// Every shard to this node (PostgreSQL; the other node is not told).
    Move {
        to: usize,
    },
    /// A collector run with purge (min_age 0 alone, 2 s beside another operation).
    Collect,
    OneShot {
        node: usize,
        pieces: Vec<usize>,
    },
    /// Two operations at the same time.
    Pair(Box<Op>, Box<Op>),
}

fn pieces() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..PIECES, 1..=3)
}

/// PATCH sizes: mostly a few fixed ones, so two generations of one upload reach the same
/// offsets (what a stale hasher keyed by offset alone would be taken at).
fn part() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => prop::sample::select(vec![100_000usize, 200_000, 450_000]),
        1 => 1usize..300_000,
    ]
}

fn simple_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..SLOTS, 0..2usize, pieces()).prop_map(|(slot, node, pieces)| Op::Create { slot, node, pieces }),
        4 => (0..SLOTS, 0..2usize, part()).prop_map(|(slot, node, part)| Op::Patch { slot, node, part }),
        1 => (0..SLOTS, 0..2usize, 1usize..300_000, 0usize..200_000)
            .prop_map(|(slot, node, part, sent)| Op::CutPatch { slot, node, part, sent: sent.min(part - 1) }),
        1 => (0..SLOTS, 0..2usize).prop_map(|(slot, node)| Op::Terminate { slot, node }),
        2 => (0..SLOTS, 0..2usize, pieces()).prop_map(|(slot, node, pieces)| Op::Recreate { slot, node, pieces }),
        1 => (0usize..2, 1usize..300_000, 0usize..300_000, 0u64..40).prop_map(|(node, part, sent, wait_ms)| Op::DropPatch { slot: 0, node, part, sent: sent.min(part), wait_ms }),
        1 => (0..2usize).prop_map(|node| Op::Sweep { node }),
        2 => (0..2usize).prop_map(|to| Op::Move { to }),
        2 => Just(Op::Collect),
        1 => (0..2usize, pieces()).prop_map(|(node, pieces)| Op::OneShot { node, pieces }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => simple_op(),
        2 => (simple_op(), simple_op()).prop_map(|(a, b)| Op::Pair(Box::new(a), Box::new(b))),
    ]
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

struct World {
    /// Owns the shared pack store (the one the collector runs on); it serves no request.
    _store: TestNode,
    nodes: [TestNode; 2],
    ledger: Arc<dyn UploadLedger>,
    /// The manifests the nodes share (the collector marks from them).
    manifests: Arc<dyn ManifestStore>,
    /// PostgreSQL: the cluster database, whose placement table says who owns the shards.
    pool: Option<sqlx::PgPool>,
    /// The node the placement table gives every shard to, and twice the moves so far
    /// (counted when a move starts and when it ends).
    owner: AtomicUsize,
    moves: AtomicUsize,
    /// Writes refused to a node that lost the shards (503 `shard_moved`), and requests
    /// dropped before their answer: what the program really exercised.
    refused: AtomicUsize,
    dropped: AtomicUsize,
    piece: Vec<Vec<u8>>,
    /// The session id of each slot, and the content its client believes it uploads.
    slots: Vec<(String, std::sync::Mutex<Option<Vec<u8>>>)>,
    acked: std::sync::Mutex<BTreeSet<String>>,
    /// Every content a program used (their keys are checked too).
    contents: std::sync::Mutex<Vec<Vec<u8>>>,
    budget: [u64; 2],
}

const BUDGET: &str = "graviton_admission_local_available_bytes";

fn metric(node: &TestNode, name: &str) -> Option<u64> {
    node.metrics_text().lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        if key != name {
            return None;
        }
        value.trim().parse::<f64>().ok().map(|v| v as u64)
    })
}

fn node_id(node: usize) -> String {
    format!("node-{node}")
}

/// Give every shard to `owner` in the placement table. The nodes are embedded nodes
/// whose own tables say they own every shard at epoch 0, so a move changes the owner and
/// keeps the epoch (the fence compares both).
async fn give_every_shard_to(pool: &sqlx::PgPool, owner: usize) {
    sqlx::query("UPDATE placement_shards SET node_id = $1, epoch = 0")
        .bind(node_id(owner))
        .execute(pool)
        .await
        .unwrap();
}

impl World {
    async fn start(pool: Option<sqlx::PgPool>) -> Self {
        let store = TestNode::start().await;
        let state = store.node.as_ref().unwrap().state().clone();
        let (ledger, manifests): (Arc<dyn UploadLedger>, Arc<dyn ManifestStore>) = match &pool {
            Some(pool) => {
                let shards = graviton::config::Config::default().cluster.shard_count;
                graviton::storage::pg::PlacementStore::new(pool.clone())
                    .bootstrap(shards)
                    .await
                    .unwrap();
                sqlx::query(
                    "INSERT INTO placement_nodes (id, public_addr, internal_addr, control_addr, version, state)
                     VALUES ('node-0', '', '', '', 't', 'active'), ('node-1', '', '', '', 't', 'active')",
                )
                .execute(pool)
                .await
                .unwrap();
                give_every_shard_to(pool, 0).await;
                (
                    Arc::new(graviton::upload::ledger::PgLedger::new(pool.clone())),
                    Arc::new(graviton::storage::pg::PgManifestStore::new(pool.clone())),
                )
            }
            None => (state.uploads.ledger().clone(), state.manifests.clone()),
        };
        let mut nodes = Vec::new();
        for n in 0..2 {
            nodes.push(
                TestNode::start_with(
                    |config| config.node.id = node_id(n),
                    NodeOptions {
                        blocks: Some(state.blocks.clone()),
                        manifests: Some(manifests.clone()),
                        ledger: Some(ledger.clone()),
                    },
                )
                .await,
            );
        }
        let nodes: [TestNode; 2] = nodes.try_into().ok().unwrap();
        let piece = (0..PIECES)
            .map(|i| random_bytes(PIECE_LEN + i * 7_919, 900 + i as u64))
            .collect();
        let slots = (0..SLOTS)
            .map(|_| {
                (
                    graviton::ids::SessionId::new_random().to_string(),
                    std::sync::Mutex::new(None),
                )
            })
            .collect();
        let budget = [
            metric(&nodes[0], BUDGET).expect("budget metric"),
            metric(&nodes[1], BUDGET).expect("budget metric"),
        ];
        Self {
            _store: store,
            nodes,
            ledger,
            manifests,
            pool,
            owner: AtomicUsize::new(0),
            moves: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            dropped: AtomicUsize::new(0),
            piece,
            slots,
            acked: Default::default(),
            contents: Default::default(),
            budget,
        }
    }

    /// Whether `node` may be refused a write: on PostgreSQL, it is not the owner now, or
    /// a move ran since `moves_before`.
    fn may_be_fenced(&self, node: usize, moves_before: usize) -> bool {
        self.pool.is_some()
            && (self.owner.load(Ordering::SeqCst) != node
                || self.moves.load(Ordering::SeqCst) != moves_before)
    }

    /// Whether `node` is, and stays, fenced out for a write run alone.
    fn fenced_out(&self, node: usize) -> bool {
        self.pool.is_some() && self.owner.load(Ordering::SeqCst) != node
    }

    fn upload_id(&self, slot: usize) -> UploadId {
        format!("{TENANT}.{}", self.slots[slot].0).parse().unwrap()
    }

    /// The slot's ledger row and tail, as the ledger holds them.
    async fn row(
        &self,
        slot: usize,
    ) -> Option<(graviton::upload::ledger::UploadRow, bytes::Bytes)> {
        self.ledger.get(self.upload_id(slot)).await.unwrap()
    }

    /// An answer that may be the fenced-out node's: 503 `shard_moved` with Retry-After.
    async fn is_shard_moved(&self, r: reqwest::Response) -> bool {
        if r.status() != 503 {
            return false;
        }
        self.refused.fetch_add(1, Ordering::SeqCst);
        assert!(
            r.headers().get("retry-after").is_some(),
            "a 503 without Retry-After"
        );
        let body: serde_json::Value = r.json().await.unwrap_or_default();
        assert_eq!(body["error"], "shard_moved", "503 {body}");
        true
    }

    fn content_of(&self, pieces: &[usize]) -> Vec<u8> {
        let content: Vec<u8> = pieces.iter().flat_map(|p| self.piece[*p].clone()).collect();
        self.contents.lock().unwrap().push(content.clone());
        content
    }

    fn upload_url(&self, slot: usize, node: usize) -> String {
        format!(
            "{}/v1/uploads/{}.{}",
            self.nodes[node].url, TENANT, self.slots[slot].0
        )
    }

    /// (offset, length) of the slot's upload as `node` reports it; None if gone.
    async fn head(&self, slot: usize, node: usize) -> Option<(usize, usize)> {
        let r = client()
            .head(self.upload_url(slot, node))
            .header("tus-resumable", "1.0.0")
            .send()
            .await
            .unwrap();
        if r.status() != 200 {
            assert!(
                [404, 410].contains(&r.status().as_u16()),
                "HEAD {}",
                r.status()
            );
            return None;
        }
        let h = |n: &str| -> usize { r.headers()[n].to_str().unwrap().parse().unwrap() };
        Some((h("upload-offset"), h("upload-length")))
    }

    fn ack(&self, key: &str) {
        self.acked.lock().unwrap().insert(key.to_string());
    }

    /// Run one operation. `solo`: nothing else runs meanwhile, so a write refused to the
    /// fenced-out node must leave the row as it was.
    fn run<'a>(&'a self, op: &'a Op, solo: bool) -> futures_util::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            let moves = self.moves.load(Ordering::SeqCst);
            let fenced_slot = match op {
                Op::Create { slot, node, .. }
                | Op::Patch { slot, node, .. }
                | Op::CutPatch { slot, node, .. }
                | Op::DropPatch { slot, node, .. }
                | Op::Terminate { slot, node }
                | Op::Recreate { slot, node, .. }
                    if solo && self.fenced_out(*node) =>
                {
                    Some((*slot, self.row(*slot).await))
                }
                _ => None,
            };
            self.run_op(op, moves, solo).await;
            if let Some((slot, before)) = fenced_slot {
                // TUS-5: a node that lost the shard wrote nothing.
                assert_eq!(
                    self.row(slot).await,
                    before,
                    "{op:?}: the fenced-out node changed the row"
                );
            }
        })
    }

    fn run_op<'a>(
        &'a self,
        op: &'a Op,
        moves: usize,
        solo: bool,
    ) -> futures_util::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            match op {
                Op::Create { slot, node, pieces } => {
                    let content = self.content_of(pieces);
                    let r = client()
                        .post(format!("{}/v1/uploads", self.nodes[*node].url))
                        .header("tus-resumable", "1.0.0")
                        .header("upload-length", content.len().to_string())
                        .header("x-graviton-tenant-id", TENANT)
                        .header("x-graviton-upload-session-id", &self.slots[*slot].0)
                        .send()
                        .await
                        .unwrap();
                    match r.status().as_u16() {
                        201 => *self.slots[*slot].1.lock().unwrap() = Some(content),
                        409 => {}
                        503 if self.may_be_fenced(*node, moves) => {
                            assert!(self.is_shard_moved(r).await);
                        }
                        other => panic!("create answered {other}: {:?}", r.text().await),
                    }
                }
                Op::Patch { slot, node, part } => {
                    let Some(content) = self.slots[*slot].1.lock().unwrap().clone() else {
                        return;
                    };
                    let Some((offset, length)) = self.head(*slot, *node).await else {
                        return;
                    };
                    if length != content.len() || offset >= length {
                        return;
                    }
                    let end = (offset + part).min(length);
                    let r = client()
                        .patch(self.upload_url(*slot, *node))
                        .header("tus-resumable", "1.0.0")
                        .header("content-type", OCTETS)
                        .header("upload-offset", offset.to_string())
                        .body(content[offset..end].to_vec())
                        .send()
                        .await
                        .unwrap();
                    let status = r.status().as_u16();
                    if let Some(key) = r.headers().get("graviton-blob-key") {
                        assert_eq!(status, 204);
                        self.ack(key.to_str().unwrap());
                    }
                    // 409: a concurrent PATCH holds the session or moved the offset;
                    // 404/410: terminated or swept meanwhile; 503: the node lost the shard.
                    if status == 503 && self.may_be_fenced(*node, moves) {
                        assert!(self.is_shard_moved(r).await);
                        return;
                    }
                    assert!(
                        [204, 404, 409, 410].contains(&status),
                        "PATCH answered {status}: {:?}",
                        r.text().await
                    );
                }
                Op::CutPatch {
                    slot,
                    node,
                    part,
                    sent,
                } => {
                    let Some(content) = self.slots[*slot].1.lock().unwrap().clone() else {
                        return;
                    };
                    let Some((offset, length)) = self.head(*slot, *node).await else {
                        return;
                    };
                    if length != content.len() || offset >= length {
                        return;
                    }
                    let end = (offset + part).min(length);
                    let sent = (*sent).min(end - offset - 1);
                    let first = bytes::Bytes::copy_from_slice(&content[offset..offset + sent]);
                    let body = futures_util::stream::iter(vec![
                        Ok(first),
                        Err(std::io::Error::other("the client went away")),
                    ]);
                    // The declared length is never reached: the connection is cut.
                    let r = client()
                        .patch(self.upload_url(*slot, *node))
                        .header("tus-resumable", "1.0.0")
                        .header("content-type", OCTETS)
                        .header("upload-offset", offset.to_string())
                        .header("content-length", (end - offset).to_string())
                        .body(reqwest::Body::wrap_stream(body))
                        .send()
                        .await;
                    if let Ok(r) = r {
                        assert!(
                            r.headers().get("graviton-blob-key").is_none(),
                            "a cut PATCH completed an upload"
                        );
                    }
                }
                Op::DropPatch {
                    slot,
                    node,
                    part,
                    sent,
                    wait_ms,
                } => {
                    let Some(content) = self.slots[*slot].1.lock().unwrap().clone() else {
                        return;
                    };
                    let Some((offset, length)) = self.head(*slot, *node).await else {
                        return;
                    };
                    if length != content.len() || offset >= length {
                        return;
                    }
                    let end = (offset + part).min(length);
                    let sent = (*sent).min(end - offset);
                    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
                    let body = futures_util::stream::unfold(rx, |mut rx| async move {
                        rx.recv()
                            .await
                            .map(|chunk| (Ok::<_, std::io::Error>(chunk), rx))
                    });
                    let request = tokio::spawn(
                        client()
                            .patch(self.upload_url(*slot, *node))
                            .header("tus-resumable", "1.0.0")
                            .header("content-type", OCTETS)
                            .header("upload-offset", offset.to_string())
                            .header("content-length", (end - offset).to_string())
                            .body(reqwest::Body::wrap_stream(body))
                            .send(),
                    );
                    if sent > 0 {
                        // Refused before its body (409, 503), the request ends unread.
                        let _ = tx
                            .send(bytes::Bytes::copy_from_slice(
                                &content[offset..offset + sent],
                            ))
                            .await;
                    }
                    // Where the request is dropped: a random moment, not a condition the
                    // test waits for (the checks after the step wait for what it left).
                    tokio::time::sleep(Duration::from_millis(*wait_ms)).await;
                    request.abort();
                    match request.await {
                        Ok(Ok(r)) => {
                            if let Some(key) = r.headers().get("graviton-blob-key") {
                                self.ack(key.to_str().unwrap());
                            }
                        }
                        _ => {
                            self.dropped.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    drop(tx);
                }
                Op::Terminate { slot, node } => {
                    let r = client()
                        .delete(self.upload_url(*slot, *node))
                        .header("tus-resumable", "1.0.0")
                        .send()
                        .await
                        .unwrap();
                    let status = r.status().as_u16();
                    if status == 503 && self.may_be_fenced(*node, moves) {
                        assert!(self.is_shard_moved(r).await);
                        return;
                    }
                    assert!(
                        [204, 404, 410].contains(&status),
                        "DELETE answered {status}"
                    );
                }
                Op::Recreate { slot, node, pieces } => {
                    self.run_op(
                        &Op::Terminate {
                            slot: *slot,
                            node: *node,
                        },
                        moves,
                        solo,
                    )
                    .await;
                    self.run_op(
                        &Op::Create {
                            slot: *slot,
                            node: *node,
                            pieces: pieces.clone(),
                        },
                        moves,
                        solo,
                    )
                    .await;
                }
                Op::Sweep { node } => {
                    let later = graviton::tus::now_ms() + 100 * 3_600_000;
                    let uploads = self.nodes[*node]
                        .node
                        .as_ref()
                        .unwrap()
                        .state()
                        .uploads
                        .clone();
                    let swept = uploads.sweep_expired_at(later).await.unwrap();
                    if self.fenced_out(*node) && moves == self.moves.load(Ordering::SeqCst) {
                        // TUS-6: only the owner sweeps.
                        assert_eq!(swept, 0, "a node that does not own the shard swept");
                    }
                }
                Op::Move { to } => {
                    if let Some(pool) = &self.pool {
                        // Counted before the placement table changes as well as after: a
                        // request running beside the move may be refused as soon as the
                        // table's commit lands, before this task records the new owner
                        // (a Pair(Recreate, Move) was answered 503 `shard_moved` in
                        // that window, and the harness did not allow it).
                        self.moves.fetch_add(1, Ordering::SeqCst);
                        give_every_shard_to(pool, *to).await;
                        self.owner.store(*to, Ordering::SeqCst);
                        self.moves.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Op::Collect => {
                    let state = self._store.node.as_ref().unwrap().state().clone();
                    let (packs, _) = state.packs.as_ref().expect("a pack store");
                    // Alone, nothing is in flight (the check after each step waits for
                    // idle nodes): min_age 0 collects every unreferenced block at once.
                    // Beside another operation, min_age is the grace the design relies
                    // on for a non-final PATCH between its index commit and its ledger
                    // advance, and for packs not yet indexed. (A manifest's blocks no
                    // longer rely on it: they are pinned until it is written, STO-25;
                    // with 0 a run here once purged them under an acknowledged key,
                    // found by this test on PostgreSQL, see the regressions file.)
                    let min_age = if solo {
                        Duration::ZERO
                    } else {
                        Duration::from_secs(2)
                    };
                    let options = GcOptions {
                        min_age,
                        retention: Duration::ZERO,
                        compact_below: 0.5,
                        dry_run: false,
                        purge: true,
                        batch: 64,
                    };
                    // The collector marks the blocks of live resumable uploads (the
                    // shared ledger) as the nodes' collectors do.
                    let manifests = graviton::upload::ledger::LiveUploads {
                        manifests: self.manifests.clone(),
                        ledger: self.ledger.clone(),
                    };
                    gc::collect(packs, &manifests, options, &mut Quiet)
                        .await
                        .unwrap();
                }
                Op::OneShot { node, pieces } => {
                    let content = self.content_of(pieces);
                    let key = one_shot(&self.nodes[*node].url, &content).await;
                    assert_eq!(key, BlobKey::of(&content).to_string());
                    self.ack(&key);
                }
                Op::Pair(a, b) => {
                    futures_util::future::join(self.run(a, false), self.run(b, false)).await;
                }
            }
        })
    }

    /// The invariants after a step.
    async fn check(&self, step: usize, op: &Op) {
        let acked: Vec<String> = self.acked.lock().unwrap().iter().cloned().collect();
        for key in &acked {
            let got = get(&self.nodes[step % 2].url, key).await;
            let got =
                got.unwrap_or_else(|| panic!("step {step} ({op:?}): acknowledged {key} is gone"));
            assert_eq!(
                BlobKey::of(&got).to_string(),
                *key,
                "step {step} ({op:?}): {key} names other bytes"
            );
        }
        let contents: Vec<Vec<u8>> = self.contents.lock().unwrap().clone();
        let keys: BTreeSet<String> = contents
            .iter()
            .map(|c| BlobKey::of(c).to_string())
            .collect();
        for key in keys.iter().filter(|k| !acked.contains(k)) {
            if let Some(got) = get(&self.nodes[0].url, key).await {
                assert_eq!(BlobKey::of(&got).to_string(), *key, "step {step} ({op:?})");
            }
        }
        for (i, node) in self.nodes.iter().enumerate() {
            // A dropped request's work on the node ends soon after its connection closes:
            // wait for the node to be idle, then require everything given back.
            let cluster = node.node.as_ref().unwrap().state().cluster.clone();
            let shards = cluster.view().shard_count();
            let held = || {
                (0..shards)
                    .map(|s| cluster.view().in_flight(graviton::placement::ShardId(s)))
                    .sum::<usize>()
            };
            let idle = support::wait_until(Duration::from_secs(10), || {
                let sessions = metric(node, "graviton_active_sessions");
                let budget = metric(node, BUDGET);
                let permits = held();
                async move { sessions == Some(0) && budget == Some(self.budget[i]) && permits == 0 }
            })
            .await;
            assert_eq!(
                metric(node, "graviton_active_sessions"),
                Some(0),
                "step {step} ({op:?}): node {i} has a session left busy"
            );
            assert_eq!(
                held(),
                0,
                "step {step} ({op:?}): node {i} holds an ingest permit"
            );
            assert!(
                idle,
                "step {step} ({op:?}): node {i} leaked admission budget"
            );
        }
    }

    async fn finish(&self) {
        let contents: Vec<Vec<u8>> = self.contents.lock().unwrap().clone();
        for content in contents {
            let key = one_shot(&self.nodes[1].url, &content).await;
            assert_eq!(key, BlobKey::of(&content).to_string());
            let Some(got) = get(&self.nodes[0].url, &key).await else {
                // Seen once in a soak on PostgreSQL and not reproduced since: say what
                // the stores hold, for whoever meets it next.
                let parsed: BlobKey = key.parse().unwrap();
                let stored = self.manifests.get(parsed).await;
                let again = get(&self.nodes[1].url, &key).await.map(|b| b.len());
                panic!(
                    "{key} was acknowledged and answers 404 on node 0; the shared manifest \
                     store gives {:?}, node 1 gives {again:?}",
                    stored.map(|m| m.map(|m| m.blocks.len()))
                );
            };
            assert!(got == content, "{key} downloads other bytes");
        }
    }
}

async fn one_shot(url: &str, data: &[u8]) -> String {
    let r = client()
        .post(format!("{url}/v1/blobs"))
        .body(data.to_vec())
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert!(
        status.is_success(),
        "one-shot upload answered {status}: {text}"
    );
    eprintln!("interleavings: one-shot {status}: {text}");
    let body: serde_json::Value = serde_json::from_str(&text).unwrap();
    body["key"].as_str().unwrap().to_string()
}

/// The bytes of `key`, or None for 404; anything else fails the program.
async fn get(url: &str, key: &str) -> Option<Vec<u8>> {
    let r = client()
        .get(format!("{url}/v1/blobs/{key}"))
        .send()
        .await
        .unwrap();
    match r.status().as_u16() {
        200 => Some(r.bytes().await.expect("a whole body").to_vec()),
        404 => None,
        other => panic!("GET {key} answered {other}: {:?}", r.text().await),
    }
}

/// Where failing seeds are kept (replayed first on every run; commit new ones).
const REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/interleavings.proptest-regressions"
);

/// Programs per ledger: `GRAVITON_INTERLEAVING_CASES` (a soak), else `default` (the CI
/// bound: the default run stays under about 40 s on a busy two-core machine).
fn cases(default: u32) -> u32 {
    std::env::var("GRAVITON_INTERLEAVING_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seed of the random search: `PROPTEST_RNG_SEED` when set, else a fresh one. Printed
/// either way, so every run (a soak too) can be replayed program for program with
/// `PROPTEST_RNG_SEED=<seed>`; a failing program's own seed is also persisted in
/// [`REGRESSIONS`].
fn seed() -> proptest::test_runner::RngSeed {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let seed = std::env::var("PROPTEST_RNG_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(rand::random);
        eprintln!("interleavings: seed {seed} (replay with PROPTEST_RNG_SEED={seed})");
        seed
    });
    proptest::test_runner::RngSeed::Fixed(seed)
}

/// What a program exercised (printed after each program, so a soak's log says it).
#[derive(Debug)]
// Read through `Debug` in the printed line; `refused` is also asserted on.
#[allow(dead_code)]
struct Exercised {
    acked: usize,
    refused: usize,
    dropped: usize,
    moves: usize,
}

fn run_program(ops: Vec<Op>, postgres: Option<&TestDatabase>) -> Exercised {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let pool = match postgres {
            Some(db) => {
                let pool = graviton::storage::pg::connect_pool(
                    db.url(),
                    6,
                    Duration::from_secs(5),
                    "graviton-interleavings",
                )
                .await
                .unwrap();
                // A fresh database per program: every program starts from an empty ledger.
                graviton::storage::pg::migrate(&pool).await.unwrap();
                Some(pool)
            }
            None => None,
        };
        let world = World::start(pool).await;
        for (step, op) in ops.iter().enumerate() {
            world.run(op, true).await;
            world.check(step, op).await;
        }
        world.finish().await;
        let exercised = Exercised {
            acked: world.acked.lock().unwrap().len(),
            refused: world.refused.load(Ordering::SeqCst),
            dropped: world.dropped.load(Ordering::SeqCst),
            // Each move counts twice (before and after its table change).
            moves: world.moves.load(Ordering::SeqCst) / 2,
        };
        eprintln!(
            "interleavings: {} steps on {}: {exercised:?}",
            ops.len(),
            if postgres.is_some() {
                "postgres"
            } else {
                "redb"
            }
        );
        exercised
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(8),
        rng_seed: seed(),
        max_shrink_iters: 64,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..ProptestConfig::default()
    })]

    // Checks CAS-6, CAS-7, SES-3 and STO-23 on the redb ledger (one node's stores: no
    // fence, so moves change nothing; requests alternate between the nodes).
    #[test]
    fn interleavings_on_the_redb_ledger(ops in prop::collection::vec(op(), 4..24)) {
        run_program(ops, None);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(6),
        rng_seed: seed(),
        max_shrink_iters: 32,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..ProptestConfig::default()
    })]

    // Checks CAS-6, CAS-7, SES-3, STO-23, TUS-5 and TUS-6 on the PostgreSQL ledger and
    // manifest store, with shard moves.
    #[test]
    fn interleavings_on_the_postgres_ledger(ops in prop::collection::vec(op(), 4..24)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let db = rt.block_on(TestDatabase::create("interleavings_on_the_postgres_ledger"));
        let Some(db) = db else { return Ok(()); };
        run_program(ops, Some(&db));
    }
}

/// Programs the random search is unlikely to hit by chance, kept as fixed cases: each
/// was a real defect (docs/invariants.md names them).
#[test]
fn known_interleavings() {
    use Op::*;
    // CAS-7: a hasher cached on node 0 for the first generation, the upload created
    // again on node 1 and taken to the same offset with other bytes, the final PATCH on
    // node 0.
    let poisoning = vec![
        Create {
            slot: 0,
            node: 0,
            pieces: vec![0, 1],
        },
        Patch {
            slot: 0,
            node: 0,
            part: 100_000,
        },
        Recreate {
            slot: 0,
            node: 1,
            pieces: vec![2, 3],
        },
        Patch {
            slot: 0,
            node: 1,
            part: 100_000,
        },
        Patch {
            slot: 0,
            node: 0,
            part: 450_000,
        },
    ];
    run_program(poisoning, None);
    // CAS-6/CAS-7: the upload swept while its final PATCH is on the way, then its bytes
    // uploaded in one shot; and a collector run between the PATCHes of an upload whose
    // first part deduplicated against a one-shot blob.
    let swept = vec![
        OneShot {
            node: 1,
            pieces: vec![0],
        },
        Create {
            slot: 0,
            node: 0,
            pieces: vec![0, 1],
        },
        Patch {
            slot: 0,
            node: 1,
            part: 200_000,
        },
        Collect,
        Pair(
            Box::new(Patch {
                slot: 0,
                node: 0,
                part: 450_000,
            }),
            Box::new(Sweep { node: 0 }),
        ),
        Collect,
        OneShot {
            node: 0,
            pieces: vec![0, 1],
        },
    ];
    run_program(swept, None);
}

/// A fixed program of shard moves on PostgreSQL: the node that lost the shards is refused
/// every write (the row unchanged) and its sweep removes nothing, the owner's does; the
/// upload moves back and completes byte-exact, with a request dropped on the way.
#[test]
fn known_interleavings_with_moves() {
    use Op::*;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = rt.block_on(TestDatabase::create("known_interleavings_with_moves"));
    let Some(db) = db else { return };
    let moves = vec![
        Create {
            slot: 0,
            node: 0,
            pieces: vec![0, 1, 2],
        },
        Patch {
            slot: 0,
            node: 0,
            part: 200_000,
        },
        Move { to: 1 },
        // TUS-5: node 0 has not learnt of the move; its writes are refused.
        Patch {
            slot: 0,
            node: 0,
            part: 100_000,
        },
        Terminate { slot: 0, node: 0 },
        Create {
            slot: 0,
            node: 0,
            pieces: vec![3],
        },
        // TUS-6: every row is expired on this clock; only the owner may sweep.
        Sweep { node: 0 },
        Patch {
            slot: 0,
            node: 1,
            part: 100_000,
        },
        DropPatch {
            slot: 0,
            node: 1,
            part: 100_000,
            sent: 100_000,
            wait_ms: 5,
        },
        Move { to: 0 },
        Patch {
            slot: 0,
            node: 0,
            part: 450_000,
        },
        Sweep { node: 1 },
        Collect,
        OneShot {
            node: 1,
            pieces: vec![0, 1, 2],
        },
    ];
    let exercised = run_program(moves, Some(&db));
    // The program did what it is for: the fenced-out node's PATCH, DELETE and creation
    // were refused.
    assert!(exercised.refused >= 3, "{exercised:?}");
}
