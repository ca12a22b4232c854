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
//!
//! **Grouped mode** (vLLM ≥ 0.33, whose events carry `group_idx`): the map keeps, per page,
//! which KV-cache group holds which copy, and reports a page's blocks only while the engine
//! would reuse a prefix through them under its hybrid rule ([`crate::groups`]):
//! - A page is *claimable* when every known group accepts the prefix ending at the page's end
//!   and some group holds the page. With vLLM lookahead hashing (a block's hash covers the
//!   `L` tokens after it), a page is claimable only once the map holds the chain's next `L`
//!   tokens: the engine reuses the page only for a prompt that carries them.
//! - The reported pages are the claimable ones and every page before one (the index's
//!   lookup credits a leading run of blocks, so the path to a reusable end must be present).
//!   A lookup that follows a stored chain is therefore credited exactly what the engine
//!   reuses; one that leaves the chain between two claimable ends is credited up to where it
//!   leaves, which the engine may round down to the previous claimable end.
//! - A removal drops one group's copy; the page stays known while any group holds it, or
//!   while pages after it are known (they are forgotten by their own removals). Claims are
//!   re-evaluated for the page, the pages after it and (for the reported path) before it,
//!   so a removal in one group never erases a prefix the other groups keep reusable, and a
//!   claim shrinks as soon as the groups stop accepting it.
//!
//! Grouped mode's store, removal and settling walk are in `positional/grouped.rs`; the page
//! map, the legacy paths and the reconcile's view ([`ReverseMap::current_entries`]) are here.

use crate::groups::{Group, Groups, Kind};
use crate::tier::{self, Tier};
use crate::wire::BlockStored;
use inferencecache_engine::fingerprint::{prefix_hashes_from, to_wire};
use std::collections::{BTreeMap, HashMap, HashSet};

mod grouped;

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
    /// The chain's last index-block boundary at or before the page's end.
    boundary: Boundary,
    /// Index blocks that end inside this page: (prefix hash, cumulative tokens).
    owned: Vec<(u64, i32)>,
    adapter: String,
    /// Media key → tier of every copy the engine holds (legacy mode).
    media: BTreeMap<String, Tier>,
    /// Tokens in the page.
    page_tokens: u64,
    /// Grouped mode: (group, copy key) → tier of every copy the engine holds.
    copies: BTreeMap<(u32, String), Tier>,
    /// Grouped mode: tokens after the page that its engine hash covers (lookahead hashing).
    lookahead: u64,
    /// Grouped mode: the engine reuses the prefix ending at this page.
    claimable: bool,
    /// Grouped mode: this page is claimable or lies before a claimable page.
    on_claimed_path: bool,
    /// Grouped mode: the tier the page's blocks are reported at (`None` = not reported).
    reported: Option<Tier>,
    /// Grouped mode: bit `i` set when the `i`-th known group holds every page from the chain
    /// start through this one (kept for full-attention groups, whose rule needs it).
    held_from_start: u64,
}

impl Page {
    fn hottest(&self) -> Option<Tier> {
        self.media.values().min().copied()
    }

    /// Tokens from the chain start through the page's end.
    fn end_tokens(&self) -> u64 {
        u64::try_from(self.boundary.tokens).unwrap_or(0) + self.boundary.tail.len() as u64
    }

    fn holds(&self, group: u32) -> bool {
        self.copies.keys().any(|(g, _)| *g == group)
    }

