//! Stateful property test of the upload path under interleavings (CAS-6, CAS-7, SES-3,
//! STO-23): two nodes share one upload ledger (redb, or real PostgreSQL), one pack store
//! and one manifest store, as cluster nodes share PostgreSQL and S3, while each keeps its
//! own hasher cache, session region and admission budget. Random programs of client
//! operations run against them over real sockets:
//!
//! - tus create (clients choose the id, so an upload can be created again under the same
//!   id), partial and final PATCH, a PATCH whose client disconnects mid-body, DELETE;
//! - one-shot uploads of contents that share pieces with the resumable ones (dedup hits,
//!   and the bytes a poisoned key would have named);
//! - expiry sweeps of the shared ledger (its clock moved past every expiry);
//! - collector runs with `min_age` 0 and purge (mark, quarantine, purge);
//! - requests alternating between the nodes (an upload's owner moving back and forth),
//!   and pairs of operations run at the same time.
//!
//! After every step: every acknowledged key downloads exactly the bytes whose hash it
//! names; no key of any content the program used answers anything but 200-exact or 404
//! (a manifest whose blocks do not add up answers 500); no session is left busy and the
//! admission budget is whole again on both nodes. At the end every content uploads in one
//! shot to its own key and downloads exactly.
//!
//! Replay: a failure prints the minimal program, and proptest stores its seed under
//! `tests/interleavings.proptest-regressions` (replayed first on every run).
//! `GRAVITON_INTERLEAVING_CASES=500` runs a soak (default: 12 programs per ledger).

#[allow(unused_imports)]
mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use graviton::cas::BlobKey;
use graviton::node::NodeOptions;
use graviton::storage::pack::gc::{self, GcOptions, Quiet};
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
    /// The expiry sweep of the shared ledger, its clock past every expiry.
    Sweep,
    /// A collector run, min_age 0, with purge.
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
        1 => Just(Op::Sweep),
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
    /// Owns the shared stores (its pack store is the one the collector runs on); it
    /// serves no request itself.
    store: TestNode,
    nodes: [TestNode; 2],
    ledger: Arc<dyn UploadLedger>,
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

impl World {
    async fn start(ledger: Option<Arc<dyn UploadLedger>>) -> Self {
        let store = TestNode::start().await;
        let state = store.node.as_ref().unwrap().state().clone();
        let ledger = ledger.unwrap_or_else(|| state.uploads.ledger().clone());
        let mut nodes = Vec::new();
        for _ in 0..2 {
            nodes.push(
                TestNode::start_with(
                    |_| {},
                    NodeOptions {
                        blocks: Some(state.blocks.clone()),
                        manifests: Some(state.manifests.clone()),
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
            store,
            nodes,
            ledger,
            piece,
            slots,
            acked: Default::default(),
            contents: Default::default(),
            budget,
        }
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

    fn run<'a>(&'a self, op: &'a Op) -> futures_util::future::BoxFuture<'a, ()> {
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
                    // 409: a concurrent PATCH holds the session or moved the offset;
                    // 404/410: terminated or swept meanwhile.
                    assert!(
                        [204, 404, 409, 410].contains(&status),
                        "PATCH answered {status}: {:?}",
                        r.text().await
                    );
                    if let Some(key) = r.headers().get("graviton-blob-key") {
                        self.ack(key.to_str().unwrap());
                    }
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
                Op::Terminate { slot, node } => {
                    let r = client()
                        .delete(self.upload_url(*slot, *node))
                        .header("tus-resumable", "1.0.0")
                        .send()
                        .await
                        .unwrap();
                    assert!(
                        [204, 404, 410].contains(&r.status().as_u16()),
                        "{}",
                        r.status()
                    );
                }
                Op::Recreate { slot, node, pieces } => {
                    self.run(&Op::Terminate {
                        slot: *slot,
                        node: *node,
                    })
                    .await;
                    self.run(&Op::Create {
                        slot: *slot,
                        node: *node,
                        pieces: pieces.clone(),
                    })
                    .await;
                }
                Op::Sweep => {
                    let later = graviton::tus::now_ms() + 100 * 3_600_000;
                    self.ledger.sweep(later).await.unwrap();
                }
                Op::Collect => {
                    let state = self.store.node.as_ref().unwrap().state().clone();
                    let (packs, _) = state.packs.as_ref().expect("a pack store");
                    let options = GcOptions {
                        min_age: Duration::ZERO,
                        retention: Duration::ZERO,
                        compact_below: 0.5,
                        dry_run: false,
                        purge: true,
                        batch: 64,
                    };
                    // The collector marks the blocks of live resumable uploads (the
                    // shared ledger) as the nodes' collectors do.
                    let manifests = graviton::upload::ledger::LiveUploads {
                        manifests: state.manifests.clone(),
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
                    futures_util::future::join(self.run(a), self.run(b)).await;
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
            assert_eq!(
                metric(node, "graviton_active_sessions"),
                Some(0),
                "step {step} ({op:?}): node {i} has a session left busy"
            );
            // Permits are given back when the request's task ends, just after its answer.
            let whole = support::wait_until(Duration::from_secs(10), || {
                let budget = metric(node, BUDGET);
                async move { budget == Some(self.budget[i]) }
            })
            .await;
            assert!(
                whole,
                "step {step} ({op:?}): node {i} leaked admission budget"
            );
        }
    }

    async fn finish(&self) {
        let contents: Vec<Vec<u8>> = self.contents.lock().unwrap().clone();
        for content in contents {
            let key = one_shot(&self.nodes[1].url, &content).await;
            assert_eq!(key, BlobKey::of(&content).to_string());
            let got = get(&self.nodes[0].url, &key).await.expect("uploaded");
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

fn cases() -> u32 {
    std::env::var("GRAVITON_INTERLEAVING_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

fn run_program(ops: Vec<Op>, postgres: Option<&TestDatabase>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ledger: Option<Arc<dyn UploadLedger>> = match postgres {
            Some(db) => {
                let pool = graviton::storage::pg::connect_pool(
                    db.url(),
                    4,
                    Duration::from_secs(5),
                    "graviton-interleavings",
                )
                .await
                .unwrap();
                // A fresh database per program: every program starts from an empty ledger.
                graviton::storage::pg::migrate(&pool).await.unwrap();
                Some(Arc::new(graviton::upload::ledger::PgLedger::new(pool)))
            }
            None => None,
        };
        let world = World::start(ledger).await;
        for (step, op) in ops.iter().enumerate() {
            world.run(op).await;
            world.check(step, op).await;
        }
        world.finish().await;
    });
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 64,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..ProptestConfig::default()
    })]

    // Checks CAS-6, CAS-7, SES-3 and STO-23 on the redb ledger.
    #[test]
    fn interleavings_on_the_redb_ledger(ops in prop::collection::vec(op(), 4..24)) {
        run_program(ops, None);
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases().div_ceil(2),
        max_shrink_iters: 32,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..ProptestConfig::default()
    })]

    // Checks CAS-6, CAS-7, SES-3 and STO-23 on the PostgreSQL ledger.
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
            Box::new(Sweep),
        ),
        Collect,
        OneShot {
            node: 0,
            pieces: vec![0, 1],
        },
    ];
    run_program(swept, None);
}
