//! The event-path reporter (spec `sidecar.md` §6): decoded batches → `ReportCacheState` updates
//! and `PublishEvent` calls, with add-batching, store-before-evict ordering, tiers from media,
//! L2 mode and LoRA partitioning.
//!
//! The reporter applies its input strictly in order; the subscriber guarantees that order
//! matches the engine's sequence numbers and inserts a [`Input::Resync`] wherever it cannot,
//! which clears this replica (and only it) on the server before anything after it is applied.
//!
//! Everything it sends goes through the link of `link.rs`: an in-order outbox retried with
//! backoff, a reconcile (clear this replica, send the reverse map's full block set) when the
//! outbox overflows or a digest comparison fails, and a digest comparison whenever delivery
//! cannot be proven (a failed call, a new server instance, periodically).

use crate::client::Sink;
use crate::link::{self, Outbox, Outgoing, Pushed, ReconcileReason};
use crate::lora::AdapterMap;
use crate::positional::{Entry, Removal, ReverseMap};
use crate::telemetry::{ResyncReason, Telemetry};
use crate::tier::Tier;
use crate::wire::{BlockStored, Event, EventBatch};
use inferencecache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, CacheTier, GetCacheStateRequest, PrefixEntry, cache_event,
};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
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
    /// Bound of the outbox in entries; beyond it the outbox is dropped for a reconcile.
    pub outbox_max_entries: usize,
    /// First and longest delay between attempts to deliver the outbox's head.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Period of the anti-entropy digest comparison (zero = off).
    pub anti_entropy_interval: Duration,
    /// Period of the server-instance probe while nothing else reaches the server (zero = off).
    pub probe_interval: Duration,
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
            outbox_max_entries: link::DEFAULT_OUTBOX_MAX_ENTRIES,
            retry_min: link::DEFAULT_RETRY_MIN,
            retry_max: link::DEFAULT_RETRY_MAX,
            anti_entropy_interval: link::DEFAULT_ANTI_ENTROPY_INTERVAL,
            probe_interval: link::DEFAULT_PROBE_INTERVAL,
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
    pub reconciles: u64,
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
    link: LinkState,
}