    /// The tier a claim through this page is served from: per group its hottest copy, and the
    /// coldest of those (every group's copy is needed); GPU for a page no group holds.
    fn grouped_tier(&self) -> Tier {
        let mut per_group: BTreeMap<u32, Tier> = BTreeMap::new();
        for ((group, _), &tier) in &self.copies {
            per_group
                .entry(*group)
                .and_modify(|t| *t = (*t).min(tier))
                .or_insert(tier);
        }
        per_group.values().max().copied().unwrap_or(Tier::Gpu)
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
    /// Grouped mode: claims that shrank (a newly learned group, or a changed rule).
    pub evicted: Vec<Entry>,
    /// Grouped mode: the kind of the event's group.
    pub group_kind: Option<Kind>,
}

/// What one `BlockRemoved` event produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// Entries whose last copy is gone (with every later block of their chains).
    pub evicted: Vec<Entry>,
    /// Entries still held in a colder medium, at their new tier.
    pub retiered: Vec<Entry>,
    /// Grouped mode: one item per removed copy: its group's kind, and whether the page's
    /// blocks stayed reported (the other groups keep the prefix reusable).
    pub group_copies: Vec<(Kind, bool)>,
}

/// Which copies a `BlockRemoved` event names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removal<'a> {
    /// Storage medium; `None` = every medium.
    pub medium: Option<&'a str>,
    /// vLLM KV-cache group; `None` = every group.
    pub group: Option<u32>,
    /// vLLM `locality`.
    pub locality: Option<&'a str>,
    /// vLLM `ownership`.
    pub ownership: Option<&'a str>,
}

/// A group's contiguous holdings along a chain, up to some page.
#[derive(Debug, Clone)]
struct Walk {
    /// Bit `i`: the `i`-th known group (in [`Groups`] order) holds every page so far.
    all: u64,
    /// Per known group: tokens of the contiguous run of held pages ending here.
    run: Vec<u64>,
}

/// Where [`ReverseMap::settle`] starts: a page whose holdings changed, and how far after it
/// (in tokens past its end) claims may have changed with it; `None` = the whole subtree.
type Start = (Vec<u8>, Option<u64>);

/// Engine page hash → positional fingerprint state, for one replica.
#[derive(Debug)]
pub struct ReverseMap {
    pages: HashMap<Vec<u8>, Page>,
    block_size: usize,
    /// Grouped mode: on once an event carried a `group_idx`.
    grouped: bool,
    /// Groups learned from store events.
    groups: Groups,
    /// Configured attention chunk size of chunked-local groups (0 = unknown).
    attention_chunk: u64,
    /// Largest lookahead seen, in tokens.
    max_lookahead: u64,
    /// Grouped mode: copies of pages not known yet (a group whose event names hashes the
    /// map cannot key: null blocks left out, or a parent another group has not stored yet),
    /// attached when the page is keyed, dropped by a removal or a clear.
    parked: HashMap<Vec<u8>, BTreeMap<(u32, String), Tier>>,
}

impl Default for ReverseMap {
    fn default() -> Self {
        Self::new(16)
    }
}

/// What a `BlockStored` event's pages are, checked before any of them is keyed.
enum PageSize {
    /// The event names no page.
    NoPages,
    /// A zero page size, or token ids that do not cover every page: nothing is keyed.
    Mismatched,
    /// Tokens per engine page.
    Tokens(usize),
}

/// A `BlockStored` event whose pages can be keyed: its page size and the copy it reports.
struct EventCopy {
    /// Tokens per engine page.
    page_size: usize,
    /// The copy's tier.
    tier: Tier,
    /// The copy's key among a page's copies (medium, locality, ownership).
    media_key: String,
}

/// Checks the event's pages and classifies its copy (recording a mismatch or an unknown
/// medium in `out`); `None` when none of its pages can be keyed.
fn event_copy(ev: &BlockStored, out: &mut Stored) -> Option<EventCopy> {
    let page_size = match page_size(ev) {
        PageSize::NoPages => return None,
        PageSize::Mismatched => {
            out.mismatched = true;
            return None;
        }
        PageSize::Tokens(size) => size,
    };
    let classified = tier::classify_copy(ev.medium.as_deref(), ev.locality.as_deref());
    out.unknown_medium = classified.unknown;
    Some(EventCopy {
        page_size,
        tier: classified.tier,
        media_key: tier::copy_key(
            ev.medium.as_deref(),
            ev.locality.as_deref(),
            ev.ownership.as_deref(),
        ),
    })
}

