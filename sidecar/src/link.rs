//! The reporter's link to the index server: the bounded in-order outbox, the retry schedule,
//! the replica digest and their counters.
//!
//! Invariants (the index never holds an entry the engine does not hold):
//! - **Never drop.** A message the server did not acknowledge stays at the head of the
//!   [`Outbox`] and is sent again, in order, after a bounded exponential backoff
//!   ([`retry_schedule`], from the `backon` crate). Nothing behind it is sent first, so a
//!   removal never overtakes the store it undoes.
//! - **An overflow is a gap, never a loss.** When the outbox would exceed its bound, it is
//!   emptied and the reporter owes the server a *reconcile* (clear this replica, send its full
//!   current block set from the reverse map, go on live). The reverse map already holds every
//!   change the dropped messages carried, so the reconcile supersedes them exactly.
//! - **What cannot be proven is verified.** After a failed call (the server may have applied
//!   it, or applied it late), after a new server instance appears (a restart, a restore from an
//!   older checkpoint, a failover) and periodically, the reporter compares
//!   [`replica_digest`] of its reverse map with the server's digest of the replica's entries;
//!   a mismatch leads to the reconcile.

use crate::positional::Entry;
use backon::BackoffBuilder;
use inferencecache_engine::replica_entry_hash;
use inferencecache_exposition::{Family, Labels, label};
use inferencecache_proto::v1alpha1::{CacheEvent, CacheStateUpdate, cache_event};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Default bound of the outbox, in index entries (an event counts as one).
pub const DEFAULT_OUTBOX_MAX_ENTRIES: usize = 100_000;
/// Default first retry delay.
pub const DEFAULT_RETRY_MIN: Duration = Duration::from_millis(100);
/// Default longest retry delay: how long after a server comes back the sidecar may take to
/// notice.
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(2);
/// Default period of the anti-entropy digest comparison.
pub const DEFAULT_ANTI_ENTROPY_INTERVAL: Duration = Duration::from_secs(30);
/// Default period of the server-instance probe of an idle link.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// Wait before a mismatching digest is asked again (a replicated server applies an
/// acknowledged write a moment later; a late call may still land).
pub const RECHECK_DELAY: Duration = Duration::from_millis(300);

/// The delays between attempts to deliver the outbox's head: exponential from `min` to `max`,
/// with jitter (so sidecars do not retry in step), never giving up.
pub fn retry_schedule(min: Duration, max: Duration) -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::new()
        .with_min_delay(min)
        .with_max_delay(max.max(min))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// One message to the server.
#[derive(Debug, Clone, PartialEq)]
pub enum Outgoing {
    /// A `ReportCacheState` update.
    Update(CacheStateUpdate),
    /// A `PublishEvent` event.
    Event(CacheEvent),
}

impl Outgoing {
    /// What it counts against the bound: its entries (at least one).
    pub fn weight(&self) -> usize {
        match self {
            Outgoing::Update(u) => u.prefixes.len().max(1),
            Outgoing::Event(_) => 1,
        }
    }

    /// Whether it clears the replica (everything before it is moot).
    pub fn is_clear(&self) -> bool {
        matches!(self, Outgoing::Event(e) if e.r#type == cache_event::Type::AllCleared as i32)
    }
}

/// A queued message and the attempts already made to deliver it.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    /// The message.
    pub message: Outgoing,
    /// Failed attempts so far.
    pub attempts: u32,
}

/// What [`Outbox::push`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Queued.
    Queued,
    /// Over the bound: the outbox was emptied; the caller owes a reconcile.
    Overflowed,
}

/// The bounded in-order queue of messages not yet acknowledged.
#[derive(Debug)]
pub struct Outbox {
    queue: VecDeque<Queued>,
    entries: usize,
    max_entries: usize,
}

impl Outbox {
    /// An empty outbox holding at most `max_entries` entries (at least one message fits).
    pub fn new(max_entries: usize) -> Self {
        Self {
            queue: VecDeque::new(),
            entries: 0,
            max_entries: max_entries.max(1),
        }
    }

    /// Queues `message` last. A replica clear supersedes everything queued before it (the
    /// server drops those entries anyway); a message over the bound empties the outbox.
    pub fn push(&mut self, message: Outgoing) -> Pushed {
        if message.is_clear() {
            self.clear();
        }
        let weight = message.weight();
        if self.entries.saturating_add(weight) > self.max_entries && !self.queue.is_empty() {
            self.clear();
            return Pushed::Overflowed;
        }
        self.entries += weight;
        self.queue.push_back(Queued {
            message,
            attempts: 0,
        });
        Pushed::Queued
    }

