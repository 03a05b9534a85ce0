//! A private Redis Cluster per test: `redis-server --cluster-enabled yes` processes on free
//! loopback ports (each with its bus port, port + 10000, free too) in temp dirs, joined by
//! `redis-cli --cluster create`. Slot migration and failover are driven with the same
//! commands an operator would use (`CLUSTER SETSLOT`, `MIGRATE`, `CLUSTER FAILOVER`,
//! SIGKILL). Every server is killed on drop.
//!
//! [`RedisCluster::start_tls`] starts the same cluster TLS-only: every node listens on a
//! TLS port alone (`--port 0 --tls-port`), and the cluster bus and replication links are
//! TLS too (`--tls-cluster yes --tls-replication yes`), with a certificate of a test CA
//! ([`super::pki::TestPki`]); `redis-cli` and [`RedisCluster::url`] (`rediss://`) use it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One node of a [`RedisCluster`].
pub struct ClusterNode {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

/// The TLS files of a TLS-only cluster: the CA that clients verify against and the one
/// certificate (for 127.0.0.1) every node serves and presents on its bus links.
#[derive(Clone)]
pub struct ClusterTls {
    pub ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl ClusterTls {
    /// A certificate issued by `pki` (the files live as long as `pki`).
    pub fn issued_by(pki: &super::pki::TestPki) -> Self {
        let (cert, key) = pki.issue("redis-cluster");
        Self {
            ca: pki.ca.clone(),
            cert,
            key,
        }
    }

    /// `redis-cli` arguments for a TLS connection verified against the CA.
    fn cli_args(&self) -> Vec<std::ffi::OsString> {
        vec!["--tls".into(), "--cacert".into(), self.ca.clone().into()]
    }

    /// `redis-server` arguments: TLS only, on `port`, bus and replication included.
    fn server_args(&self, port: u16) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--cluster-port",
            &(port + 10_000).to_string(),
            "--tls-cluster",
            "yes",
            "--tls-replication",
            "yes",
            "--tls-auth-clients",
            "no",
        ]
        .iter()
        .map(Into::into)
        .collect();
        for (flag, file) in [
            ("--tls-cert-file", &self.cert),
            ("--tls-key-file", &self.key),
            ("--tls-ca-cert-file", &self.ca),
        ] {
            args.push(flag.into());
            args.push(file.into());
        }
        args
    }
}

/// A line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    pub failed: bool,
    /// Id of the primary this replica follows (`-` for primaries).
    pub primary_id: String,
    /// Owned slot ranges (inclusive), without migration markers.
    pub slots: Vec<(u16, u16)>,
}

/// A Redis Cluster of `primaries` primaries with `replicas` replicas each.
pub struct RedisCluster {
    pub nodes: Vec<ClusterNode>,
    tls: Option<ClusterTls>,
}

