//! What replicated mode needs from the index (see `docs/scale-out.md`).
//!
//! In replicated mode every server applies the same ordered log, so two servers hold the same
//! entries as long as every state change is a function of the log alone. Three kinds of change
//! are not: evictions (the cap, quotas and the TTL sweep decide from local state and the local
//! clock), LFU credits (each server sees its own lookups) and the moment a timestamp `0` is
//! resolved. The server resolves timestamps before it logs an update; this module provides the
//! rest:
//!
//! - **A switch for local eviction** ([`Index::set_local_eviction`]). Off, an ingest never
//!   enforces the cap or a quota and the sweep never removes an entry by TTL (it still expires
//!   stale stats and reclaims empty records, which no lookup answer depends on). A follower runs
//!   with it off; the one server that decides (the leader) runs with it on.
//! - **A decision log** ([`Index::set_decision_log`]): every entry the leader's cap, quotas or
//!   sweep removes is reported with its identity and the `last_seen` it had, so the server can
//!   log the decision for everybody.
//! - **Applying a decision** ([`Index::remove_decided`]): remove the entry only if it is still
//!   present with a `last_seen` no newer than the decided one. Every server applies a decision
//!   the same way at the same log position, so they agree whatever happened to the entry
//!   between the decision and its position in the log (a refresh since keeps it everywhere).
//! - **Credits as data** ([`CapturedHits::for_each_hit`], [`Index::credit_entry`]): lookups of
//!   LFU namespaces are counted by the server and logged; every server applies the counts.
//! - **A digest** ([`Index::digest`]): an order-independent hash over every entry, so equal
//!   digests mean equal contents.
//! - **A replica's digest** ([`Index::replica_digest`], [`replica_entry_hash`]): the same kind
//!   of sum over one replica's entries of one (tenant, model), over the values its producer
//!   knows (scheme, adapter, key, tier, token count; not `last_seen`), so a producer can prove
//!   the index holds exactly the entries it reported (the sidecar's anti-entropy).
//! - **Clearing** ([`Index::remove_everything`]): a server that must re-bootstrap drops what
//!   it holds before it loads a checkpoint.

use super::DumpPartition;
use super::counters::Pending;
use super::decision_log::{Decided, DecisionLog};
use super::records::Partition;
use super::{CapturedHits, Index};
use crate::raw::holder::{tier_code, tier_wire};
use crate::raw::key::key_parts;
use crossbeam_epoch as epoch;
use std::sync::Arc;
// The switch is a setting outside the loom seam (see `Index::local_eviction`'s field).
use std::sync::atomic::Ordering;
use xxhash_rust::xxh3::xxh3_128;

/// An order-independent summary of the index's entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexDigest {
    /// Storage entries summed (reserved tenants excluded).
    pub entries: u64,
    /// Sum (wrapping) of a 128-bit hash of each entry's identity and values.
    pub hash: u128,
}

impl Index {
    /// The index clock now (µs): what a timestamp `0` resolves to.
    pub fn now_us(&self) -> i64 {
        self.clock.now_us()
    }

    /// Turns local eviction (cap, quotas, TTL removal by the sweep) on or off. On by default.
    pub fn set_local_eviction(&self, on: bool) {
        self.local_eviction.store(on, Ordering::Release);
    }

    /// Whether this index decides its own evictions.
    pub fn local_eviction(&self) -> bool {
        self.local_eviction.load(Ordering::Acquire)
    }

    /// Installs (or with `None` removes) the decision log.
    pub fn set_decision_log(&self, log: Option<Arc<dyn DecisionLog>>) {
        let mut slot = self.decision_log.write();
        self.decision_log_set
            .store(log.is_some(), Ordering::Release);
        *slot = log;
    }

    /// Whether a decision log is installed (lets hot removal loops skip name lookups). One
    /// load, no lock: the cap asks it once per victim.
    pub(crate) fn decision_log_installed(&self) -> bool {
        self.decision_log_set.load(Ordering::Acquire)
    }

