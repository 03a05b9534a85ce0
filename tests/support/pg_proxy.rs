//! A TCP proxy for one process's PostgreSQL connections (real sockets), that a fault test
//! can make delay or black-hole live connections on command.
//!
//! The process under test is given `postgres://…@127.0.0.1:<proxy port>/…`; the proxy
//! forwards every connection to the real server. Each connection is labelled with the
//! `application_name` of its startup message (a node names its pools
//! `graviton-<purpose>:<node>`), so a fault can hit one pool only, in one direction only.
//!
//! Faults ([`Fault`]), set by [`PgProxy::set`] for connections whose label contains a
//! pattern (the last matching rule wins; no rule is [`Fault::Pass`]):
//! - `Delay(d)`: every chunk is forwarded `d` after the proxy read it (order kept).
//! - `Hold`: nothing is forwarded, and the connection stays open: a black hole, as far as
//!   the application layer can tell. Held bytes (and a held close) are kept, in order,
//!   and forwarded when the rule is lifted, as TCP would retransmit them after a
//!   partition heals. [`PgProxy::held`] tells how many bytes are held now, so a test can
//!   wait until a request or an answer is actually caught.
//! - `HoldAfter(needles)`: chunks pass until the byte strings `needles` have been seen in
//!   order (each in one chunk, the last chunk passes too), then everything after is held
//!   like `Hold`: a connection cut right after a given statement (e.g. the `COMMIT` of a
//!   re-registration, so the next statement on that connection hangs).
//! - `HoldFrom(needle)`: chunks pass until one contains `needle`; that chunk and every
//!   later one are held (e.g. the answer that carries a given value).
//!
//! Honest limit: the proxy's own kernel acknowledges the data and answers TCP keepalives
//! on both sides, so a held connection looks alive at the TCP level. TCP keepalives and
//! `tcp_user_timeout` never fire on it; only application deadlines (the node's call and
//! heartbeat deadlines) and the server's `idle_in_transaction_session_timeout` do.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What happens to the bytes of matching connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay(Duration),
    Hold,
    HoldAfter(Arc<Vec<Vec<u8>>>),
    HoldFrom(Arc<Vec<u8>>),
}

/// Which way a rule acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Both,
    /// Server to client (answers).
    ToClient,
    /// Client to server (requests).
    ToServer,
}

#[derive(Clone, Debug)]
struct Rule {
    pattern: String,
    direction: Direction,
    fault: Fault,
    /// Which `set` made it (a `HoldAfter` counts its needles per rule and connection).
    generation: u64,
}

/// One proxied connection's bookkeeping.
struct Conn {
    label: Mutex<Option<String>>,
    /// Bytes held now, per direction (to server, to client).
    held: [AtomicUsize; 2],
    forwarded: [AtomicU64; 2],
    /// Chunks that waited for a `Delay` rule, per direction.
    delayed: [AtomicU64; 2],
    open: std::sync::atomic::AtomicBool,
    /// `HoldAfter` progress per direction: (rule generation, needles seen).
    progress: [Mutex<(u64, usize)>; 2],
}

struct Shared {
    rules: Mutex<Vec<Rule>>,
    /// Bumped on every rule change, so held or delayed chunks look again.
    changed: watch::Sender<u64>,
    conns: Mutex<Vec<Arc<Conn>>>,
}

impl Shared {
    fn fault(&self, label: Option<&str>, to_client: bool) -> (Fault, u64) {
        let rules = self.rules.lock().unwrap();
        rules
            .iter()
            .rev()
            .find(|r| {
                let way = match r.direction {
                    Direction::Both => true,
                    Direction::ToClient => to_client,
                    Direction::ToServer => !to_client,
                };
                way && label.is_some_and(|l| l.contains(&r.pattern))
            })
            .map(|r| (r.fault.clone(), r.generation))
            .unwrap_or((Fault::Pass, 0))
    }
}

/// The proxy; stops accepting and closes every connection when dropped.
pub struct PgProxy {
    pub port: u16,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// `url` (a `postgres://` URL) with its host and port replaced by `127.0.0.1:port`.
pub fn url_through(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").expect("postgres URL");
    let (user, after_user) = match rest.split_once('@') {
        Some((user, host)) => (format!("{user}@"), host),
        None => (String::new(), rest),
    };
    let path = after_user
        .find('/')
        .map(|i| &after_user[i..])
        .unwrap_or_default();
    format!("{scheme}://{user}127.0.0.1:{port}{path}")
}

/// The `host:port` a `postgres://` URL names.
pub fn upstream_of(url: &str) -> SocketAddr {
    use std::net::ToSocketAddrs;
    let rest = url.split_once("://").expect("postgres URL").1;
    let host = rest.split_once('@').map(|(_, h)| h).unwrap_or(rest);
    let host = host.split(['/', '?']).next().unwrap();
    let host = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:5432")
    };
    host.to_socket_addrs()
        .expect("resolve the PostgreSQL host")
        .next()
        .expect("an address")
}

