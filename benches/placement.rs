//! Local owner resolution cost, against the session-shard hash alone as baseline.
//!
//! Run: `cargo bench --bench placement`

use std::time::Instant;

use graviton::actors::Cluster;
use graviton::ids::{NodeId, SessionId, SessionKey, TenantId};
use graviton::placement::hash::shard_of;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = runtime.enter();
    let cluster = Cluster::single_node(NodeId::parse("bench").unwrap(), 1024);
    let keys: Vec<SessionKey> = (0..4096)
        .map(|_| SessionKey {
            tenant: TenantId::new_random(),
            session: SessionId::new_random(),
        })
        .collect();
    let rounds = 2_000_000usize;

    let started = Instant::now();
    let mut acc = 0u64;
    for i in 0..rounds {
        acc = acc.wrapping_add(u64::from(shard_of(&keys[i % keys.len()], 1024).0));
    }
    let hash_ns = started.elapsed().as_nanos() as f64 / rounds as f64;
    std::hint::black_box(acc);

    let started = Instant::now();
    let mut local = 0usize;
    for i in 0..rounds {
        if cluster
            .resolve(&keys[i % keys.len()])
            .map(|o| o.is_local)
            .unwrap_or(false)
        {
            local += 1;
        }
    }
    let resolve_ns = started.elapsed().as_nanos() as f64 / rounds as f64;
    assert_eq!(local, rounds);
    println!("session-shard hash alone (baseline)     {hash_ns:>8.1} ns/op");
    println!(
        "local owner resolution (hash + table)   {resolve_ns:>8.1} ns/op   ratio vs hash: {:.2}   target < 1000 ns",
        resolve_ns / hash_ns
    );
}