    /// Takes the head to send it.
    pub fn pop(&mut self) -> Option<Queued> {
        let head = self.queue.pop_front()?;
        self.entries -= head.message.weight();
        Some(head)
    }

    /// Puts a head whose delivery failed back in front.
    pub fn unpop(&mut self, head: Queued) {
        self.entries += head.message.weight();
        self.queue.push_front(head);
    }

    /// Drops everything (a reconcile supersedes it).
    pub fn clear(&mut self) {
        self.queue.clear();
        self.entries = 0;
    }

    /// Queued messages.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Queued entries.
    pub fn entries(&self) -> usize {
        self.entries
    }
}

/// The digest a server holding exactly `entries` for this replica reports: entry count and
/// the wrapping sum of [`replica_entry_hash`]. Entries with the same (adapter, key) are one
/// index entry, counted once at their hottest tier.
pub fn replica_digest(scheme: &str, entries: impl IntoIterator<Item = Entry>) -> (u64, u128) {
    let mut unique: HashMap<(String, [u8; 8]), Entry> = HashMap::new();
    for entry in entries {
        match unique.entry((entry.adapter.clone(), entry.prefix_hash)) {
            std::collections::hash_map::Entry::Occupied(mut held) => {
                if entry.tier < held.get().tier {
                    held.insert(entry);
                }
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(entry);
            }
        }
    }
    let mut hash = 0u128;
    for entry in unique.values() {
        hash = hash.wrapping_add(replica_entry_hash(
            scheme,
            &entry.adapter,
            &entry.prefix_hash,
            entry.tier.wire() as i32,
            entry.token_count,
        ));
    }
    (unique.len() as u64, hash)
}

/// Why the reporter cleared its replica on the server and sent its full block set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileReason {
    /// The server's digest of the replica differed from the reverse map's.
    DigestMismatch,
    /// The outbox overflowed while the server was unreachable.
    OutboxOverflow,
    /// Delivery could not be proven and the server offers no digest to check it.
    Unproven,
}

impl ReconcileReason {
    /// Label value in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ReconcileReason::DigestMismatch => "digest_mismatch",
            ReconcileReason::OutboxOverflow => "outbox_overflow",
            ReconcileReason::Unproven => "unproven",
        }
    }

    const ALL: [ReconcileReason; 3] = [
        ReconcileReason::DigestMismatch,
        ReconcileReason::OutboxOverflow,
        ReconcileReason::Unproven,
    ];
}

/// Counters and gauges of the link to the server.
#[derive(Debug, Default)]
pub struct LinkTelemetry {
    /// Attempts to deliver a message that failed before.
    pub send_retries: AtomicU64,
    /// Messages queued and not yet acknowledged.
    pub outbox_messages: AtomicU64,
    /// Entries queued and not yet acknowledged.
    pub outbox_entries: AtomicU64,
    /// Times the outbox overflowed (each one leads to a reconcile).
    pub outbox_overflows: AtomicU64,
    reconciles: [AtomicU64; 3],
    /// Digest comparisons answered by the server.
    pub digest_checks: AtomicU64,
    /// Digest comparisons that differed (after one re-check).
    pub digest_mismatches: AtomicU64,
    /// Times the server instance answering differed from the one before.
    pub instance_changes: AtomicU64,
}