impl PgProxy {
    /// A proxy on a free loopback port in front of `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            rules: Mutex::new(Vec::new()),
            changed: watch::channel(0).0,
            conns: Mutex::new(Vec::new()),
        });
        let accept = tokio::spawn({
            let shared = shared.clone();
            async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        proxy(shared, client, server).await;
                    });
                }
            }
        });
        Self {
            port,
            shared,
            accept,
        }
    }

    /// Apply `fault` in `direction` to connections whose label contains `pattern` (`""`
    /// matches every labelled connection); replaces an earlier rule for the same pattern
    /// and direction.
    pub fn set(&self, pattern: &str, direction: Direction, fault: Fault) {
        let generation = *self.shared.changed.borrow() + 1;
        {
            let mut rules = self.shared.rules.lock().unwrap();
            rules.retain(|r| !(r.pattern == pattern && r.direction == direction));
            rules.push(Rule {
                pattern: pattern.to_string(),
                direction,
                fault,
                generation,
            });
        }
        self.shared.changed.send_modify(|n| *n = generation);
    }

    /// Drop every rule: held bytes flow again, in order.
    pub fn heal(&self) {
        self.shared.rules.lock().unwrap().clear();
        self.shared.changed.send_modify(|n| *n += 1);
    }

    fn sum(&self, pattern: &str, f: impl Fn(&Conn) -> u64) -> u64 {
        self.shared
            .conns
            .lock()
            .unwrap()
            .iter()
            .filter(|c| {
                c.label
                    .lock()
                    .unwrap()
                    .as_deref()
                    .is_some_and(|l| l.contains(pattern))
            })
            .map(|c| f(c))
            .sum()
    }

    /// Bytes held now on connections whose label contains `pattern`, towards the client
    /// (`to_client`) or the server.
    pub fn held(&self, pattern: &str, to_client: bool) -> u64 {
        let i = usize::from(to_client);
        self.sum(pattern, |c| c.held[i].load(Ordering::SeqCst) as u64)
    }

    /// Bytes forwarded so far on connections whose label contains `pattern`.
    pub fn forwarded(&self, pattern: &str, to_client: bool) -> u64 {
        let i = usize::from(to_client);
        self.sum(pattern, |c| c.forwarded[i].load(Ordering::SeqCst))
    }

    /// Chunks forwarded late under a `Delay` rule so far, on connections whose label
    /// contains `pattern`.
    pub fn delayed(&self, pattern: &str, to_client: bool) -> u64 {
        let i = usize::from(to_client);
        self.sum(pattern, |c| c.delayed[i].load(Ordering::SeqCst))
    }

    /// Open connections whose label contains `pattern`.
    pub fn open_connections(&self, pattern: &str) -> u64 {
        self.sum(pattern, |c| u64::from(c.open.load(Ordering::SeqCst)))
    }

    /// The labels of every connection seen so far (open or not).
    pub fn labels(&self) -> Vec<String> {
        self.shared
            .conns
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| c.label.lock().unwrap().clone())
            .collect()
    }
}

/// The `application_name` of a client's first bytes (an optional SSLRequest or
/// GSSENCRequest, then the startup message), once the startup message is complete.
/// `None` while incomplete; `Some("")` if it names none.
fn startup_label(bytes: &[u8]) -> Option<String> {
    let mut at = 0;
    loop {
        let len = u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize;
        let code = u32::from_be_bytes(bytes.get(at + 4..at + 8)?.try_into().ok()?);
        let message = bytes.get(at..at + len)?;
        // SSLRequest / GSSENCRequest: the server answers one byte, the startup follows.
        if len == 8 && (code == 80_877_103 || code == 80_877_104) {
            at += 8;
            continue;
        }
        let mut fields = message[8..].split(|b| *b == 0);
        while let Some(key) = fields.next() {
            let value = fields.next().unwrap_or_default();
            if key == b"application_name" {
                return Some(String::from_utf8_lossy(value).into_owned());
            }
        }
        return Some(String::new());
    }
}