fn page_size(ev: &BlockStored) -> PageSize {
    let pages = ev.block_hashes.len();
    let size = usize::try_from(ev.block_size).unwrap_or(0);
    if pages == 0 {
        PageSize::NoPages
    } else if size == 0
        || size
            .checked_mul(pages)
            .is_none_or(|needed| ev.token_ids.len() < needed)
    {
        PageSize::Mismatched
    } else {
        PageSize::Tokens(size)
    }
}

/// Where a chain stands at the end of a page: its last index-block boundary and the tokens
/// after it, which the next page of the chain completes into blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Boundary {
    /// Prefix hash at the boundary (`None` at the chain start).
    hash: Option<u64>,
    /// Tokens from the chain start to the boundary.
    tokens: i64,
    /// Tokens after the boundary (shorter than one block).
    tail: Vec<u32>,
}

impl Boundary {
    /// The index blocks one engine page completes: the waiting `tail` plus the page's tokens,
    /// cut into `block_size` blocks chained from `hash`. Returns what the page owns (each
    /// block's prefix hash and the cumulative token count through it) and moves the boundary
    /// past those blocks; the tokens after the last full block become the new `tail`.
    fn complete(&mut self, page: &[u32], block_size: usize) -> Vec<(u64, i32)> {
        let mut tokens = std::mem::take(&mut self.tail);
        tokens.extend_from_slice(page);
        let hashes = prefix_hashes_from(&tokens, block_size, self.hash);
        let block = i64::try_from(block_size).unwrap_or(i64::MAX);
        let start = self.tokens;
        let owned = hashes
            .iter()
            .enumerate()
            .map(|(k, &h)| {
                let count = start.saturating_add((k as i64 + 1).saturating_mul(block));
                (h, i32::try_from(count).unwrap_or(i32::MAX))
            })
            .collect();
        let full = hashes.len() * block_size;
        self.tail = tokens[full..].to_vec();
        self.hash = hashes.last().copied().or(self.hash);
        self.tokens = start.saturating_add(full as i64);
        owned
    }
}

impl ReverseMap {
    /// Where a stored event's chain starts: at the chain start without a parent, at the
    /// parent page's boundary when the map knows it, `None` (an orphan) when it does not.
    fn chain_start(&self, parent: Option<&Vec<u8>>) -> Option<Boundary> {
        match parent {
            None => Some(Boundary::default()),
            Some(parent) => self.pages.get(parent).map(|p| p.boundary.clone()),
        }
    }
}

impl ReverseMap {
    /// An empty map keying index blocks of `block_size` tokens (0 is treated as 1).
    pub fn new(block_size: usize) -> Self {
        Self {
            pages: HashMap::new(),
            block_size: block_size.max(1),
            grouped: false,
            groups: Groups::default(),
            attention_chunk: 0,
            max_lookahead: 0,
            parked: HashMap::new(),
        }
    }

    /// Sets the attention chunk size of chunked-local-attention groups (vLLM does not publish
    /// it; 0 = unknown, and such groups are then held to the full-attention rule).
    pub fn set_attention_chunk_size(&mut self, tokens: u64) {
        self.attention_chunk = tokens;
    }

    /// True once an event carried a `group_idx` (vLLM ≥ 0.33).
    pub fn is_grouped(&self) -> bool {
        self.grouped
    }

