//! Positional hashing over engine page chains, for one replica (spec `sidecar.md` §5).
//!
//! Engine block hashes are engine-private (random roots, salted, scheme-specific). The sidecar
//! re-keys every stored page with the content fingerprint (`fingerprint.md`) of index blocks of
//! `block_size` tokens (the server's `--engine-block-size`), continuing from the parent page,
//! so the result equals a gateway's fingerprint of the whole prompt across any split of the
//! pages into events and any engine page size.
//!
//! Invariants (the index never holds an entry the engine does not hold):
//! - A page is keyed only when its whole prefix is known: a root (`parent_block_hash` absent)
//!   or a child of a known page. A page whose parent is unknown (a gap, or a chain that began
//!   before the sidecar listened) is skipped with its whole event, and so are its descendants.
//! - Each index block is *owned* by the page holding its last token. Pages smaller than the
//!   block size (SGLang `page_size = 1`) carry the tokens after their last block boundary
//!   (`tail`, always shorter than one block) so the next page of the chain can complete the
//!   block; pages larger than the block size own several blocks; a page that does not divide
//!   the block size owns the blocks that end inside it, which may start in its parent.
//! - When a page's last copy is removed, it and every page after it in the chain are forgotten
//!   and their blocks evicted: an index block is reusable only while every page under it is.
//! - A page held in several media is reported at its hottest tier; removing one medium drops
//!   only that copy (and re-reports the blocks at the next tier).
//! - Blocks whose engine hash depends on more than tokens (vLLM `extra_keys` beyond the LoRA
//!   name, SGLang `cache_salt`) are skipped, with the rest of their chain: a lookup carries
//!   tokens only, so any index key for them would match a prompt the engine would not reuse.

use crate::tier::{self, Tier};
use crate::wire::BlockStored;
use inferencecache_engine::fingerprint::{prefix_hashes_from, to_wire};
use std::collections::{BTreeMap, HashMap};

/// One index entry derived from an engine page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Wire form (8 bytes big-endian) of the prefix hash.
    pub prefix_hash: [u8; 8],
    /// Cumulative token count.
    pub token_count: i32,
    /// Adapter partition.
    pub adapter: String,
    /// Hottest tier still holding the block.
    pub tier: Tier,
}

/// What the sidecar remembers about one engine page.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Page {
    parent: Option<Vec<u8>>,
    children: Vec<Vec<u8>>,
    /// Prefix hash at the last index-block boundary at or before the page's end.
    boundary_hash: Option<u64>,
    /// Tokens from the chain start to that boundary.
    boundary_tokens: i64,
    /// Tokens after the boundary through the page's end (shorter than one block).
    tail: Vec<u32>,
    /// Index blocks that end inside this page: (prefix hash, cumulative tokens).
    owned: Vec<(u64, i32)>,
    adapter: String,
    /// Media key → tier of every copy the engine holds.
    media: BTreeMap<String, Tier>,
}

impl Page {
    fn hottest(&self) -> Option<Tier> {
        self.media.values().min().copied()
    }

    fn entries(&self, tier: Tier) -> impl Iterator<Item = Entry> + '_ {
        self.owned.iter().map(move |&(hash, tokens)| Entry {
            prefix_hash: to_wire(hash),
            token_count: tokens,
            adapter: self.adapter.clone(),
            tier,
        })
    }
}

/// What one `BlockStored` event produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// Entries to report: new blocks and known blocks that gained a hotter copy.
    pub entries: Vec<Entry>,
    /// Pages skipped because their parent is unknown.
    pub orphan_pages: usize,
    /// Pages skipped because their hash depends on extra keys or a cache salt.
    pub keyed_pages: usize,
    /// True when the token ids do not cover the announced pages (nothing was keyed).
    pub mismatched: bool,
    /// True when the medium is not in the tier table.
    pub unknown_medium: bool,
}

/// What one `BlockRemoved` event produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// Entries whose last copy is gone (with every later block of their chains).
    pub evicted: Vec<Entry>,
    /// Entries still held in a colder medium, at their new tier.
    pub retiered: Vec<Entry>,
}

/// Engine page hash → positional fingerprint state, for one replica.
#[derive(Debug)]
pub struct ReverseMap {
    pages: HashMap<Vec<u8>, Page>,
    block_size: usize,
}

impl Default for ReverseMap {
    fn default() -> Self {
        Self::new(16)
    }
}

impl ReverseMap {
    /// An empty map keying index blocks of `block_size` tokens (0 is treated as 1).
    pub fn new(block_size: usize) -> Self {
        Self {
            pages: HashMap::new(),
            block_size: block_size.max(1),
        }
    }

    /// Number of known engine pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// True when no page is known.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// True when the engine page is known.
    pub fn contains(&self, engine_hash: &[u8]) -> bool {
        self.pages.contains_key(engine_hash)
    }

