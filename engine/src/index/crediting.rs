//! LFU crediting (V3, V4, D4, L9): a PREFIX_MATCH lookup in an LFU namespace captures its hits
//! ([`CapturedHits`]); they are credited only once the answer is delivered, and only to the
//! entry they saw (generation-checked): a hit whose entry was removed or replaced is ignored.

use super::Index;
use super::records::Partition;
use crate::ReplicaId;
use crate::raw::key::KeyBytesOwned;
use crate::raw::key::key_parts;
use crate::raw::lfu::Credited;
use crossbeam_epoch::{self as epoch, Guard};
use std::sync::Arc;

/// One captured LFU hit (L9): identifies one storage entry by key, replica and generation.
#[derive(Clone)]
pub(super) struct Hit {
    pub(super) replica: ReplicaId,
    pub(super) rep: u32,
    pub(super) key: KeyBytesOwned,
    pub(super) generation: u32,
}

/// Hits captured by a PREFIX_MATCH lookup in an LFU namespace, not yet credited (L9, V4).
#[derive(Clone, Default)]
pub struct CapturedHits {
    pub(super) part: Option<Arc<Partition>>,
    pub(super) hits: Vec<Hit>,
}

impl std::fmt::Debug for CapturedHits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedHits")
            .field("len", &self.hits.len())
            .finish()
    }
}

impl CapturedHits {
    /// Number of captured entries.
    pub fn len(&self) -> usize {
        self.hits.len()
    }
    /// No captured entry.
    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }
    /// Captured entries of one replica.
    pub fn count_for(&self, replica: &str) -> usize {
        self.hits.iter().filter(|h| &*h.replica == replica).count()
    }
    /// Drops every hit.
    pub fn clear(&mut self) {
        self.hits.clear();
        self.part = None;
    }
    /// Keeps only the hits of replicas for which `keep` returns true.
    pub fn retain_replicas(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.hits.retain(|h| keep(&h.replica));
    }
}

impl Index {
    /// Credits captured hits (lock-free). Hits whose entry was removed (or replaced by a new
    /// entry with the same key and replica) are ignored (L9, T92).
    pub fn credit_hits(&self, hits: &CapturedHits) {
        let Some(part) = hits.part.as_deref() else {
            return;
        };
        let guard = epoch::pin();
        for hit in hits.hits.iter() {
            self.credit_one(part, hit.key.as_bytes(), hit.rep, hit.generation, &guard);
        }
    }

    /// One LFU credit of the entry `(key, rep)` if it is still the `generation` credited.
    pub(crate) fn credit_one(
        &self,
        part: &Partition,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &Guard,
    ) {
        let (digest, long) = key_parts(key);
        let live =
            |h: Option<crate::raw::holder::Holder>| h.is_some_and(|h| h.generation() == generation);
        if !live(part.store.entry(digest, long, rep, guard)) {
            return;
        }
        // Lock-free once the entry has an LFU cell; the first credit creates it under the
        // partition's writer lock after re-validating the entry there (removals kill cells
        // under the same lock, so a cell is never created for a removed entry).
        let cell = match part.lfu.cell(digest, rep, generation, guard) {
            Some(c) => c,
            None => {
                let created = part.store.with_entry_locked(digest, long, rep, guard, |h| {
                    live(h).then(|| part.lfu.cell_or_create(key, rep, generation, guard))
                });
                match created {
                    Some(c) => c,
                    None => return,
                }
            }
        };
        // Counts above the threshold go to per-core stripes under contention and leave the
        // key sum alone: it only needs min(count, threshold) per cell to decide "hot" (D4).
        let lanes = self.stripe_lanes;
        if cell.credit(self.hot_threshold(), lanes, &part.lfu) == Credited::BelowThreshold {
            self.add_key_access(&part.model, cell.ksum(), 1);
        }
    }
}
