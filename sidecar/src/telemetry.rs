//! The sidecar's own counters and their Prometheus text exposition.
//!
//! Every activity holds the same [`Telemetry`] behind an `Arc` and bumps relaxed atomics: the
//! counters are independent facts, read only by the `/metrics` handler, so no ordering between
//! them is promised (a scrape may see a gap counted before its replay).

use crate::groups::Kind;
use inferencecache_exposition::{Family, Labels, label, render_text};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Why the sidecar dropped everything it knew about the replica and started over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncReason {
    /// The subscriber connected for the first time: events before it are unknown.
    Startup,
    /// The connection to the engine dropped and was dialed again.
    Reconnect,
    /// A sequence gap the replay socket could not fill.
    GapUnfillable,
    /// The sequence went backwards: the engine process started again.
    EngineRestart,
}

impl ResyncReason {
    /// Label value in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ResyncReason::Startup => "startup",
            ResyncReason::Reconnect => "reconnect",
            ResyncReason::GapUnfillable => "gap_unfillable",
            ResyncReason::EngineRestart => "engine_restart",
        }
    }

    const ALL: [ResyncReason; 4] = [
        ResyncReason::Startup,
        ResyncReason::Reconnect,
        ResyncReason::GapUnfillable,
        ResyncReason::EngineRestart,
    ];
}

/// Counters of one sidecar process.
#[derive(Debug, Default)]
pub struct Telemetry {
    /// Batches decoded from the live stream.
    pub batches_live: AtomicU64,
    /// Batches applied from the engine's replay socket.
    pub batches_replayed: AtomicU64,
    /// Live batches skipped because their sequence number was already applied from a replay.
    pub batches_duplicate: AtomicU64,
    /// Payloads that were not a valid event batch.
    pub decode_failures: AtomicU64,
    /// `BlockStored` events received.
    pub events_stored: AtomicU64,
    /// `BlockRemoved` events received.
    pub events_removed: AtomicU64,
    /// `AllBlocksCleared` events received.
    pub events_cleared: AtomicU64,
    /// Sequence gaps seen on the live stream.
    pub gaps: AtomicU64,
    /// Gaps filled completely from the replay socket.
    pub gaps_filled: AtomicU64,
    /// Replay requests that failed (no answer, timeout, malformed frames).
    pub replay_failures: AtomicU64,
    resyncs: [AtomicU64; 4],
    /// `ReportCacheState` updates acknowledged.
    pub updates_sent: AtomicU64,
    /// `PREFIX_EVICTED` events acknowledged.
    pub evictions_sent: AtomicU64,
    /// `ALL_CLEARED` events acknowledged.
    pub clears_sent: AtomicU64,
    /// Failed `ReportCacheState` calls.
    pub report_errors: AtomicU64,
    /// Failed `PublishEvent` calls.
    pub publish_errors: AtomicU64,
    /// Engine blocks not indexed because their parent block is unknown.
    pub orphan_blocks: AtomicU64,
    /// Engine blocks not indexed because their hash depends on extra keys or a cache salt.
    pub keyed_blocks: AtomicU64,
    /// Block copies whose medium is not in the tier table.
    pub unknown_medium: AtomicU64,
    /// `BlockStored` events dropped for an unmapped LoRA id.
    pub unmapped_lora: AtomicU64,
    /// `BlockStored` events whose token ids did not cover their blocks.
    pub no_index_entries: AtomicU64,
    /// Wall clock (ms since the epoch) of the last batch received; 0 = none yet.
    last_event_ms: AtomicU64,
    /// Events dropped from a batch because they were malformed (the rest was applied).
    pub malformed_events: AtomicU64,
    /// Engine blocks stored, per vLLM KV-cache group kind ([`Kind::ALL`] order).
    group_stored: [AtomicU64; 5],
    /// Block copies removed, per group kind.
    group_removed: [AtomicU64; 5],
    /// Removed copies whose page stayed reported because the other groups keep it reusable.
    group_kept: [AtomicU64; 5],
    /// The link to the server: retries, outbox, reconciles, digests (`link.rs`).
    pub link: crate::link::LinkTelemetry,
}

