//! A session owner's hot state and its transitions.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::SessionError;

/// Where a session is in its life on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Known, no upload running.
    Idle,
    /// An upload is streaming into this node.
    Receiving,
}

/// Counters and phase of one session; a few dozen bytes, whatever the uploads' sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotState {
    pub phase: Phase,
    pub bytes_seen: u64,
    pub frames_seen: u64,
    pub uploads_completed: u32,
    pub uploads_failed: u32,
    pub started_at: SystemTime,
    pub last_activity: SystemTime,
}

/// A copy of the hot state for operators and peers (no tenant or session values).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotSnapshot {
    pub phase: Phase,
    pub bytes_seen: u64,
    pub frames_seen: u64,
    pub uploads_completed: u32,
    pub uploads_failed: u32,
    pub started_at_ms: u64,
    pub last_activity_ms: u64,
}

impl HotState {
    pub fn new(now: SystemTime) -> Self {
        Self {
            phase: Phase::Idle,
            bytes_seen: 0,
            frames_seen: 0,
            uploads_completed: 0,
            uploads_failed: 0,
            started_at: now,
            last_activity: now,
        }
    }

    /// An upload starts. Only one upload of a session runs at a time.
    pub fn begin(&mut self, now: SystemTime) -> Result<(), SessionError> {
        if self.phase == Phase::Receiving {
            return Err(SessionError::Busy);
        }
        self.phase = Phase::Receiving;
        self.last_activity = now;
        Ok(())
    }

    /// Body bytes arrived (counters only).
    pub fn progress(&mut self, bytes: u64, frames: u64, now: SystemTime) {
        self.bytes_seen = self.bytes_seen.saturating_add(bytes);
        self.frames_seen = self.frames_seen.saturating_add(frames);
        self.last_activity = now;
    }

    /// The running upload ended.
    pub fn finish(&mut self, succeeded: bool, now: SystemTime) {
        if self.phase != Phase::Receiving {
            return;
        }
        self.phase = Phase::Idle;
        if succeeded {
            self.uploads_completed = self.uploads_completed.saturating_add(1);
        } else {
            self.uploads_failed = self.uploads_failed.saturating_add(1);
        }
        self.last_activity = now;
    }

    pub fn snapshot(&self) -> HotSnapshot {
        let ms = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
        };
        HotSnapshot {
            phase: self.phase,
            bytes_seen: self.bytes_seen,
            frames_seen: self.frames_seen,
            uploads_completed: self.uploads_completed,
            uploads_failed: self.uploads_failed,
            started_at_ms: ms(self.started_at),
            last_activity_ms: ms(self.last_activity),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_upload_at_a_time_and_counters_accumulate() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let mut state = HotState::new(t0);
        state.begin(t0).unwrap();
        assert_eq!(state.begin(t0), Err(SessionError::Busy));
        state.progress(10, 2, t0 + Duration::from_secs(1));
        state.finish(true, t0 + Duration::from_secs(2));
        assert_eq!(state.phase, Phase::Idle);
        state.begin(t0).unwrap();
        state.progress(5, 1, t0);
        state.finish(false, t0 + Duration::from_secs(3));
        let snap = state.snapshot();
        assert_eq!((snap.bytes_seen, snap.frames_seen), (15, 3));
        assert_eq!((snap.uploads_completed, snap.uploads_failed), (1, 1));
        assert_eq!(snap.last_activity_ms, 103_000);
        // finishing twice does not double count
        state.finish(true, t0);
        assert_eq!(state.uploads_completed, 1);
    }
}