fn cluster_port() -> u16 {
    loop {
        let port = super::free_port();
        if port > 55_000 {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Run `redis-cli -p port args...` (over TLS with `tls`); returns stdout (raw, `--no-raw`
/// off).
fn cli(tls: Option<&ClusterTls>, port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(tls.map(ClusterTls::cli_args).unwrap_or_default())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli on PATH");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn parse_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let port = fields[1]
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()?;
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(NodeInfo {
                id: fields[0].to_string(),
                port,
                primary: fields[2].contains("master"),
                failed: fields[2].contains("fail") && !fields[2].contains("fail?"),
                primary_id: fields[3].to_string(),
                slots,
            })
        })
        .collect()
}

impl RedisCluster {
    /// Start and join the cluster, or `None` (after a loud skip line) without the binaries.
    pub fn start(test: &str, primaries: usize, replicas: usize) -> Option<Self> {
        Self::start_with(test, primaries, replicas, None)
    }

    /// [`Self::start`], TLS-only with `tls` (see the module docs).
    pub fn start_tls(
        test: &str,
        primaries: usize,
        replicas: usize,
        tls: ClusterTls,
    ) -> Option<Self> {
        Self::start_with(test, primaries, replicas, Some(tls))
    }

    fn start_with(
        test: &str,
        primaries: usize,
        replicas: usize,
        tls: Option<ClusterTls>,
    ) -> Option<Self> {
        let binary = find("redis-server");
        if binary.is_none() || find("redis-cli").is_none() {
            super::missing_service(test, "redis-server or redis-cli not found on PATH");
            return None;
        }
        let binary = binary.unwrap();
        let mut nodes = Vec::new();
        for _ in 0..primaries * (1 + replicas) {
            let mut node = ClusterNode {
                port: cluster_port(),
                dir: tempfile::tempdir().expect("tempdir for redis cluster node"),
                child: None,
            };
            node.spawn(&binary, tls.as_ref());
            nodes.push(node);
        }
        let cluster = Self { nodes, tls };
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(
                cluster
                    .tls
                    .as_ref()
                    .map(ClusterTls::cli_args)
                    .unwrap_or_default(),
            )
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli --cluster create");
        assert!(status.success(), "redis-cli --cluster create failed");
        cluster.wait_healthy(primaries, primaries * (1 + replicas));
        Some(cluster)
    }

    /// Wait until every live node reports `cluster_state:ok`, knows `nodes` nodes and sees
    /// exactly `primaries` primaries (every replica has been assigned in every view).
    pub fn wait_healthy(&self, primaries: usize, nodes: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ok = self.live_ports().iter().all(|&port| {
                let view = parse_nodes(&self.cli(port, &["CLUSTER", "NODES"]));
                self.cli(port, &["CLUSTER", "INFO"])
                    .contains("cluster_state:ok")
                    && view.len() == nodes
                    && view.iter().filter(|n| n.primary).count() == primaries
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis cluster not healthy within 60s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Ports of the nodes still running.
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// `redis-cli -p port args...` with this cluster's TLS settings; returns stdout.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(self.tls.as_ref(), port, args)
    }

    /// `redis://127.0.0.1:<port>/` of node `index` (`rediss://` for a TLS cluster).
    pub fn url(&self, index: usize) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.nodes[index].port)
    }

    /// The cluster's view from any live node.
    pub fn topology(&self) -> Vec<NodeInfo> {
        let port = self.live_ports()[0];
        parse_nodes(&self.cli(port, &["CLUSTER", "NODES"]))
    }

    /// `CLUSTER KEYSLOT key`.
    pub fn keyslot(&self, key: &str) -> u16 {
        let port = self.live_ports()[0];
        self.cli(port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers a number")
    }

    /// The live primary serving `slot`, as the node on `port` sees it.
    pub fn owner_seen_by(&self, port: u16, slot: u16) -> Option<NodeInfo> {
        parse_nodes(&self.cli(port, &["CLUSTER", "NODES"]))
            .into_iter()
            .find(|n| {
                n.primary && !n.failed && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
            })
    }

    /// The primary serving `slot`.
    pub fn owner(&self, slot: u16) -> NodeInfo {
        self.owner_seen_by(self.live_ports()[0], slot)
            .expect("some primary serves the slot")
    }

    /// Redirect and retry answers the node at `port` has given (`MOVED`, `ASK`,
    /// `TRYAGAIN`), from `INFO errorstats`.
    pub fn redirects(&self, port: u16) -> u64 {
        self.cli(port, &["INFO", "errorstats"])
            .lines()
            .filter(|l| {
                ["errorstat_MOVED:", "errorstat_ASK:", "errorstat_TRYAGAIN:"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .filter_map(|l| l.split("count=").nth(1)?.trim().parse::<u64>().ok())
            .sum()
    }

    /// Keys of `slot` on the node at `port`.
    pub fn count_keys(&self, port: u16, slot: u16) -> u64 {
        self.cli(port, &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
            .trim()
            .parse()
            .unwrap_or(0)
    }

    /// Move `slot` from its primary to another primary, key by key, sleeping `pause`
    /// between keys so that clients meet `ASK` and `TRYAGAIN` on the way. Returns the new
    /// owner's port.
    pub fn migrate_slot(&self, slot: u16, pause: Duration) -> u16 {
        let topology = self.topology();
        let source = self.owner(slot);
        let target = topology
            .iter()
            .find(|n| n.primary && !n.failed && !n.slots.is_empty() && n.id != source.id)
            .expect("another primary")
            .clone();
        let s = slot.to_string();
        assert_eq!(
            self.cli(
                target.port,
                &["CLUSTER", "SETSLOT", &s, "IMPORTING", &source.id]
            )
            .trim(),
            "OK"
        );
        assert_eq!(
            self.cli(
                source.port,
                &["CLUSTER", "SETSLOT", &s, "MIGRATING", &target.id]
            )
            .trim(),
            "OK"
        );
        loop {
            let keys = self.cli(source.port, &["CLUSTER", "GETKEYSINSLOT", &s, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|k| !k.trim().is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            for key in keys {
                let reply = self.cli(
                    source.port,
                    &[
                        "MIGRATE",
                        "127.0.0.1",
                        &target.port.to_string(),
                        key,
                        "0",
                        "5000",
                    ],
                );
                assert!(
                    matches!(reply.trim(), "OK" | "NOKEY"),
                    "MIGRATE {key}: {reply}"
                );
                std::thread::sleep(pause);
            }
        }
        let target_id = target.id.clone();
        for port in [target.port, source.port] {
            assert_eq!(
                self.cli(port, &["CLUSTER", "SETSLOT", &s, "NODE", &target_id])
                    .trim(),
                "OK"
            );
        }
        for node in topology.iter().filter(|n| n.primary && !n.failed) {
            self.cli(node.port, &["CLUSTER", "SETSLOT", &s, "NODE", &target_id]);
        }
        target.port
    }

    /// Promote the replica of `slot`'s primary with `CLUSTER FAILOVER` (the replica catches
    /// up first, so no write is lost) and wait until the cluster agrees. Returns the new
    /// primary's port.
    pub fn failover(&self, slot: u16) -> u16 {
        let primary = self.owner(slot);
        let replica = self
            .topology()
            .into_iter()
            .find(|n| !n.primary && n.primary_id == primary.id)
            .expect("the slot's primary has a replica");
        // A manual failover gives up silently after 5 s when the replica cannot catch up
        // (a loaded machine); ask again until it happens.
        for _ in 0..5 {
            assert_eq!(
                self.cli(replica.port, &["CLUSTER", "FAILOVER"]).trim(),
                "OK"
            );
            if self.wait_owner(slot, replica.port, Duration::from_secs(15)) {
                return replica.port;
            }
        }
        panic!("slot {slot} did not fail over to port {}", replica.port);
    }

    /// SIGKILL the primary of `slot` and wait until its replica has taken over (after
    /// `cluster-node-timeout`). Returns the new primary's port.
    pub fn kill_primary(&mut self, slot: u16) -> u16 {
        let primary = self.owner(slot);
        let replica = self
            .topology()
            .into_iter()
            .find(|n| !n.primary && n.primary_id == primary.id)
            .expect("the slot's primary has a replica");
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == primary.port)
            .expect("primary is ours");
        node.stop();
        assert!(
            self.wait_owner(slot, replica.port, Duration::from_secs(60)),
            "slot {slot} did not fail over to port {} within 60s",
            replica.port
        );
        replica.port
    }

    /// Wait until every live node sees `port` serving `slot`; `false` after `timeout`.
    fn wait_owner(&self, slot: u16, port: u16, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let agreed = self.live_ports().iter().all(|&p| {
                self.owner_seen_by(p, slot).is_some_and(|n| n.port == port)
                    && self
                        .cli(p, &["CLUSTER", "INFO"])
                        .contains("cluster_state:ok")
            });
            if agreed {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl ClusterNode {
    fn spawn(&mut self, binary: &PathBuf, tls: Option<&ClusterTls>) {
        let mut command = Command::new(binary);
        match tls {
            Some(tls) => command.args(tls.server_args(self.port)),
            None => command.args(["--port", &self.port.to_string()]),
        };
        let child = command
            .args(["--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", "2000"])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server --cluster-enabled yes");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while cli(tls, self.port, &["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "cluster node on port {} did not answer PING",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL the node.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.stop();
    }
}

fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
