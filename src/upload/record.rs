//! Owner-side ownership records: one structured log event when a session upload takes its
//! shard's ingest permit, and one when its manifest committed under the commit fence.
//!
//! Both are `info` events with the stable target [`TARGET`] and these fields (the JSON log
//! format prints them under `fields`):
//!
//! | event (`message`) | fields |
//! |---|---|
//! | `ingest begin` | `node`, `shard`, `epoch`, `session`, `begun_us` |
//! | `ingest commit` | `node`, `shard`, `epoch`, `session`, `begun_us`, `commit_sent_us`, `committed_us` |
//!
//! `session` is the 16-hex-digit [`session_hash`] (never the raw tenant or session id);
//! times are wall-clock microseconds since the Unix epoch. `begun_us` is read after the
//! permit was granted, `commit_sent_us` before the fenced manifest commit was sent, and the
//! commit event is written before the permit is released, so `[begun_us, commit_sent_us]`
//! lies inside the interval in which this node held the shard's permit at `epoch`. The
//! nemesis suite checks LOC-5 and LOC-6 (docs/locality.md §13) from these events.

use std::time::SystemTime;

use crate::ids::SessionKey;
use crate::placement::hash::session_hash;
use crate::storage::manifest::CommitFence;

/// The `tracing` target of the ownership records.
pub const TARGET: &str = "graviton::ownership";

/// Microseconds since the Unix epoch (0 for a clock before it).
pub fn unix_micros(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// The session as the records name it.
pub fn session_tag(key: &SessionKey) -> String {
    format!("{:016x}", session_hash(key))
}

/// What the records of one session upload share.
#[derive(Debug, Clone)]
pub struct OwnershipRecord {
    fence: CommitFence,
    session: String,
    begun: SystemTime,
}

impl OwnershipRecord {
    /// Write the `ingest begin` event (call right after the permit was granted).
    pub fn begin(key: &SessionKey, fence: &CommitFence) -> Self {
        let record = Self {
            fence: fence.clone(),
            session: session_tag(key),
            begun: SystemTime::now(),
        };
        tracing::info!(
            target: TARGET,
            node = %record.fence.node,
            shard = record.fence.shard.0,
            epoch = record.fence.epoch.0,
            session = %record.session,
            begun_us = unix_micros(record.begun),
            "ingest begin"
        );
        record
    }

    /// Write the `ingest commit` event (call before the permit is released).
    pub fn committed(&self, commit_sent: SystemTime) {
        tracing::info!(
            target: TARGET,
            node = %self.fence.node,
            shard = self.fence.shard.0,
            epoch = self.fence.epoch.0,
            session = %self.session,
            begun_us = unix_micros(self.begun),
            commit_sent_us = unix_micros(commit_sent),
            committed_us = unix_micros(SystemTime::now()),
            "ingest commit"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::NodeId;
    use crate::placement::model::{Epoch, ShardId};
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    // Checks LOC-5, LOC-6 (the records they are checked from): both events carry node,
    // shard, epoch and the hashed session under the stable target, and no raw id.
    #[test]
    fn records_name_the_fence_and_the_hashed_session_only() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(move || writer.clone())
            .finish();
        let key = SessionKey {
            tenant: "0190a1b2-0000-7000-8000-000000000001".parse().unwrap(),
            session: "0190a1b2-0000-7000-8000-000000000002".parse().unwrap(),
        };
        let fence = CommitFence {
            shard: ShardId(5),
            node: NodeId::parse("node-b").unwrap(),
            epoch: Epoch(9),
        };
        tracing::subscriber::with_default(subscriber, || {
            let record = OwnershipRecord::begin(&key, &fence);
            record.committed(SystemTime::now());
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("0190a1b2"), "raw id in a record: {text}");
        let events: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(events.len(), 2, "{text}");
        for (event, message) in events.iter().zip(["ingest begin", "ingest commit"]) {
            assert_eq!(event["target"], TARGET);
            assert_eq!(event["level"], "INFO");
            let fields = &event["fields"];
            assert_eq!(fields["message"], message);
            assert_eq!(fields["node"], "node-b");
            assert_eq!(fields["shard"], 5);
            assert_eq!(fields["epoch"], 9);
            assert_eq!(fields["session"], session_tag(&key));
            assert!(fields["begun_us"].as_u64().unwrap() > 0);
        }
        let commit = &events[1]["fields"];
        let (begun, sent, done) = (
            commit["begun_us"].as_u64().unwrap(),
            commit["commit_sent_us"].as_u64().unwrap(),
            commit["committed_us"].as_u64().unwrap(),
        );
        assert!(begun <= sent && sent <= done, "{commit}");
    }
}
