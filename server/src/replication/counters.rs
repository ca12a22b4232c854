//! Replicated mode's counters and gauges, shared by the outbox, the apply thread and the
//! leader's duties, and exported by `super::families`.

use std::sync::atomic::{AtomicBool, AtomicU64};

/// Replication counters and gauges (`inferencecache_replication_*`).
#[derive(Default)]
pub struct Counters {
    pub applied_seq: AtomicU64,
    pub stream_last_seq: AtomicU64,
    pub lag_seconds_micros: AtomicU64,
    pub published: AtomicU64,
    pub publish_errors: AtomicU64,
    pub dropped: AtomicU64,
    pub buffered: AtomicU64,
    /// Records published and not yet acked.
    pub in_flight: AtomicU64,
    pub bootstraps: AtomicU64,
    pub gaps: AtomicU64,
    pub undecodable: AtomicU64,
    pub checkpoint_uploads: AtomicU64,
    pub checkpoint_upload_failures: AtomicU64,
    pub credits_dropped: AtomicU64,
    pub leader: AtomicBool,
    pub connected: AtomicBool,
}