fn kind_slot(kind: Kind) -> usize {
    Kind::ALL
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(Kind::ALL.len() - 1)
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Telemetry {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        bump(counter);
    }

    /// Counts a resync.
    pub fn resync(&self, reason: ResyncReason) {
        bump(&self.resyncs[reason as usize]);
    }

    /// Resyncs so far for one reason.
    pub fn resyncs(&self, reason: ResyncReason) -> u64 {
        self.resyncs[reason as usize].load(Ordering::Relaxed)
    }

    /// Counts `blocks` stored in a group of `kind`.
    pub fn group_blocks_stored(&self, kind: Kind, blocks: u64) {
        Telemetry::add(&self.group_stored[kind_slot(kind)], blocks);
    }

    /// Counts one copy removed from a group of `kind`; `kept` when the page's blocks stayed
    /// reported.
    pub fn group_copy_removed(&self, kind: Kind, kept: bool) {
        bump(&self.group_removed[kind_slot(kind)]);
        if kept {
            bump(&self.group_kept[kind_slot(kind)]);
        }
    }

    /// Notes that a batch arrived now.
    pub fn event_arrived(&self) {
        self.last_event_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Seconds since the last batch, `None` before the first.
    pub fn seconds_since_last_event(&self) -> Option<f64> {
        match self.last_event_ms.load(Ordering::Relaxed) {
            0 => None,
            at => Some(now_ms().saturating_sub(at) as f64 / 1000.0),
        }
    }

    /// The Prometheus text exposition (version 0.0.4) of every counter.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        counter(
            &mut out,
            "inferencecache_sidecar_batches_received_total",
            "Event batches received, by source.",
            &[
                (label("source", "live"), load(&self.batches_live)),
                (label("source", "replay"), load(&self.batches_replayed)),
            ],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_duplicate_batches_total",
            "Live batches skipped because a replay had already applied their sequence number.",
            &[(Vec::new(), load(&self.batches_duplicate))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_events_received_total",
            "Engine events received, by type.",
            &[
                (label("type", "BlockStored"), load(&self.events_stored)),
                (label("type", "BlockRemoved"), load(&self.events_removed)),
                (
                    label("type", "AllBlocksCleared"),
                    load(&self.events_cleared),
                ),
            ],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_decode_failures_total",
            "Payloads that were not a valid event batch.",
            &[(Vec::new(), load(&self.decode_failures))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_sequence_gaps_total",
            "Sequence gaps seen on the live stream.",
            &[(Vec::new(), load(&self.gaps))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_sequence_gaps_filled_total",
            "Sequence gaps filled completely from the engine's replay socket.",
            &[(Vec::new(), load(&self.gaps_filled))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_replayed_batches_total",
            "Batches applied from the engine's replay socket.",
            &[(Vec::new(), load(&self.batches_replayed))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_replay_failures_total",
            "Replay requests without a complete answer.",
            &[(Vec::new(), load(&self.replay_failures))],
        );
        let resyncs: Vec<(Labels, u64)> = ResyncReason::ALL
            .iter()
            .map(|r| (label("reason", r.as_str()), self.resyncs(*r)))
            .collect();
        counter(
            &mut out,
            "inferencecache_sidecar_resyncs_total",
            "Times the replica's entries were cleared and rebuilt, by reason.",
            &resyncs,
        );
        counter(
            &mut out,
            "inferencecache_sidecar_updates_sent_total",
            "ReportCacheState updates acknowledged by the server.",
            &[(Vec::new(), load(&self.updates_sent))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_events_sent_total",
            "PublishEvent calls acknowledged by the server, by type.",
            &[
                (label("type", "PREFIX_EVICTED"), load(&self.evictions_sent)),
                (label("type", "ALL_CLEARED"), load(&self.clears_sent)),
            ],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_send_errors_total",
            "Failed calls to the server, by RPC.",
            &[
                (label("rpc", "ReportCacheState"), load(&self.report_errors)),
                (label("rpc", "PublishEvent"), load(&self.publish_errors)),
            ],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_skipped_blocks_total",
            "Engine blocks not indexed, by reason.",
            &[
                (label("reason", "unknown_parent"), load(&self.orphan_blocks)),
                (label("reason", "extra_keys"), load(&self.keyed_blocks)),
            ],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_unknown_medium_total",
            "Block copies whose medium is not in the tier table (reported as T3).",
            &[(Vec::new(), load(&self.unknown_medium))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_unmapped_lora_total",
            "BlockStored events dropped for a LoRA id without an adapter name.",
            &[(Vec::new(), load(&self.unmapped_lora))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_no_index_entries_total",
            "BlockStored events whose token ids did not cover their blocks.",
            &[(Vec::new(), load(&self.no_index_entries))],
        );
        counter(
            &mut out,
            "inferencecache_sidecar_malformed_events_total",
            "Events dropped from a batch because they were malformed (the rest of the batch was applied).",
            &[(Vec::new(), load(&self.malformed_events))],
        );
        for (name, help, values) in [
            (
                "inferencecache_sidecar_group_blocks_stored_total",
                "Engine blocks stored, by vLLM KV-cache group kind.",
                &self.group_stored,
            ),
            (
                "inferencecache_sidecar_group_blocks_removed_total",
                "Engine block copies removed, by vLLM KV-cache group kind.",
                &self.group_removed,
            ),
            (
                "inferencecache_sidecar_group_removals_kept_reusable_total",
                "Removed block copies whose prefix stayed reported because the other groups keep it reusable, by group kind.",
                &self.group_kept,
            ),
        ] {
            let samples: Vec<(Labels, u64)> = Kind::ALL
                .iter()
                .map(|k| (label("kind", k.as_str()), load(&values[kind_slot(*k)])))
                .collect();
            counter(&mut out, name, help, &samples);
        }
        if let Some(age) = self.seconds_since_last_event() {
            out.push(Family::gauge(
                "inferencecache_sidecar_seconds_since_last_event",
                "Seconds since the last event batch arrived.",
                age,
            ));
        }
        self.link.families(&mut out);
        render_text(&out)
    }
}

fn counter(out: &mut Vec<Family>, name: &str, help: &'static str, samples: &[(Labels, u64)]) {
    out.push(Family::with_counts(name, "counter", help, samples));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_lists_counters_with_labels() {
        let t = Telemetry::default();
        Telemetry::inc(&t.gaps);
        t.resync(ResyncReason::EngineRestart);
        Telemetry::add(&t.batches_replayed, 3);
        let text = t.render();
        assert!(text.contains("inferencecache_sidecar_sequence_gaps_total 1\n"));
        assert!(
            text.contains("inferencecache_sidecar_resyncs_total{reason=\"engine_restart\"} 1\n")
        );
        assert!(text.contains("inferencecache_sidecar_resyncs_total{reason=\"startup\"} 0\n"));
        assert!(text.contains("inferencecache_sidecar_replayed_batches_total 3\n"));
        assert!(!text.contains("seconds_since_last_event"));
        t.event_arrived();
        assert!(
            t.render()
                .contains("inferencecache_sidecar_seconds_since_last_event ")
        );
    }
}
