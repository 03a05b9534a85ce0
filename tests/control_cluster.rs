//! The ractor_cluster control transport over real loopback sockets.
//!
//! Nodes run in this process (ractor's pg is process-global; nextest gives each test
//! its own process) except where a peer must be killed: that peer is this same test
//! binary re-executed as a child process (see `child_node_entry`), so `kill -9` is real.
//! Under `cargo test` (one process, parallel threads) the tests take a process-wide
//! lock: ractor's pg drops a remote actor from every group when any actor with the same
//! id stops, and two NodeServers in one process can hand out equal remote ids. Each
//! test also uses its own node names.

#[allow(unused_imports)]
mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use graviton::backoff::Backoff;
use graviton::config::Secret;
use graviton::control::cluster::{ClusterOptions, ClusterTransport, MAX_FRAME_BYTES};
use graviton::control::envelope::{
    self, Envelope, OwnerReply, Reply, ReplyErrorCode, SessionRequest,
};
use graviton::control::transport::{ControlError, ControlTransport, FnHandler, InMemoryNetwork};
use graviton::ids::{NodeId, SessionId, TenantId};
use support::free_port;

const TOKEN: &str = "test-token-0123456789abcdefghijklmnopqrstuvwxyz";
const CHILD_ENV: &str = "GRAVITON_TEST_CONTROL_CHILD";
const CHILD_PEERS_ENV: &str = "GRAVITON_TEST_CONTROL_CHILD_PEERS";
const CALL: Duration = Duration::from_secs(2);

fn node(id: &str) -> NodeId {
    NodeId::parse(id).unwrap()
}

/// A handler answering "I own it" with its node id, and the process id as the epoch
/// (so a restarted peer is distinguishable).
fn owner_handler(me: &str) -> Arc<FnHandler<impl Fn(Envelope) -> Reply + Send + Sync + 'static>> {
    let me = node(me);
    Arc::new(FnHandler(move |request| match request {
        Envelope::ActivateSession(_) | Envelope::ResolveSession(_) => Reply::Owner(OwnerReply {
            owner: me.clone(),
            owner_internal_addr: "127.0.0.1:7071".parse().unwrap(),
            shard_epoch: u64::from(std::process::id()),
            hot_state: None,
        }),
        Envelope::AssignmentChanged { .. } | Envelope::Drain { .. } => {
            HINTS.fetch_add(1, Ordering::SeqCst);
            Reply::Ack
        }
    }))
}

/// Serializes the tests of this file when they share a process (`cargo test`).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Hints (casts) received by any handler in this process.
static HINTS: AtomicU64 = AtomicU64::new(0);

async fn start(id: &str, port: u16, token: &str) -> ClusterTransport {
    let options = ClusterOptions {
        node: node(id),
        listen: SocketAddr::from(([127, 0, 0, 1], port)),
        token: Secret::new(token),
        backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
        dial_timeout: Duration::from_millis(500),
    };
    ClusterTransport::start(options, owner_handler(id))
        .await
        .expect("start control plane")
}

fn activate() -> Envelope {
    Envelope::ActivateSession(SessionRequest {
        tenant: TenantId::new_random(),
        session: SessionId::new_random(),
        shard: 7,
        epoch: 1,
    })
}