impl LinkTelemetry {
    /// Counts a completed reconcile.
    pub fn reconciled(&self, reason: ReconcileReason) {
        self.reconciles[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Completed reconciles for one reason.
    pub fn reconciles(&self, reason: ReconcileReason) -> u64 {
        self.reconciles[reason as usize].load(Ordering::Relaxed)
    }

    /// Sets the outbox gauges.
    pub fn outbox(&self, outbox: &Outbox) {
        self.outbox_messages
            .store(outbox.len() as u64, Ordering::Relaxed);
        self.outbox_entries
            .store(outbox.entries() as u64, Ordering::Relaxed);
    }

    /// Appends these series' families.
    pub fn families(&self, out: &mut Vec<Family>) {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.push(Family::with_counts(
            "inferencecache_sidecar_send_retries_total",
            "counter",
            "Attempts to deliver a message to the server that failed before.",
            &[(Vec::new(), load(&self.send_retries))],
        ));
        out.push(Family::with_counts(
            "inferencecache_sidecar_outbox_messages",
            "gauge",
            "Messages waiting for the server's acknowledgement, in order.",
            &[(Vec::new(), load(&self.outbox_messages))],
        ));
        out.push(Family::with_counts(
            "inferencecache_sidecar_outbox_entries",
            "gauge",
            "Index entries in the messages waiting for the server's acknowledgement.",
            &[(Vec::new(), load(&self.outbox_entries))],
        ));
        out.push(Family::with_counts(
            "inferencecache_sidecar_outbox_overflows_total",
            "counter",
            "Times the outbox went over its bound (each leads to a reconcile).",
            &[(Vec::new(), load(&self.outbox_overflows))],
        ));
        let reconciles: Vec<(Labels, u64)> = ReconcileReason::ALL
            .iter()
            .map(|r| (label("reason", r.as_str()), self.reconciles(*r)))
            .collect();
        out.push(Family::with_counts(
            "inferencecache_sidecar_reconciles_total",
            "counter",
            "Times the replica was cleared on the server and its full block set sent, by reason.",
            &reconciles,
        ));
        out.push(Family::with_counts(
            "inferencecache_sidecar_digest_checks_total",
            "counter",
            "Comparisons of the replica's digest with the server's.",
            &[(Vec::new(), load(&self.digest_checks))],
        ));
        out.push(Family::with_counts(
            "inferencecache_sidecar_digest_mismatches_total",
            "counter",
            "Digest comparisons that differed (each leads to a reconcile).",
            &[(Vec::new(), load(&self.digest_mismatches))],
        ));
        out.push(Family::with_counts(
            "inferencecache_sidecar_server_instance_changes_total",
            "counter",
            "Times the answering server instance changed (a restart or a failover).",
            &[(Vec::new(), load(&self.instance_changes))],
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::Tier;

    fn update(n: usize) -> Outgoing {
        Outgoing::Update(CacheStateUpdate {
            prefixes: vec![Default::default(); n],
            ..Default::default()
        })
    }

    fn clear() -> Outgoing {
        Outgoing::Event(CacheEvent {
            r#type: cache_event::Type::AllCleared as i32,
            ..Default::default()
        })
    }

    #[test]
    fn the_outbox_keeps_order_and_its_bound() {
        let mut outbox = Outbox::new(10);
        assert_eq!(outbox.push(update(4)), Pushed::Queued);
        assert_eq!(outbox.push(update(6)), Pushed::Queued);
        assert_eq!((outbox.len(), outbox.entries()), (2, 10));
        let head = outbox.pop().unwrap();
        assert_eq!(head.message.weight(), 4);
        outbox.unpop(head);
        assert_eq!((outbox.len(), outbox.entries()), (2, 10));
        assert_eq!(outbox.push(update(1)), Pushed::Overflowed);
        assert_eq!((outbox.len(), outbox.entries()), (0, 0));
        // A single message over the bound still fits an empty outbox.
        assert_eq!(outbox.push(update(50)), Pushed::Queued);
        assert_eq!(outbox.push(clear()), Pushed::Queued);
        assert_eq!((outbox.len(), outbox.entries()), (1, 1));
    }

    #[test]
    fn the_schedule_grows_to_its_cap() {
        let delays: Vec<Duration> =
            retry_schedule(Duration::from_millis(100), Duration::from_secs(1))
                .take(8)
                .collect();
        assert_eq!(delays.len(), 8);
        assert!(delays[0] >= Duration::from_millis(100), "{delays:?}");
        // Jitter adds at most the delay itself.
        assert!(
            delays.iter().all(|d| *d <= Duration::from_secs(2)),
            "{delays:?}"
        );
        assert!(delays[7] >= Duration::from_secs(1), "{delays:?}");
    }

    #[test]
    fn the_digest_counts_a_key_once_at_its_hottest_tier() {
        let entry = |hash: u8, tier: Tier| Entry {
            prefix_hash: [hash; 8],
            token_count: 16,
            adapter: String::new(),
            tier,
        };
        let one = replica_digest("vllm", [entry(1, Tier::Gpu)]);
        assert_eq!(
            one,
            (
                1,
                replica_entry_hash("vllm", "", &[1; 8], Tier::Gpu.wire() as i32, 16)
            )
        );
        assert_eq!(
            replica_digest("vllm", [entry(1, Tier::Cpu), entry(1, Tier::Gpu)]),
            one
        );
        assert_ne!(replica_digest("sglang", [entry(1, Tier::Gpu)]), one);
        assert_eq!(replica_digest("vllm", []), (0, 0));
    }
}