    /// Reports a removal to the decision log, if one is installed.
    pub(crate) fn log_decision(
        &self,
        part: &Partition,
        key: &[u8],
        replica_id: &str,
        last_seen_ms: i64,
    ) {
        if part.tenant.reserved {
            return;
        }
        if let Some(log) = &*self.decision_log.read() {
            log.removed(&Decided {
                tenant_id: &part.tenant.name,
                model_id: &part.model.name,
                hash_scheme: &part.scope.scheme,
                adapter_id: &part.adapter,
                replica_id,
                key,
                last_seen_ms,
            });
        }
    }

    /// Applies eviction decisions of one partition and replica: each `(key, last_seen_ms)` is
    /// removed if the replica still holds it with a `last_seen` ≤ the decided one. Returns the
    /// entries removed. Change notifications are published like any removal.
    pub fn remove_decided<K: AsRef<[u8]>>(
        &self,
        tenant_id: &str,
        model_id: &str,
        hash_scheme: &str,
        adapter_id: &str,
        replica_id: &str,
        entries: &[(K, i64)],
    ) -> u64 {
        let guard = epoch::pin();
        let Some(part) = self.part_ref(tenant_id, model_id, hash_scheme, adapter_id, &guard) else {
            return 0;
        };
        if part.tenant.reserved {
            return 0;
        }
        let Some(rep) = part.scope.enter_existing(replica_id) else {
            return 0;
        };
        let sink = self.active_sink(false);
        let now_us = self.clock.now_us();
        let mut removed = 0u64;
        let mut pend = Pending::default();
        for (key, decided_ms) in entries {
            let key = key.as_ref();
            if key.is_empty() {
                continue;
            }
            let (digest, long) = key_parts(key);
            let report = part.store.remove_entry_if(
                digest,
                long,
                rep,
                &guard,
                |h, _| h.last_seen_ms() <= *decided_ms,
                |h| self.entry_removed(part, key, &h, &guard, &mut pend),
            );
            if report.removed == 0 {
                continue;
            }
            removed += 1;
            pend.keys -= report.keys_removed as i64;
            if let Some(s) = &sink {
                s.publish(&crate::ChangeEvent {
                    kind: crate::ChangeKind::Removed,
                    tenant_id,
                    model_id,
                    replica_id,
                    prefix_hash: key,
                    adapter_id,
                    timestamp_us: now_us,
                });
            }
        }
        self.flush_pending(part, rep, &mut pend, &guard);
        part.scope.exit(rep);
        removed
    }

    /// Credits the entry `(key, replica)` of one partition `times` times (an LFU credit logged
    /// by some server's lookups). Absent entries are ignored, as a credit of a removed entry is.
    #[allow(clippy::too_many_arguments)]
    pub fn credit_entry(
        &self,
        tenant_id: &str,
        model_id: &str,
        hash_scheme: &str,
        adapter_id: &str,
        replica_id: &str,
        key: &[u8],
        times: u32,
    ) {
        let guard = epoch::pin();
        let Some(part) = self.part_ref(tenant_id, model_id, hash_scheme, adapter_id, &guard) else {
            return;
        };
        let Some(rep) = part.scope.enter_existing(replica_id) else {
            return;
        };
        let (digest, long) = key_parts(key);
        let generation = part
            .store
            .entry(digest, long, rep, &guard)
            .map(|h| h.generation());
        if let Some(generation) = generation {
            for _ in 0..times.min(u32::from(u16::MAX)) {
                self.credit_one(part, key, rep, generation, &guard);
            }
        }
        part.scope.exit(rep);
    }

