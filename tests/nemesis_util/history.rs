//! The nemesis history and its checker: pure code, no I/O.
//!
//! A run records every upload attempt ([`Attempt`]: node asked, session, shard, start and end
//! relative to the run's start, outcome with the `owner` of a 201) and, from the test's own
//! PostgreSQL connection, periodic snapshots of `placement_shards` ([`ShardSample`], with the
//! instants the query was sent and answered). [`check`] turns that into violations of the
//! invariants of docs/locality.md §13 (ids of docs/invariants.md):
//!
//! - **LOC-1 (double ownership)**: two 201s for the same session whose request intervals
//!   overlap, answered as owner by two different nodes, unless the commit windows inside
//!   those requests show one commit ended before the other began. The windows come from
//!   what the stores and the clients observed ([`store_windows`]: the manifest row's
//!   transaction start, the test's own transaction snapshots, the 201's arrival), not from
//!   the product's own log. A 201 can leave its node
//!   seconds after the commit (a node paused between its commit and its answer, or a
//!   request that waited at a paused node while the shard moved on under the handoff
//!   protocol), so overlapping requests alone do not prove two owners at once; overlapping
//!   commit windows, or a 201 without a commit window inside its request, do.
//! - **LOC-1 (stale owner)**: a 201 answered as owner by node X while PostgreSQL had the
//!   session's shard on another node Y at one epoch for the whole request: the last shard
//!   sample answered before the request started and the first sample sent after it ended
//!   both show `(Y, e)`. Epochs grow on every move, so the shard did not visit X in between.
//! - **LOC-4**: a 5xx that is not a documented retryable answer (503 with `Retry-After`, or
//!   502 `owner_unavailable` with `Retry-After`: the owner failed mid-stream).
//!
//! LOC-2 (acknowledged blobs readable byte-exact from every node) and LOC-3 (the cluster
//! regains an acting manager) are checked against the live cluster after the run; their
//! failures are recorded here with [`Violation::new`] so one report lists everything.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

/// How one HTTP attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// 201: the blob key and the node that ingested (`owner` of the JSON body).
    Created { key: String, owner: String },
    /// Any other HTTP status, with the JSON `error` code and whether `Retry-After` was set.
    Status {
        code: u16,
        error: Option<String>,
        retry_after: bool,
    },
    /// No HTTP answer (connection refused or reset, timeout).
    Transport(String),
}

/// One upload attempt.
#[derive(Clone, Debug)]
pub struct Attempt {
    /// Logical operation (retries of one upload share it).
    pub op: u64,
    /// `tenant/session`.
    pub session: String,
    /// The session as the owner-side records name it (`upload::record::session_tag`).
    pub tag: String,
    pub shard: u32,
    /// Node the request was sent to.
    pub node: String,
    pub start: Duration,
    pub end: Duration,
    /// The body is `random_bytes(len, content_seed)`.
    pub content_seed: u64,
    pub len: usize,
    pub outcome: Outcome,
}

impl Attempt {
    pub fn created(&self) -> Option<(&str, &str)> {
        match &self.outcome {
            Outcome::Created { key, owner } => Some((key, owner)),
            _ => None,
        }
    }

    /// A documented retryable answer: the client tries again (maybe on another node).
    pub fn retryable(&self) -> bool {
        match &self.outcome {
            Outcome::Created { .. } => false,
            Outcome::Transport(_) => true,
            Outcome::Status {
                code, retry_after, ..
            } => documented_retryable(*code, self.error(), *retry_after) || *code == 409,
        }
    }

    pub fn error(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Status { error, .. } => error.as_deref(),
            _ => None,
        }
    }
}

/// 503 with `Retry-After`, or 502 `owner_unavailable` with `Retry-After`.
pub fn documented_retryable(code: u16, error: Option<&str>, retry_after: bool) -> bool {
    retry_after && (code == 503 || (code == 502 && error == Some("owner_unavailable")))
}

/// One row of `placement_shards` as the test read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardRow {
    pub owner: Option<String>,
    pub epoch: i64,
    pub moving_to: Option<String>,
}

/// A snapshot of the shard table: the query was sent at `sent` and answered at `received`,
/// so the snapshot's instant lies in between.
#[derive(Clone, Debug)]
pub struct ShardSample {
    pub sent: Duration,
    pub received: Duration,
    pub shards: HashMap<u32, ShardRow>,
}

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub invariant: &'static str,
    pub detail: String,
}

