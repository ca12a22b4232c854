//! The event-path reporter (spec `sidecar.md` §6): decoded batches → `ReportCacheState` updates
//! and `PublishEvent` calls, with add-batching, store-before-evict ordering, tiers from media,
//! L2 mode and LoRA partitioning.
//!
//! The reporter applies its input strictly in order; the subscriber guarantees that order
//! matches the engine's sequence numbers and inserts a [`Input::Resync`] wherever it cannot,
//! which clears this replica (and only it) on the server before anything after it is applied.

use crate::client::Sink;
use crate::lora::AdapterMap;
use crate::positional::{Entry, Removal, ReverseMap};
use crate::telemetry::{ResyncReason, Telemetry};
use crate::tier::Tier;
use crate::wire::{BlockStored, Event, EventBatch};
use inferencecache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, CacheTier, PrefixEntry, cache_event,
};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::{info, warn};

/// What the subscriber hands the reporter, in engine order.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A batch to apply.
    Batch(EventBatch),
    /// Forget everything about this replica: what came before is not known to be complete.
    Resync(ResyncReason),
}

impl From<EventBatch> for Input {
    fn from(batch: EventBatch) -> Self {
        Input::Batch(batch)
    }
}

/// Default add-batching window.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(100);
/// Pending entries that force an immediate flush.
pub const FLUSH_THRESHOLD: usize = 4096;
/// Default tokens per index block (the server's default `--engine-block-size`).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Identity stamped on every update and event.
#[derive(Debug, Clone, Default)]
pub struct Identity {
    pub replica_id: String,
    pub model_id: String,
    pub tenant_id: String,
    pub hash_scheme: String,
}

/// Reporter settings.
#[derive(Debug, Clone)]
pub struct ReporterConfig {
    pub identity: Identity,
    /// Flush window (ticker period).
    pub window: Duration,
    /// Pending entries that force a flush.
    pub flush_threshold: usize,
    /// L2 mode (`--ignore-block-removed`): removals are re-reported as T2.
    pub l2_mode: bool,
    /// LoRA id → adapter mapping.
    pub adapters: AdapterMap,
    /// Tokens per index block (the server's `--engine-block-size`).
    pub block_size: usize,
    /// Attention chunk size of vLLM chunked-local-attention groups (0 = unknown).
    pub attention_chunk_size: u64,
    /// Shared counters.
    pub telemetry: Arc<Telemetry>,
}

impl ReporterConfig {
    /// Defaults for one identity.
    pub fn new(identity: Identity) -> Self {
        Self {
            identity,
            window: DEFAULT_WINDOW,
            flush_threshold: FLUSH_THRESHOLD,
            l2_mode: false,
            adapters: AdapterMap::default(),
            block_size: DEFAULT_BLOCK_SIZE,
            attention_chunk_size: 0,
            telemetry: Arc::default(),
        }
    }
}

/// Counters, for tests and the final log line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReporterCounters {
    pub updates_sent: u64,
    pub updates_failed: u64,
    pub events_sent: u64,
    pub events_failed: u64,
    pub dropped_unmapped_lora: u64,
    pub no_index_entries: u64,
    pub resyncs: u64,
}

/// Converts engine float seconds into µs (`ts ≤ 0 → 0`, else truncated).
pub fn ts_to_us(ts: f64) -> i64 {
    if ts.is_nan() || ts <= 0.0 {
        0
    } else {
        (ts * 1e6) as i64
    }
}

/// The reporter state machine. Single-threaded: it owns the reverse map.
pub struct Reporter<S: Sink> {
    cfg: ReporterConfig,
    sink: S,
    map: ReverseMap,
    pending: Vec<PrefixEntry>,
    pending_ts_us: i64,
    warned_lora: HashSet<i64>,
    warned_media: HashSet<String>,
    counters: ReporterCounters,
}

fn prefix_entry(e: Entry, tier: CacheTier) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: e.prefix_hash.to_vec(),
        token_count: e.token_count,
        block_hashes: Vec::new(),
        block_token_counts: Vec::new(),
        tier: tier as i32,
        adapter_id: e.adapter,
    }
}