    /// Order-independent digest of every non-reserved entry: tenant, model, scheme, adapter,
    /// key, replica, tier, token count and `last_seen`. Taken without a lock (per-entry
    /// consistent, like a checkpoint's dump): equal only when compared at rest.
    pub fn digest(&self) -> IndexDigest {
        let mut digest = IndexDigest::default();
        let mut buf: Vec<u8> = Vec::with_capacity(256);
        for part in self.dump_partitions() {
            for shard in 0..DumpPartition::SHARDS {
                part.for_each_entry(shard, |key, _slot, replica, entry| {
                    buf.clear();
                    for field in [
                        part.tenant().as_bytes(),
                        part.model().as_bytes(),
                        part.scheme().as_bytes(),
                        part.adapter().as_bytes(),
                        key,
                        replica.as_str().as_bytes(),
                    ] {
                        buf.extend_from_slice(&(field.len() as u32).to_le_bytes());
                        buf.extend_from_slice(field);
                    }
                    buf.extend_from_slice(&entry.tier.to_le_bytes());
                    buf.extend_from_slice(&entry.tokens.to_le_bytes());
                    buf.extend_from_slice(&entry.last_seen_ms.to_le_bytes());
                    digest.entries += 1;
                    digest.hash = digest.hash.wrapping_add(xxh3_128(&buf));
                });
            }
        }
        digest
    }

    /// Order-independent digest of the entries `replica_id` holds under (`tenant_id`,
    /// `model_id`), every scheme and adapter: the scope an `ALL_CLEARED` of that replica
    /// clears. Each entry adds [`replica_entry_hash`] of its scheme, adapter, key, tier and
    /// token count, so a producer that sums the same over the entries it reported gets the same
    /// digest exactly when the index holds those entries and no other. Walks only the pair's
    /// partitions, without a lock (per-entry consistent, like [`Index::digest`]).
    pub fn replica_digest(&self, tenant_id: &str, model_id: &str, replica_id: &str) -> IndexDigest {
        let mut digest = IndexDigest::default();
        for part in self.dump_partitions() {
            if part.tenant() != tenant_id || part.model() != model_id {
                continue;
            }
            for shard in 0..DumpPartition::SHARDS {
                part.for_each_entry(shard, |key, _slot, replica, entry| {
                    if replica.as_str() != replica_id {
                        return;
                    }
                    digest.entries += 1;
                    digest.hash = digest.hash.wrapping_add(replica_entry_hash(
                        part.scheme(),
                        part.adapter(),
                        key,
                        entry.tier,
                        entry.tokens,
                    ));
                });
            }
        }
        digest
    }

    /// Removes every entry (re-bootstrap). Returns the entries removed. Stats records stay:
    /// the next load replaces those it holds and the sweep expires the rest.
    pub fn remove_everything(&self) -> u64 {
        let parts: Vec<Arc<Partition>> = self.all_parts.lock().clone();
        let mut removed = 0;
        for p in parts.iter().filter(|p| !p.tenant.reserved) {
            removed += self.walk_remove(p, |_| true, |_, _| {}).removed as u64;
        }
        removed
    }
}

/// One entry's term of [`Index::replica_digest`]: a 128-bit hash of its scheme, adapter, key,
/// tier (a wire value, normalized as the index stores it: K6) and token count. A producer
/// sums (wrapping) this over the entries it reported to compare with the index's digest.
pub fn replica_entry_hash(
    scheme: &str,
    adapter: &str,
    key: &[u8],
    wire_tier: i32,
    tokens: i32,
) -> u128 {
    let mut buf: Vec<u8> = Vec::with_capacity(64 + key.len() + adapter.len() + scheme.len());
    for field in [scheme.as_bytes(), adapter.as_bytes(), key] {
        buf.extend_from_slice(&(field.len() as u32).to_le_bytes());
        buf.extend_from_slice(field);
    }
    buf.extend_from_slice(&tier_wire(tier_code(wire_tier)).to_le_bytes());
    buf.extend_from_slice(&tokens.to_le_bytes());
    xxh3_128(&buf)
}

impl CapturedHits {
    /// Calls `f(tenant, model, scheme, adapter, replica, key)` for every captured hit (so a
    /// server can log credits instead of applying them).
    pub fn for_each_hit(&self, mut f: impl FnMut(&str, &str, &str, &str, &str, &[u8])) {
        let Some(part) = self.part.as_deref() else {
            return;
        };
        for hit in &self.hits {
            f(
                &part.tenant.name,
                &part.model.name,
                &part.scope.scheme,
                &part.adapter,
                hit.replica.as_str(),
                hit.key.as_bytes(),
            );
        }
    }
}
