//! Owner-side ownership records (`graviton::upload::record`): every node writes an
//! `ingest begin` event when a session upload took its shard's ingest permit and an
//! `ingest commit` event when the manifest committed under the commit fence, with node,
//! shard, epoch, the hashed session and wall-clock microseconds. The suite reads them from
//! the nodes' JSON logs and checks LOC-5 and LOC-6 (docs/locality.md §13) from them; the
//! checks are pure and unit-tested on violating histories below.
//!
//! Why the checks are sound on a correct cluster: `begun` is read after the permit was
//! granted and `commit_sent` before the fenced commit was sent, so `[begun, commit_sent]`
//! lies inside the node's permit interval at `epoch`. A node is granted a permit at epoch
//! `e'` only after it read a table in which PostgreSQL had already moved the shard to it
//! at `e'`; a commit at an older epoch `e < e'` succeeds only while the row still says
//! `(node, e)` (same transaction, `FOR SHARE`); epochs only grow. So a commit at `e` sent
//! after another node began at `e' > e` cannot have been fenced correctly. All processes
//! run on one machine, so their wall clocks agree.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use super::history::{Attempt, CommitWindows, Violation};

/// One `ingest begin` or `ingest commit` event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerRecord {
    pub node: String,
    pub shard: u32,
    pub epoch: i64,
    /// `upload::record::session_tag` of the session.
    pub session: String,
    /// Permit granted (µs since the Unix epoch).
    pub begun: u64,
    /// `Some((commit_sent, committed))` for an `ingest commit` event.
    pub commit: Option<(u64, u64)>,
}

/// Parse the ownership records out of a node's JSON log (other lines are skipped).
pub fn parse_log(text: &str) -> Vec<OwnerRecord> {
    text.lines()
        .filter(|l| l.contains(graviton::upload::record::TARGET))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == graviton::upload::record::TARGET)
        .filter_map(|v| {
            let f = &v["fields"];
            let commit = match f["message"].as_str()? {
                "ingest begin" => None,
                "ingest commit" => {
                    Some((f["commit_sent_us"].as_u64()?, f["committed_us"].as_u64()?))
                }
                _ => return None,
            };
            Some(OwnerRecord {
                node: f["node"].as_str()?.to_string(),
                shard: f["shard"].as_u64()? as u32,
                epoch: f["epoch"].as_i64()?,
                session: f["session"].as_str()?.to_string(),
                begun: f["begun_us"].as_u64()?,
                commit,
            })
        })
        .collect()
}

/// The records of every log file in `logs`.
pub fn read_logs(logs: &[&Path]) -> Vec<OwnerRecord> {
    logs.iter()
        .flat_map(|p| parse_log(&std::fs::read_to_string(p).unwrap_or_default()))
        .collect()
}

fn describe(r: &OwnerRecord, t0_us: u64) -> String {
    let s = |us: u64| format!("{:.3}s", (us as i64 - t0_us as i64) as f64 / 1e6);
    match r.commit {
        Some((sent, done)) => format!(
            "{} committed shard {} epoch {} [begun {} .. sent {} .. done {}]",
            r.node,
            r.shard,
            r.epoch,
            s(r.begun),
            s(sent),
            s(done)
        ),
        None => format!(
            "{} began shard {} epoch {} at {}",
            r.node,
            r.shard,
            r.epoch,
            s(r.begun)
        ),
    }
}

/// LOC-5: no two nodes committed the same session in overlapping ownership intervals
/// (`[begun, commit_sent]` of two commits by different nodes intersect).
pub fn overlapping_commits(records: &[OwnerRecord], t0_us: u64) -> Vec<Violation> {
    let mut by_session: HashMap<&str, Vec<&OwnerRecord>> = HashMap::new();
    for r in records.iter().filter(|r| r.commit.is_some()) {
        by_session.entry(&r.session).or_default().push(r);
    }
    let mut sessions: Vec<_> = by_session.into_iter().collect();
    sessions.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = Vec::new();
    for (session, mut commits) in sessions {
        commits.sort_by_key(|r| r.begun);
        for (i, a) in commits.iter().enumerate() {
            let a_sent = a.commit.unwrap().0;
            for b in &commits[i + 1..] {
                if b.begun > a_sent {
                    break;
                }
                if a.node != b.node {
                    out.push(Violation::new(
                        "LOC-5",
                        format!(
                            "overlapping commits: session {session}: {} overlaps {}",
                            describe(a, t0_us),
                            describe(b, t0_us)
                        ),
                    ));
                }
            }
        }
    }
    out
}