impl Violation {
    pub fn new(invariant: &'static str, detail: impl Into<String>) -> Self {
        Self {
            invariant,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.invariant, self.detail)
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

fn describe(a: &Attempt) -> String {
    let what = match &a.outcome {
        Outcome::Created { owner, .. } => format!("201 owner={owner}"),
        Outcome::Status { code, error, .. } => {
            format!("{code} {}", error.as_deref().unwrap_or("-"))
        }
        Outcome::Transport(e) => format!("transport error {e}"),
    };
    format!(
        "op {} sent to {} [{} .. {}] {what}",
        a.op,
        a.node,
        ms(a.start),
        ms(a.end)
    )
}

/// The owner-side commit windows `[begun, committed]` of every `(node, session tag)`, in
/// run time ([`store_windows`]; the nodes' own records give the same shape, `records::commit_windows`).
pub type CommitWindows = HashMap<(String, String), Vec<(Duration, Duration)>>;

/// How far apart the nodes' wall clock and the test's run clock may be when a commit
/// window is matched to a request (same machine; both read once per event).
const CLOCK_SLACK: Duration = Duration::from_millis(20);

/// The commit windows of `a`'s owner for `a`'s session that lie inside `a`'s request.
fn windows_inside<'w>(a: &Attempt, windows: &'w CommitWindows) -> Vec<&'w (Duration, Duration)> {
    let Some((_, owner)) = a.created() else {
        return Vec::new();
    };
    windows
        .get(&(owner.to_string(), a.tag.clone()))
        .map(|all| {
            all.iter()
                .filter(|(begun, committed)| {
                    *begun + CLOCK_SLACK >= a.start && *committed <= a.end + CLOCK_SLACK
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the owners' commit windows show `a`'s and `b`'s commits one after the other.
fn commits_sequential(a: &Attempt, b: &Attempt, windows: &CommitWindows) -> bool {
    let (wa, wb) = (windows_inside(a, windows), windows_inside(b, windows));
    wa.iter().any(|(a_begun, a_done)| {
        wb.iter()
            .any(|(b_begun, b_done)| a_done < b_begun || b_done < a_begun)
    })
}

/// LOC-1: two overlapping 201s for one session from two different owners whose commit
/// windows do not show one commit after the other (see the module docs).
pub fn double_ownership(attempts: &[Attempt], windows: &CommitWindows) -> Vec<Violation> {
    let mut by_session: HashMap<&str, Vec<&Attempt>> = HashMap::new();
    for a in attempts.iter().filter(|a| a.created().is_some()) {
        by_session.entry(&a.session).or_default().push(a);
    }
    let mut out = Vec::new();
    let mut sessions: Vec<_> = by_session.into_iter().collect();
    sessions.sort_by(|a, b| a.0.cmp(b.0));
    for (session, mut acks) in sessions {
        acks.sort_by_key(|a| a.start);
        for (i, a) in acks.iter().enumerate() {
            for b in &acks[i + 1..] {
                if b.start >= a.end {
                    break;
                }
                let (oa, ob) = (a.created().unwrap().1, b.created().unwrap().1);
                if oa != ob && !commits_sequential(a, b, windows) {
                    out.push(Violation::new(
                        "LOC-1",
                        format!(
                            "double ownership: session {session}: {} overlaps {}",
                            describe(a),
                            describe(b)
                        ),
                    ));
                }
            }
        }
    }
    out
}

/// LOC-1: a 201 from a node that PostgreSQL did not have as the shard's owner during the
/// whole request (bracketing samples agree on another owner at one epoch).
pub fn stale_owner(attempts: &[Attempt], samples: &[ShardSample]) -> Vec<Violation> {
    let mut out = Vec::new();
    for a in attempts {
        let Some((_, owner)) = a.created() else {
            continue;
        };
        let before = samples
            .iter()
            .filter(|s| s.received <= a.start)
            .max_by_key(|s| s.received);
        let after = samples
            .iter()
            .filter(|s| s.sent >= a.end)
            .min_by_key(|s| s.sent);
        let (Some(before), Some(after)) = (before, after) else {
            continue;
        };
        let (Some(rb), Some(ra)) = (before.shards.get(&a.shard), after.shards.get(&a.shard)) else {
            continue;
        };
        if rb.epoch == ra.epoch
            && rb.owner == ra.owner
            && rb.owner.as_deref() != Some(owner)
            && rb.moving_to.as_deref() != Some(owner)
        {
            out.push(Violation::new(
                "LOC-1",
                format!(
                    "stale owner: {} for session {} (shard {}) while PostgreSQL had it on {} at epoch {} from {} to {}",
                    describe(a),
                    a.session,
                    a.shard,
                    rb.owner.as_deref().unwrap_or("nobody"),
                    rb.epoch,
                    ms(before.received),
                    ms(after.sent)
                ),
            ));
        }
    }
    out
}

/// LOC-4: 5xx answers that are not documented retryable ones.
pub fn unexpected_5xx(attempts: &[Attempt]) -> Vec<Violation> {
    attempts
        .iter()
        .filter_map(|a| match &a.outcome {
            Outcome::Status {
                code,
                error,
                retry_after,
            } if *code >= 500 && !documented_retryable(*code, error.as_deref(), *retry_after) => {
                Some(Violation::new(
                    "LOC-4",
                    format!(
                        "undocumented 5xx: {} (Retry-After {})",
                        describe(a),
                        if *retry_after { "set" } else { "missing" }
                    ),
                ))
            }
            _ => None,
        })
        .collect()
}

/// A transaction snapshot of the test's own connection (`pg_current_snapshot()`), sent
/// at `sent` and answered at `received`: which transactions had completed by then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxSnapshot {
    pub sent: Duration,
    pub received: Duration,
    pub xmin: u64,
    pub xmax: u64,
    pub xip: Vec<u64>,
}

impl TxSnapshot {
    /// Parse `xmin:xmax:xip,xip,…` (the text form of `pg_current_snapshot()`).
    pub fn parse(text: &str, sent: Duration, received: Duration) -> Option<Self> {
        let mut parts = text.trim().split(':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        Some(Self {
            sent,
            received,
            xmin,
            xmax,
            xip,
        })
    }

    /// Whether transaction `xid` (a row's 32-bit `xmin`, placed in this snapshot's epoch)
    /// had completed when this snapshot was taken.
    pub fn completed(&self, xid: u32) -> bool {
        let mut full = (self.xmax & !0xffff_ffff) | u64::from(xid);
        if full > self.xmax {
            full = full.saturating_sub(1 << 32);
        }
        full < self.xmin || (full < self.xmax && !self.xip.contains(&full))
    }
}

/// One acknowledged manifest as the store holds it: its row's writing transaction `xid`
/// and that transaction's start (`created_at`, the database clock, in run time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManifestRow {
    pub begun: Duration,
    pub xid: u32,
}

/// The commit windows of LOC-1's overlap check, from what the clients and the stores
/// observed (not from the product's own log): for every 201, the window of the manifest
/// row of its key, from its transaction's start (`created_at`) to the first snapshot of
/// the test's own connection that shows the transaction completed (answered at
/// `received`), and no later than the 201's arrival (the commit preceded the answer). A
/// key without a row, or whose row's transaction began before the request (an earlier
/// attempt wrote it), gets no window inside the request, so it cannot excuse an overlap.
pub fn store_windows(
    attempts: &[Attempt],
    rows: &HashMap<String, ManifestRow>,
    snapshots: &[TxSnapshot],
) -> CommitWindows {
    let mut out = CommitWindows::new();
    for a in attempts {
        let Some((key, owner)) = a.created() else {
            continue;
        };
        let Some(row) = rows.get(key) else {
            continue;
        };
        let seen = snapshots
            .iter()
            .filter(|s| s.sent >= row.begun && s.completed(row.xid))
            .map(|s| s.received)
            .min();
        let committed = seen.map_or(a.end, |at| at.min(a.end));
        out.entry((owner.to_string(), a.tag.clone()))
            .or_default()
            .push((row.begun, committed));
    }
    out
}

/// Every check on the client's history (double ownership also reads the commit
/// windows, [`store_windows`]).
pub fn check(
    attempts: &[Attempt],
    samples: &[ShardSample],
    windows: &CommitWindows,
) -> Vec<Violation> {
    let mut out = double_ownership(attempts, windows);
    out.extend(stale_owner(attempts, samples));
    out.extend(unexpected_5xx(attempts));
    out
}

/// Acknowledged blobs, one per key: `(key, len, content_seed)`.
pub fn acknowledged(attempts: &[Attempt]) -> Vec<(String, usize, u64)> {
    let mut seen = HashMap::new();
    for a in attempts {
        if let Some((key, _)) = a.created() {
            seen.entry(key.to_string())
                .or_insert((a.len, a.content_seed));
        }
    }
    let mut out: Vec<_> = seen.into_iter().map(|(k, (l, s))| (k, l, s)).collect();
    out.sort();
    out
}

/// Counts by outcome class, for the printed summary.
pub fn summary(attempts: &[Attempt]) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for a in attempts {
        let class = match &a.outcome {
            Outcome::Created { .. } => "201".to_string(),
            Outcome::Status { code, error, .. } => {
                format!("{code} {}", error.as_deref().unwrap_or("-"))
            }
            Outcome::Transport(_) => "transport".to_string(),
        };
        *counts.entry(class).or_default() += 1;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort();
    counts
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The attempts of one session, for printing the history around a violation.
pub fn session_history(attempts: &[Attempt], session: &str) -> Vec<String> {
    let mut mine: Vec<&Attempt> = attempts.iter().filter(|a| a.session == session).collect();
    mine.sort_by_key(|a| a.start);
    mine.into_iter().map(describe).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    // Checks LOC-1: the windows that excuse overlapping 201s come from the stores (the
    // manifest rows' transactions and the test's own snapshots) and the clients, and
    // excuse only commits the snapshots show one after the other.
    #[test]
    fn store_windows_excuse_only_commits_the_snapshots_order() {
        let a = attempt("t/s", "node-a", 5000, 5400, created("node-b", "k1"));
        let b = attempt("t/s", "node-c", 5100, 5500, created("node-c", "k2"));
        let rows = HashMap::from([
            (
                "k1".to_string(),
                ManifestRow {
                    begun: at(5130),
                    xid: 100,
                },
            ),
            (
                "k2".to_string(),
                ManifestRow {
                    begun: at(5300),
                    xid: 101,
                },
            ),
        ]);
        let snap = |sent: u64, xmin: u64, xmax: u64, xip: &[u64]| TxSnapshot {
            sent: at(sent),
            received: at(sent + 2),
            xmin,
            xmax,
            xip: xip.to_vec(),
        };
        let attempts = vec![a.clone(), b.clone()];
        // k1's transaction completed by 5200, before k2's began at 5300: sequential.
        let ordered = vec![snap(5150, 100, 101, &[100]), snap(5200, 101, 102, &[101])];
        let windows = store_windows(&attempts, &rows, &ordered);
        assert!(double_ownership(&attempts, &windows).is_empty());
        // Still in progress at 5350, after k2 began: the commits may overlap.
        let late = vec![snap(5350, 100, 102, &[100, 101]), snap(5450, 102, 102, &[])];
        let windows = store_windows(&attempts, &rows, &late);
        assert_eq!(double_ownership(&attempts, &windows).len(), 1);
        // No snapshot at all: the window ends at the 201 (5400), after k2 began.
        let windows = store_windows(&attempts, &rows, &[]);
        assert_eq!(double_ownership(&attempts, &windows).len(), 1);
        // A row written before the request (an earlier attempt): no window inside it.
        let early = HashMap::from([
            (
                "k1".to_string(),
                ManifestRow {
                    begun: at(4000),
                    xid: 100,
                },
            ),
            (
                "k2".to_string(),
                ManifestRow {
                    begun: at(5300),
                    xid: 101,
                },
            ),
        ]);
        let windows = store_windows(&attempts, &early, &ordered);
        assert_eq!(double_ownership(&attempts, &windows).len(), 1);
    }

    #[test]
    fn snapshots_parse_and_tell_completed_transactions() {
        let s = TxSnapshot::parse("100:105:101,103", at(0), at(1)).unwrap();
        assert!(s.completed(99) && s.completed(100) && s.completed(102) && s.completed(104));
        assert!(!s.completed(101) && !s.completed(103) && !s.completed(105));
        let empty = TxSnapshot::parse("7:7:", at(0), at(1)).unwrap();
        assert!(empty.completed(6) && !empty.completed(7));
        // A 32-bit xid placed in the snapshot's epoch.
        let epoch = (3u64 << 32) | 10;
        let s = TxSnapshot::parse(&format!("{epoch}:{}:", epoch + 5), at(0), at(1)).unwrap();
        assert!(s.completed(12) && !s.completed(15));
    }

    fn attempt(session: &str, node: &str, start: u64, end: u64, outcome: Outcome) -> Attempt {
        Attempt {
            op: start,
            session: session.to_string(),
            tag: session.to_string(),
            shard: 7,
            node: node.to_string(),
            start: at(start),
            end: at(end),
            content_seed: start,
            len: 10,
            outcome,
        }
    }

    fn created(owner: &str, key: &str) -> Outcome {
        Outcome::Created {
            key: key.to_string(),
            owner: owner.to_string(),
        }
    }

    fn status(code: u16, error: &str, retry_after: bool) -> Outcome {
        Outcome::Status {
            code,
            error: Some(error.to_string()),
            retry_after,
        }
    }

    fn sample(sent: u64, received: u64, owner: &str, epoch: i64) -> ShardSample {
        let mut shards = HashMap::new();
        shards.insert(
            7,
            ShardRow {
                owner: Some(owner.to_string()),
                epoch,
                moving_to: None,
            },
        );
        ShardSample {
            sent: at(sent),
            received: at(received),
            shards,
        }
    }

    // Checks LOC-1: the checker flags the history of issue 9 item 1.
    #[test]
    fn overlapping_acks_from_two_owners_are_double_ownership() {
        let history = vec![
            attempt("t/s", "node-a", 100, 400, created("node-a", "k1")),
            attempt("t/s", "node-b", 150, 500, created("node-b", "k2")),
        ];
        let found = double_ownership(&history, &CommitWindows::new());
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].invariant, "LOC-1");
        assert!(found[0].detail.contains("node-a") && found[0].detail.contains("node-b"));
    }

    #[test]
    fn sequential_acks_or_one_owner_are_not_double_ownership() {
        let history = vec![
            // A legitimate move: a's ack ends before b's starts.
            attempt("t/s", "node-a", 100, 200, created("node-a", "k1")),
            attempt("t/s", "node-c", 250, 300, created("node-b", "k2")),
            // Same owner twice (forwarded from another node), overlapping.
            attempt("t/u", "node-a", 100, 400, created("node-b", "k3")),
            attempt("t/u", "node-b", 150, 500, created("node-b", "k4")),
            // Different sessions overlapping on different owners.
            attempt("t/v", "node-a", 100, 400, created("node-a", "k5")),
            attempt("t/w", "node-b", 100, 400, created("node-b", "k6")),
            // An overlapping refusal is not an ack.
            attempt("t/s", "node-a", 260, 280, status(503, "shard_moved", true)),
        ];
        assert!(double_ownership(&history, &CommitWindows::new()).is_empty());
    }

    #[test]
    fn a_later_overlap_after_a_long_ack_is_found() {
        // The long ack [0, 1000] overlaps an ack that starts after a short one ends.
        let history = vec![
            attempt("t/s", "node-a", 0, 1000, created("node-a", "k1")),
            attempt("t/s", "node-a", 10, 20, created("node-a", "k2")),
            attempt("t/s", "node-b", 500, 600, created("node-b", "k3")),
        ];
        assert_eq!(double_ownership(&history, &CommitWindows::new()).len(), 1);
    }

    fn windows(list: &[(&str, &str, u64, u64)]) -> CommitWindows {
        let mut out = CommitWindows::new();
        for (node, tag, begun, committed) in list {
            out.entry((node.to_string(), tag.to_string()))
                .or_default()
                .push((at(*begun), at(*committed)));
        }
        out
    }

    // Checks LOC-1: overlapping requests are explained only by commits one after the other
    // inside them (the request times are those of the report seen under load, with
    // node-b paused by SIGSTOP from 1.983 s to 5.118 s); overlapping commits, or commit
    // windows outside the requests, are still double ownership.
    #[test]
    fn overlapping_acks_are_explained_only_by_sequential_commits_inside_them() {
        let history = vec![
            attempt("t/s", "node-b", 2114, 5335, created("node-b", "k1")),
            attempt("t/s", "node-c", 2333, 5420, created("node-c", "k2")),
        ];
        let sequential = windows(&[("node-b", "t/s", 5130, 5250), ("node-c", "t/s", 5300, 5400)]);
        assert!(double_ownership(&history, &sequential).is_empty());

        let overlapping = windows(&[("node-b", "t/s", 5130, 5320), ("node-c", "t/s", 5300, 5400)]);
        assert_eq!(double_ownership(&history, &overlapping).len(), 1);

        // c's only window lies before its request: it is another upload's commit, so
        // nothing explains c's 201.
        let outside = windows(&[("node-b", "t/s", 5130, 5250), ("node-c", "t/s", 1000, 1100)]);
        assert_eq!(double_ownership(&history, &outside).len(), 1);

        // Windows of another node or session explain nothing.
        let unrelated = windows(&[("node-a", "t/s", 5130, 5250), ("node-c", "t/u", 5300, 5400)]);
        assert_eq!(double_ownership(&history, &unrelated).len(), 1);
    }

    // Checks LOC-1: a 201 from a node PostgreSQL did not list as owner.
    #[test]
    fn ack_bracketed_by_samples_of_another_owner_is_stale() {
        let samples = vec![
            sample(0, 10, "node-b", 3),
            sample(90, 95, "node-b", 3),
            sample(600, 620, "node-b", 3),
        ];
        let history = vec![attempt("t/s", "node-a", 100, 500, created("node-a", "k1"))];
        let found = stale_owner(&history, &samples);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].detail.contains("epoch 3"), "{}", found[0].detail);
    }

    #[test]
    fn ack_across_a_move_or_without_brackets_is_not_stale() {
        let history = vec![attempt("t/s", "node-a", 100, 500, created("node-a", "k1"))];
        // Moved to a during the request.
        let moved = vec![sample(0, 10, "node-b", 3), sample(600, 620, "node-a", 4)];
        assert!(stale_owner(&history, &moved).is_empty());
        // Owned by a throughout.
        let own = vec![sample(0, 10, "node-a", 3), sample(600, 620, "node-a", 3)];
        assert!(stale_owner(&history, &own).is_empty());
        // Moved away and back: the epoch differs, the checker cannot tell, and says nothing.
        let back = vec![sample(0, 10, "node-b", 3), sample(600, 620, "node-b", 5)];
        assert!(stale_owner(&history, &back).is_empty());
        // A sample answered after the start does not bracket the request.
        let late = vec![sample(50, 150, "node-b", 3), sample(600, 620, "node-b", 3)];
        assert!(stale_owner(&history, &late).is_empty());
    }

    // Checks LOC-4.
    #[test]
    fn only_documented_retryable_5xx_pass() {
        let history = vec![
            attempt("t/s", "a", 0, 1, status(503, "shard_moved", true)),
            attempt("t/s", "a", 0, 1, status(503, "owner_moved", true)),
            attempt("t/s", "a", 0, 1, status(502, "owner_unavailable", true)),
            attempt("t/s", "a", 0, 1, status(409, "session_busy", false)),
            attempt("t/s", "a", 0, 1, Outcome::Transport("reset".into())),
            attempt("t/s", "a", 0, 1, status(500, "internal", false)),
            attempt("t/s", "a", 0, 1, status(503, "storage_unavailable", false)),
            attempt("t/s", "a", 0, 1, status(502, "bad_gateway", true)),
        ];
        let found = unexpected_5xx(&history);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found.iter().all(|v| v.invariant == "LOC-4"));
        assert!(history[..5].iter().all(Attempt::retryable));
    }

    #[test]
    fn acknowledged_lists_each_key_once() {
        let history = vec![
            attempt("t/s", "a", 0, 1, created("a", "k1")),
            attempt("t/s", "b", 2, 3, created("a", "k1")),
            attempt("t/s", "b", 4, 5, created("a", "k2")),
            attempt("t/s", "b", 6, 7, status(503, "shard_moved", true)),
        ];
        let acked = acknowledged(&history);
        assert_eq!(
            acked.iter().map(|a| a.0.as_str()).collect::<Vec<_>>(),
            ["k1", "k2"]
        );
        assert_eq!(check(&history, &[], &CommitWindows::new()), vec![]);
    }
}