/// Poll `call` until it yields an owner reply, or panic at the deadline.
async fn owner_within(from: &ClusterTransport, peer: &NodeId, deadline: Duration) -> OwnerReply {
    let until = Instant::now() + deadline;
    loop {
        match from.call(peer, activate(), CALL).await {
            Ok(Reply::Owner(owner)) => return owner,
            Ok(other) => panic!("unexpected reply {other:?}"),
            Err(error) if Instant::now() < until => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => panic!("no reply from {peer} within {deadline:?}: {error}"),
        }
    }
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_exchange_calls_both_ways() {
    let _serial = SERIAL.lock().await;
    let (pa, pb) = (free_port(), free_port());
    let a = start("two-a", pa, TOKEN).await;
    let b = start("two-b", pb, TOKEN).await;
    let peers = vec![(node("two-a"), addr(pa)), (node("two-b"), addr(pb))];
    a.set_peers(peers.clone());
    b.set_peers(peers);

    assert_eq!(
        owner_within(&a, &node("two-b"), Duration::from_secs(10))
            .await
            .owner,
        node("two-b")
    );
    assert_eq!(
        owner_within(&b, &node("two-a"), Duration::from_secs(10))
            .await
            .owner,
        node("two-a")
    );
    // Hints are fire-and-forget but must not error on a connected peer.
    a.cast(
        &node("two-b"),
        Envelope::AssignmentChanged {
            term: 3,
            epoch_hint: Some(9),
        },
    )
    .unwrap();
    let casts = a.broadcast(Envelope::Drain {
        node: node("two-a"),
    });
    assert_eq!(casts, 1, "one connected peer");
    support::eventually(Duration::from_secs(10), "both casts delivered", || {
        HINTS.load(Ordering::SeqCst) >= 2
    })
    .await;
    // The local node answers through the same codec without the network.
    assert!(matches!(
        a.call(&node("two-a"), activate(), CALL).await,
        Ok(Reply::Owner(_))
    ));
    // Unlisted peers are typed errors.
    assert_eq!(
        a.call(&node("two-z"), activate(), CALL).await,
        Err(ControlError::UnknownPeer(node("two-z")))
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Three nodes in three processes (this one and two children): every node reaches
/// both others. Children report each peer they reached on stdout (`REACHED <peer>`).
/// Separate processes matter: ractor's pg is process-global, so several in-process
/// NodeServers talking to the same peer can collide on remote actor ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_in_three_processes_reach_every_peer() {
    let _serial = SERIAL.lock().await;
    let ids = ["three-a", "three-b", "three-c"];
    let ports = [free_port(), free_port(), free_port()];
    let peers: Vec<_> = ids
        .iter()
        .zip(ports)
        .map(|(id, p)| (node(id), addr(p)))
        .collect();
    let a = start(ids[0], ports[0], TOKEN).await;
    let mut b = ChildNode::spawn_with_peers(ids[1], ports[1], &peers);
    let mut c = ChildNode::spawn_with_peers(ids[2], ports[2], &peers);
    a.set_peers(peers.clone());
    for to in &ids[1..] {
        let owner = owner_within(&a, &node(to), Duration::from_secs(20)).await;
        assert_eq!(owner.owner, node(to));
    }
    let reached_b = b.wait_for_reached(2, Duration::from_secs(20));
    let reached_c = c.wait_for_reached(2, Duration::from_secs(20));
    assert_eq!(
        reached_b,
        vec!["three-a".to_string(), "three-c".to_string()]
    );
    assert_eq!(
        reached_c,
        vec!["three-a".to_string(), "three-b".to_string()]
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_cookie_is_refused_and_redialed_with_backoff() {
    let _serial = SERIAL.lock().await;
    let (pa, pb) = (free_port(), free_port());
    let a = start("cookie-a", pa, TOKEN).await;
    let b = start(
        "cookie-b",
        pb,
        "another-token-0123456789abcdefghijklmnopqrstuvwxyz",
    )
    .await;
    a.set_peers(vec![(node("cookie-b"), addr(pb))]);

    // Each failed handshake schedules a re-dial; wait for several.
    support::eventually(
        Duration::from_secs(15),
        "three re-dials after refused handshakes",
        || a.redials() >= 3,
    )
    .await;
    assert!(a.connected_peers().is_empty());
    assert!(b.connected_peers().is_empty());
    assert_eq!(
        a.call(&node("cookie-b"), activate(), CALL).await,
        Err(ControlError::NotConnected(node("cookie-b")))
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_payloads_get_typed_errors_and_the_session_survives() {
    let _serial = SERIAL.lock().await;
    let (pa, pb) = (free_port(), free_port());
    let a = start("bad-a", pa, TOKEN).await;
    let b = start("bad-b", pb, TOKEN).await;
    a.set_peers(vec![(node("bad-b"), addr(pb))]);
    let peer = node("bad-b");
    owner_within(&a, &peer, Duration::from_secs(10)).await;
    let redials_before = a.redials();

    let oversized = vec![0x90; envelope::MAX_ENVELOPE_BYTES + 1];
    assert!((oversized.len() as u64) < MAX_FRAME_BYTES);
    let mut deep = vec![0x91; 200];
    deep.push(0x01);
    let mut trailing = envelope::encode_request(&activate()).unwrap();
    trailing.extend_from_slice(b"xx");
    for bad in [
        b"\xc1\xc1garbage".to_vec(),
        Vec::new(),
        oversized,
        deep,
        trailing,
    ] {
        let reply = a
            .call_raw(&peer, bad, CALL)
            .await
            .expect("a reply, not a dead session");
        match envelope::decode_reply(&reply).unwrap() {
            Reply::Error { code, .. } => assert_eq!(code, ReplyErrorCode::BadRequest),
            other => panic!("unexpected {other:?}"),
        }
    }
    // Random garbage of random sizes: every one answered, none fatal.
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for _ in 0..300 {
        let len = rng.random_range(0..4096);
        let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let reply = a
            .call_raw(&peer, bytes, CALL)
            .await
            .expect("a reply, not a dead session");
        assert!(envelope::decode_reply(&reply).is_ok());
    }
    // Same session, still serving.
    assert!(matches!(
        a.call(&peer, activate(), CALL).await,
        Ok(Reply::Owner(_))
    ));
    assert_eq!(
        a.redials(),
        redials_before,
        "the session must not have been dropped"
    );
    a.shutdown().await;
    b.shutdown().await;
}

struct ChildNode {
    child: Child,
    lines: Option<std::sync::mpsc::Receiver<String>>,
}

impl ChildNode {
    fn spawn(id: &str, port: u16) -> Self {
        Self::spawn_with_peers(id, port, &[])
    }

    /// Start a child node; with `peers`, it dials them and reports each one it reached.
    fn spawn_with_peers(id: &str, port: u16, peers: &[(NodeId, SocketAddr)]) -> Self {
        let exe = std::env::current_exe().expect("test binary path");
        let peers: Vec<String> = peers
            .iter()
            .map(|(id, addr)| format!("{id}={addr}"))
            .collect();
        let mut child = Command::new(exe)
            .args([
                "child_node_entry",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, format!("{id} {port}"))
            .env(CHILD_PEERS_ENV, peers.join(","))
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child node");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines: Some(rx),
        }
    }

    fn id(&self) -> u32 {
        self.child.id()
    }

    /// Wait (with a deadline) until the child reported `count` reached peers.
    fn wait_for_reached(&mut self, count: usize, deadline: Duration) -> Vec<String> {
        let lines = self.lines.as_ref().expect("stdout reader");
        let until = Instant::now() + deadline;
        let mut reached = Vec::new();
        while reached.len() < count {
            let left = until.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    // libtest may print "test child_node_entry ... " on the same line.
                    if let Some(at) = line.find("REACHED ") {
                        reached.push(line[at + "REACHED ".len()..].trim().to_string());
                    }
                }
                Err(_) => panic!("child reached only {reached:?} within {deadline:?}"),
            }
        }
        reached.sort();
        reached
    }

    fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

impl Drop for ChildNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The body of a child node process (kill/restart, three nodes, latency) when the
/// environment variable names one. Run as a test of its own (without the variable) it
/// checks itself: this binary, re-executed as a child node, answers an owner call from
/// this process with its own pid as the epoch, so it never passes without doing anything.
#[test]
fn child_node_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        runtime.block_on(async {
            let _serial = SERIAL.lock().await;
            let (pa, pb) = (free_port(), free_port());
            let me = start("entry-a", pa, TOKEN).await;
            let peer = node("entry-b");
            let child = ChildNode::spawn("entry-b", pb);
            me.set_peers(vec![(peer.clone(), addr(pb))]);
            let owner = owner_within(&me, &peer, Duration::from_secs(20)).await;
            assert_eq!(owner.owner, peer, "the child node answered as itself");
            assert_eq!(
                owner.shard_epoch,
                u64::from(child.id()),
                "the answer came from the child process"
            );
        });
        return;
    };
    let (id, port) = spec.split_once(' ').expect("id port");
    let port: u16 = port.parse().expect("port");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let peers: Vec<(NodeId, SocketAddr)> = std::env::var(CHILD_PEERS_ENV)
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (id, addr) = p.split_once('=').expect("id=addr");
            (node(id), addr.parse().expect("addr"))
        })
        .collect();
    runtime.block_on(async {
        let me = start(id, port, TOKEN).await;
        if !peers.is_empty() {
            me.set_peers(peers.clone());
            for (peer, _) in peers.iter().filter(|(p, _)| p.as_str() != id) {
                let owner = owner_within(&me, peer, Duration::from_secs(20)).await;
                assert_eq!(&owner.owner, peer);
                println!("REACHED {peer}");
            }
        }
        std::future::pending::<()>().await;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_and_restarted_peer_is_redialed() {
    let _serial = SERIAL.lock().await;
    let (pa, pb) = (free_port(), free_port());
    let a = start("kill-a", pa, TOKEN).await;
    let peer = node("kill-b");
    let mut child = ChildNode::spawn("kill-b", pb);
    a.set_peers(vec![(peer.clone(), addr(pb))]);

    let first = owner_within(&a, &peer, Duration::from_secs(20)).await;
    assert_eq!(first.owner, peer);
    assert_eq!(first.shard_epoch, u64::from(child.id()));

    child.kill();
    // The session drops; calls fail fast with a typed error, never hang.
    support::wait_for(
        Duration::from_secs(10),
        "calls to the dead peer to fail as not connected",
        || async {
            match a.call(&peer, activate(), CALL).await {
                Err(ControlError::NotConnected(_)) => true,
                Err(ControlError::Transport { .. } | ControlError::Timeout { .. }) | Ok(_) => false,
                Err(other) => panic!("unexpected {other}"),
            }
        },
    )
    .await;
    let restarted = ChildNode::spawn("kill-b", pb);
    let second = owner_within(&a, &peer, Duration::from_secs(20)).await;
    assert_eq!(
        second.shard_epoch,
        u64::from(restarted.id()),
        "answered by the new process"
    );
    // The child has no peer list (isolated mode), so only node-a's dialer can have
    // re-established the session.
    assert!(
        a.redials() >= 1,
        "a re-dial was scheduled after the session dropped"
    );
    drop(restarted);
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_activation_round_trip_figures() {
    let _serial = SERIAL.lock().await;
    let (pa, pb) = (free_port(), free_port());
    let a = start("rtt-a", pa, TOKEN).await;
    let peer = node("rtt-b");
    let _child = ChildNode::spawn("rtt-b", pb);
    a.set_peers(vec![(peer.clone(), addr(pb))]);
    owner_within(&a, &peer, Duration::from_secs(20)).await;

    for _ in 0..200 {
        a.call(&peer, activate(), CALL).await.unwrap();
    }
    let mut samples = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let started = Instant::now();
        let reply = a.call(&peer, activate(), CALL).await.unwrap();
        samples.push(started.elapsed());
        assert!(matches!(reply, Reply::Owner(_)));
    }
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)];
    println!(
        "FIGURE remote activation round trip over loopback (separate processes, n={}): p50={:?} p99={:?} max={:?}",
        samples.len(),
        pct(0.50),
        pct(0.99),
        samples[samples.len() - 1]
    );

    // The same calls through the in-memory transport: codec + handler only, no
    // sockets and no actors. The difference is the ractor_cluster path.
    let net = InMemoryNetwork::new();
    let mem_a = net.join(node("rtt-a"), owner_handler("rtt-a"));
    let _mem_b = net.join(peer.clone(), owner_handler("rtt-b"));
    mem_a.set_peers(vec![(peer.clone(), addr(pb))]);
    let mut local = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let started = Instant::now();
        mem_a.call(&peer, activate(), CALL).await.unwrap();
        local.push(started.elapsed());
    }
    local.sort();
    println!(
        "FIGURE same calls in memory (codec + handler only, n={}): p50={:?} p99={:?}",
        local.len(),
        local[local.len() / 2],
        local[local.len() * 99 / 100]
    );
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_control_port_is_a_start_error() {
    let _serial = SERIAL.lock().await;
    let port = free_port();
    let first = start("busy-a", port, TOKEN).await;
    let options = ClusterOptions {
        node: node("busy-b"),
        listen: addr(port),
        token: Secret::new(TOKEN),
        backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
        dial_timeout: Duration::from_millis(500),
    };
    let error = ClusterTransport::start(options, owner_handler("busy-b"))
        .await
        .err()
        .expect("the port is taken");
    assert!(!error.to_string().contains(TOKEN));
    first.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrected_peer_address_is_dialed_at_once() {
    let _serial = SERIAL.lock().await;
    let (pa, pb, nowhere) = (free_port(), free_port(), free_port());
    let a = start("moved-a", pa, TOKEN).await;
    let b = start("moved-b", pb, TOKEN).await;
    // A stale node-table row: nothing listens there, so re-dials pile up.
    a.set_peers(vec![(node("moved-b"), addr(nowhere))]);
    support::eventually(
        Duration::from_secs(10),
        "two re-dials towards the stale address",
        || a.redials() >= 2,
    )
    .await;
    assert_eq!(
        a.call(&node("moved-b"), activate(), CALL).await,
        Err(ControlError::NotConnected(node("moved-b")))
    );
    // The row is corrected: the new address is dialed without waiting out the backoff.
    a.set_peers(vec![(node("moved-b"), addr(pb))]);
    let owner = owner_within(&a, &node("moved-b"), Duration::from_secs(10)).await;
    assert_eq!(owner.owner, node("moved-b"));
    a.shutdown().await;
    b.shutdown().await;
}