/// LOC-6: per shard, an epoch belongs to one node, and no commit at an epoch is sent
/// after another node began at a later epoch.
pub fn epoch_order(records: &[OwnerRecord], t0_us: u64) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut holder: HashMap<(u32, i64), &OwnerRecord> = HashMap::new();
    for r in records {
        match holder.get(&(r.shard, r.epoch)) {
            Some(first) if first.node != r.node => out.push(Violation::new(
                "LOC-6",
                format!(
                    "shared epoch: shard {} epoch {} held by {} and {}: {} / {}",
                    r.shard,
                    r.epoch,
                    first.node,
                    r.node,
                    describe(first, t0_us),
                    describe(r, t0_us)
                ),
            )),
            Some(_) => {}
            None => {
                holder.insert((r.shard, r.epoch), r);
            }
        }
    }
    // The earliest begin of every (shard, node, epoch).
    let mut first_begin: HashMap<(u32, &str, i64), u64> = HashMap::new();
    for r in records {
        let e = first_begin
            .entry((r.shard, r.node.as_str(), r.epoch))
            .or_insert(r.begun);
        *e = (*e).min(r.begun);
    }
    for c in records.iter().filter(|r| r.commit.is_some()) {
        let sent = c.commit.unwrap().0;
        let later = first_begin
            .iter()
            .filter(|((shard, node, epoch), begun)| {
                *shard == c.shard && *node != c.node && *epoch > c.epoch && **begun < sent
            })
            .min_by_key(|(_, begun)| **begun);
        if let Some(((_, node, epoch), begun)) = later {
            out.push(Violation::new(
                "LOC-6",
                format!(
                    "commit after move: {} sent its commit after {node} began at epoch {epoch} at {:.3}s",
                    describe(c, t0_us),
                    (*begun as i64 - t0_us as i64) as f64 / 1e6
                ),
            ));
        }
    }
    out
}

/// LOC-5 (the records are complete): every 201 answered as owner by node X for a session
/// has an `ingest commit` record by X for that session (counted per node and session).
pub fn unrecorded_acks(attempts: &[Attempt], records: &[OwnerRecord]) -> Vec<Violation> {
    let mut commits: HashMap<(&str, &str), usize> = HashMap::new();
    for r in records.iter().filter(|r| r.commit.is_some()) {
        *commits.entry((&r.node, &r.session)).or_default() += 1;
    }
    let mut acks: HashMap<(&str, &str), usize> = HashMap::new();
    for a in attempts {
        if let Some((_, owner)) = a.created() {
            *acks.entry((owner, &a.tag)).or_default() += 1;
        }
    }
    let mut out: Vec<Violation> = acks
        .into_iter()
        .filter_map(|((node, tag), n)| {
            let recorded = commits.get(&(node, tag)).copied().unwrap_or(0);
            (recorded < n).then(|| {
                Violation::new(
                    "LOC-5",
                    format!(
                        "unrecorded ack: {n} 201s answered as owner by {node} for session {tag}, \
                         {recorded} commit records"
                    ),
                )
            })
        })
        .collect();
    out.sort_by(|a, b| a.detail.cmp(&b.detail));
    out
}

/// Every commit's window `[begun, committed]` in run time, by `(node, session tag)`, for
/// the double-ownership check of the client history (LOC-1).
pub fn commit_windows(records: &[OwnerRecord], t0_us: u64) -> CommitWindows {
    let run_time = |us: u64| Duration::from_micros(us.saturating_sub(t0_us));
    let mut out = CommitWindows::new();
    for r in records {
        if let Some((_, committed)) = r.commit {
            out.entry((r.node.clone(), r.session.clone()))
                .or_default()
                .push((run_time(r.begun), run_time(committed)));
        }
    }
    out
}