    /// Keys the pages of a `BlockStored` event under `adapter` and records them.
    pub fn store(&mut self, ev: &BlockStored, adapter: &str) -> Stored {
        let mut out = Stored::default();
        let pages = ev.block_hashes.len();
        let page_size = usize::try_from(ev.block_size).unwrap_or(0);
        if pages == 0 {
            return out;
        }
        if page_size == 0
            || page_size
                .checked_mul(pages)
                .is_none_or(|needed| ev.token_ids.len() < needed)
        {
            out.mismatched = true;
            return out;
        }
        let classified = tier::classify(ev.medium.as_deref());
        out.unknown_medium = classified.unknown;
        let tier = classified.tier;
        let media_key = tier::media_key(ev.medium.as_deref());

        let (mut boundary_hash, mut boundary_tokens, mut tail) = match &ev.parent_block_hash {
            None => (None, 0i64, Vec::new()),
            Some(parent) => match self.pages.get(parent) {
                Some(p) => (p.boundary_hash, p.boundary_tokens, p.tail.clone()),
                None => {
                    out.orphan_pages = pages;
                    return out;
                }
            },
        };
        let keyed_from = if ev.cache_salt.is_some() {
            Some(0)
        } else {
            ev.first_keyed_block
        };
        let mut parent = ev.parent_block_hash.clone();
        for (i, hash) in ev.block_hashes.iter().enumerate() {
            if keyed_from.is_some_and(|k| i >= k) {
                out.keyed_pages = pages - i;
                break;
            }
            if let Some(known) = self.pages.get_mut(hash) {
                // Another copy of a known page: keep its keys, report a hotter tier.
                let before = known.hottest();
                known.media.insert(media_key.clone(), tier);
                if before.is_none_or(|b| tier < b) {
                    out.entries.extend(known.entries(tier));
                }
                boundary_hash = known.boundary_hash;
                boundary_tokens = known.boundary_tokens;
                tail = known.tail.clone();
                parent = Some(hash.clone());
                continue;
            }
            let mut tokens = std::mem::take(&mut tail);
            tokens.extend_from_slice(&ev.token_ids[i * page_size..(i + 1) * page_size]);
            let hashes = prefix_hashes_from(&tokens, self.block_size, boundary_hash);
            let block = i64::try_from(self.block_size).unwrap_or(i64::MAX);
            let owned: Vec<(u64, i32)> = hashes
                .iter()
                .enumerate()
                .map(|(k, &h)| {
                    let count =
                        boundary_tokens.saturating_add((k as i64 + 1).saturating_mul(block));
                    (h, i32::try_from(count).unwrap_or(i32::MAX))
                })
                .collect();
            let full = hashes.len() * self.block_size;
            tail = tokens[full..].to_vec();
            boundary_hash = hashes.last().copied().or(boundary_hash);
            boundary_tokens = boundary_tokens.saturating_add(full as i64);
            if let Some(p) = parent.as_ref().and_then(|p| self.pages.get_mut(p)) {
                p.children.push(hash.clone());
            }
            let page = Page {
                parent: parent.clone(),
                children: Vec::new(),
                boundary_hash,
                boundary_tokens,
                tail: tail.clone(),
                owned,
                adapter: adapter.to_string(),
                media: BTreeMap::from([(media_key.clone(), tier)]),
            };
            out.entries.extend(page.entries(tier));
            self.pages.insert(hash.clone(), page);
            parent = Some(hash.clone());
        }
        out
    }

    /// Removes the copy in `medium` (every copy when `None`) of each known page. A page left
    /// without copies is forgotten; with `cascade` so is every later page of its chain.
    pub fn remove(
        &mut self,
        engine_hashes: &[Vec<u8>],
        medium: Option<&str>,
        cascade: bool,
    ) -> Removed {
        let mut out = Removed::default();
        for hash in engine_hashes {
            let Some(page) = self.pages.get_mut(hash) else {
                continue;
            };
            let before = page.hottest();
            match medium {
                None => page.media.clear(),
                Some(m) => {
                    page.media.remove(&tier::media_key(Some(m)));
                }
            }
            match page.hottest() {
                Some(now) => {
                    if Some(now) != before {
                        out.retiered.extend(page.entries(now));
                    }
                }
                None => self.forget(hash, cascade, &mut out.evicted),
            }
        }
        out
    }

    fn forget(&mut self, hash: &[u8], cascade: bool, evicted: &mut Vec<Entry>) {
        let Some(page) = self.pages.remove(hash) else {
            return;
        };
        if let Some(parent) = page.parent.as_ref().and_then(|p| self.pages.get_mut(p)) {
            parent.children.retain(|c| c.as_slice() != hash);
        }
        // Iterative: SGLang chains of one-token pages are as deep as the prompt is long.
        let mut stack = vec![page];
        while let Some(page) = stack.pop() {
            let tier = page.hottest().unwrap_or(Tier::Gpu);
            evicted.extend(page.entries(tier));
            if cascade {
                stack.extend(page.children.iter().filter_map(|c| self.pages.remove(c)));
            }
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.pages.clear();
    }
}

impl ReverseMap {
    /// Every index entry the known pages own, each at its page's hottest tier: the replica's
    /// full current block set, which a reconcile sends and the anti-entropy digest sums.
    pub fn current_entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        for page in self.pages.values() {
            if let Some(tier) = page.hottest() {
                out.extend(page.entries(tier));
            }
        }
        out
    }
}