/// Where the reporter stands with the server (see `link.rs`).
struct LinkState {
    outbox: Outbox,
    /// The server instance that acknowledged the last call.
    instance: Option<String>,
    /// A reconcile is owed (the outbox is then empty and stays so until it is done).
    reconcile: Option<ReconcileReason>,
    /// A digest comparison is owed.
    verify: bool,
    /// Whether the server answered a digest question with a digest (unknown until asked).
    digests: Option<bool>,
    /// No attempt before this (backing off after a failure).
    retry_at: Option<Instant>,
    /// The delays left since the last success.
    backoff: Option<backon::ExponentialBackoff>,
    /// Whether a failure was logged since the last success (one warning per outage).
    warned: bool,
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
            sink,
            pending: Vec::new(),
            pending_ts_us: 0,
            warned_lora: HashSet::new(),
            warned_media: HashSet::new(),
            counters: ReporterCounters::default(),
            link: LinkState {
                outbox: Outbox::new(cfg.outbox_max_entries),
                instance: None,
                reconcile: None,
                verify: false,
                digests: None,
                retry_at: None,
                backoff: None,
                warned: false,
            },
            cfg,
        }
    }

    /// Messages waiting for the server's acknowledgement.
    pub fn outbox_len(&self) -> usize {
        self.link.outbox.len()
    }

    /// The server instance that acknowledged the last call.
    pub fn server_instance(&self) -> Option<&str> {
        self.link.instance.as_deref()
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

    /// Sends the pending entries as one update (nothing pending → nothing sent), through the
    /// outbox.
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
        self.enqueue(Outgoing::Update(update));
        self.pump().await;
    }

    async fn send_event(&mut self, ev: CacheEvent) {
        self.enqueue(Outgoing::Event(ev));
        self.pump().await;
    }

    /// Queues a message, unless a reconcile is owed (the reverse map already holds what it
    /// carries, and the reconcile sends all of that).
    fn enqueue(&mut self, message: Outgoing) {
        if self.link.reconcile.is_some() {
            return;
        }
        if self.link.outbox.push(message) == Pushed::Overflowed {
            Telemetry::inc(&self.cfg.telemetry.link.outbox_overflows);
            warn!(
                event = "outbox_overflow",
                max_entries = self.cfg.outbox_max_entries,
                "outbox full while the server is unreachable; the replica will be reconciled"
            );
            self.link.reconcile = Some(ReconcileReason::OutboxOverflow);
        }
        self.cfg.telemetry.link.outbox(&self.link.outbox);
    }

    /// Whether a backoff still holds further attempts back.
    fn backing_off(&self) -> bool {
        self.link.retry_at.is_some_and(|at| Instant::now() < at)
    }

    /// After a failed attempt: wait the next delay of the schedule before the next one.
    fn failed(&mut self, what: &str, status: &tonic::Status) {
        let (min, max) = (self.cfg.retry_min, self.cfg.retry_max);
        let delay = self
            .link
            .backoff
            .get_or_insert_with(|| link::retry_schedule(min, max))
            .next()
            .unwrap_or(max)
            // Jitter may add up to the delay itself; the cap is what operators are promised.
            .min(max);
        self.link.retry_at = Some(Instant::now() + delay);
        if !self.link.warned {
            self.link.warned = true;
            warn!(
                code = ?status.code(),
                err = %status.message(),
                rpc = what,
                outbox = self.link.outbox.len(),
                "send_failed"
            );
        }
    }

    /// After a successful call: the schedule starts over.
    fn succeeded(&mut self) {
        self.link.retry_at = None;
        self.link.backoff = None;
        if self.link.warned {
            self.link.warned = false;
            info!(event = "server_reachable", "the server answers again");
        }
    }

    /// Notes which server instance answered: a different one than before may hold less (a
    /// restart) or more (a restore from an older checkpoint, another replica of a pair) than
    /// this replica reported, so it owes a digest comparison.
    fn note_instance(&mut self, instance: &str) {
        if instance.is_empty() {
            return;
        }
        match &self.link.instance {
            Some(known) if known == instance => {}
            Some(known) => {
                Telemetry::inc(&self.cfg.telemetry.link.instance_changes);
                info!(
                    event = "server_instance_changed",
                    from = %known,
                    to = %instance,
                    "a new server instance answers; comparing this replica's digest"
                );
                self.link.instance = Some(instance.to_string());
                self.link.verify = true;
            }
            None => self.link.instance = Some(instance.to_string()),
        }
    }

    async fn deliver(&mut self, message: Outgoing) -> Result<Ack, tonic::Status> {
        match message {
            Outgoing::Update(update) => {
                let result = self.sink.report(update).await;
                match &result {
                    Ok(_) => {
                        self.counters.updates_sent += 1;
                        Telemetry::inc(&self.cfg.telemetry.updates_sent);
                    }
                    Err(_) => {
                        self.counters.updates_failed += 1;
                        Telemetry::inc(&self.cfg.telemetry.report_errors);
                    }
                }
                result
            }
            Outgoing::Event(event) => {
                let clear = event.r#type == cache_event::Type::AllCleared as i32;
                let result = self.sink.publish(event).await;
                let telemetry = &self.cfg.telemetry;
                match &result {
                    Ok(_) => {
                        self.counters.events_sent += 1;
                        if clear {
                            Telemetry::inc(&telemetry.clears_sent);
                        } else {
                            Telemetry::inc(&telemetry.evictions_sent);
                        }
                    }
                    Err(_) => {
                        self.counters.events_failed += 1;
                        Telemetry::inc(&telemetry.publish_errors);
                    }
                }
                result
            }
        }
    }

    /// Moves the link forward as far as the server lets it: an owed reconcile, then the outbox
    /// in order, then an owed digest comparison. Returns at the first failure (the backoff
    /// decides when the next attempt is due) and does nothing while backing off.
    pub async fn pump(&mut self) {
        if self.backing_off() {
            return;
        }
        loop {
            if let Some(reason) = self.link.reconcile {
                if !self.reconcile(reason).await {
                    return;
                }
                continue;
            }
            let Some(mut head) = self.link.outbox.pop() else {
                if self.link.verify && self.pending.is_empty() {
                    self.verify().await;
                    if self.link.reconcile.is_some() && !self.backing_off() {
                        continue;
                    }
                }
                return;
            };
            if head.attempts > 0 {
                Telemetry::inc(&self.cfg.telemetry.link.send_retries);
            }
            let rpc = match &head.message {
                Outgoing::Update(_) => "ReportCacheState",
                Outgoing::Event(_) => "PublishEvent",
            };
            match self.deliver(head.message.clone()).await {
                Ok(ack) => {
                    self.succeeded();
                    self.note_instance(&ack.server_instance_id);
                }
                Err(status) => {
                    head.attempts += 1;
                    self.link.outbox.unpop(head);
                    // It may have been applied, or may still be (a timed-out call): prove it.
                    self.link.verify = true;
                    self.failed(rpc, &status);
                }
            }
            self.cfg.telemetry.link.outbox(&self.link.outbox);
            if self.backing_off() {
                return;
            }
        }
    }

    fn state_request(&self, with_digest: bool) -> GetCacheStateRequest {
        let id = &self.cfg.identity;
        GetCacheStateRequest {
            model_id: id.model_id.clone(),
            tenant_id: id.tenant_id.clone(),
            replica_id: if with_digest {
                id.replica_id.clone()
            } else {
                String::new()
            },
        }
    }

    /// Compares the reverse map's digest with the server's digest of this replica (asked
    /// again once after [`link::RECHECK_DELAY`] when they differ); a mismatch, or a server
    /// that cannot answer with a digest, owes a reconcile. Called with nothing queued or
    /// pending, so the two sides describe the same moment.
    async fn verify(&mut self) {
        // L2 mode reports removed blocks as T2 and forgets them: the index rightly holds
        // entries the reverse map does not, so no digest can match. It reconciles instead.
        if self.cfg.l2_mode {
            self.link.verify = false;
            self.link.reconcile = Some(ReconcileReason::Unproven);
            return;
        }
        let local =
            link::replica_digest(&self.cfg.identity.hash_scheme, self.map.current_entries());
        for attempt in 0..2 {
            let answer = match self.sink.cache_state(self.state_request(true)).await {
                Ok(answer) => answer,
                Err(status) => {
                    self.failed("GetCacheState", &status);
                    return;
                }
            };
            self.succeeded();
            self.note_instance(&answer.server_instance_id);
            self.link.verify = false;
            let Some(remote) = answer.replica_digest else {
                self.link.digests = Some(false);
                self.link.reconcile = Some(ReconcileReason::Unproven);
                return;
            };
            self.link.digests = Some(true);
            Telemetry::inc(&self.cfg.telemetry.link.digest_checks);
            let hash = <[u8; 16]>::try_from(remote.digest.as_slice())
                .map(u128::from_be_bytes)
                .ok();
            let entries = u64::try_from(remote.entries).ok();
            if entries == Some(local.0) && hash == Some(local.1) {
                return;
            }
            if attempt == 0 {
                tokio::time::sleep(link::RECHECK_DELAY).await;
                continue;
            }
            Telemetry::inc(&self.cfg.telemetry.link.digest_mismatches);
            warn!(
                event = "digest_mismatch",
                local_entries = local.0,
                server_entries = remote.entries,
                "the server's entries of this replica differ from the engine's; reconciling"
            );
            self.link.reconcile = Some(ReconcileReason::DigestMismatch);
        }
    }

    /// Clears this replica on the server and sends its full current block set, in updates of
    /// at most `flush_threshold` entries; whatever was queued is superseded. Returns false on
    /// a failure (the reconcile stays owed and starts over) or when the server instance changed
    /// on the way (what went to the old one may be lost).
    async fn reconcile(&mut self, reason: ReconcileReason) -> bool {
        self.link.outbox.clear();
        self.cfg.telemetry.link.outbox(&self.link.outbox);
        self.pending.clear();
        self.pending_ts_us = 0;
        let id = &self.cfg.identity;
        let clear = CacheEvent {
            r#type: cache_event::Type::AllCleared as i32,
            replica_id: id.replica_id.clone(),
            model_id: id.model_id.clone(),
            tenant_id: id.tenant_id.clone(),
            prefix_hash: Vec::new(),
            timestamp_us: 0,
            adapter_id: String::new(),
        };
        let entries = self.map.current_entries();
        let started_with = self.link.instance.clone();
        let mut messages = vec![Outgoing::Event(clear)];
        let chunk = self.cfg.flush_threshold.max(1);
        for part in entries.chunks(chunk) {
            let prefixes = part.iter().cloned().map(tiered_entry).collect();
            messages.push(Outgoing::Update(self.update(0, prefixes)));
        }
        for message in messages {
            let rpc = match message {
                Outgoing::Update(_) => "ReportCacheState",
                Outgoing::Event(_) => "PublishEvent",
            };
            match self.deliver(message).await {
                Ok(ack) => {
                    self.succeeded();
                    self.note_instance(&ack.server_instance_id);
                }
                Err(status) => {
                    self.failed(rpc, &status);
                    return false;
                }
            }
        }
        if started_with.is_some() && self.link.instance != started_with {
            // Started against one instance, ended against another: start over.
            return true;
        }
        self.link.reconcile = None;
        self.link.verify = false;
        self.counters.reconciles += 1;
        self.cfg.telemetry.link.reconciled(reason);
        info!(
            event = "reconcile",
            reason = reason.as_str(),
            entries = entries.len(),
            "cleared this replica on the server and sent its full block set"
        );
        true
    }

    /// Asks the server which instance it is (a cheap question), so a restart is noticed even
    /// while the engine is idle.
    async fn probe(&mut self) {
        if self.backing_off() || !self.link.outbox.is_empty() {
            return;
        }
        match self.sink.cache_state(self.state_request(false)).await {
            Ok(answer) => {
                self.succeeded();
                self.note_instance(&answer.server_instance_id);
            }
            Err(status) => {
                // The server is gone: whatever answers next (the same process after a freeze,
                // a restarted one, another one) is verified, and it is asked as often as the
                // backoff allows rather than at the next probe, so a restart from a checkpoint
                // is noticed within the retry delay of its readiness.
                self.link.verify = true;
                self.failed("GetCacheState", &status);
                return;
            }
        }
        self.pump().await;
    }

    /// The periodic anti-entropy comparison (skipped against a server without digests, which
    /// would otherwise make every period a reconcile).
    async fn anti_entropy(&mut self) {
        if self.link.digests == Some(false) {
            return;
        }
        self.flush().await;
        self.link.verify = true;
        self.pump().await;
    }

    /// Runs until `rx` closes: batches are handled as they come, pending adds are flushed on
    /// every window tick, the outbox is retried when its backoff ends, the server instance is
    /// probed and the digest compared periodically; when the input closes, a final flush and
    /// a bounded attempt to deliver what is left.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Input>) -> Self {
        let window = if self.cfg.window.is_zero() {
            DEFAULT_WINDOW
        } else {
            self.cfg.window
        };
        let mut ticker = tokio::time::interval_at(Instant::now() + window, window);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let never = Duration::from_secs(365 * 24 * 3600);
        let period = |d: Duration| if d.is_zero() { never } else { d };
        let probe_every = period(self.cfg.probe_interval);
        let mut probe = tokio::time::interval_at(Instant::now() + probe_every, probe_every);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let check_every = period(self.cfg.anti_entropy_interval);
        let mut check = tokio::time::interval_at(Instant::now() + check_every, check_every);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let retry_at = self.link.retry_at;
            // Unbiased: a steady stream of batches cannot starve the window tick.
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(input) => self.handle(&input).await,
                    None => break,
                },
                _ = ticker.tick() => self.flush().await,
                _ = tokio::time::sleep_until(retry_at.unwrap_or_else(|| Instant::now() + never)), if retry_at.is_some() => {
                    self.link.retry_at = None;
                    self.pump().await;
                }
                _ = probe.tick() => self.probe().await,
                _ = check.tick() => self.anti_entropy().await,
            }
        }
        self.flush().await;
        let deadline = Instant::now() + FINAL_DELIVERY;
        while !self.link.outbox.is_empty() || self.link.reconcile.is_some() {
            let at = self
                .link
                .retry_at
                .unwrap_or_else(Instant::now)
                .min(deadline);
            tokio::time::sleep_until(at).await;
            if Instant::now() >= deadline {
                break;
            }
            self.link.retry_at = None;
            self.pump().await;
        }
        let c = self.counters;
        info!(
            updates_sent = c.updates_sent,
            updates_failed = c.updates_failed,
            events_sent = c.events_sent,
            events_failed = c.events_failed,
            undelivered = self.link.outbox.len(),
            "reporter_drained"
        );
        self
    }
}

/// How long a stopping reporter keeps trying to deliver its outbox.
pub const FINAL_DELIVERY: Duration = Duration::from_secs(3);

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