fn tiered_entry(e: Entry) -> PrefixEntry {
    let tier = e.tier.wire();
    prefix_entry(e, tier)
}

impl<S: Sink> Reporter<S> {
    /// A reporter with an empty reverse map.
    pub fn new(cfg: ReporterConfig, sink: S) -> Self {
        let mut map = ReverseMap::new(cfg.block_size);
        map.set_attention_chunk_size(cfg.attention_chunk_size);
        Self {
            map,
            cfg,
            sink,
            pending: Vec::new(),
            pending_ts_us: 0,
            warned_lora: HashSet::new(),
            warned_media: HashSet::new(),
            counters: ReporterCounters::default(),
        }
    }

    /// The reverse map (tests).
    pub fn reverse_map(&self) -> &ReverseMap {
        &self.map
    }

    /// Entries waiting for the next flush.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Counters so far.
    pub fn counters(&self) -> ReporterCounters {
        self.counters
    }

    /// The sink (tests).
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Processes one input.
    pub async fn handle(&mut self, input: &Input) {
        match input {
            Input::Batch(batch) => self.handle_batch(batch).await,
            Input::Resync(reason) => self.resync(*reason).await,
        }
    }

    /// Processes one batch, event by event.
    pub async fn handle_batch(&mut self, batch: &EventBatch) {
        let ts_us = ts_to_us(batch.ts);
        let telemetry = Arc::clone(&self.cfg.telemetry);
        for ev in &batch.events {
            match ev {
                Event::BlockStored(bs) => {
                    Telemetry::inc(&telemetry.events_stored);
                    self.on_stored(bs, ts_us).await
                }
                Event::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                    locality,
                    ownership,
                } => {
                    Telemetry::inc(&telemetry.events_removed);
                    let removal = Removal {
                        medium: medium.as_deref(),
                        group: *group_idx,
                        locality: locality.as_deref(),
                        ownership: ownership.as_deref(),
                    };
                    self.on_removed(block_hashes, removal, ts_us).await
                }
                Event::AllBlocksCleared => {
                    Telemetry::inc(&telemetry.events_cleared);
                    self.on_cleared(ts_us).await
                }
            }
        }
    }

    /// Drops everything known about this replica and clears it on the server.
    pub async fn resync(&mut self, reason: ResyncReason) {
        self.counters.resyncs += 1;
        self.cfg.telemetry.resync(reason);
        info!(
            event = "resync",
            reason = reason.as_str(),
            known_pages = self.map.len(),
            "clearing this replica's entries; rebuilding from the engine's events"
        );
        self.on_cleared(0).await;
    }

    async fn on_stored(&mut self, ev: &BlockStored, ts_us: i64) {
        let resolved = self
            .cfg
            .adapters
            .resolve_named(ev.lora_id, ev.lora_name.as_deref())
            .map(str::to_string);
        let Some(adapter) = resolved else {
            self.counters.dropped_unmapped_lora += 1;
            Telemetry::inc(&self.cfg.telemetry.unmapped_lora);
            let id = ev.lora_id.unwrap_or_default();
            if self.warned_lora.insert(id) {
                warn!(
                    event = "unmapped_lora",
                    lora_id = id,
                    "BlockStored with a LoRA id missing from --lora-adapter-names; dropped"
                );
            }
            return;
        };
        let stored = self.map.store(ev, &adapter);
        let telemetry = Arc::clone(&self.cfg.telemetry);
        if let Some(kind) = stored.group_kind {
            telemetry.group_blocks_stored(kind, ev.block_hashes.len() as u64);
        }
        if !stored.evicted.is_empty() {
            self.withdraw_claims(stored.evicted.clone(), ts_us).await;
        }
        Telemetry::add(&telemetry.orphan_blocks, stored.orphan_pages as u64);
        Telemetry::add(&telemetry.keyed_blocks, stored.keyed_pages as u64);
        if stored.unknown_medium {
            Telemetry::inc(&telemetry.unknown_medium);
            let medium = ev.medium.clone().unwrap_or_default();
            if self.warned_media.insert(medium.clone()) {
                warn!(
                    event = "unknown_medium",
                    medium = %medium,
                    "BlockStored with a medium outside the tier table; reported as T3"
                );
            }
        }
        if stored.mismatched {
            self.counters.no_index_entries += 1;
            Telemetry::inc(&telemetry.no_index_entries);
            warn!(
                event = "no_index_entries",
                blocks = ev.block_hashes.len(),
                tokens = ev.token_ids.len(),
                block_size = ev.block_size,
                "BlockStored produced no index entries (missing or mismatched token_ids)"
            );
            return;
        }
        if stored.entries.is_empty() {
            return;
        }
        self.pending
            .extend(stored.entries.into_iter().map(tiered_entry));
        if ts_us > 0 {
            self.pending_ts_us = ts_us;
        }
        if self.pending.len() >= self.cfg.flush_threshold {
            self.flush().await;
        }
    }

    /// Claims that shrank on a store (a newly learned KV-cache group is stricter): entries
    /// still waiting in the pending buffer are dropped from it, and each is withdrawn from the
    /// server (PREFIX_EVICTED; in L2 mode re-reported as T2, like a removal).
    async fn withdraw_claims(&mut self, evicted: Vec<Entry>, ts_us: i64) {
        let gone: std::collections::HashSet<([u8; 8], String)> = evicted
            .iter()
            .map(|e| (e.prefix_hash, e.adapter.clone()))
            .collect();
        self.pending.retain(|p| {
            let key: Option<[u8; 8]> = p.prefix_hash.as_slice().try_into().ok();
            !key.is_some_and(|k| gone.contains(&(k, p.adapter_id.clone())))
        });
        if self.cfg.l2_mode {
            let prefixes: Vec<PrefixEntry> = evicted
                .into_iter()
                .map(|e| Entry {
                    tier: Tier::Cpu,
                    ..e
                })
                .map(tiered_entry)
                .collect();
            let update = self.update(ts_us, prefixes);
            self.send_update(update).await;
            return;
        }
        for e in evicted {
            let ev = CacheEvent {
                r#type: cache_event::Type::PrefixEvicted as i32,
                replica_id: self.cfg.identity.replica_id.clone(),
                model_id: self.cfg.identity.model_id.clone(),
                tenant_id: self.cfg.identity.tenant_id.clone(),
                prefix_hash: e.prefix_hash.to_vec(),
                timestamp_us: ts_us,
                adapter_id: e.adapter,
            };
            self.send_event(ev).await;
        }
    }

    async fn on_removed(&mut self, hashes: &[Vec<u8>], removal: Removal<'_>, ts_us: i64) {
        // L2 mode: the engine offloads what it removes, so the chain after a page stays usable.
        let removed = self.map.remove_copies(hashes, removal, !self.cfg.l2_mode);
        for &(kind, kept) in &removed.group_copies {
            self.cfg.telemetry.group_copy_removed(kind, kept);
        }
        if !removed.retiered.is_empty() || (self.cfg.l2_mode && !removed.evicted.is_empty()) {
            // Stamped with the removal and never merged into the pending buffer, so a later
            // store cannot refresh a downgrade.
            self.flush().await;
            let mut prefixes: Vec<PrefixEntry> =
                removed.retiered.into_iter().map(tiered_entry).collect();
            if self.cfg.l2_mode {
                prefixes.extend(
                    removed
                        .evicted
                        .iter()
                        .cloned()
                        .map(|e| Entry {
                            tier: Tier::Cpu,
                            ..e
                        })
                        .map(tiered_entry),
                );
            }
            let update = self.update(ts_us, prefixes);
            self.send_update(update).await;
        }
        if !self.cfg.l2_mode {
            self.flush().await;
            for e in removed.evicted {
                let ev = CacheEvent {
                    r#type: cache_event::Type::PrefixEvicted as i32,
                    replica_id: self.cfg.identity.replica_id.clone(),
                    model_id: self.cfg.identity.model_id.clone(),
                    tenant_id: self.cfg.identity.tenant_id.clone(),
                    prefix_hash: e.prefix_hash.to_vec(),
                    timestamp_us: ts_us,
                    adapter_id: e.adapter,
                };
                self.send_event(ev).await;
            }
        }
    }

    async fn on_cleared(&mut self, ts_us: i64) {
        self.pending.clear();
        self.pending_ts_us = 0;
        self.map.clear();
        let ev = CacheEvent {
            r#type: cache_event::Type::AllCleared as i32,
            replica_id: self.cfg.identity.replica_id.clone(),
            model_id: self.cfg.identity.model_id.clone(),
            tenant_id: self.cfg.identity.tenant_id.clone(),
            prefix_hash: Vec::new(),
            timestamp_us: ts_us,
            adapter_id: String::new(),
        };
        self.send_event(ev).await;
    }

    fn update(&self, timestamp_us: i64, prefixes: Vec<PrefixEntry>) -> CacheStateUpdate {
        let id = &self.cfg.identity;
        CacheStateUpdate {
            replica_id: id.replica_id.clone(),
            model_id: id.model_id.clone(),
            tenant_id: id.tenant_id.clone(),
            hash_scheme: id.hash_scheme.clone(),
            timestamp_us,
            prefixes,
            stats: None,
            adapter_id: String::new(),
        }
    }

    /// Sends the pending entries as one update (nothing pending → nothing sent). Errors are
    /// logged and the batch is dropped.
    pub async fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let prefixes = std::mem::take(&mut self.pending);
        let ts = std::mem::take(&mut self.pending_ts_us);
        let update = self.update(ts, prefixes);
        self.send_update(update).await;
    }

    async fn send_update(&mut self, update: CacheStateUpdate) {
        let n = update.prefixes.len();
        match self.sink.report(update).await {
            Ok(_) => {
                self.counters.updates_sent += 1;
                Telemetry::inc(&self.cfg.telemetry.updates_sent);
            }
            Err(status) => {
                self.counters.updates_failed += 1;
                Telemetry::inc(&self.cfg.telemetry.report_errors);
                warn!(
                    code = ?status.code(),
                    err = %status.message(),
                    prefixes = n,
                    "ReportCacheState failed; batch dropped"
                );
            }
        }
    }

    async fn send_event(&mut self, ev: CacheEvent) {
        let ty = ev.r#type;
        match self.sink.publish(ev).await {
            Ok(_) => {
                self.counters.events_sent += 1;
                let telemetry = &self.cfg.telemetry;
                if ty == cache_event::Type::AllCleared as i32 {
                    Telemetry::inc(&telemetry.clears_sent);
                } else {
                    Telemetry::inc(&telemetry.evictions_sent);
                }
            }
            Err(status) => {
                self.counters.events_failed += 1;
                Telemetry::inc(&self.cfg.telemetry.publish_errors);
                warn!(
                    code = ?status.code(),
                    err = %status.message(),
                    event_type = ty,
                    "PublishEvent failed"
                );
            }
        }
    }

    /// Runs until `rx` closes: batches are handled as they come, pending adds are flushed on
    /// every window tick, and a final flush happens when the input closes.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Input>) -> Self {
        let window = if self.cfg.window.is_zero() {
            DEFAULT_WINDOW
        } else {
            self.cfg.window
        };
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + window, window);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Unbiased: a steady stream of batches cannot starve the window tick.
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(input) => self.handle(&input).await,
                    None => break,
                },
                _ = ticker.tick() => self.flush().await,
            }
        }
        self.flush().await;
        let c = self.counters;
        info!(
            updates_sent = c.updates_sent,
            updates_failed = c.updates_failed,
            events_sent = c.events_sent,
            events_failed = c.events_failed,
            "reporter drained"
        );
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(ts_to_us(0.0), 0);
        assert_eq!(ts_to_us(-3.0), 0);
        assert_eq!(ts_to_us(f64::NAN), 0);
        assert_eq!(ts_to_us(1.5), 1_500_000);
        assert_eq!(ts_to_us(2.25), 2_250_000);
    }
}