/// Every check on the owner-side records.
pub fn check(attempts: &[Attempt], records: &[OwnerRecord], t0_us: u64) -> Vec<Violation> {
    let mut out = overlapping_commits(records, t0_us);
    out.extend(epoch_order(records, t0_us));
    out.extend(unrecorded_acks(attempts, records));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nemesis_util::history::Outcome;
    use std::time::Duration;

    fn begin(node: &str, shard: u32, epoch: i64, session: &str, at: u64) -> OwnerRecord {
        OwnerRecord {
            node: node.into(),
            shard,
            epoch,
            session: session.into(),
            begun: at,
            commit: None,
        }
    }

    fn commit(
        node: &str,
        shard: u32,
        epoch: i64,
        session: &str,
        at: u64,
        sent: u64,
    ) -> OwnerRecord {
        OwnerRecord {
            commit: Some((sent, sent + 5)),
            ..begin(node, shard, epoch, session, at)
        }
    }

    fn ack(owner: &str, tag: &str) -> Attempt {
        Attempt {
            op: 0,
            session: format!("t/{tag}"),
            tag: tag.into(),
            shard: 1,
            node: "node-c".into(),
            start: Duration::ZERO,
            end: Duration::from_millis(1),
            content_seed: 0,
            len: 1,
            outcome: Outcome::Created {
                key: "k".into(),
                owner: owner.into(),
            },
        }
    }

    #[test]
    fn commit_windows_are_in_run_time_and_skip_begins() {
        let t0 = 1_000_000;
        let records = vec![
            begin("node-a", 1, 2, "s", t0 + 10),
            commit("node-a", 1, 2, "s", t0 + 2_000, t0 + 3_000),
            commit("node-b", 1, 3, "s", t0 + 9_000, t0 + 9_500),
        ];
        let windows = commit_windows(&records, t0);
        let us = Duration::from_micros;
        assert_eq!(
            windows[&("node-a".to_string(), "s".to_string())],
            vec![(us(2_000), us(3_005))]
        );
        assert_eq!(
            windows[&("node-b".to_string(), "s".to_string())],
            vec![(us(9_000), us(9_505))]
        );
        assert_eq!(windows.len(), 2);
    }

    #[test]
    fn the_json_log_lines_of_both_events_parse() {
        let log = concat!(
            r#"{"timestamp":"x","level":"INFO","fields":{"message":"ingest begin","node":"node-a","shard":3,"epoch":7,"session":"00aa","begun_us":100},"target":"graviton::ownership"}"#,
            "\n",
            r#"{"timestamp":"x","level":"INFO","fields":{"message":"listening"},"target":"graviton::node"}"#,
            "\n",
            r#"{"timestamp":"x","level":"INFO","fields":{"message":"ingest commit","node":"node-a","shard":3,"epoch":7,"session":"00aa","begun_us":100,"commit_sent_us":150,"committed_us":160},"target":"graviton::ownership"}"#,
            "\nnot json graviton::ownership\n",
        );
        assert_eq!(
            parse_log(log),
            vec![
                begin("node-a", 3, 7, "00aa", 100),
                OwnerRecord {
                    commit: Some((150, 160)),
                    ..begin("node-a", 3, 7, "00aa", 100)
                }
            ]
        );
    }

    // Checks LOC-5: two nodes committed one session in overlapping ownership intervals.
    #[test]
    fn overlapping_commits_of_one_session_by_two_nodes_are_found() {
        let records = vec![
            commit("node-a", 3, 7, "s1", 100, 400),
            commit("node-b", 3, 8, "s1", 300, 500),
        ];
        let found = overlapping_commits(&records, 0);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].detail.contains("node-a") && found[0].detail.contains("node-b"));
        // A long commit interval overlapping one after a short one is found too.
        let records = vec![
            commit("node-a", 3, 7, "s1", 0, 1000),
            commit("node-a", 3, 7, "s1", 10, 20),
            commit("node-b", 3, 8, "s1", 500, 600),
        ];
        assert_eq!(overlapping_commits(&records, 0).len(), 1);
    }

    #[test]
    fn sequential_or_same_node_commits_do_not_overlap() {
        let records = vec![
            // A handoff: a's commit was sent before b began.
            commit("node-a", 3, 7, "s1", 100, 200),
            commit("node-b", 3, 8, "s1", 250, 300),
            // One node, two overlapping uploads of one session (a retry).
            commit("node-b", 6, 8, "s2", 100, 400),
            commit("node-b", 6, 8, "s2", 150, 450),
            // Different sessions.
            commit("node-a", 4, 1, "s3", 100, 400),
            commit("node-b", 5, 1, "s4", 100, 400),
            // A begin without a commit is not a commit.
            begin("node-c", 3, 9, "s1", 460),
        ];
        assert!(overlapping_commits(&records, 0).is_empty());
        assert!(epoch_order(&records, 0).is_empty());
    }

    // Checks LOC-6: one epoch of a shard held by two nodes.
    #[test]
    fn two_nodes_at_one_epoch_are_found() {
        let records = vec![
            begin("node-a", 3, 7, "s1", 100),
            begin("node-b", 3, 7, "s2", 5000),
        ];
        let found = epoch_order(&records, 0);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].detail.starts_with("shared epoch"), "{}", found[0]);
    }

    // Checks LOC-6: the issue 9 item 2 history (an owner paused inside the commit window
    // commits after its shard moved), here on another session of the shard.
    #[test]
    fn a_commit_sent_after_another_node_began_at_a_later_epoch_is_found() {
        let records = vec![
            begin("node-b", 3, 8, "s2", 300),
            commit("node-a", 3, 7, "s1", 100, 400),
        ];
        let found = epoch_order(&records, 0);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].detail.starts_with("commit after move"),
            "{}",
            found[0]
        );
        // Sent before the later epoch began: a legitimate move.
        let records = vec![
            commit("node-a", 3, 7, "s1", 100, 250),
            begin("node-b", 3, 8, "s2", 300),
        ];
        assert!(epoch_order(&records, 0).is_empty());
        // Moved back to a at a later epoch: a's new commits are fine.
        let records = vec![
            commit("node-a", 3, 7, "s1", 100, 250),
            begin("node-b", 3, 8, "s2", 300),
            commit("node-a", 3, 9, "s1", 600, 700),
        ];
        assert!(epoch_order(&records, 0).is_empty());
    }

    // Checks LOC-5 (the records are complete).
    #[test]
    fn a_201_without_its_commit_record_is_found() {
        let records = vec![commit("node-a", 1, 1, "s1", 0, 1)];
        let acks = vec![
            ack("node-a", "s1"),
            ack("node-a", "s1"),
            ack("node-b", "s2"),
        ];
        let found = unrecorded_acks(&acks, &records);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(unrecorded_acks(&acks[..1], &records).is_empty());
        assert_eq!(check(&acks[..1], &records, 0), vec![]);
    }
}