async fn proxy(shared: Arc<Shared>, client: TcpStream, server: TcpStream) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let conn = Arc::new(Conn {
        label: Mutex::new(None),
        held: [AtomicUsize::new(0), AtomicUsize::new(0)],
        forwarded: [AtomicU64::new(0), AtomicU64::new(0)],
        delayed: [AtomicU64::new(0), AtomicU64::new(0)],
        open: std::sync::atomic::AtomicBool::new(true),
        progress: [Mutex::new((0, 0)), Mutex::new((0, 0))],
    });
    shared.conns.lock().unwrap().push(conn.clone());
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(
        shared.clone(),
        conn.clone(),
        client_read,
        server_write,
        false,
    );
    let down = pump(shared, conn.clone(), server_read, client_write, true);
    // A close is forwarded (or held) like data; a failed write ends that direction.
    tokio::join!(up, down);
    conn.open.store(false, Ordering::SeqCst);
}

/// Read from `from` and write to `to` under the rules: `None` in the queue is the close.
async fn pump(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    to_client: bool,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let reader = {
        let conn = conn.clone();
        async move {
            let mut startup = Vec::new();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = from.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    let _ = tx.send((Instant::now(), None));
                    return;
                }
                if !to_client && conn.label.lock().unwrap().is_none() {
                    startup.extend_from_slice(&buf[..n]);
                    let label = startup_label(&startup).or_else(|| {
                        // A client that sends something else: labelled, unparsed.
                        (startup.len() > 64 << 10).then(String::new)
                    });
                    *conn.label.lock().unwrap() = label;
                }
                if tx.send((Instant::now(), Some(buf[..n].to_vec()))).is_err() {
                    return;
                }
            }
        }
    };
    let writer = async move {
        let i = usize::from(to_client);
        let mut changed = shared.changed.subscribe();
        while let Some((read_at, chunk)) = rx.recv().await {
            let len = chunk.as_ref().map_or(0, Vec::len);
            let mut holding = false;
            let mut waited = false;
            // A `HoldAfter` rule decides each chunk once, when it first sees it.
            let mut decided: Option<(u64, bool)> = None;
            loop {
                // Marked seen before the rules are read: a change after this wakes us.
                changed.borrow_and_update();
                let label = conn.label.lock().unwrap().clone();
                let (fault, generation) = shared.fault(label.as_deref(), to_client);
                let fault = match fault {
                    Fault::HoldFrom(needle) => {
                        let hold = match decided {
                            Some((g, hold)) if g == generation => hold,
                            _ => {
                                let mut progress = conn.progress[i].lock().unwrap();
                                if progress.0 != generation {
                                    *progress = (generation, 0);
                                }
                                if chunk.as_deref().is_some_and(|c| {
                                    c.windows(needle.len()).any(|w| w == &needle[..])
                                }) {
                                    progress.1 = 1;
                                }
                                decided = Some((generation, progress.1 == 1));
                                progress.1 == 1
                            }
                        };
                        if hold { Fault::Hold } else { Fault::Pass }
                    }
                    Fault::HoldAfter(needles) => {
                        let hold = match decided {
                            Some((g, hold)) if g == generation => hold,
                            _ => {
                                let mut progress = conn.progress[i].lock().unwrap();
                                if progress.0 != generation {
                                    *progress = (generation, 0);
                                }
                                let hold = progress.1 >= needles.len();
                                if !hold
                                    && chunk.as_deref().is_some_and(|c| {
                                        let needle = &needles[progress.1];
                                        c.windows(needle.len()).any(|w| w == &needle[..])
                                    })
                                {
                                    progress.1 += 1;
                                }
                                decided = Some((generation, hold));
                                hold
                            }
                        };
                        if hold { Fault::Hold } else { Fault::Pass }
                    }
                    other => other,
                };
                let wait = match fault {
                    Fault::Pass | Fault::HoldAfter(_) | Fault::HoldFrom(_) => None,
                    Fault::Delay(d) if Instant::now() >= read_at + d => None,
                    Fault::Delay(d) => Some(Some(read_at + d)),
                    Fault::Hold => Some(None),
                };
                let Some(until) = wait else { break };
                if matches!(fault, Fault::Hold) && !holding {
                    holding = true;
                    conn.held[i].fetch_add(len.max(1), Ordering::SeqCst);
                }
                match until {
                    Some(at) => {
                        waited = true;
                        tokio::select! {
                            _ = tokio::time::sleep_until(at) => {}
                            _ = changed.changed() => {}
                        }
                    }
                    None => {
                        let _ = changed.changed().await;
                    }
                }
            }
            if holding {
                conn.held[i].fetch_sub(len.max(1), Ordering::SeqCst);
            }
            if waited {
                conn.delayed[i].fetch_add(1, Ordering::SeqCst);
            }
            match chunk {
                Some(bytes) => {
                    if to.write_all(&bytes).await.is_err() {
                        return;
                    }
                    conn.forwarded[i].fetch_add(bytes.len() as u64, Ordering::SeqCst);
                }
                None => {
                    let _ = to.shutdown().await;
                    return;
                }
            }
        }
    };
    tokio::join!(reader, writer);
}