    /// The groups learned so far.
    pub fn groups(&self) -> &Groups {
        &self.groups
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
        if ev.group_idx.is_some() || self.grouped {
            return self.store_grouped(ev, adapter);
        }
        let mut out = Stored::default();
        let Some(EventCopy {
            page_size,
            tier,
            media_key,
        }) = event_copy(ev, &mut out)
        else {
            return out;
        };
        let pages = ev.block_hashes.len();

        let Some(mut boundary) = self.chain_start(ev.parent_block_hash.as_ref()) else {
            out.orphan_pages = pages;
            return out;
        };
        // Without groups there is no claim bookkeeping: a block hashed with lookahead tokens is
        // treated like one with extra keys.
        let keyed_from = min_some(first_keyed(ev), first_lookahead(ev));
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
                boundary = known.boundary.clone();
                parent = Some(hash.clone());
                continue;
            }
            let owned = boundary.complete(
                &ev.token_ids[i * page_size..(i + 1) * page_size],
                self.block_size,
            );
            if let Some(p) = parent.as_ref().and_then(|p| self.pages.get_mut(p)) {
                p.children.push(hash.clone());
            }
            let page = Page {
                parent: parent.clone(),
                children: Vec::new(),
                boundary: boundary.clone(),
                owned,
                adapter: adapter.to_string(),
                media: BTreeMap::from([(media_key.clone(), tier)]),
                page_tokens: page_size as u64,
                copies: BTreeMap::new(),
                lookahead: 0,
                claimable: false,
                on_claimed_path: false,
                reported: None,
                held_from_start: 0,
            };
            out.entries.extend(page.entries(tier));
            self.pages.insert(hash.clone(), page);
            parent = Some(hash.clone());
        }
        out
    }

    /// Applies a `BlockRemoved` event: in grouped mode the named group's copies (see
    /// [`Removal`]), otherwise [`ReverseMap::remove`] with the copy key of `medium`,
    /// `locality` and `ownership`.
    pub fn remove_copies(
        &mut self,
        engine_hashes: &[Vec<u8>],
        removal: Removal<'_>,
        cascade: bool,
    ) -> Removed {
        if self.grouped {
            return self.remove_grouped(engine_hashes, removal);
        }
        if removal.medium.is_none() && removal.locality.is_none() && removal.ownership.is_none() {
            return self.remove(engine_hashes, None, cascade);
        }
        let key = tier::copy_key(removal.medium, removal.locality, removal.ownership);
        self.remove(engine_hashes, Some(&key), cascade)
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

    /// Forgets everything, the learned groups included (the engine may have restarted with
    /// another layout; the next store events teach them again).
    pub fn clear(&mut self) {
        self.pages.clear();
        self.groups.clear();
        self.grouped = false;
        self.max_lookahead = 0;
        self.parked.clear();
    }
}

/// Records one copy of a known page; true when the page changed (a new copy, another tier, a
/// longer lookahead).
fn add_copy(page: &mut Page, key: &(u32, String), tier: Tier, lookahead: u64) -> bool {
    let before = page.copies.insert(key.clone(), tier);
    let longer = lookahead > page.lookahead;
    page.lookahead = page.lookahead.max(lookahead);
    before != Some(tier) || longer
}

/// First block whose hash has extra keys (`extra_keys` beyond the LoRA name, a cache salt).
fn first_keyed(ev: &BlockStored) -> Option<usize> {
    if ev.cache_salt.is_some() {
        Some(0)
    } else {
        ev.first_keyed_block
    }
}

/// First block whose hash covers lookahead tokens.
fn first_lookahead(ev: &BlockStored) -> Option<usize> {
    ev.lookahead_tokens
        .as_ref()
        .and_then(|l| l.iter().position(|&n| n > 0))
}

fn min_some(a: Option<usize>, b: Option<usize>) -> Option<usize> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

impl ReverseMap {
    /// Every index entry the map reports, each at its reported tier (a page's hottest copy; in
    /// grouped mode only the claimed pages and the path to them, at the claim's tier): the
    /// replica's full current block set, which a reconcile sends and the anti-entropy digest
    /// sums.
    pub fn current_entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        for page in self.pages.values() {
            // Grouped mode reports only what the hybrid rule claims (and the path to it), at
            // the claim's tier; a page held by some group but not claimable is not the
            // server's to hold.
            let tier = if self.grouped {
                page.reported
            } else {
                page.hottest()
            };
            if let Some(tier) = tier {
                out.extend(page.entries(tier));
            }
        }
        out
    }
}
