//! The bounded index of live session owners on one node.
//!
//! Holds, per session, whether an upload is running and when the session was last
//! active. At the bound, a new session evicts the least recently active *inactive*
//! session; when every session is active the new one is refused (never an active one
//! evicted). Inactive sessions idle for longer than the timeout are reported for stopping.
//! All operations are O(log n).

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
struct Entry {
    active: bool,
    last_activity: Instant,
    seq: u64,
}

/// What the index says about a session that wants to start an upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission<K> {
    /// Known and not running an upload; it is now marked active.
    Existing,
    /// Known and already running an upload.
    Busy,
    /// New; it is now in the index (active). If `evicted` is set, that session was
    /// removed to make room and its owner must be stopped.
    Inserted { evicted: Option<K> },
    /// New, and every slot holds an active session.
    Full,
}

/// Bounded table of sessions keyed by `K`.
#[derive(Debug)]
pub struct SessionIndex<K> {
    capacity: usize,
    entries: HashMap<K, Entry>,
    /// Inactive sessions ordered by (last activity, insertion sequence).
    idle_order: BTreeSet<(Instant, u64, K)>,
    next_seq: u64,
}

impl<K: Clone + Eq + Hash + Ord> SessionIndex<K> {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0, "session index capacity must be positive");
        Self {
            capacity,
            entries: HashMap::new(),
            idle_order: BTreeSet::new(),
            next_seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn active(&self) -> usize {
        self.entries.len() - self.idle_order.len()
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Whether `key` is running an upload.
    pub fn is_active(&self, key: &K) -> bool {
        self.entries.get(key).is_some_and(|e| e.active)
    }

    /// An upload of `key` wants to start at `now`.
    pub fn begin(&mut self, key: &K, now: Instant) -> Admission<K> {
        if let Some(entry) = self.entries.get_mut(key) {
            if entry.active {
                return Admission::Busy;
            }
            self.idle_order
                .remove(&(entry.last_activity, entry.seq, key.clone()));
            entry.active = true;
            entry.last_activity = now;
            return Admission::Existing;
        }
        let mut evicted = None;
        if self.entries.len() >= self.capacity {
            let Some(oldest) = self.idle_order.pop_first() else {
                return Admission::Full;
            };
            self.entries.remove(&oldest.2);
            evicted = Some(oldest.2);
        }
        let seq = self.bump();
        self.entries.insert(
            key.clone(),
            Entry {
                active: true,
                last_activity: now,
                seq,
            },
        );
        Admission::Inserted { evicted }
    }

    /// The running upload of `key` ended at `now`. Unknown keys are ignored.
    pub fn end(&mut self, key: &K, now: Instant) {
        let seq = self.bump();
        if let Some(entry) = self.entries.get_mut(key) {
            if entry.active {
                entry.active = false;
            } else {
                self.idle_order
                    .remove(&(entry.last_activity, entry.seq, key.clone()));
            }
            entry.last_activity = now;
            entry.seq = seq;
            self.idle_order.insert((now, seq, key.clone()));
        }
    }

    /// Forget `key` (its owner stopped).
    pub fn remove(&mut self, key: &K) -> bool {
        match self.entries.remove(key) {
            Some(entry) => {
                if !entry.active {
                    self.idle_order
                        .remove(&(entry.last_activity, entry.seq, key.clone()));
                }
                true
            }
            None => false,
        }
    }

    /// Remove and return inactive sessions idle since before `now - timeout`.
    pub fn take_idle(&mut self, now: Instant, timeout: std::time::Duration) -> Vec<K> {
        let mut expired = Vec::new();
        while let Some((last, _, _)) = self.idle_order.first() {
            if now.saturating_duration_since(*last) < timeout {
                break;
            }
            let (_, _, key) = self.idle_order.pop_first().expect("first exists");
            self.entries.remove(&key);
            expired.push(key);
        }
        expired
    }

    fn bump(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Recompute derived structures and compare (used by tests after every step).
    pub fn consistency_check(&self) -> Result<(), String> {
        let inactive = self.entries.values().filter(|e| !e.active).count();
        if inactive != self.idle_order.len() {
            return Err(format!(
                "{inactive} inactive entries but {} in idle order",
                self.idle_order.len()
            ));
        }
        for (last, seq, key) in &self.idle_order {
            match self.entries.get(key) {
                Some(e) if !e.active && e.last_activity == *last && e.seq == *seq => {}
                _ => return Err("idle order entry without matching inactive entry".into()),
            }
        }
        if self.entries.len() > self.capacity {
            return Err(format!(
                "{} entries exceed capacity {}",
                self.entries.len(),
                self.capacity
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    #[test]
    fn evicts_least_recently_active_inactive_session_first() {
        let t = Instant::now();
        let mut index = SessionIndex::new(2);
        assert_eq!(index.begin(&1, t), Admission::Inserted { evicted: None });
        assert_eq!(index.begin(&2, t), Admission::Inserted { evicted: None });
        assert_eq!(index.begin(&3, t), Admission::Full, "all active: refuse");
        index.end(&2, t + Duration::from_secs(1));
        index.end(&1, t + Duration::from_secs(2));
        assert_eq!(
            index.begin(&3, t + Duration::from_secs(3)),
            Admission::Inserted { evicted: Some(2) }
        );
        assert_eq!(index.begin(&1, t), Admission::Existing);
        assert_eq!(index.begin(&1, t), Admission::Busy);
        index.consistency_check().unwrap();
    }

    #[test]
    fn idle_sessions_expire_but_active_ones_never_do() {
        let t = Instant::now();
        let mut index = SessionIndex::new(10);
        index.begin(&"a", t);
        index.begin(&"b", t);
        index.end(&"a", t);
        let later = t + Duration::from_secs(100);
        assert_eq!(index.take_idle(later, Duration::from_secs(10)), vec!["a"]);
        assert!(index.contains(&"b"));
        assert_eq!(index.len(), 1);
        index.consistency_check().unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Begin(u8),
        End(u8),
        Remove(u8),
        Sweep(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..20).prop_map(Op::Begin),
            (0u8..20).prop_map(Op::End),
            (0u8..20).prop_map(Op::Remove),
            (0u64..50).prop_map(Op::Sweep),
        ]
    }

    proptest! {
        // Checks SES-1: the bound holds and a busy session is never evicted, for any operations.
        #[test]
        fn bound_holds_and_active_sessions_are_never_evicted(
            capacity in 1usize..8,
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let start = Instant::now();
            let mut index = SessionIndex::new(capacity);
            let mut active = std::collections::HashSet::new();
            for (step, op) in ops.into_iter().enumerate() {
                let now = start + Duration::from_secs(step as u64);
                match op {
                    Op::Begin(k) => match index.begin(&k, now) {
                        Admission::Inserted { evicted } => {
                            if let Some(e) = evicted { prop_assert!(!active.contains(&e)); }
                            active.insert(k);
                        }
                        Admission::Existing => { active.insert(k); }
                        Admission::Busy => prop_assert!(active.contains(&k)),
                        Admission::Full => prop_assert_eq!(active.len(), capacity),
                    },
                    Op::End(k) => { index.end(&k, now); active.remove(&k); }
                    Op::Remove(k) => { index.remove(&k); active.remove(&k); }
                    Op::Sweep(t) => {
                        for k in index.take_idle(now, Duration::from_secs(t)) {
                            prop_assert!(!active.contains(&k));
                        }
                    }
                }
                prop_assert!(index.len() <= capacity);
                prop_assert_eq!(index.active(), active.len());
                index.consistency_check().map_err(TestCaseError::fail)?;
            }
        }
    }
}