/// Stage a stale `Dead` heartbeat answer (issue 25 item 5) for node `node`, whose
/// PostgreSQL connections go through `proxy`: its heartbeat, sent with its old
/// incarnation, is answered `Dead` by the server before its re-registration commits, and
/// is delivered after the node learned its new incarnation, while the re-registration's
/// closing table read is still held (the window in which a node without an incarnation
/// check on `Dead` fenced itself for good). `public_addr` is the node's public
/// `host:port` (its re-registration binds it); `log` reads the node's log;
/// `declared_dead` tells whether the manager declared the node dead.
///
/// Each attempt: cut the node's heartbeat and placement connections until it is declared
/// dead; let one `Dead` answer through (the node queues its re-registration, which the
/// held placement connection keeps from the server); hold the next heartbeat answer from
/// the chunk carrying `dead`; let the re-registration through up to its `COMMIT` and hold
/// what follows; once the node logged its new incarnation, deliver the held answer. An
/// attempt counts only if the node logged the refusal as stale ("heartbeat refusal for an
/// older incarnation ignored") while the table read was held, before and after; it fails
/// if the held answer missed the heartbeat's deadline. Returns the attempt that staged it.
pub async fn stage_stale_dead_reply<F, Fut>(
    proxy: &PgProxy,
    node: &str,
    public_addr: &str,
    log: &dyn Fn() -> String,
    declared_dead: F,
    attempts: usize,
) -> Result<usize, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    const IGNORED: &str = "heartbeat refusal for an older incarnation ignored";
    const REFUSED: &str = "heartbeat refused";
    const REREGISTERED: &str = "re-registered; fenced until the table is re-read";
    let heartbeat = format!("graviton-heartbeat:{node}");
    let actor = format!("graviton-placement:{node}");
    let count = |needle: &str| log().matches(needle).count();
    let ignored_before = count(IGNORED);
    for attempt in 1..=attempts {
        proxy.set(&heartbeat, Direction::Both, Fault::Hold);
        proxy.set(&actor, Direction::Both, Fault::Hold);
        let dead = super::wait_until(Duration::from_secs(30), &declared_dead).await;
        if !dead {
            proxy.heal();
            return Err(format!("{node} was never declared dead while cut off"));
        }
        let (refused, reregistered) = (count(REFUSED), count(REREGISTERED));
        proxy.set(&heartbeat, Direction::Both, Fault::Pass);
        let learned = super::wait_until(Duration::from_secs(10), || async {
            count(REFUSED) > refused
        })
        .await;
        if !learned {
            proxy.heal();
            return Err(format!("{node} never learned it was declared dead"));
        }
        proxy.set(
            &heartbeat,
            Direction::ToClient,
            Fault::HoldFrom(Arc::new(b"dead".to_vec())),
        );
        let caught = super::wait_until(Duration::from_secs(10), || async {
            proxy.held(&heartbeat, true) > 0
        })
        .await;
        if !caught {
            proxy.heal();
            return Err(format!("no heartbeat answer of {node} was held"));
        }
        let held_at = Instant::now();
        proxy.set(&actor, Direction::Both, Fault::Pass);
        proxy.set(
            &actor,
            Direction::ToServer,
            Fault::HoldAfter(Arc::new(vec![
                public_addr.as_bytes().to_vec(),
                b"COMMIT".to_vec(),
            ])),
        );
        let done = super::wait_until(Duration::from_secs(10), || async {
            count(REREGISTERED) > reregistered
        })
        .await;
        if !done {
            proxy.heal();
            return Err(format!("{node} never re-registered"));
        }
        let read_held = super::wait_until(Duration::from_millis(300), || async {
            proxy.held(&actor, false) > 0
        })
        .await;
        proxy.set(&heartbeat, Direction::ToClient, Fault::Pass);
        let released_after = held_at.elapsed();
        let ignored = super::wait_until(Duration::from_secs(2), || async {
            count(IGNORED) > ignored_before
        })
        .await;
        let still_held = proxy.held(&actor, false) > 0;
        proxy.heal();
        eprintln!(
            "stale heartbeat answer for {node}, attempt {attempt}: released {released_after:?} \
             after it was caught; seen as stale: {ignored}; re-registration's table read \
             held before: {read_held}, after: {still_held}"
        );
        if ignored && read_held && still_held {
            return Ok(attempt);
        }
    }
    Err(format!(
        "a stale Dead answer never reached {node} within its heartbeat deadline in {attempts} attempts"
    ))
}
