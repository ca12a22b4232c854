//! Sequence tracking of one engine publisher (spec `sidecar.md` §3, D13).
//!
//! vLLM and SGLang number every batch they publish (`seq`, from 0 per process) and keep the
//! last `buffer_steps` batches for replay. A publisher is identified by the endpoint the
//! sidecar subscribes to, the topic and the batch's data-parallel rank; the subscriber keeps
//! one [`Tracker`] per (topic, rank) of its endpoint.
//!
//! Rules, for a batch arriving live with sequence `s` when `next` is expected:
//! - no expectation yet (after a resync) or `s == next` → apply;
//! - `s > next` → a gap `[next, s)`: fill it from the replay socket, else resync;
//! - `s < next` and `s` was applied from a replay that overlapped the live stream → duplicate,
//!   skip (never apply twice);
//! - any other `s < next` → the sequence went backwards: the engine restarted, resync.

use std::ops::RangeInclusive;

/// What to do with a live batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it.
    Apply,
    /// Already applied from a replay: skip it.
    Duplicate,
    /// Batches `[from, s)` are missing.
    Gap { from: u64 },
    /// The sequence went backwards: a new publisher process.
    Restart,
}

/// Expected sequence of one publisher.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tracker {
    next: Option<u64>,
    /// Sequence numbers applied from a replay that the live stream may deliver again.
    replayed: Option<RangeInclusive<u64>>,
}

impl Tracker {
    /// A tracker without expectation.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next sequence number expected, if any.
    pub fn next(&self) -> Option<u64> {
        self.next
    }

    /// Classifies a live batch.
    pub fn classify(&self, seq: u64) -> Verdict {
        match self.next {
            None => Verdict::Apply,
            Some(n) if seq == n => Verdict::Apply,
            Some(n) if seq > n => Verdict::Gap { from: n },
            Some(_) => {
                if self.replayed.as_ref().is_some_and(|r| r.contains(&seq)) {
                    Verdict::Duplicate
                } else {
                    Verdict::Restart
                }
            }
        }
    }

    /// Records a batch applied from the live stream.
    pub fn applied_live(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
        // Once the live stream is past the replay, it cannot deliver the replayed batches again.
        if self.replayed.as_ref().is_some_and(|r| seq > *r.end()) {
            self.replayed = None;
        }
    }

    /// Records a batch applied from a replay.
    pub fn applied_replayed(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
        let start = match &self.replayed {
            Some(r) => *r.start().min(&seq),
            None => seq,
        };
        self.replayed = Some(start..=seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_gap_duplicate_restart() {
        let mut t = Tracker::new();
        assert_eq!(t.classify(7), Verdict::Apply);
        t.applied_live(7);
        assert_eq!(t.classify(8), Verdict::Apply);
        assert_eq!(t.classify(10), Verdict::Gap { from: 8 });
        assert_eq!(t.classify(3), Verdict::Restart);
        assert_eq!(t.classify(7), Verdict::Restart);

        // A replay of 0..=4 overlapping live 3..=4, then live 5.
        let mut t = Tracker::new();
        for s in 0..=4 {
            t.applied_replayed(s);
        }
        assert_eq!(t.classify(3), Verdict::Duplicate);
        assert_eq!(t.classify(4), Verdict::Duplicate);
        assert_eq!(t.classify(5), Verdict::Apply);
        t.applied_live(5);
        // Past the replay, an old sequence is a restart again.
        assert_eq!(t.classify(0), Verdict::Restart);
    }
}
