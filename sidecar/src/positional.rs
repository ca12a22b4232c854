//! Positional hashing with the per-replica reverse map (spec `sidecar.md` §5).
//!
//! Engine block hashes are engine-private (random roots, salted, scheme-specific). The sidecar
//! re-keys every stored block with the content fingerprint (`fingerprint.md`), continuing from
//! the parent block's prefix hash when the parent is known, so the result equals a gateway's
//! fingerprint of the whole prompt across any split of the blocks into suffix events.

use crate::wire::BlockStored;
use inferencecache_engine::fingerprint::{prefix_hashes_from, to_wire};
use std::collections::HashMap;

/// What the sidecar remembers about one engine block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// Fingerprint prefix hash of the sequence ending with this block.
    pub prefix_hash: u64,
    /// Tokens from the start of the sequence through this block.
    pub cumulative_tokens: i32,
    /// Adapter partition the block was indexed under.
    pub adapter: String,
}

/// One index entry derived from an engine block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Wire form (8 bytes big-endian) of the prefix hash.
    pub prefix_hash: [u8; 8],
    /// Cumulative token count.
    pub token_count: i32,
    /// Adapter partition.
    pub adapter: String,
}

/// Engine block hash → positional fingerprint, for one replica.
#[derive(Debug, Default)]
pub struct ReverseMap {
    map: HashMap<Vec<u8>, Known>,
}

impl ReverseMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of known engine blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no block is known.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Looks up one engine block.
    pub fn get(&self, engine_hash: &[u8]) -> Option<&Known> {
        self.map.get(engine_hash)
    }

    /// Derives the index entries of a `BlockStored` event under `adapter` and records its blocks.
    /// Returns nothing when the event cannot be keyed (bad block size, no hashes, or token ids
    /// that do not cover exactly the announced blocks).
    pub fn store(&mut self, ev: &BlockStored, adapter: &str) -> Vec<Entry> {
        let bs = ev.block_size;
        if bs <= 0 || ev.block_hashes.is_empty() {
            return Vec::new();
        }
        let (parent, parent_tokens) =
            match ev.parent_block_hash.as_ref().and_then(|p| self.map.get(p)) {
                Some(k) => (Some(k.prefix_hash), i64::from(k.cumulative_tokens)),
                None => (None, 0),
            };
        let Ok(bs_usize) = usize::try_from(bs) else {
            return Vec::new();
        };
        let phs = prefix_hashes_from(&ev.token_ids, bs_usize, parent);
        if phs.len() != ev.block_hashes.len() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(phs.len());
        for (i, (ph, engine_hash)) in phs.iter().zip(&ev.block_hashes).enumerate() {
            let tokens = parent_tokens.saturating_add((i as i64 + 1).saturating_mul(bs));
            let tokens = i32::try_from(tokens).unwrap_or(i32::MAX);
            self.map.insert(
                engine_hash.clone(),
                Known {
                    prefix_hash: *ph,
                    cumulative_tokens: tokens,
                    adapter: adapter.to_string(),
                },
            );
            out.push(Entry {
                prefix_hash: to_wire(*ph),
                token_count: tokens,
                adapter: adapter.to_string(),
            });
        }
        out
    }

    /// Forgets the given engine blocks and returns the entries of those that were known.
    pub fn remove(&mut self, engine_hashes: &[Vec<u8>]) -> Vec<Entry> {
        engine_hashes
            .iter()
            .filter_map(|h| self.map.remove(h))
            .map(|k| Entry {
                prefix_hash: to_wire(k.prefix_hash),
                token_count: k.cumulative_tokens,
                adapter: k.adapter,
            })
            .collect()
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.map.clear();
    }
}
