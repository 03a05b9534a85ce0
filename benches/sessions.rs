//! Memory of idle hot sessions: RSS growth after 100,000 sessions each ran one upload
//! (begin + finish) through the real session region and owner actors.
//!
//! Run: `cargo bench --bench sessions` (`GRAVITON_BENCH_SESSIONS` sets the count).

use std::time::{Duration, Instant};

use graviton::actors::session_region::RegionArgs;
use graviton::actors::supervisor::{SupervisorArgs, SupervisorHandle};
use graviton::ids::{SessionId, SessionKey, TenantId};
use graviton::metrics::Metrics;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let count: usize = std::env::var("GRAVITON_BENCH_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let metrics = Metrics::new();
        let supervisor = SupervisorHandle::start(SupervisorArgs {
            region_name: "bench-sessions".into(),
            region: RegionArgs {
                max_hot: count,
                idle_timeout: Duration::from_secs(3600),
                sweep_interval: Duration::from_secs(3600),
                metrics: metrics.clone(),
            },
        })
        .await
        .expect("supervisor");
        let sessions = supervisor.sessions();
        let tenant = TenantId::new_random();
        // Warm up allocator and actor machinery before the baseline.
        for _ in 0..1000 {
            let key = SessionKey { tenant, session: SessionId::new_random() };
            sessions.begin(key).await.expect("begin").finish(true);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = rss_kib();
        let started = Instant::now();
        for _ in 0..count {
            let key = SessionKey { tenant, session: SessionId::new_random() };
            sessions.begin(key).await.expect("begin").finish(true);
        }
        let elapsed = started.elapsed();
        let stats = sessions.stats().await.expect("stats");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let after = rss_kib();
        let per_session = (after.saturating_sub(before) * 1024) as f64 / count as f64;
        println!("graviton session memory benchmark: {count} idle sessions");
        println!(
            "hot sessions {} (bound {}); RSS {} MiB -> {} MiB: +{} MiB, {:.0} bytes per idle session (target: 100k < 64 MiB)",
            stats.hot_sessions,
            stats.capacity,
            before / 1024,
            after / 1024,
            after.saturating_sub(before) / 1024,
            per_session
        );
        println!("session activation (begin + finish through the region): {:.1} µs each", elapsed.as_secs_f64() * 1e6 / count as f64);
        supervisor.shutdown().await;
    });
}
