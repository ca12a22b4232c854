//! The per-partition key table: a sharded open-addressing hash table of immutable key nodes, plus
//! the side table of LFU cells (only for credited entries).
//!
//! # Layout
//!
//! A [`KeyTable`] has [`SHARDS`] shards chosen by the top bits of the mixed key digest. Each shard
//! owns an epoch-protected [`ShardTable`]: an array of 32-byte [`Group`]s (two per cache line) of
//! any length (the home group is the hash's low 32 bits scaled to the length, so a rebuild sizes
//! the table to its keys without power-of-two rounding). A lane names a node of the shard's
//! [`Arena`](crate::raw::arena) by its index and carries a 1-byte tag: [`EMPTY`] (never used: ends a
//! probe), [`TOMB`] (deleted: probe continues; reused by inserts) or `0x80 | 7 bits of the hash`
//! (a fingerprint). Probing is linear over groups; a probe ends at the first group holding an
//! empty lane, so a miss usually reads one cache line (P2). A 16-bit presence summary per 6
//! slots (a superset, cleared only by rebuilds) answers most misses without reading the group. A
//! table and the arena its lanes index are published together (the table owns a reference to the
//! arena), so a rebuild that compacts the arena swaps both at once.
//!
//! Groups come in two formats, chosen per table at its rebuild. **Narrow** (every table whose
//! arena's indices fit in 24 bits, i.e. up to 128 MiB of nodes per shard): 8 lanes, each a `u32`
//! `tag << 24 | index`, 4 bytes per lane. **Wide** (beyond that): a tag word of 6 tags and 6 full
//! `u32` indices, 5⅓ bytes per lane. The first node allocated at an index a narrow lane cannot
//! hold moves the shard to a wide table (an ordinary rebuild, before the node is published); a
//! compaction that leaves the arena small enough brings it back. Readers decode either format
//! into the same 8 tag bytes and indices ([`Lanes`]), so one probe loop serves both.
//!
//! A [`KeyNode`] lives in the arena at its exact size in 8-byte units: the 8-byte key (or, for
//! other lengths, the big-endian XXH3-64 digest), then its holders inline (16 bytes each, sorted
//! by scope-local replica index, the last one flagged), then for non-8-byte keys `u32 len` + the
//! key bytes. A single-holder node with an 8-byte key is 24 bytes, with no allocator header. A
//! node built by a chain ingest inside a chain run ([`crate::raw::runs`]) holds the run word in the
//! key's place (its holders are flagged; the key is read from the run), at the same size.
//!
//! A **member node** is the 16-byte form of a run node with one holder whose first word
//! (`last_seen` and replica) is the run's member word, i.e. the ingest's own entry: the run
//! word, then only the holder's second word. Its top two bits are `10` (`F_LAST` set, `F_LONG`
//! clear), which a plain node's second word, its first holder's `a`, never has: `last_seen` is
//! stored in 43 bits, sign-extended through bit 63. So a member node's key costs what a plain
//! node's does (8 bytes, in the run), and a chain's single-holder tail is a run a lookup steps
//! over instead of one probe per block. [`KeyNode::holders`] rebuilds the holder from the run.
//!
//! [`Holder`] packs `last_seen` (ms, signed 43 bits: years ~1830–2109; out-of-range timestamps
//! are clamped), the replica index (20 bits), `token_count` (i32), the tier code (2 bits), a
//! per-entry generation (27 bits, from a per-shard counter; it wraps after 2^27 creations in one
//! shard, far longer than any captured hit lives) and three layout flags.
//!
//! LFU state lives in a per-shard side table ([`LfuTable`]) that exists only once an entry of the
//! shard has been credited: `(digest, replica, generation) → LfuCell {count, key sum}`. An
//! LRU-only index never allocates it.
//!
//! # Invariants
//!
//! 1. A published [`KeyNode`] is immutable. Every change to a key's holders builds a new node and
//!    swaps the slot pointer (Release); the old node is retired through the epoch collector.
//! 2. Every table has at least one empty lane in some group (load, tombstones included, stays
//!    ≤ 17/20), so a probe terminates. A group that loses its last EMPTY lane never gets one back
//!    until the table is rebuilt: a removal leaves a TOMB in such a group, and may leave EMPTY
//!    only in a group that still has another EMPTY lane (as in Swiss tables). So a group with an
//!    EMPTY lane has had one continuously since the table was built, no probe ever continued
//!    past it, and every key lives in the first group of its probe sequence that had a free lane
//!    when it was inserted, with no EMPTY lane in any group before it. Under insert/remove churn
//!    this keeps tombstones (and long probes) to the groups that were once full.
//! 3. Only the holder of the shard mutex stores into a shard's groups, its table pointer, its LFU
//!    table pointer or the LFU cells' identity.
//! 4. Nodes, LFU cells, key sums and tables are freed only through `Guard::defer*` after being
//!    made unreachable, so a reader pinned before the unlink can still read them. A node's arena
//!    memory is handed back to the writer (and reused) only by such a deferred function.
//!
//! # Memory ordering
//!
//! Insert: the writer builds the node in the arena (registering a new chunk in the arena's
//! directory first if it needs one), then publishes it. Narrow: one Release store of the word
//! holding the lane (tag and index together). Wide: the index (Release), then the group's tag
//! word (Release). A reader loads the group's words (Acquire; a wide group's tag word first) and,
//! on a fingerprint match, translates the index through the arena directory: everything the
//! writer did before the store it read — the node's bytes, the directory entry — is visible to it
//! (C3, never torn). Only the shard mutex holder stores into a group, so a store of one lane's
//! word (which also holds a neighbouring lane) rewrites that neighbour with its current value.
//! Replace: the new index is stored the same way; the tag is unchanged. Remove: narrow, one
//! store turns the lane into TOMB or EMPTY with index 0; wide, the index becomes 0 (Release)
//! before the tag does, and a reader that sees a matching tag and index 0 treats the lane as
//! deleted. A rebuilt table is fully built with Relaxed stores
//! and published with a Release store of the shard's table pointer; readers that still hold the
//! old table (and, after a compaction, the old arena it references) see nodes that stay valid
//! until their guard is dropped (stale but consistent). A retired node's memory returns to the
//! arena's free lists only from a deferred function, i.e. after every reader that could hold its
//! index has unpinned; a reused node is therefore never visible to a reader of its old self.

use crate::raw::arena::{Arena, ArenaState, BATCH_CAPACITY, Batch, units_for};
use crate::raw::pages::{PageArray, heap_chunk as chunk};
use crate::raw::runs::{ChainRun, Reaper};
use crate::sync::{
    AtomicI64, AtomicPtr, AtomicU16, AtomicU64, Mutex, MutexGuard, Ordering, thread_local,
};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use crossbeam_utils::CachePadded;
use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr as StdAtomicPtr, Ordering as StdOrdering};

/// Number of shards per partition table.
pub(crate) const SHARDS: usize = 16;
const SHARD_SHIFT: u32 = 60;
/// Lanes per group of a narrow table (tag and node index share a `u32`).
const NARROW_LANES: usize = 8;
/// Lanes per group of a wide table (a tag word and six `u32` node indices).
const WIDE_LANES: usize = 6;
/// Node index bits of a narrow lane: a shard whose arena hands out an index at or above
/// `1 << NARROW_BITS` (128 MiB of nodes) needs a wide table.
const NARROW_BITS: u32 = 24;
const NARROW_MASK: u32 = (1 << NARROW_BITS) - 1;
/// Table slots per presence-summary word.
const SUMMARY_SLOTS: usize = 6;
/// Minimum groups per shard table.
const MIN_GROUPS: usize = 1;
/// Arena bytes beyond a multiple of the live nodes' that a rebuild tolerates before compacting.
const COMPACT_SLACK: i64 = 16 << 10;

/// Empty lane tag.
const EMPTY: u64 = 0x00;
/// Deleted lane tag.
const TOMB: u64 = 0x01;
const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;
/// A wide group's initial tag word: tag lanes 6 and 7 have no slot and are permanently TOMB
/// (never empty, never match a fingerprint).
const WIDE_INIT_TAGS: u64 = (TOMB << 56) | (TOMB << 48);

/// Tier codes as stored (K6 compaction): 1 = T1, 2 = T2, 3 = T3, 4 = colder/invalid.
pub(crate) const TIER_COLDER: u8 = 4;
/// Largest scope-local replica index.
pub(crate) const REP_MASK: u32 = (1 << REP_BITS) - 1;
const REP_BITS: u32 = 20;
/// Stored `last_seen` bits (signed). 43, not the 44 the field has room for: the top two bits of
/// a holder's first word are then always equal, which tells a member node's holder word (top
/// bits `10`) from a plain node's first holder (see [`KeyNode`]).
const TS_BITS: u32 = 43;
const TS_MAX: i64 = (1 << (TS_BITS - 1)) - 1;
const TS_MIN: i64 = -(1 << (TS_BITS - 1));
/// Per-entry generations are 27-bit.
pub(crate) const GEN_MASK: u32 = (1 << 27) - 1;
/// On every holder: the node's first word is a run word, not the key (see [`crate::raw::runs`]).
const F_RUN: u64 = 1 << 61;
const F_LONG: u64 = 1 << 62;
const F_LAST: u64 = 1 << 63;

/// Wire → stored tier (K6).
#[inline]
pub(crate) fn tier_code(wire: i32) -> u8 {
    match wire {
        0 => 1,
        1..=3 => wire as u8,
        _ => TIER_COLDER,
    }
}

/// Stored → wire tier (K6).
#[inline]
pub(crate) fn tier_wire(code: u8) -> i32 {
    if (1..=3).contains(&code) {
        code as i32
    } else {
        0
    }
}

/// Clamps a ms timestamp to the 43-bit stored range (years ~1830–2109).
#[inline]
pub(crate) fn clamp_ts(ms: i64) -> i64 {
    ms.clamp(TS_MIN, TS_MAX)
}

/// One holder of a key (16 bytes).
///
/// `a = last_seen_ms (signed 43, sign-extended to 44 bits) << 20 | rep (20)`;
/// `b = tokens (u32) | tier−1 (2) << 32 | generation (27) << 34 | F_RUN | F_LONG | F_LAST`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Holder {
    a: u64,
    b: u64,
}

impl Holder {
    #[inline]
    pub(crate) fn new(rep: u32, tier: u8, tokens: i32, last_seen_ms: i64, generation: u32) -> Self {
        debug_assert!(rep <= REP_MASK);
        debug_assert!((1..=4).contains(&tier));
        let a = ((clamp_ts(last_seen_ms) as u64) << REP_BITS) | rep as u64;
        let b = (tokens as u32 as u64)
            | (((tier - 1) as u64 & 3) << 32)
            | (((generation & GEN_MASK) as u64) << 34);
        Self { a, b }
    }
    /// The first word of every holder of replica `rep` last seen at `last_seen_ms`: a run's
    /// member word (see [`KeyNode`]).
    #[inline]
    pub(crate) fn member_word(rep: u32, last_seen_ms: i64) -> u64 {
        Self::new(rep, 1, 0, last_seen_ms, 0).a
    }
    #[inline]
    pub(crate) fn rep(&self) -> u32 {
        (self.a & REP_MASK as u64) as u32
    }
    #[inline]
    pub(crate) fn last_seen_ms(&self) -> i64 {
        (self.a as i64) >> REP_BITS
    }
    #[inline]
    pub(crate) fn tokens(&self) -> i32 {
        self.b as u32 as i32
    }
    #[inline]
    pub(crate) fn tier(&self) -> u8 {
        ((self.b >> 32) & 3) as u8 + 1
    }
    #[inline]
    pub(crate) fn generation(&self) -> u32 {
        ((self.b >> 34) as u32) & GEN_MASK
    }
    #[inline]
    fn is_last(&self) -> bool {
        self.b & F_LAST != 0
    }
    /// Same entry state (flags ignored).
    #[inline]
    pub(crate) fn same_data(&self, o: &Holder) -> bool {
        self.a == o.a && (self.b ^ o.b) & !(F_RUN | F_LONG | F_LAST) == 0
    }
    /// Same replica, `last_seen` and tier: what a lookup reads of a holder (token counts and
    /// generations may differ).
    #[inline]
    pub(crate) fn same_for_lookup(&self, o: &Holder) -> bool {
        self.a == o.a && (self.b ^ o.b) & (3 << 32) == 0
    }
    /// K11 refresh: new tokens and tier, `last_seen = max(old, ts)` (D7); generation kept.
    #[inline]
    pub(crate) fn refreshed(&self, tokens: i32, tier: u8, ts_ms: i64) -> Self {
        let ls = self.last_seen_ms().max(clamp_ts(ts_ms));
        Self::new(self.rep(), tier, tokens, ls, self.generation())
    }
}

/// An immutable key node. Only the 8-byte key word is a Rust field; the holders (and long key
/// bytes) follow in the same allocation (see the module docs). Always used by reference.
#[repr(C, align(8))]
pub(crate) struct KeyNode {
    /// The 8-byte key itself, or the big-endian XXH3-64 digest of a longer / shorter key.
    k: [u8; 8],
}

const HDR: usize = std::mem::size_of::<KeyNode>();
const HS: usize = std::mem::size_of::<Holder>();
/// Size of a member node: the run word and one holder's second word.
const MEMBER_SIZE: usize = HDR + 8;

/// Whether a node's second word is a member node's holder `b` (top bits `10`: `F_LAST` set,
/// `F_LONG` clear) rather than a plain node's first holder `a` (top bits equal, see `TS_BITS`).
#[inline]
fn is_member_word(w: u64) -> bool {
    w >> 62 == 0b10
}

/// A node's holders: a slice of a plain node, or the one holder of a member node, rebuilt
/// from its run (see [`KeyNode`]). Dereferences to the slice either way.
pub(crate) enum Holders<'a> {
    Slice(&'a [Holder]),
    One(Holder),
}

impl std::ops::Deref for Holders<'_> {
    type Target = [Holder];
    #[inline]
    fn deref(&self) -> &[Holder] {
        match self {
            Holders::Slice(s) => s,
            Holders::One(h) => std::slice::from_ref(h),
        }
    }
}

impl KeyNode {
    /// The word after the key word: a plain node's first holder's `a`, or a member node's
    /// holder `b`.
    #[inline]
    fn second_word(&self) -> u64 {
        #[cfg(loom)]
        crate::raw::loom_api::read(
            crate::raw::loom_api::Kind::Node,
            self as *const KeyNode as usize,
        );
        // SAFETY: every node has at least 16 bytes (a member node is the smallest).
        unsafe { ((self as *const KeyNode as *const u8).add(HDR) as *const u64).read() }
    }

    /// Whether this is a member node (see [`is_member_word`]).
    #[inline]
    pub(crate) fn is_member(&self) -> bool {
        is_member_word(self.second_word())
    }

    /// A member node's holder: the run's member word and the node's own second word `b`.
    #[inline]
    fn member_holder(&self, b: u64) -> Holder {
        let (r, _) = crate::raw::runs::unpack(u64::from_ne_bytes(self.k));
        // SAFETY: a member node names a run, alive while the node can be reached (see `run`).
        let a = unsafe { (*r).member() };
        Holder { a, b }
    }

    /// The first holder of a plain node. Callers check `is_member` first: a member node has
    /// only 8 bytes after its header, not a holder.
    #[inline]
    fn holders_ptr(&self) -> *const Holder {
        debug_assert!(!self.is_member());
        #[cfg(loom)]
        crate::raw::loom_api::read(
            crate::raw::loom_api::Kind::Node,
            self as *const KeyNode as usize,
        );
        // SAFETY: a plain node is always allocated with at least one holder right after the
        // header (see `build`); the offset stays inside that allocation.
        unsafe { (self as *const KeyNode as *const u8).add(HDR) as *const Holder }
    }

    /// The digest of the key (see [`digest`]).
    #[inline]
    pub(crate) fn digest(&self) -> u64 {
        #[cfg(loom)]
        crate::raw::loom_api::read(
            crate::raw::loom_api::Kind::Node,
            self as *const KeyNode as usize,
        );
        match self.run() {
            // SAFETY: see `run_ref`.
            Some((r, o)) => unsafe { (*r).key(o) },
            None => u64::from_be_bytes(self.k),
        }
    }

    /// Number of holders (≥ 1).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        if self.is_member() {
            return 1;
        }
        self.plain_len()
    }

    /// Number of holders of a plain node.
    #[inline]
    fn plain_len(&self) -> usize {
        let p = self.holders_ptr();
        let mut n = 0;
        // SAFETY: holders are contiguous and the last one carries F_LAST (set by `build`), so
        // the scan stays inside the allocation.
        unsafe {
            while !(*p.add(n)).is_last() {
                n += 1;
            }
        }
        n + 1
    }

    /// The holders, sorted by replica index.
    #[inline]
    pub(crate) fn holders(&self) -> Holders<'_> {
        let w = self.second_word();
        if is_member_word(w) {
            return Holders::One(self.member_holder(w));
        }
        // SAFETY: `plain_len()` holders are initialized right after the header and live as
        // long as the node (immutable once published).
        Holders::Slice(unsafe { std::slice::from_raw_parts(self.holders_ptr(), self.plain_len()) })
    }

    /// The run this node names and its offset in it (see [`crate::raw::runs`]). A run node keeps
    /// its key in the run (the run word takes the key's place), so it is no larger than a
    /// plain node. The run is alive as long as the node can be reached: a node holds a
    /// reference to its run until it is unlinked, and readers that reach it are pinned.
    #[inline]
    pub(crate) fn run(&self) -> Option<(*const ChainRun, usize)> {
        if self.first_b() & F_RUN == 0 {
            return None;
        }
        Some(crate::raw::runs::unpack(u64::from_ne_bytes(self.k)))
    }

    /// The second word of the first holder (its flags); a member node's own second word.
    #[inline]
    fn first_b(&self) -> u64 {
        let w = self.second_word();
        if is_member_word(w) {
            return w;
        }
        // SAFETY: a plain node has at least one holder.
        unsafe { (*self.holders_ptr()).b }
    }

    #[inline]
    fn is_long(&self) -> bool {
        self.first_b() & F_LONG != 0
    }

    /// The key bytes.
    #[inline]
    pub(crate) fn key(&self) -> &[u8] {
        if let Some((r, o)) = self.run() {
            // SAFETY: the run outlives every reference to a node naming it (see `run`).
            return unsafe { (*r).key_bytes(o) };
        }
        if !self.is_long() {
            return &self.k;
        }
        let n = self.len();
        // SAFETY: long-key nodes store `u32 len` then the bytes right after the holders (see
        // `build`); both lie inside the allocation.
        unsafe {
            let p = (self as *const KeyNode as *const u8).add(HDR + n * HS);
            let len = (p as *const u32).read_unaligned() as usize;
            std::slice::from_raw_parts(p.add(4), len)
        }
    }

    /// Whether this node's key is `key` (whose digest is `d`).
    #[inline]
    pub(crate) fn matches(&self, key: &[u8], d: u64) -> bool {
        #[cfg(loom)]
        crate::raw::loom_api::read(
            crate::raw::loom_api::Kind::Node,
            self as *const KeyNode as usize,
        );
        let b = self.first_b();
        if b & F_RUN != 0 {
            return self.run_matches(key, d);
        }
        u64::from_be_bytes(self.k) == d && (key.len() == 8 && b & F_LONG == 0 || self.key() == key)
    }

    /// [`KeyNode::matches`] for a run node (its key is in the run; always 8 bytes).
    #[inline(never)]
    fn run_matches(&self, key: &[u8], d: u64) -> bool {
        key.len() == 8 && self.digest() == d
    }

    /// The holder of replica `rep`.
    #[inline]
    pub(crate) fn holder(&self, rep: u32) -> Option<Holder> {
        let hs = self.holders();
        if hs.len() <= 16 {
            hs.iter().find(|h| h.rep() == rep).copied()
        } else {
            hs.binary_search_by_key(&rep, |h| h.rep())
                .ok()
                .map(|i| hs[i])
        }
    }

    /// Whether a node of `holders` naming `run` takes the member form: one holder, the run's
    /// member (same replica and `last_seen`).
    #[inline]
    fn member_form(holders: &[Holder], key: &[u8], run: Option<u64>) -> bool {
        match run {
            Some(w) if holders.len() == 1 && key.len() == 8 => {
                let (r, _) = crate::raw::runs::unpack(w);
                // SAFETY: a run word handed to a build names a live run: the building
                // ingest's, which holds its own reference until the seal.
                unsafe { (*r).member() == holders[0].a }
            }
            _ => false,
        }
    }

    fn layout_for(holders: &[Holder], key: &[u8], run: Option<u64>) -> Layout {
        if Self::member_form(holders, key, run) {
            return Layout::from_size_align(MEMBER_SIZE, 8).expect("node layout");
        }
        let n = holders.len();
        let extra = if key.len() == 8 { 0 } else { 4 + key.len() };
        Layout::from_size_align(HDR + n * HS + extra, 8).expect("node layout")
    }

    fn layout(&self) -> Layout {
        if self.is_member() {
            return Layout::from_size_align(MEMBER_SIZE, 8).expect("node layout");
        }
        // Run nodes have 8-byte keys (`Index::plan_run`): no need to read the run.
        let extra = if self.is_long() {
            4 + self.key().len()
        } else {
            0
        };
        Layout::from_size_align(HDR + self.len() * HS + extra, 8).expect("node layout")
    }

    /// Arena units of this node.
    pub(crate) fn units(&self) -> u32 {
        units_for(self.layout().size())
    }

    /// Arena units of a node with these holders and key, naming `run` or not.
    pub(crate) fn units_of(holders: &[Holder], key: &[u8], run: Option<u64>) -> u32 {
        units_for(Self::layout_for(holders, key, run).size())
    }

    /// Builds a node in the shard's arena: its index and address. `holders` must be sorted by
    /// replica index and non-empty. Mutex holder only.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build_in(
        st: &mut ArenaState,
        arena: &Arena,
        key: &[u8],
        d: u64,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> (u32, NonNull<KeyNode>) {
        assert!(!holders.is_empty());
        let lay = Self::layout_for(holders, key, run);
        let (idx, p) = st.alloc(arena, units_for(lay.size()), guard);
        // SAFETY: the arena handed out `units_for(lay.size())` units at `p`, 8-aligned and
        // unreachable by anyone else.
        let nn = unsafe { Self::write_at(p, key, d, holders, run) };
        (idx, nn)
    }

    /// Writes a node at `p`.
    ///
    /// # Safety
    /// `p` is 8-aligned, writable for `layout_for(holders, key, run).size()` bytes and not
    /// visible to any other thread; a `run` word names a live run holding `key` at its offset.
    unsafe fn write_at(
        p: *mut u8,
        key: &[u8],
        d: u64,
        holders: &[Holder],
        run: Option<u64>,
    ) -> NonNull<KeyNode> {
        let n = holders.len();
        let long = key.len() != 8;
        debug_assert!(!(long && run.is_some()), "run nodes have 8-byte keys");
        let Some(nn) = NonNull::new(p) else {
            unreachable!("arena nodes are never null")
        };
        if let Some(w) = run
            && Self::member_form(holders, key, run)
        {
            // SAFETY: per the contract, `p` has room for a member node (`layout_for`).
            unsafe {
                (p as *mut u64).write(w);
                let b = (holders[0].b & !(F_RUN | F_LONG | F_LAST)) | F_RUN | F_LAST;
                (p.add(HDR) as *mut u64).write(b);
            }
            #[cfg(loom)]
            crate::raw::loom_api::created(crate::raw::loom_api::Kind::Node, p as usize);
            return nn.cast();
        }
        // SAFETY: per the contract: we write the key or run word, `n` holders and (long keys)
        // the length and bytes, all within the node's size.
        unsafe {
            (p as *mut [u8; 8]).write(match run {
                Some(w) => w.to_ne_bytes(),
                None => d.to_be_bytes(),
            });
            let hp = p.add(HDR) as *mut Holder;
            for (i, h) in holders.iter().enumerate() {
                let mut h = *h;
                h.b &= !(F_RUN | F_LONG | F_LAST);
                if long {
                    h.b |= F_LONG;
                }
                if run.is_some() {
                    h.b |= F_RUN;
                }
                if i + 1 == n {
                    h.b |= F_LAST;
                }
                hp.add(i).write(h);
            }
            if long {
                let kp = p.add(HDR + n * HS);
                (kp as *mut u32).write_unaligned(key.len() as u32);
                std::ptr::copy_nonoverlapping(key.as_ptr(), kp.add(4), key.len());
            }
        }
        #[cfg(loom)]
        crate::raw::loom_api::created(crate::raw::loom_api::Kind::Node, p as usize);
        nn.cast()
    }

    /// Builds a node in a plain allocation (unit tests of the layout).
    #[cfg(test)]
    pub(crate) fn build_boxed(
        key: &[u8],
        d: u64,
        holders: &[Holder],
        run: Option<u64>,
    ) -> Box<[u64]> {
        let size = Self::layout_for(holders, key, run).size();
        let mut buf = vec![0u64; size.div_ceil(8)].into_boxed_slice();
        // SAFETY: `buf` is 8-aligned, at least `size` bytes and ours alone.
        unsafe { Self::write_at(buf.as_mut_ptr() as *mut u8, key, d, holders, run) };
        buf
    }
}

/// The 64-bit digest of a key: an 8-byte key's big-endian value, else XXH3-64.
#[inline]
pub(crate) fn digest(b: &[u8]) -> u64 {
    match <[u8; 8]>::try_from(b) {
        Ok(a) => u64::from_be_bytes(a),
        Err(_) => xxhash_rust::xxh3::xxh3_64(b),
    }
}

#[inline]
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[inline]
fn fingerprint(h: u64) -> u64 {
    0x80 | ((h >> 48) & 0x7f)
}

/// Bytes of `x` equal to zero → their high bit set (may also flag bytes above a true zero byte,
/// which callers tolerate: a false candidate is verified, a false "empty" implies a real one).
#[inline]
fn zero_bytes(x: u64) -> u64 {
    x.wrapping_sub(LO) & !x & HI
}

/// Prefetches the cache line at `p` into all cache levels. A hint only: never faults.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is a hint; it does not dereference `p` architecturally and never
    // faults, whatever the address. SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(not(loom))]
thread_local! {
    static RETIRED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}
// Loom: a loom thread-local (per model thread, reset per execution) so flushes stay deterministic.
#[cfg(loom)]
thread_local! {
    static RETIRED: std::cell::Cell<u32> = std::cell::Cell::new(0);
}

/// Counts a retirement and flushes the thread's deferred bag every 64 (see `docs/engine.md`):
/// crossbeam-epoch collects at most a few bags per 128 pins on its own, which is slower than a
/// writer retires nodes under sustained ingest, so garbage (and RSS) would otherwise grow well
/// past the live size. Flushing pushes our bag and frees expired garbage of earlier epochs.
#[inline]
fn note_retired(guard: &Guard) {
    let n = RETIRED.with(|c| {
        let n = c.get() + 1;
        c.set(if n >= 64 { 0 } else { n });
        n
    });
    if n >= 64 {
        guard.flush();
    }
}

/// Half a cache line of lanes; a lane names a node by its arena index (0: none) and carries a
/// one-byte tag. Narrow tables: 8 lanes, each `tag << 24 | index`, lane `l` in half `l / 4` of
/// word `l % 4` (so that the four tag bytes of each half line up with a shift per word, see
/// [`narrow_tags`]). Wide tables: word 0 is the tag word (byte `l` = tag of lane `l`; bytes 6
/// and 7 permanently TOMB) and words 1–3 hold lanes 0–5 as `u32` indices (lane `l` in half
/// `l % 2` of word `1 + l / 2`).
#[repr(C, align(32))]
struct Group {
    w: [AtomicU64; 4],
}

/// A group as one reader load of its four words: the lanes' tags gathered into one word (byte
/// `l` = tag of lane `l`, so the SWAR tests below apply to both formats) and their indices.
#[derive(Clone, Copy)]
struct Lanes {
    tags: u64,
    w: [u64; 4],
    wide: bool,
}

/// Where lane `l` of a group keeps its node index: the word, and the shift of its `u32` half
/// (see [`Group`]). The one definition of the layout; a narrow lane's `u32` also carries its tag
/// in the top byte ([`half_index`] strips it).
#[inline]
fn lane_pos(wide: bool, l: usize) -> (usize, u32) {
    if wide {
        (1 + l / 2, 32 * (l as u32 & 1))
    } else {
        (l & 3, 32 * (l as u32 >> 2))
    }
}

/// The node index in the `u32` half of a lane (narrow: without its tag byte).
#[inline]
fn half_index(wide: bool, half: u32) -> u32 {
    if wide { half } else { half & NARROW_MASK }
}

impl Lanes {
    /// The node index in lane `l` (0: none).
    #[inline]
    fn idx(&self, l: usize) -> u32 {
        let (k, sh) = lane_pos(self.wide, l);
        half_index(self.wide, (self.w[k] >> sh) as u32)
    }
}

/// The tag bytes of a narrow group's words, lane `l` in byte `l`: lane `l`'s tag sits in bits
/// `32 * (l / 4) + 24..` of word `l % 4`, i.e. `24 - 8 * (l % 4)` bits above its byte in the
/// result, one shift per word for both halves.
#[inline]
fn narrow_tags(w: &[u64; 4]) -> u64 {
    ((w[0] >> 24) & 0x0000_00ff_0000_00ff)
        | ((w[1] >> 16) & 0x0000_ff00_0000_ff00)
        | ((w[2] >> 8) & 0x00ff_0000_00ff_0000)
        | (w[3] & 0xff00_0000_ff00_0000)
}

struct ShardTable {
    groups: PageArray<Group>,
    /// Wide format (6 lanes of full `u32` indices per group) instead of narrow (8 lanes of
    /// 24-bit indices); fixed for the table's life.
    wide: bool,
    /// Where the nodes named by this table's lanes live. A table and its arena are published
    /// together: a compacting rebuild moves the nodes into a new arena and publishes a new table
    /// pointing at it, so a reader translates every index it read through the right directory.
    arena: Arc<Arena>,
    /// A 16-bit presence summary per [`SUMMARY_SLOTS`] slots of the table: the two bits
    /// `summary_bits(h)` of word `summary_at(h)` are set for every key with mixed hash `h`. Set
    /// before a key is published, cleared only by a rebuild (a superset): a clear bit proves
    /// absence without touching the group line (P2: the summary, 1/12 the size of the groups,
    /// stays cache-resident, the groups do not). Its words follow the slots, not the groups:
    /// one word per narrow group let a third more misses through than one per 6-lane group did
    /// (W1M Q0 57 → 77 ns), and one 32-bit word per group cost a quarter more bytes per lane.
    summary: PageArray<AtomicU16>,
    /// Number of summary words.
    ns: u64,
    /// Number of groups.
    n: u64,
}

/// The two bits of a key's summary word (they may coincide). Two bits per key instead of one
/// let through a fifth fewer absent keys of W1M (24.7% → 20.0% of Q0 misses read the group
/// line; 18.6% → 13.2% at 12,000 chains) for the same memory.
#[inline]
fn summary_bits(h: u64) -> u16 {
    1 << ((h >> 40) & 15) | 1 << ((h >> 44) & 15)
}

impl ShardTable {
    fn new(groups: usize, arena: Arc<Arena>, wide: bool) -> Self {
        debug_assert!(groups >= 1 && groups <= u32::MAX as usize);
        let first = if wide { WIDE_INIT_TAGS } else { 0 };
        let groups = PageArray::new(groups, |_| Group {
            w: [
                AtomicU64::new(first),
                AtomicU64::new(0),
                AtomicU64::new(0),
                AtomicU64::new(0),
            ],
        });
        let n = groups.len() as u64;
        let ns = (groups.len() * if wide { WIDE_LANES } else { NARROW_LANES })
            .div_ceil(SUMMARY_SLOTS)
            .max(1);
        let summary = PageArray::new(ns, |_| AtomicU16::new(0));
        let ns = ns as u64;
        Self {
            groups,
            wide,
            arena,
            summary,
            ns,
            n,
        }
    }

    /// Lanes per group.
    #[inline]
    fn lanes(&self) -> usize {
        if self.wide { WIDE_LANES } else { NARROW_LANES }
    }

    /// Tag bytes of the real lanes.
    #[inline]
    fn lane_bytes(&self) -> u64 {
        if self.wide {
            (1 << (8 * WIDE_LANES)) - 1
        } else {
            !0
        }
    }

    /// Reads group `g` (each word with `ord`; a wide group's tag word first, so a tag seen
    /// with Acquire comes with the index stored before it).
    #[inline]
    fn read(&self, g: usize, ord: Ordering) -> Lanes {
        let grp = &self.groups[g];
        let w = [
            grp.w[0].load(ord),
            grp.w[1].load(ord),
            grp.w[2].load(ord),
            grp.w[3].load(ord),
        ];
        let tags = if self.wide { w[0] } else { narrow_tags(&w) };
        Lanes {
            tags,
            w,
            wide: self.wide,
        }
    }

    /// Sets lane `l` of group `g` to `tag` and node index `idx` (mutex holder, or a table not
    /// yet published). Narrow: one store of the lane's word. Wide: the index, then the tag
    /// word, both with `ord` — a reader that sees the tag (Acquire) sees the index, and a
    /// removal (index 0, then TOMB) is seen as "deleted" from either store on.
    #[inline]
    fn set(&self, g: usize, l: usize, tag: u64, idx: u32, ord: Ordering) {
        let grp = &self.groups[g];
        let (k, sh) = lane_pos(self.wide, l);
        let half = if self.wide {
            idx as u64
        } else {
            debug_assert!(idx <= NARROW_MASK);
            tag << NARROW_BITS | idx as u64
        };
        let x = grp.w[k].load(Ordering::Relaxed);
        grp.w[k].store((x & !(0xffff_ffff << sh)) | half << sh, ord);
        if self.wide {
            let t = grp.w[0].load(Ordering::Relaxed);
            grp.w[0].store((t & !(0xff << (8 * l))) | tag << (8 * l), ord);
        }
    }

    /// The home group of mixed hash `h`: its low 32 bits scaled to the group count (any count,
    /// not only powers of two, so a rebuild can size the table to the live keys). The low bits
    /// are independent of the shard (bits 60–63), fingerprint (48–54) and summary (40–47) bits.
    #[inline]
    fn home(&self, h: u64) -> usize {
        (((h & 0xffff_ffff) * self.n) >> 32) as usize
    }

    /// The summary word of mixed hash `h`: like the home group, its low 32 bits scaled to the
    /// number of words.
    #[inline]
    fn summary_at(&self, h: u64) -> usize {
        (((h & 0xffff_ffff) * self.ns) >> 32) as usize
    }

    /// The group after `g` in probe order.
    #[inline]
    fn step(&self, g: usize) -> usize {
        let g = g + 1;
        if g as u64 == self.n { 0 } else { g }
    }

    /// Whether the key with mixed hash `h` may be present (false: definitely absent).
    #[inline]
    fn may_contain(&self, h: u64) -> bool {
        let bits = summary_bits(h);
        self.summary[self.summary_at(h)].load(Ordering::Relaxed) & bits == bits
    }

    /// Marks the key with mixed hash `h` present (mutex holder / unpublished table only).
    #[inline]
    fn mark(&self, h: u64) {
        let s = &self.summary[self.summary_at(h)];
        s.store(
            s.load(Ordering::Relaxed) | summary_bits(h),
            Ordering::Relaxed,
        );
    }

    /// Places node `n` (hash `h`) in the first free lane from its home group, in a table not
    /// yet published (a rebuild: Relaxed stores, the table's publication orders them).
    fn place(&self, h: u64, n: u32) {
        self.mark(h);
        let mut g = self.home(h);
        loop {
            let e = zero_bytes(self.read(g, Ordering::Relaxed).tags);
            if e != 0 {
                let lane = (e.trailing_zeros() / 8) as usize;
                debug_assert!(
                    self.wide || n <= NARROW_MASK,
                    "narrow table sized for its arena"
                );
                self.set(g, lane, fingerprint(h), n, Ordering::Relaxed);
                return;
            }
            g = self.step(g);
        }
    }

    fn slots(&self) -> usize {
        self.groups.len() * self.lanes()
    }

    /// The node index at slot id `i` (`group << 3 | lane`; Acquire), None past the table or
    /// its lanes.
    #[inline]
    fn lane_at(&self, i: usize) -> Option<u32> {
        let (g, l) = (i >> 3, i & 7);
        if l >= self.lanes() || g >= self.groups.len() {
            return None;
        }
        // Only the word holding the lane's index.
        let (k, sh) = lane_pos(self.wide, l);
        let half = (self.groups[g].w[k].load(Ordering::Acquire) >> sh) as u32;
        Some(half_index(self.wide, half))
    }
    fn bytes(&self) -> usize {
        self.groups.footprint() + self.summary.footprint() + chunk(std::mem::size_of::<Self>())
    }

    /// Probe for `key` (digest `d`, mixed hash `h`): `(group, lane, node)`.
    #[inline]
    fn probe(&self, key: &[u8], d: u64, h: u64) -> Option<(usize, usize, *mut KeyNode)> {
        if !self.may_contain(h) {
            return None;
        }
        let fp = fingerprint(h) * LO;
        let mut g = self.home(h);
        loop {
            let grp = self.read(g, Ordering::Acquire);
            let tags = grp.tags;
            let mut m = zero_bytes(tags ^ fp);
            while m != 0 {
                let lane = (m.trailing_zeros() / 8) as usize;
                m &= m - 1;
                if lane >= self.lanes() {
                    break;
                }
                let i = grp.idx(lane);
                if i == 0 {
                    continue;
                }
                let n = self.arena.node(i) as *mut KeyNode;
                // SAFETY: a non-zero index read from a lane is a live node published with
                // Release (Acquire above) and retired through the epoch, so it stays valid while
                // the caller's guard is pinned.
                if unsafe { (*n).matches(key, d) } {
                    return Some((g, lane, n));
                }
            }
            if zero_bytes(tags) != 0 {
                return None;
            }
            g = self.step(g);
        }
    }
}

/// Per-entry LFU state (V3): created on the entry's first credit, killed on its removal.
///
/// # Per-core counting
///
/// The count is `access` (the *base*) plus, once the cell is hot and contended, the sum of its
/// [`Stripes`]. A credit first tries one CAS on the base. While the base is below the hot
/// threshold every credit lands there (so the key sum, which only tracks `min(count, threshold)`
/// per cell, is updated exactly); at or above the threshold a failed CAS means another core is
/// crediting the same entry at the same moment, and the credit moves to this thread's stripe
/// (a cache line of its own). A shared system prompt hit from every core therefore stops
/// bouncing one cache line after its first few credits, and nothing is merged in the
/// background: the count is summed when it is read (eviction sampling, snapshots).
///
/// No increment is lost or counted after a removal: a credit lands in the base or in a stripe
/// with a read-modify-write that refuses a [`DEAD`] value, and a kill marks the base, then the
/// stripe pointer (null → [`stripes_dead`], so no stripes appear later), then every existing
/// stripe DEAD with a `swap` that returns the stripe's final value. Every credit's RMW is
/// ordered before or after the kill's RMW on the same word: before, it is in the returned
/// total; after, it sees DEAD and is refused.
pub(crate) struct LfuCell {
    digest: u64,
    rep: u32,
    generation: u32,
    /// Base access count; [`DEAD`] once the entry was removed.
    access: AtomicU64,
    /// Null, a live [`Stripes`] (owned by this cell, freed with it) or [`stripes_dead`].
    stripes: AtomicPtr<Stripes>,
    ksum: *const KeySum,
}

/// Marks an LFU cell whose entry was removed (credits become no-ops).
pub(crate) const DEAD: u64 = 1 << 63;

/// Per-key access sum (G1 hot keys), shared by the key's LFU cells: Σ min(count, threshold).
pub(crate) struct KeySum {
    pub(crate) sum: AtomicI64,
    /// Cells pointing here (writer-side, under the shard mutex).
    refs: AtomicI64,
}

/// Largest count a base or a stripe reaches (counts saturate, reads clamp the sum).
const COUNT_MAX: u64 = u32::MAX as u64;

/// Per-core overflow counters of a hot, contended LFU cell: one cache line per lane.
pub(crate) struct Stripes {
    lanes: Box<[CachePadded<AtomicU64>]>,
}

impl Stripes {
    fn new(lanes: usize) -> Self {
        Self {
            lanes: (0..lanes)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
        }
    }

    /// Accounted bytes of a stripe set with `lanes` lanes.
    pub(crate) fn bytes(lanes: usize) -> usize {
        chunk(std::mem::size_of::<Self>()) + lanes * std::mem::size_of::<CachePadded<AtomicU64>>()
    }
}

/// Stripe pointer of a killed cell (never dereferenced).
#[inline]
fn stripes_dead() -> *mut Stripes {
    NonNull::<Stripes>::dangling().as_ptr()
}

/// Lanes per stripe set: the machine's parallelism rounded up to a power of two, 2..=64.
pub(crate) fn stripe_lanes() -> usize {
    #[cfg(loom)]
    {
        2
    }
    #[cfg(not(loom))]
    {
        std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .next_power_of_two()
            .clamp(2, 64)
    }
}

/// This thread's stripe lane (any value; callers mask it). Threads get consecutive lanes in the
/// order they first credit, which spreads a pool of worker threads over distinct lanes.
#[cfg(not(loom))]
fn lane_index() -> usize {
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    LANE.with(|l| *l)
}

/// Loom build: the same first-come numbering with loom's per-execution statics, so a model's
/// lane choice is a function of its schedule (thread ids are unique across executions, so hashing
/// them would make executions diverge on replay).
#[cfg(loom)]
fn lane_index() -> usize {
    loom::lazy_static! {
        static ref NEXT: loom::sync::atomic::AtomicUsize = loom::sync::atomic::AtomicUsize::new(0);
    }
    loom::thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    LANE.with(|l| *l)
}

/// Outcome of [`LfuCell::credit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Credited {
    /// Counted while the count was below the hot threshold: the key sum gains 1.
    BelowThreshold,
    /// Counted at or above the threshold: the key sum is unchanged.
    AtOrAbove,
    /// Not counted: the entry was removed, or the count is saturated.
    Refused,
}

/// Increments `word` unless it is DEAD or saturated.
#[inline]
fn bump(word: &AtomicU64) -> bool {
    word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
        (x & DEAD == 0 && x < COUNT_MAX).then_some(x + 1)
    })
    .is_ok()
}

impl LfuCell {
    /// The key sum.
    pub(crate) fn ksum(&self) -> &KeySum {
        #[cfg(loom)]
        crate::raw::loom_api::read(crate::raw::loom_api::Kind::KeySum, self.ksum as usize);
        // SAFETY: a key sum is retired (through the epoch) only after every cell pointing to it
        // was unlinked, and a cell reference implies a guard pinned before that.
        unsafe { &*self.ksum }
    }

    /// Credits one access (V3). `thr` is the hot threshold (≥ 1); `table` pays for a stripe set
    /// created here.
    pub(crate) fn credit(&self, thr: u64, lanes: usize, table: &KeyTable) -> Credited {
        let mut v = self.access.load(Ordering::Acquire);
        loop {
            if v & DEAD != 0 || v >= COUNT_MAX {
                return Credited::Refused;
            }
            match self
                .access
                .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if v < thr => return Credited::BelowThreshold,
                Ok(_) => return Credited::AtOrAbove,
                // Contended at or above the threshold: count on this core's lane instead.
                Err(cur) if cur & DEAD == 0 && cur >= thr => {
                    return if self.credit_striped(lanes, table) {
                        Credited::AtOrAbove
                    } else {
                        Credited::Refused
                    };
                }
                Err(cur) => v = cur,
            }
        }
    }

    fn credit_striped(&self, lanes: usize, table: &KeyTable) -> bool {
        let mut s = self.stripes.load(Ordering::Acquire);
        if s.is_null() {
            let fresh = Box::into_raw(Box::new(Stripes::new(lanes)));
            match self.stripes.compare_exchange(
                std::ptr::null_mut(),
                fresh,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    table.add_bytes(Stripes::bytes(lanes) as i64);
                    s = fresh;
                }
                Err(cur) => {
                    // SAFETY: `fresh` was never published.
                    drop(unsafe { Box::from_raw(fresh) });
                    s = cur;
                }
            }
        }
        if s == stripes_dead() {
            return false;
        }
        // SAFETY: a live stripe set is owned by the cell and freed only with it, which happens
        // through the epoch after the cell is unlinked; our guard predates that.
        let st = unsafe { &*s };
        bump(&st.lanes[lane_index() & (st.lanes.len() - 1)])
    }

    /// Adds `n` restored accesses (a checkpoint load) to the base, saturating; returns how much
    /// the key sum gains (`min(count, thr)` after minus before). Refused (0) once DEAD.
    pub(crate) fn restore(&self, n: u64, thr: u64) -> i64 {
        let mut gained = 0i64;
        let _ = self
            .access
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
                if x & DEAD != 0 {
                    return None;
                }
                let new = x.saturating_add(n).min(COUNT_MAX);
                gained = new.min(thr) as i64 - x.min(thr) as i64;
                Some(new)
            });
        gained
    }

    /// The access count: base plus stripes, clamped to `u32::MAX`.
    pub(crate) fn count(&self) -> u64 {
        let mut n = self.access.load(Ordering::Acquire) & !DEAD;
        let s = self.stripes.load(Ordering::Acquire);
        if !s.is_null() && s != stripes_dead() {
            // SAFETY: as in `credit_striped`.
            let st = unsafe { &*s };
            n += st
                .lanes
                .iter()
                .map(|l| l.load(Ordering::Acquire) & !DEAD)
                .sum::<u64>();
        }
        n.min(COUNT_MAX)
    }

    /// Marks the cell DEAD (base, stripe pointer, stripes, in that order; see the type docs).
    /// Returns `(total count, base count, stripe bytes to release)`.
    fn kill(&self) -> (u64, u64, usize) {
        let base = self.access.swap(DEAD, Ordering::AcqRel) & !DEAD;
        let mut total = base;
        let mut bytes = 0;
        if let Err(s) = self.stripes.compare_exchange(
            std::ptr::null_mut(),
            stripes_dead(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) && s != stripes_dead()
        {
            // SAFETY: as in `credit_striped`; the stripes stay linked until the cell is freed.
            let st = unsafe { &*s };
            total += st
                .lanes
                .iter()
                .map(|l| l.swap(DEAD, Ordering::AcqRel) & !DEAD)
                .sum::<u64>();
            bytes = Stripes::bytes(st.lanes.len());
        }
        (total.min(COUNT_MAX), base, bytes)
    }
}

impl Drop for LfuCell {
    fn drop(&mut self) {
        let s = self.stripes.load(Ordering::Relaxed);
        if !s.is_null() && s != stripes_dead() {
            // SAFETY: `&mut self`: the cell is being freed (after the epoch), so no credit can
            // still reach its stripes; a live stripe set is owned by the cell.
            drop(unsafe { Box::from_raw(s) });
        }
    }
}

const LFU_CELL_BYTES: usize = 48; // chunk(size_of::<LfuCell>())

/// Open-addressing table of LFU cell pointers (null = empty, [`ltomb`] = deleted).
struct LfuTable {
    slots: Box<[AtomicPtr<LfuCell>]>,
    mask: usize,
}

#[inline]
fn ltomb() -> *mut LfuCell {
    NonNull::<LfuCell>::dangling().as_ptr()
}

#[inline]
fn lfu_hash(d: u64, rep: u32, generation: u32) -> u64 {
    mix(d ^ ((rep as u64) << 32 | generation as u64).rotate_left(17))
}

impl LfuTable {
    fn new(cap: usize) -> Self {
        Self {
            slots: (0..cap)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            mask: cap - 1,
        }
    }
    fn bytes(&self) -> usize {
        chunk(self.slots.len() * 8) + chunk(std::mem::size_of::<Self>())
    }
    fn find(&self, d: u64, rep: u32, generation: u32) -> Option<(usize, *mut LfuCell)> {
        let mut i = lfu_hash(d, rep, generation) as usize & self.mask;
        loop {
            let c = self.slots[i].load(Ordering::Acquire);
            if c.is_null() {
                return None;
            }
            if c != ltomb() {
                #[cfg(loom)]
                crate::raw::loom_api::read(crate::raw::loom_api::Kind::LfuCell, c as usize);
                // SAFETY: live cell (published with Release, retired through the epoch).
                let r = unsafe { &*c };
                if r.digest == d && r.rep == rep && r.generation == generation {
                    return Some((i, c));
                }
            }
            i = (i + 1) & self.mask;
        }
    }
    fn put(&self, c: *mut LfuCell) {
        // SAFETY: `c` is a live cell owned by this table's writer.
        let r = unsafe { &*c };
        let mut i = lfu_hash(r.digest, r.rep, r.generation) as usize & self.mask;
        loop {
            let s = self.slots[i].load(Ordering::Relaxed);
            if s.is_null() || s == ltomb() {
                self.slots[i].store(c, Ordering::Release);
                return;
            }
            i = (i + 1) & self.mask;
        }
    }
}

/// Whether a rebuild copies the live nodes into a fresh arena.
#[derive(Clone, Copy)]
enum Compact {
    /// When the arena holds more than 4× the live nodes' bytes, or the shard is empty.
    Auto,
    /// Always (`maybe_shrink`'s bloat check).
    Force,
    /// Never: a node not yet published lives in the current arena.
    Never,
}

/// A shard's key sums by key (see [`ShardState::ksums`]).
type KeySums = HashMap<Box<[u8]>, *mut KeySum>;

struct ShardState {
    /// Arena indices at or above this need a wide table ([`NARROW_BITS`]; lower in tests).
    narrow_limit: u64,
    /// Live keys.
    live: usize,
    /// `live + 1` at the last rebuild (tells growth from tombstone cleanup, see `rebuild`).
    live_at_rebuild: usize,
    /// Lanes full or TOMB.
    used: usize,
    rebuilds: u64,
    /// Next per-entry generation (27-bit, wrapping).
    next_gen: u32,
    lfu_live: usize,
    lfu_used: usize,
    /// Key sums by key (writer side; LFU namespaces only). Boxed on first use, so a shard of
    /// an LRU tenant (most of them) does not carry an empty map: with it inline the shard took
    /// 384 bytes padded instead of 256.
    ksums: Option<Box<KeySums>>,
    /// The writer half of the current table's node arena.
    arena: ArenaState,
    /// Arena units of the live nodes.
    node_units: usize,
    /// Most arena units live at once since the arena was last replaced (see `maybe_shrink`).
    peak_units: usize,
    /// Nodes unlinked by writers of this shard, not yet handed to the epoch (one deferred
    /// function per batch, flushed when full and before a compaction; see the `Drop` of
    /// [`ShardWriter`] for loom builds).
    retired: Option<Box<Batch>>,
}

// SAFETY: the raw pointers in `ksums` point to key sums only touched under the shard mutex or
// through atomics; the state itself is only accessed under the mutex.
unsafe impl Send for ShardState {}

struct Shard {
    table: Atomic<ShardTable>,
    lfu: Atomic<LfuTable>,
    /// Bytes held by this shard (nodes, cells, tables). Written only by the mutex holder with a
    /// plain load + store (no locked instruction), read Relaxed; exact once writes quiesce.
    bytes: AtomicI64,
    w: Mutex<ShardState>,
}

/// A partition's key table.
///
/// Shards are created by their first writer (a partition of one key costs one shard, not
/// sixteen: a new tenant's or model's first entry used to allocate ~28 KiB of shard shells),
/// published with a compare-and-swap (Release) and freed only with the table. Readers of a
/// shard that does not exist yet probe a shared empty table instead (every probe misses). A
/// shard whose last key goes publishes that same shared table (its own table and arena are
/// retired through the epoch, like any replaced table), so an emptied shard holds its shell
/// only; the shared table is never written (see [`empty_table`]).
pub(crate) struct KeyTable {
    shards: [StdAtomicPtr<CachePadded<Shard>>; SHARDS],
    /// Arena index limit of narrow lanes for the shards created from now on.
    narrow_limit: u64,
    /// Bytes held (nodes, cells, tables); Relaxed, exact once writes quiesce.
    bytes: AtomicI64,
    /// Bytes of the chain runs whose nodes live in this table (also in `bytes`); Relaxed.
    run_bytes: AtomicI64,
    /// Where the epoch leaves this table's retired chain runs for its writers to free.
    reaper: Arc<Reaper>,
}

/// Result of [`KeyTable::candidate`].
#[derive(Clone, Copy)]
pub(crate) enum Cand {
    /// Definitely absent (the home group has an empty lane and no fingerprint match).
    Miss,
    /// First fingerprint match in the home group (not yet verified).
    Node(*const KeyNode),
    /// Inconclusive: needs a full probe.
    Probe,
}

/// A key prepared for probing: digest and mixed hash.
#[derive(Clone, Copy)]
pub(crate) struct Probe<'k> {
    key: &'k [u8],
    d: u64,
    h: u64,
}

impl<'k> Probe<'k> {
    #[inline]
    pub(crate) fn new(key: &'k [u8]) -> Self {
        let d = digest(key);
        Self { key, d, h: mix(d) }
    }
    #[inline]
    fn shard(&self) -> usize {
        (self.h >> SHARD_SHIFT) as usize & (SHARDS - 1)
    }
    /// The key being probed.
    #[inline]
    pub(crate) fn key(&self) -> &'k [u8] {
        self.key
    }
}

/// Where [`Index::memory_bytes`](crate::Index::memory_bytes) goes, by component (bytes; a diagnostic, taken shard by shard
/// under each shard's lock, so not one atomic snapshot under concurrent writes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryBreakdown {
    /// The key tables' group and presence-summary arrays (current tables only).
    pub key_tables: i64,
    /// Live key nodes.
    pub nodes_live: i64,
    /// Node memory the arenas hold but no live key uses: free lists, nodes waiting for their
    /// epoch, split remainders.
    pub nodes_free: i64,
    /// Arena chunk bytes not carved into nodes yet (the tail of each current chunk), plus the
    /// chunk directories.
    pub arena_unused: i64,
    /// Chain runs (lookup shortcuts over shared chain prefixes, see `docs/engine.md`).
    pub chain_runs: i64,
    /// Everything else `memory_bytes` counts: LFU cells and tables, retired tables still
    /// waiting for their epoch, partition and stats records.
    pub other: i64,
}

impl KeyTable {
    pub(crate) fn new() -> Self {
        // Loom models can ask for wide tables from the start (limit 0: every index is "too
        // large" for a narrow lane).
        #[cfg(loom)]
        let narrow_limit = if crate::raw::loom_api::wide_tables() {
            0
        } else {
            1 << NARROW_BITS
        };
        #[cfg(not(loom))]
        let narrow_limit = 1 << NARROW_BITS;
        let t = Self {
            shards: std::array::from_fn(|_| StdAtomicPtr::new(std::ptr::null_mut())),
            narrow_limit,
            bytes: AtomicI64::new(0),
            run_bytes: AtomicI64::new(0),
            reaper: Arc::default(),
        };
        // Loom models keep every shard from the start: the empty table readers fall back to
        // is a process-wide static, which loom objects cannot be.
        #[cfg(loom)]
        for i in 0..SHARDS {
            t.shard_or_create(i);
        }
        t
    }

    /// Shard `i`, if a writer created it.
    #[inline]
    fn shard(&self, i: usize) -> Option<&Shard> {
        // SAFETY: a non-null shard pointer is a published, fully built shard (Release CAS,
        // Acquire load), freed only by `Drop` (exclusive access).
        unsafe { self.shards[i].load(StdOrdering::Acquire).as_ref() }.map(|s| &**s)
    }

    /// Every shard created so far.
    fn created_shards(&self) -> impl Iterator<Item = &Shard> {
        (0..SHARDS).filter_map(|i| self.shard(i))
    }

    /// Shard `i`, created (with its empty table and arena) if it does not exist yet.
    fn shard_or_create(&self, i: usize) -> &Shard {
        if let Some(sh) = self.shard(i) {
            return sh;
        }
        let fresh = Box::into_raw(Box::new(CachePadded::new(Shard {
            table: Atomic::new(ShardTable::new(
                MIN_GROUPS,
                Arc::new(Arena::new()),
                self.narrow_limit == 0,
            )),
            lfu: Atomic::null(),
            bytes: AtomicI64::new(0),
            w: Mutex::new(ShardState {
                narrow_limit: self.narrow_limit,
                live: 0,
                live_at_rebuild: 0,
                used: 0,
                rebuilds: 0,
                next_gen: 1,
                lfu_live: 0,
                lfu_used: 0,
                ksums: None,
                arena: ArenaState::new(),
                node_units: 0,
                peak_units: 0,
                retired: None,
            }),
        })));
        match self.shards[i].compare_exchange(
            std::ptr::null_mut(),
            fresh,
            StdOrdering::AcqRel,
            StdOrdering::Acquire,
        ) {
            Ok(_) => {
                // SAFETY: just published; lives until the table is dropped.
                let sh = unsafe { &*fresh };
                let per = ShardTable::new(MIN_GROUPS, Arc::new(Arena::new()), false).bytes()
                    + std::mem::size_of::<CachePadded<Shard>>();
                self.add_bytes(per as i64);
                sh
            }
            Err(cur) => {
                // SAFETY: `fresh` was never published; `cur` is (see `shard`).
                unsafe {
                    drop(Box::from_raw(fresh));
                    &*cur
                }
            }
        }
    }

    #[inline]
    pub(crate) fn add_bytes(&self, b: i64) {
        self.bytes.fetch_add(b, Ordering::Relaxed);
    }

    /// The reaper of this table's retired chain runs.
    pub(crate) fn reaper(&self) -> &Arc<Reaper> {
        &self.reaper
    }

    /// Accounts a chain run created for this table's nodes (or, negative, freed).
    #[inline]
    pub(crate) fn add_run_bytes(&self, b: i64) {
        self.run_bytes.fetch_add(b, Ordering::Relaxed);
        self.add_bytes(b);
    }

    /// Adds this table's share of [`MemoryBreakdown`] (locks each shard in turn, briefly).
    pub(crate) fn breakdown(&self, out: &mut MemoryBreakdown) {
        let guard = epoch::pin();
        for shard in self.created_shards() {
            let st = shard.w.lock();
            let t = shard.table.load(Ordering::Acquire, &guard);
            // SAFETY: shard tables are never null and are retired through the epoch.
            let t = unsafe { t.deref() };
            let live = (st.node_units * crate::raw::arena::UNIT) as i64;
            out.key_tables += table_bytes(t) as i64;
            out.nodes_live += live;
            out.nodes_free += st.arena.carved() - live;
            out.arena_unused += st.arena.bytes() - st.arena.carved();
        }
        out.chain_runs += self.run_bytes.load(Ordering::Relaxed);
    }

    pub(crate) fn bytes(&self) -> i64 {
        self.bytes.load(Ordering::Relaxed)
            + self
                .created_shards()
                .map(|s| s.bytes.load(Ordering::Relaxed))
                .sum::<i64>()
    }

    /// A table whose shards go wide once an arena index reaches `limit` (tests of the wide
    /// format and of the switch, without 128 MiB of nodes).
    #[cfg(all(test, not(loom)))]
    fn with_narrow_limit(limit: u64) -> Self {
        let mut t = Self::new();
        t.narrow_limit = limit;
        t
    }

    /// Whether shard `s`'s current table is wide (tests).
    #[cfg(all(test, not(loom)))]
    fn is_wide(&self, s: usize) -> bool {
        self.table_of(s, &epoch::pin()).wide
    }

    #[inline]
    fn table_of<'g>(&self, s: usize, guard: &'g Guard) -> &'g ShardTable {
        let Some(shard) = self.shard(s) else {
            return empty_table();
        };
        let t = shard.table.load(Ordering::Acquire, guard);
        // SAFETY: shard tables are never null (created with the shard, replaced only by
        // non-null tables) and are retired through the epoch, so the table outlives `guard`.
        unsafe { t.deref() }
    }

    /// Reader lookup: wait-free (bounded probe, no locks, no retries).
    #[inline]
    pub(crate) fn find<'g>(&self, key: &[u8], guard: &'g Guard) -> Option<&'g KeyNode> {
        self.find_p(Probe::new(key), guard)
    }

    /// [`KeyTable::find`] with a prepared probe.
    #[inline]
    pub(crate) fn find_p<'g>(&self, p: Probe<'_>, guard: &'g Guard) -> Option<&'g KeyNode> {
        let t = self.table_of(p.shard(), guard);
        // SAFETY: see `ShardTable::probe`: the node stays valid while `guard` is pinned.
        t.probe(p.key, p.d, p.h).map(|(_, _, n)| unsafe { &*n })
    }

    /// First stage of a pipelined lookup: reads only the home group of `p` (no node
    /// dereference) and prefetches the candidate node. Resolve with [`KeyTable::resolve`].
    #[inline]
    pub(crate) fn candidate(&self, p: Probe<'_>, guard: &Guard) -> Cand {
        let t = self.table_of(p.shard(), guard);
        // No presence-summary check here: candidates are taken for the blocks after a match,
        // which usually match too, and the summary would cost one more line per block.
        let grp = t.read(t.home(p.h), Ordering::Acquire);
        let tags = grp.tags;
        let mut m = zero_bytes(tags ^ (fingerprint(p.h) * LO));
        while m != 0 {
            let lane = (m.trailing_zeros() / 8) as usize;
            m &= m - 1;
            if lane >= t.lanes() {
                break;
            }
            let i = grp.idx(lane);
            if i != 0 {
                let n = t.arena.node(i) as *const KeyNode;
                // Every line an 8-holder node (136 bytes, the common shared-prefix case) can
                // span: the walk reads all its holders (W1M Q50: −10% with the third line).
                prefetch(n);
                prefetch((n as *const u8).wrapping_add(64));
                prefetch((n as *const u8).wrapping_add(128));
                return Cand::Node(n);
            }
        }
        if zero_bytes(tags) != 0 {
            Cand::Miss
        } else {
            Cand::Probe
        }
    }

    /// Third look-ahead stage, once a candidate's node has had time to arrive: when the node
    /// is a run node, prefetches the line of its key in the run, which the probe's key compare
    /// reads (a fourth dependent line per block otherwise: summary and group, node, run key).
    #[inline]
    pub(crate) fn prefetch_key(c: Cand) {
        if let Cand::Node(n) = c {
            // SAFETY: `n` was read (Acquire) from a lane under a guard the caller still holds
            // (every look-ahead runs inside one pinned section); a node is retired through the
            // epoch, so its memory stays valid, and a stale node only costs a useless prefetch.
            if let Some((r, o)) = unsafe { (*n).run() } {
                // SAFETY: a node naming a run keeps it alive while the node is reachable under
                // the guard (`runs`, "Reclamation"); `o` is the node's own offset (< len).
                prefetch(unsafe { (*r).key_bytes(o) });
            }
        }
    }

    /// Second stage: the node of `p` given its [`Cand`] (a full probe when the candidate was
    /// not conclusive or was a fingerprint false positive).
    #[inline]
    pub(crate) fn resolve<'g>(
        &self,
        c: Cand,
        p: Probe<'_>,
        guard: &'g Guard,
    ) -> Option<&'g KeyNode> {
        match c {
            Cand::Miss => None,
            Cand::Node(n) => {
                // SAFETY: `n` was read (Acquire) from a lane under `guard`, which is still
                // pinned; nodes are retired through the epoch, so it is valid.
                let r = unsafe { &*n };
                if r.matches(p.key, p.d) {
                    Some(r)
                } else {
                    self.find_p(p, guard)
                }
            }
            Cand::Probe => self.find_p(p, guard),
        }
    }

    /// Whether `p`'s key may be present (its presence-summary bit; false: definitely absent).
    #[inline]
    pub(crate) fn may_contain(&self, p: Probe<'_>, guard: &Guard) -> bool {
        self.table_of(p.shard(), guard).may_contain(p.h)
    }

    /// Prefetches the home group of `p` (a hint; reads only the shard's table pointer).
    #[inline]
    pub(crate) fn prefetch_home(&self, p: Probe<'_>, guard: &Guard) {
        let t = self.table_of(p.shard(), guard);
        let g = t.home(p.h);
        prefetch(t.groups.as_ptr().wrapping_add(g));
    }

    /// Prefetches everything a full probe of `p` reads first: its presence-summary word and its
    /// home group. A probe reads the summary, then the group; issued together, the two misses
    /// overlap instead of following each other (W1M Q0: ~28 → ~24 ns in the probe loop, the
    /// group being read for a fifth of the misses; on a cached index the two prefetches cost
    /// ~5 ns per miss, criterion `chain_lookup/miss_64b` 40 → 46 ns).
    #[inline]
    pub(crate) fn prefetch_probe(&self, p: Probe<'_>, guard: &Guard) {
        let t = self.table_of(p.shard(), guard);
        prefetch(t.summary.as_ptr().wrapping_add(t.summary_at(p.h)));
        prefetch(t.groups.as_ptr().wrapping_add(t.home(p.h)));
    }

    /// The shard index of a prepared probe.
    #[inline]
    pub(crate) fn shard_of(p: Probe<'_>) -> usize {
        p.shard()
    }

    /// Locks shard `i`. First frees the chain runs the epoch has retired since the last writer
    /// (outside the lock; one load when there are none), so removals alone bring memory back.
    pub(crate) fn writer(&self, i: usize) -> ShardWriter<'_> {
        self.reaper.free_all();
        let shard = self.shard_or_create(i);
        ShardWriter {
            shard,
            table: self,
            st: shard.w.lock(),
        }
    }

    /// The writer of shard `i` if a writer created it: removal paths and walks, which have
    /// nothing to do in a shard that holds no key and must not create it (a sweep that walked
    /// all sixteen shards of every partition used to create the fifteen a one-key partition
    /// lacks: ~10 KiB per partition, allocated by the sweep that was reclaiming it).
    pub(crate) fn writer_if_created(&self, i: usize) -> Option<ShardWriter<'_>> {
        let shard = self.shard(i)?;
        self.reaper.free_all();
        Some(ShardWriter {
            shard,
            table: self,
            st: shard.w.lock(),
        })
    }

    /// Non-blocking walk over every live node (snapshot; may miss or repeat nodes moved by a
    /// concurrent rebuild; exact when writes quiesce).
    pub(crate) fn for_each_node<'g>(&self, guard: &'g Guard, mut f: impl FnMut(&'g KeyNode)) {
        for s in 0..SHARDS {
            self.for_each_node_in(s, guard, &mut f);
        }
    }

    /// [`KeyTable::for_each_node`] over shard `s` alone (a checkpoint dumps shards in parallel).
    pub(crate) fn for_each_node_in<'g>(
        &self,
        s: usize,
        guard: &'g Guard,
        mut f: impl FnMut(&'g KeyNode),
    ) {
        let t = self.table_of(s, guard);
        let arena = &t.arena;
        for g in 0..t.groups.len() {
            let grp = t.read(g, Ordering::Acquire);
            for l in 0..t.lanes() {
                let i = grp.idx(l);
                if i != 0 {
                    // SAFETY: as in `find`.
                    f(unsafe { &*(arena.node(i) as *const KeyNode) });
                }
            }
        }
    }

    /// Number of slot ids (`group << 3 | lane`) of shard `s`'s current table (lock-free; the
    /// eviction hand's walk and sampler, `eviction.rs`).
    pub(crate) fn slot_ids(&self, s: usize, guard: &Guard) -> usize {
        self.table_of(s, guard).groups.len() << 3
    }

    /// Lock-free read of the node at slot id `i` of shard `s` (None if empty or out of range:
    /// the table may have been rebuilt since `slot_ids`). Like [`KeyTable::find`], the node may
    /// be replaced or removed right after; writers re-validate under the shard mutex.
    pub(crate) fn node_at<'g>(&self, s: usize, i: usize, guard: &'g Guard) -> Option<&'g KeyNode> {
        let t = self.table_of(s, guard);
        let i = t.lane_at(i)?;
        // SAFETY: as in `find`: a non-zero lane index is a published node retired through the
        // epoch, valid while `guard` is pinned.
        (i != 0).then(|| unsafe { &*(t.arena.node(i) as *const KeyNode) })
    }

    /// Lock-free sequential scan of groups `g0 .. g0 + n` of shard `s`'s current table, calling
    /// `f` on every live node (occupied lanes found from the tag word; the nodes of the group
    /// two ahead are prefetched). Groups past the table's end are skipped (a rebuild may change
    /// its length between calls; callers treat positions as approximate).
    pub(crate) fn scan_groups<'g>(
        &self,
        s: usize,
        g0: usize,
        n: usize,
        guard: &'g Guard,
        mut f: impl FnMut(&'g KeyNode),
    ) {
        let t = self.table_of(s, guard);
        let arena = &t.arena;
        let len = t.groups.len();
        // Occupied lanes (tag high bit set) of a group, lowest first.
        let full = |grp: &Lanes| grp.tags & t.lane_bytes() & HI;
        for g in g0..(g0 + n).min(len) {
            if g + 2 < len {
                let ahead = t.read(g + 2, Ordering::Relaxed);
                let mut m = full(&ahead);
                while m != 0 {
                    let x = ahead.idx((m.trailing_zeros() / 8) as usize);
                    m &= m - 1;
                    if x != 0 {
                        prefetch(arena.node(x));
                    }
                }
            }
            let grp = t.read(g, Ordering::Acquire);
            let mut m = full(&grp);
            while m != 0 {
                let x = grp.idx((m.trailing_zeros() / 8) as usize);
                m &= m - 1;
                if x != 0 {
                    // SAFETY: as in `find`: a published node retired through the epoch.
                    f(unsafe { &*(arena.node(x) as *const KeyNode) });
                }
            }
        }
    }

    /// The LFU cell of entry `(key digest, rep, generation)`, if it was ever credited and is
    /// still linked (lock-free).
    pub(crate) fn lfu_cell<'g>(
        &self,
        p: Probe<'_>,
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> Option<&'g LfuCell> {
        let t = self.shard(p.shard())?.lfu.load(Ordering::Acquire, guard);
        // SAFETY: LFU tables are retired through the epoch; non-null ones outlive `guard`.
        let t = unsafe { t.as_ref() }?;
        // SAFETY: cells are retired through the epoch after being unlinked.
        t.find(p.d, rep, generation).map(|(_, c)| unsafe { &*c })
    }
}

impl Drop for KeyTable {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can reach this table any more; nodes, cells and
        // key sums still linked from the current tables are owned by it. Retired (unlinked)
        // objects are owned by the epoch collector and are not touched here.
        unsafe {
            let guard = epoch::unprotected();
            for slot in self.shards.iter() {
                let p = slot.load(StdOrdering::Relaxed);
                if p.is_null() {
                    continue;
                }
                let shard = Box::from_raw(p);
                let t = shard.table.load(Ordering::Relaxed, guard);
                if !t.is_null() && !is_shared_empty(t.deref()) {
                    // The nodes still linked live in the arena, which frees its chunks when
                    // its last reference (this table's, or a pending deferred free's) goes.
                    // Their chain runs are freed with their last node (a table whose runs are
                    // all gone, `run_bytes` 0, has no node naming one).
                    let tab = t.into_owned();
                    let walk = cfg!(loom) || self.run_bytes.load(Ordering::Relaxed) != 0;
                    let groups = if walk { tab.groups.len() } else { 0 };
                    for g in 0..groups {
                        let grp = tab.read(g, Ordering::Relaxed);
                        for l in 0..tab.lanes() {
                            let i = grp.idx(l);
                            if i == 0 {
                                continue;
                            }
                            let node = tab.arena.node(i) as *const KeyNode;
                            if let Some((r, _)) = (*node).run() {
                                ChainRun::release_now(r);
                            }
                            #[cfg(loom)]
                            crate::raw::loom_api::destroyed(
                                crate::raw::loom_api::Kind::Node,
                                node as usize,
                            );
                        }
                    }
                    drop(tab);
                }
                let l = shard.lfu.load(Ordering::Relaxed, guard);
                if !l.is_null() {
                    let lt = l.into_owned();
                    for s in lt.slots.iter() {
                        let c = s.load(Ordering::Relaxed);
                        if !c.is_null() && c != ltomb() {
                            #[cfg(loom)]
                            crate::raw::loom_api::destroyed(
                                crate::raw::loom_api::Kind::LfuCell,
                                c as usize,
                            );
                            drop(Box::from_raw(c));
                        }
                    }
                }
                for (_, k) in shard.w.lock().ksums.take().into_iter().flat_map(|m| *m) {
                    #[cfg(loom)]
                    crate::raw::loom_api::destroyed(crate::raw::loom_api::Kind::KeySum, k as usize);
                    drop(Box::from_raw(k));
                }
            }
        }
    }
}

/// The table readers probe in a shard no writer has created, and the table of a shard its
/// writers emptied: one empty group, never written.
fn empty_table() -> &'static ShardTable {
    /// The table is only read: a probe finds an EMPTY lane, and walks find no node.
    struct SharedEmpty(ShardTable);
    // SAFETY: nothing ever writes to the shared empty table: a writer whose shard holds it
    // leaves it before building its first node (`ShardWriter::build`), and every other write
    // (replace, remove) names a live key, which the empty table has none of. Sharing it is
    // sharing immutable data.
    unsafe impl Sync for SharedEmpty {}
    // SAFETY: as above.
    unsafe impl Send for SharedEmpty {}
    static EMPTY: std::sync::OnceLock<SharedEmpty> = std::sync::OnceLock::new();
    &EMPTY
        .get_or_init(|| SharedEmpty(ShardTable::new(MIN_GROUPS, Arc::new(Arena::new()), false)))
        .0
}

/// Whether `t` is the shared empty table (held by uncreated and emptied shards alike).
#[inline]
fn is_shared_empty(t: &ShardTable) -> bool {
    // Loom models never reach the shared table (they keep every shard and table of their own),
    // and must not initialize it: its atomics would be loom objects outside a model.
    !cfg!(loom) && std::ptr::eq(t, empty_table())
}

/// Bytes a shard's table holds: none for the shared empty table.
fn table_bytes(t: &ShardTable) -> usize {
    if is_shared_empty(t) { 0 } else { t.bytes() }
}

/// Exclusive writer access to one shard.
pub(crate) struct ShardWriter<'a> {
    shard: &'a Shard,
    table: &'a KeyTable,
    st: MutexGuard<'a, ShardState>,
}

/// Loom builds hand a writer session's retirements to the epoch when the session ends, so the
/// models' leak checks see every unlinked node freed once the threads are done. Normal builds
/// keep a partial batch in the shard state across sessions until it fills (a removal touches a
/// few keys per shard, and a deferred function per session would cost more than the removals):
/// the nodes are handed to the epoch later than they were unlinked, which only delays their
/// reuse.
#[cfg(loom)]
impl Drop for ShardWriter<'_> {
    fn drop(&mut self) {
        if self.st.retired.is_some() {
            let guard = epoch::pin();
            self.flush_retired(&guard);
        }
    }
}

/// Slot index encoding for writers: `group << 3 | lane` (lanes 6 and 7 of a wide group never
/// hold a key).
#[inline]
fn slot_id(g: usize, lane: usize) -> usize {
    g << 3 | lane
}

impl ShardWriter<'_> {
    /// Adds to the shard's byte count (mutex holder only: load + store, no RMW).
    #[inline]
    fn add_bytes(&self, d: i64) {
        let b = &self.shard.bytes;
        b.store(b.load(Ordering::Relaxed) + d, Ordering::Relaxed);
    }

    fn current<'g>(&self, guard: &'g Guard) -> &'g ShardTable {
        // SAFETY: non-null (see `KeyTable::table_of`); only we (mutex holder) replace it, and
        // the old one is retired through the epoch.
        unsafe { self.shard.table.load(Ordering::Acquire, guard).deref() }
    }

    /// Finds the key of a prepared probe (which must belong to this shard): its slot id and node.
    pub(crate) fn find_p<'g>(
        &self,
        p: Probe<'_>,
        guard: &'g Guard,
    ) -> Option<(usize, &'g KeyNode)> {
        let t = self.current(guard);
        // SAFETY: live node, see `ShardTable::probe`.
        t.probe(p.key, p.d, p.h)
            .map(|(g, l, n)| (slot_id(g, l), unsafe { &*n }))
    }

    /// Number of slot ids of the current table (for sliced walks).
    pub(crate) fn capacity(&self, guard: &Guard) -> usize {
        self.current(guard).groups.len() << 3
    }

    /// Counter bumped by every rebuild (a sliced walk restarts when it changes).
    pub(crate) fn rebuilds(&self) -> u64 {
        self.st.rebuilds
    }

    /// The live node at slot id `i`, if any.
    pub(crate) fn node_at<'g>(&self, i: usize, guard: &'g Guard) -> Option<&'g KeyNode> {
        let t = self.current(guard);
        let i = t.lane_at(i)?;
        if i == 0 {
            None
        } else {
            // SAFETY: live node, see `ShardTable::probe`.
            Some(unsafe { &*(t.arena.node(i) as *const KeyNode) })
        }
    }

    /// A fresh per-entry generation.
    pub(crate) fn next_generation(&mut self) -> u32 {
        let g = self.st.next_gen & GEN_MASK;
        self.st.next_gen = self.st.next_gen.wrapping_add(1);
        g
    }

    /// Replaces the node at slot id `i` (same key) with a node built from `holders` (naming
    /// `run`'s offset, see [`crate::raw::runs`]); retires the old node. Returns the new node.
    pub(crate) fn replace(
        &mut self,
        i: usize,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> *const KeyNode {
        let t = self.current(guard);
        let old = t.lane_at(i).unwrap_or(0);
        debug_assert!(old != 0);
        let old_node = t.arena.node(old) as *const KeyNode;
        // SAFETY: `old` is live (we hold the shard mutex; only we unlink), and stays so until
        // it is retired below, in this arena (a rebuild inside `build` never compacts).
        let (key, d, old_run) =
            unsafe { ((*old_node).key(), (*old_node).digest(), (*old_node).run()) };
        let rebuilds = self.st.rebuilds;
        let (new, nn) = self.build(key, d, holders, run, guard);
        let t = self.current(guard);
        let (g, l) = if self.st.rebuilds == rebuilds {
            (i >> 3, i & 7)
        } else {
            // `build` moved the shard to a wide table, and the key with it.
            match t.probe(key, d, mix(d)) {
                Some((g, l, _)) => (g, l),
                None => unreachable!("a rebuild moves every live key"),
            }
        };
        let tag = (t.read(g, Ordering::Relaxed).tags >> (8 * l)) & 0xff;
        Self::unlink_run(old_run);
        t.set(g, l, tag, new, Ordering::Release);
        self.retire_node(old, guard);
        self.release_run(old_run, guard);
        nn.as_ptr()
    }

    /// Before an unlinked node's replacement is published: its run no longer covers it.
    #[inline]
    fn unlink_run(run: Option<(*const ChainRun, usize)>) {
        if let Some((r, o)) = run {
            // SAFETY: the node naming the run is still linked, so the run is alive.
            unsafe { (*r).unlink(o) };
        }
    }

    /// After an unlinked node's replacement is published: drops the node's run reference.
    #[inline]
    fn release_run(&self, run: Option<(*const ChainRun, usize)>, guard: &Guard) {
        if let Some((r, _)) = run {
            // SAFETY: the node owned this reference and is unlinked now.
            let freed = unsafe { ChainRun::release(r, &self.table.reaper, guard) };
            if freed != 0 {
                self.table.add_run_bytes(-(freed as i64));
            }
        }
    }

    /// Builds a node in this shard's arena (accounting any memory the arena had to take).
    fn build(
        &mut self,
        key: &[u8],
        d: u64,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> (u32, NonNull<KeyNode>) {
        if is_shared_empty(self.current(guard)) {
            // An emptied shard's first new node: a table and arena of its own first.
            self.rebuild(guard, Compact::Never);
        }
        let t = self.current(guard);
        let before = self.st.arena.bytes();
        let built = KeyNode::build_in(&mut self.st.arena, &t.arena, key, d, holders, run, guard);
        self.add_bytes(self.st.arena.bytes() - before);
        self.st.node_units += KeyNode::units_of(holders, key, run) as usize;
        self.st.peak_units = self.st.peak_units.max(self.st.node_units);
        if !t.wide && u64::from(built.0) >= self.st.narrow_limit {
            // A narrow lane cannot name the new node: move the shard to a wide table first
            // (the node is not published yet; the rebuild keeps this arena).
            self.rebuild(guard, Compact::Never);
        }
        built
    }

    fn retire_node(&mut self, old: u32, guard: &Guard) {
        note_retired(guard);
        let t = self.current(guard);
        // SAFETY: `old` is a live node of this shard (we hold its mutex).
        let units = unsafe { (*(t.arena.node(old) as *const KeyNode)).units() };
        self.st.node_units -= units as usize;
        let st = &mut *self.st;
        let batch = st
            .retired
            .get_or_insert_with(|| st.arena.new_batch(&t.arena));
        t.arena.add_retired(batch, old, units);
        if batch.len() >= BATCH_CAPACITY {
            self.flush_retired(guard);
        }
    }

    /// Hands the session's unlinked nodes to the epoch.
    fn flush_retired(&mut self, guard: &Guard) {
        let Some(batch) = self.st.retired.take() else {
            return;
        };
        // SAFETY: every node in the batch was a live node of the current table's arena (a
        // compaction flushes first) and is now unlinked from the current table (and from any
        // older table by construction: rebuilds move indices, and older tables are retired);
        // readers pinned before the unlink may still read it, so the arena takes it back only
        // through the epoch — deferring later than the unlink only delays that. Retired once:
        // only the mutex holder unlinks, and the batch is taken out of the state.
        unsafe { self.current(guard).arena.retire_batch(batch, guard) };
    }

    /// Deletes the key at slot id `i` (tombstone) and retires its node.
    pub(crate) fn remove(&mut self, i: usize, guard: &Guard) {
        let t = self.current(guard);
        let (g, lane) = (i >> 3, i & 7);
        let grp = t.read(g, Ordering::Relaxed);
        let old = grp.idx(lane);
        debug_assert!(old != 0);
        // Invariant 2: a group that still has an EMPTY lane has had one since the table was
        // built, so no probe ever went past it and no key lives beyond it; the freed lane can be
        // EMPTY again (probes keep ending here). Otherwise it must stay a tombstone.
        let freed = if zero_bytes(grp.tags) != 0 {
            self.st.used -= 1;
            EMPTY
        } else {
            TOMB
        };
        // SAFETY: `old` is live until retired below (we hold the mutex).
        let old_run = unsafe { (*(t.arena.node(old) as *const KeyNode)).run() };
        Self::unlink_run(old_run);
        t.set(g, lane, freed, 0, Ordering::Release);
        self.retire_node(old, guard);
        self.release_run(old_run, guard);
        self.st.live -= 1;
    }

    /// Shrinks the table when it is mostly empty (call outside sliced walks).
    /// Also compacts an arena holding more than 1.5× the most node bytes ever live at once
    /// since it was created (+ 16 KiB): under steady churn that excess is garbage that waited
    /// for its epoch, and without this the arena's high-water mark ratchets up with every burst.
    /// Measured against the peak, not the current live bytes, so a shard that is merely
    /// shrinking is left to the 4× bar of its shrink rebuilds (against the live bytes, a shard
    /// emptied key by key copied its nodes once per halving, which cost W1M's removal a third
    /// of its speed).
    pub(crate) fn maybe_shrink(&mut self, guard: &Guard) {
        let t = self.current(guard);
        let held = self.st.arena.carved();
        // An empty shard gives back its table and arena (not under loom: see `rebuild_for`).
        let empty_arena = self.st.live == 0 && (held > 0 || !cfg!(loom) && !is_shared_empty(t));
        let peak_bytes = (self.st.peak_units * crate::raw::arena::UNIT) as i64;
        let bloated = held > peak_bytes * 3 / 2 + COMPACT_SLACK;
        if t.groups.len() > MIN_GROUPS && self.st.live * 8 < t.slots() || empty_arena || bloated {
            self.rebuild(
                guard,
                if bloated {
                    Compact::Force
                } else {
                    Compact::Auto
                },
            );
        }
    }

    /// Inserts a new key (the caller checked it is absent) with `holders` (naming `run`'s
    /// offset); `p` must belong to this shard. Returns the new node.
    pub(crate) fn insert_p(
        &mut self,
        p: Probe<'_>,
        holders: &[Holder],
        run: Option<u64>,
        guard: &Guard,
    ) -> *const KeyNode {
        if (self.st.used + 1) * 20 > self.current(guard).slots() * 17 {
            self.rebuild(guard, Compact::Auto);
        }
        let (node, nn) = self.build(p.key, p.d, holders, run, guard);
        let t = self.current(guard);
        // Summary bit before the node is published (a reader that sees the node's tag and
        // pointer with Acquire also sees the bit; a reader that misses the bit is concurrent).
        t.mark(p.h);
        let mut g = t.home(p.h);
        let real = t.lane_bytes();
        loop {
            let tags = t.read(g, Ordering::Relaxed).tags;
            // Free lanes: EMPTY (0) or TOMB (1), i.e. bytes ≤ 1.
            let free = zero_bytes((tags & !LO & real) | !real);
            if free != 0 {
                let lane = (free.trailing_zeros() / 8) as usize;
                debug_assert!(lane < t.lanes());
                if (tags >> (8 * lane)) & 0xff == EMPTY {
                    self.st.used += 1;
                }
                t.set(g, lane, fingerprint(p.h), node, Ordering::Release);
                break;
            }
            g = t.step(g);
        }
        self.st.live += 1;
        nn.as_ptr()
    }

    /// Rebuilds the table sized for the live keys (drops tombstones, grows or shrinks). When
    /// `compact` is asked (`maybe_shrink`'s bloat check), the arena holds more than four times
    /// the live nodes' bytes (+ 16 KiB: a shard emptied key by key then copies each node about
    /// 1/3 of a time in all) or the shard is empty, the live nodes are also copied into a fresh
    /// arena and the old one goes with the old table, through the epoch.
    fn rebuild(&mut self, guard: &Guard, compact: Compact) {
        self.rebuild_for(guard, compact, 0);
    }

    /// Sizes the table for `keys` live keys (at load 1/2) unless it already has that room: a
    /// checkpoint load presizes each shard, because it inserts keys in the order of another
    /// table, i.e. by ascending home position, which in a smaller table would all crowd into
    /// its first groups and probe past each other (quadratic) until the table grew.
    pub(crate) fn reserve(&mut self, keys: usize, guard: &Guard) {
        if keys.saturating_mul(2) > self.current(guard).slots() {
            self.rebuild_for(guard, Compact::Never, keys);
        }
    }

    /// [`ShardWriter::rebuild`], sized for at least `min_keys` live keys.
    fn rebuild_for(&mut self, guard: &Guard, compact: Compact, min_keys: usize) {
        // Retirements belong to the current arena, which a compaction replaces.
        self.flush_retired(guard);
        let old_shared = self.shard.table.load(Ordering::Acquire, guard);
        // SAFETY: non-null, see `current`.
        let old = unsafe { old_shared.deref() };
        let from_shared = is_shared_empty(old);
        // Rebuilt at 17/20 of the slots used (live or tombstone), shrunk below 1/8 live, with no
        // power-of-two rounding. Growth (a quarter more live keys than at the last rebuild):
        // load 1/2 after the rebuild, so a growing table is rebuilt every ×1.7 (each key moved
        // ~2.4 times in all). Otherwise the rebuild mostly drops tombstones (steady churn at the
        // cap) or shrinks: load 2/3, so a table of constant size holds 1.5 slots per key, not
        // 2, and is rebuilt again after a fifth of its slots have turned into tombstones.
        let live = (self.st.live + 1).max(min_keys);
        let growing = min_keys > 0 || live * 4 > self.st.live_at_rebuild * 5;
        self.st.live_at_rebuild = live;
        let slots = if growing { live * 2 } else { live * 3 / 2 };
        let live_bytes = (self.st.node_units * crate::raw::arena::UNIT) as i64;
        // Loom models stay on the move-only path: their tables are tiny, and the compaction
        // reuses the table-retirement protocol they already check.
        let held = self.st.arena.carved();
        let compact = !cfg!(loom)
            && !from_shared
            && match compact {
                Compact::Never => false,
                Compact::Force => true,
                Compact::Auto => {
                    held > 4 * live_bytes + COMPACT_SLACK || self.st.live == 0 && held > 0
                }
            };
        // Narrow lanes while every index of the table's arena is below the limit (24 bits):
        // the arena's chunk ids so far. Moving nodes keeps the arena, so the width is known
        // now. A compaction decides it from the fresh arena's chunk ids once the live nodes
        // are copied (their places are kept until then): an estimate from the live bytes
        // alone missed the ids a fresh arena's small first chunks take, so a compacted shard
        // could get a width its next rebuild undid (narrow, then wide again with no node
        // added), or a wide table it did not need.
        let limit = self.st.narrow_limit;
        let groups_for = |wide: bool| {
            slots
                .div_ceil(if wide { WIDE_LANES } else { NARROW_LANES })
                .max(MIN_GROUPS)
        };
        // A shard left empty by a compaction keeps no table: it goes back to the shared empty
        // table readers of an uncreated shard probe (an empty-but-live partition then holds its
        // shard's shell only). Loom models keep their tables: the shared table is a static.
        if compact && self.st.live == 0 && min_keys == 0 {
            let held_before = table_bytes(old) as i64 + self.st.arena.bytes();
            self.add_bytes(-held_before);
            self.st.arena = ArenaState::new();
            self.st.peak_units = 0;
            self.publish(
                old_shared,
                Shared::from(empty_table() as *const ShardTable),
                guard,
            );
            return;
        }
        let mut fresh = compact.then(ArenaState::new);
        // The shared empty table's arena is never written: leaving it takes a fresh one (the
        // shard's arena state was reset when it moved onto the shared table).
        let new_arena = if compact || from_shared {
            Arc::new(Arena::new())
        } else {
            old.arena.clone()
        };
        let moved_into = (!compact).then(|| {
            let wide = self.st.arena.index_bound() > limit;
            ShardTable::new(groups_for(wide), new_arena.clone(), wide)
        });
        let mut copied: Vec<(u64, u32)> = Vec::new();
        let arena = &old.arena;
        for gi in 0..old.groups.len() {
            // Each move reads the node's digest: prefetch the nodes of a group 4 ahead, and the
            // run keys (a run node's key lives in its run) of the group 2 ahead, whose nodes
            // were prefetched two steps earlier.
            if gi + 4 < old.groups.len() {
                let ahead = old.read(gi + 4, Ordering::Relaxed);
                for l in 0..old.lanes() {
                    let n = ahead.idx(l);
                    if n != 0 {
                        prefetch(arena.node(n));
                    }
                }
            }
            if gi + 2 < old.groups.len() {
                let next = old.read(gi + 2, Ordering::Relaxed);
                for l in 0..old.lanes() {
                    let n = next.idx(l);
                    if n == 0 {
                        continue;
                    }
                    // SAFETY: live node (we hold the mutex).
                    let run = unsafe { (*(arena.node(n) as *const KeyNode)).run() };
                    if let Some((r, o)) = run {
                        // SAFETY: a linked node's run is alive (see `KeyNode::run`).
                        prefetch(unsafe { (*r).key_bytes(o) });
                    }
                }
            }
            let grp = old.read(gi, Ordering::Relaxed);
            for l in 0..old.lanes() {
                let n = grp.idx(l);
                if n == 0 {
                    continue;
                }
                let node = arena.node(n) as *const KeyNode;
                // SAFETY: live node (we hold the mutex).
                let h = mix(unsafe { (*node).digest() });
                let n = match fresh.as_mut() {
                    Some(st) => {
                        // SAFETY: live node (we hold the mutex).
                        let units = unsafe { (*node).units() };
                        let (i, p) = st.alloc(&new_arena, units, guard);
                        // SAFETY: `p` has room for `units` units and is not yet published;
                        // `node` stays valid (its arena lives until the old table is freed).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                node as *const u8,
                                p,
                                units as usize * crate::raw::arena::UNIT,
                            )
                        };
                        i
                    }
                    None => n,
                };
                match &moved_into {
                    Some(new) => new.place(h, n),
                    None => copied.push((h, n)),
                }
            }
        }
        let new = match (moved_into, &fresh) {
            (Some(new), _) => new,
            (None, Some(st)) => {
                let wide = st.index_bound() > limit;
                let new = ShardTable::new(groups_for(wide), new_arena, wide);
                for (h, n) in copied {
                    new.place(h, n);
                }
                new
            }
            (None, None) => unreachable!("a rebuild either moves or compacts"),
        };
        let mut delta = new.bytes() as i64 - table_bytes(old) as i64;
        if let Some(st) = fresh {
            // The old arena's memory goes back when the old table (and every pending deferred
            // free into it) is gone.
            delta += st.bytes() - self.st.arena.bytes();
            self.st.arena = st;
            self.st.peak_units = self.st.node_units;
        }
        self.add_bytes(delta);
        self.publish(old_shared, Owned::new(new).into_shared(guard), guard);
    }

    /// Publishes `new` as the shard's table and retires `old` (unless it is the shared empty
    /// table, which is never freed).
    fn publish<'g>(
        &mut self,
        old: Shared<'g, ShardTable>,
        new: Shared<'g, ShardTable>,
        guard: &'g Guard,
    ) {
        // Release: publishes the fully built table.
        self.shard.table.store(new, Ordering::Release);
        // SAFETY: `old` is non-null (see `current`).
        if !is_shared_empty(unsafe { old.deref() }) {
            // SAFETY: the old table is unlinked; pinned readers may still probe it. Dropping a
            // `ShardTable` frees its group array and its reference to the arena: the nodes
            // (moved or copied) are never freed with it, and a replaced arena is freed by its
            // last reference.
            unsafe { guard.defer_destroy(old) };
        }
        self.st.used = self.st.live;
        self.st.rebuilds += 1;
    }

    // ---- LFU side table ----------------------------------------------------------------------

    fn lfu_table<'g>(&self, guard: &'g Guard) -> Option<&'g LfuTable> {
        // SAFETY: see `KeyTable::lfu_cell`.
        unsafe { self.shard.lfu.load(Ordering::Acquire, guard).as_ref() }
    }

    /// The LFU cell of an entry, creating it (count 0) if absent. The caller has validated,
    /// under this writer, that the entry `(key, rep, generation)` is live.
    pub(crate) fn lfu_cell_or_create<'g>(
        &mut self,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> &'g LfuCell {
        let d = digest(key);
        if let Some(t) = self.lfu_table(guard)
            && let Some((_, c)) = t.find(d, rep, generation)
        {
            // SAFETY: live cell.
            return unsafe { &*c };
        }
        // Key sum.
        let mut added = 0usize;
        let ksums = self.st.ksums.get_or_insert_with(Box::default);
        let ks = match ksums.get(key) {
            Some(&k) => k,
            None => {
                let k = Box::into_raw(Box::new(KeySum {
                    sum: AtomicI64::new(0),
                    refs: AtomicI64::new(0),
                }));
                #[cfg(loom)]
                crate::raw::loom_api::created(crate::raw::loom_api::Kind::KeySum, k as usize);
                ksums.insert(key.into(), k);
                added += chunk(16) + chunk(key.len()) + 32;
                k
            }
        };
        // SAFETY: `ks` is linked in `ksums` (owned by this shard, mutated under the mutex).
        unsafe { (*ks).refs.fetch_add(1, Ordering::Relaxed) };
        let cell = Box::into_raw(Box::new(LfuCell {
            digest: d,
            rep,
            generation,
            access: AtomicU64::new(0),
            stripes: AtomicPtr::new(std::ptr::null_mut()),
            ksum: ks,
        }));
        #[cfg(loom)]
        crate::raw::loom_api::created(crate::raw::loom_api::Kind::LfuCell, cell as usize);
        added += LFU_CELL_BYTES;
        // Grow / create the table (load ≤ 1/2 including tombstones).
        let cap = self.lfu_table(guard).map_or(0, |t| t.slots.len());
        if (self.st.lfu_used + 1) * 2 > cap {
            let old = self.shard.lfu.load(Ordering::Acquire, guard);
            let ncap = ((self.st.lfu_live + 1) * 4).next_power_of_two().max(16);
            let nt = LfuTable::new(ncap);
            let mut delta = nt.bytes() as i64;
            // SAFETY: `old` is null or a live table (we hold the mutex).
            if let Some(ot) = unsafe { old.as_ref() } {
                delta -= ot.bytes() as i64;
                for s in ot.slots.iter() {
                    let c = s.load(Ordering::Relaxed);
                    if !c.is_null() && c != ltomb() {
                        nt.put(c);
                    }
                }
            }
            self.add_bytes(delta);
            self.shard.lfu.store(Owned::new(nt), Ordering::Release);
            if !old.is_null() {
                // SAFETY: unlinked; dropping an `LfuTable` frees only its slot array.
                unsafe { guard.defer_destroy(old) };
            }
            self.st.lfu_used = self.st.lfu_live;
        }
        self.lfu_table(guard).expect("lfu table").put(cell);
        self.st.lfu_live += 1;
        self.st.lfu_used += 1;
        self.add_bytes(added as i64);
        // SAFETY: just linked; retired only through the epoch.
        unsafe { &*cell }
    }

    /// Kills the LFU cell of a removed entry, if any: marks it DEAD, unlinks it and returns
    /// `(base count, key sum)` so the caller can take the cell's contribution,
    /// `min(base, threshold)`, back out of the key sum (see [`LfuCell`]).
    pub(crate) fn lfu_kill<'g>(
        &mut self,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &'g Guard,
    ) -> Option<(u64, &'g KeySum)> {
        let t = self.lfu_table(guard)?;
        let (i, c) = t.find(digest(key), rep, generation)?;
        t.slots[i].store(ltomb(), Ordering::Release);
        self.st.lfu_live -= 1;
        // SAFETY: the cell was live and is now unlinked; readers may still hold it.
        let cell = unsafe { &*c };
        let (_, base, stripe_bytes) = cell.kill();
        let ks = cell.ksum;
        let mut freed = (LFU_CELL_BYTES + stripe_bytes) as i64;
        // SAFETY: `ks` is linked in `ksums` while refs > 0.
        if unsafe { (*ks).refs.fetch_sub(1, Ordering::Relaxed) } == 1 {
            if let Some(ksums) = self.st.ksums.as_mut() {
                ksums.remove(key);
            }
            freed += (chunk(16) + chunk(key.len()) + 32) as i64;
            let kp = ks as usize;
            // SAFETY: the key sum is unlinked from `ksums` and no live cell points to it;
            // readers that loaded it earlier are pinned, so it is freed through the epoch.
            unsafe {
                guard.defer_unchecked(move || {
                    #[cfg(loom)]
                    crate::raw::loom_api::destroyed(crate::raw::loom_api::Kind::KeySum, kp);
                    drop(Box::from_raw(kp as *mut KeySum))
                })
            };
        }
        let cp = c as usize;
        // SAFETY: unlinked above; freed through the epoch.
        unsafe {
            guard.defer_unchecked(move || {
                #[cfg(loom)]
                crate::raw::loom_api::destroyed(crate::raw::loom_api::Kind::LfuCell, cp);
                drop(Box::from_raw(cp as *mut LfuCell))
            })
        };
        self.add_bytes(-freed);
        // SAFETY: retired through the epoch, valid for `guard`.
        Some((base, unsafe { &*ks }))
    }

    /// Whether this shard has any LFU cell (an LRU-only shard skips the kill lookup).
    #[inline]
    pub(crate) fn has_lfu(&self) -> bool {
        self.st.lfu_live > 0
    }
}

// SAFETY: `LfuCell::ksum` points to a key sum accessed only through atomics and freed through the
// epoch collector.
unsafe impl Send for LfuCell {}
// SAFETY: see `Send`.
unsafe impl Sync for LfuCell {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn cell(ksum: &KeySum) -> LfuCell {
        LfuCell {
            digest: 1,
            rep: 0,
            generation: 1,
            access: AtomicU64::new(0),
            stripes: AtomicPtr::new(std::ptr::null_mut()),
            ksum,
        }
    }

    fn key_sum() -> KeySum {
        KeySum {
            sum: AtomicI64::new(0),
            refs: AtomicI64::new(0),
        }
    }

    fn put_keys(t: &KeyTable, keys: impl Iterator<Item = u64>, holders: usize) {
        let guard = epoch::pin();
        for k in keys {
            let key = k.to_be_bytes();
            let p = Probe::new(&key);
            let hs: Vec<Holder> = (0..holders as u32)
                .map(|r| Holder::new(r, 1, 16, k as i64, 1))
                .collect();
            t.writer(KeyTable::shard_of(p))
                .insert_p(p, &hs, None, &guard);
        }
    }

    fn remove_keys(t: &KeyTable, keys: impl Iterator<Item = u64>) {
        let guard = epoch::pin();
        for k in keys {
            let key = k.to_be_bytes();
            let p = Probe::new(&key);
            let mut w = t.writer(KeyTable::shard_of(p));
            let (i, _) = w.find_p(p, &guard).expect("present");
            w.remove(i, &guard);
            w.maybe_shrink(&guard);
        }
    }

    #[test]
    fn nodes_take_their_exact_size_and_a_shrink_compacts_the_arena() {
        const N: u64 = 60_000;
        let t = KeyTable::new();
        assert_eq!(t.bytes(), 0, "no shard before the first write");
        // The baseline is the sixteen empty shards (created by their first writers, kept).
        for i in 0..SHARDS {
            t.shard_or_create(i);
        }
        let base = t.bytes();
        assert!(base > 0);
        put_keys(&t, 0..N, 1);
        let full = t.bytes() - base;
        // 24-byte nodes, 1.2–2 lanes of 4 bytes and a 2-byte summary per 8 lanes per key, and
        // the unused tail of each shard's current chunk (chunks double up to 256 KiB, so with
        // only 3,750 keys per shard the tail is still a third of the arena).
        let per_key = full as f64 / N as f64;
        assert!((26.0..48.0).contains(&per_key), "{per_key} bytes per key");
        remove_keys(&t, 0..N - 1_000);
        let left = t.bytes() - base;
        // Without compaction the arena would keep all its chunks (~60% of `full`); with it, what
        // is left is the 4×-live bar plus 16 KiB of slack and a chunk tail per shard.
        assert!(
            left < full / 4,
            "after removing 98% the table and arena shrank: {left} of {full} bytes left"
        );
        let guard = epoch::pin();
        for k in 0..N {
            let key = k.to_be_bytes();
            let n = t.find(&key, &guard);
            if k < N - 1_000 {
                assert!(n.is_none(), "key {k} was removed");
            } else {
                let n = n.expect("surviving key moved intact");
                assert_eq!(n.key(), key);
                assert_eq!(n.holders()[0].last_seen_ms(), k as i64);
            }
        }
        drop(guard);
        remove_keys(&t, N - 1_000..N);
        let min_table = ShardTable::new(MIN_GROUPS, Arc::new(Arena::new()), false).bytes();
        assert_eq!(
            t.bytes(),
            base - (SHARDS * min_table) as i64,
            "an emptied shard gives its table and arena back (it reads the shared empty table)"
        );
        let mut breakdown = MemoryBreakdown::default();
        t.breakdown(&mut breakdown);
        assert_eq!(breakdown.key_tables, 0, "no shard holds a table of its own");
        // Writers leave the shared table on their first node; readers find every key again.
        put_keys(&t, 0..1_000, 2);
        let guard = epoch::pin();
        for k in 0..1_000u64 {
            let n = t.find(&k.to_be_bytes(), &guard).expect("re-inserted key");
            assert_eq!(n.holders().len(), 2);
            assert_eq!(n.holders()[1].last_seen_ms(), k as i64);
        }
        assert!(t.find(&5_000u64.to_be_bytes(), &guard).is_none());
        drop(guard);
        remove_keys(&t, 0..1_000);
        assert_eq!(t.bytes(), base - (SHARDS * min_table) as i64);
    }

    #[test]
    fn both_group_formats_read_back_every_lane() {
        for wide in [false, true] {
            let t = ShardTable::new(2, Arc::new(Arena::new()), wide);
            let lanes = t.lanes();
            for l in 0..lanes {
                let idx = if wide {
                    u32::MAX - l as u32
                } else {
                    NARROW_MASK - l as u32
                };
                t.set(1, l, 0x80 | l as u64, idx, Ordering::Relaxed);
            }
            // Overwrite one lane: its neighbours in the same word keep their values.
            t.set(1, 2, TOMB, 0, Ordering::Relaxed);
            let g = t.read(1, Ordering::Relaxed);
            for l in 0..lanes {
                let (tag, idx) = ((g.tags >> (8 * l)) & 0xff, g.idx(l));
                if l == 2 {
                    assert_eq!((tag, idx), (TOMB, 0), "wide {wide}");
                } else {
                    let want = if wide {
                        u32::MAX - l as u32
                    } else {
                        NARROW_MASK - l as u32
                    };
                    assert_eq!((tag, idx), (0x80 | l as u64, want), "wide {wide} lane {l}");
                }
            }
            // A wide group's tag bytes 6 and 7 are never free and never match.
            if wide {
                assert_eq!(g.tags >> 48, WIDE_INIT_TAGS >> 48);
            }
            let untouched = t.read(0, Ordering::Relaxed);
            assert!(
                zero_bytes(untouched.tags) != 0,
                "an unused group has EMPTY lanes"
            );
        }
    }

    /// Random inserts, holder changes and removals against a map, on a table whose shards
    /// switch to the wide format after a few chunks; then most keys go and compaction gives the
    /// shards fresh arenas, and every table's lane width is then exactly what its arena's
    /// indices need (wide iff they reach the limit); once the shards are emptied they are narrow
    /// again and stay so for new keys. Every key is found with its last holders throughout.
    /// (The width of a compacted shard used to be estimated from its live bytes, which missed
    /// the chunk ids of a fresh arena's small first chunks: depending on which rebuild came
    /// last, a shard ended narrow over indices past the limit or wide again with no new node,
    /// so a "narrow again at 1 key in 40" check failed about one run in four.)
    #[test]
    fn narrow_and_wide_tables_agree_with_a_map_across_the_switch() {
        // 3 chunk ids of 2^15 units: wide from the fourth chunk on.
        let t = KeyTable::with_narrow_limit(3 << 15);
        let mut model: std::collections::HashMap<u64, Vec<Holder>> = Default::default();
        let guard = epoch::pin();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let check = |t: &KeyTable, model: &std::collections::HashMap<u64, Vec<Holder>>| {
            let guard = epoch::pin();
            for (k, hs) in model {
                let n = t
                    .find(&k.to_be_bytes(), &guard)
                    .expect("a live key is found");
                assert_eq!(n.holders().len(), hs.len());
                for (a, b) in n.holders().iter().zip(hs) {
                    assert!(a.same_data(b) && a.rep() == b.rep(), "key {k:x}: holders");
                }
            }
        };
        for step in 0..60_000u32 {
            let r = next();
            let k = r % 20_000;
            let key = k.to_be_bytes();
            let p = Probe::new(&key);
            let mut w = t.writer(KeyTable::shard_of(p));
            match (w.find_p(p, &guard), r >> 60) {
                (None, _) => {
                    let hs = vec![Holder::new(0, 1, 16, i64::from(step), 1)];
                    w.insert_p(p, &hs, None, &guard);
                    model.insert(k, hs);
                }
                (Some((i, _)), 0..=3) => {
                    w.remove(i, &guard);
                    w.maybe_shrink(&guard);
                    model.remove(&k);
                }
                (Some((i, n)), _) => {
                    // Grow or refresh the holder set (up to 3 replicas).
                    let mut hs = n.holders().to_vec();
                    let rep = (r >> 20) as u32 % 3;
                    let h = Holder::new(rep, 2, 32, i64::from(step), 7);
                    match hs.iter().position(|x| x.rep() == rep) {
                        Some(pos) => hs[pos] = h,
                        None => {
                            let pos = hs.partition_point(|x| x.rep() < rep);
                            hs.insert(pos, h);
                        }
                    }
                    w.replace(i, &hs, None, &guard);
                    model.insert(k, hs);
                }
            }
            drop(w);
            if step % 15_000 == 14_999 {
                check(&t, &model);
            }
        }
        check(&t, &model);
        assert!(
            (0..SHARDS).all(|s| t.is_wide(s)),
            "every shard outgrew 3 chunk ids and went wide"
        );
        let bound = |s: usize| t.writer(s).st.arena.index_bound();
        let grown: Vec<u64> = (0..SHARDS).map(bound).collect();
        // Keep 1 key in 40: removals shrink the tables and compact the arenas.
        let doomed: Vec<u64> = model.keys().copied().filter(|k| k % 40 != 0).collect();
        remove_keys(&t, doomed.iter().copied());
        model.retain(|k, _| k % 40 == 0);
        check(&t, &model);
        for (s, &before) in grown.iter().enumerate() {
            assert!(
                bound(s) < before,
                "shard {s} was compacted into a fresh arena"
            );
            assert_eq!(
                t.is_wide(s),
                bound(s) > 3 << 15,
                "shard {s}: lane width follows its arena's indices ({} chunk ids)",
                bound(s) >> 15
            );
        }
        // The last keys go: each shard's empty arena is replaced, and the tables are narrow
        // again, also for new keys.
        remove_keys(&t, model.keys().copied());
        model.clear();
        assert!(
            (0..SHARDS).all(|s| !t.is_wide(s)),
            "emptied shards are narrow"
        );
        for k in 0..16u64 {
            let key = k.to_be_bytes();
            let p = Probe::new(&key);
            let hs = vec![Holder::new(1, 1, 16, 1, 1)];
            t.writer(KeyTable::shard_of(p))
                .insert_p(p, &hs, None, &guard);
            model.insert(k, hs);
        }
        check(&t, &model);
        assert!(
            (0..SHARDS).all(|s| !t.is_wide(s)),
            "a few new keys fit narrow lanes"
        );
    }

    /// Readers keep finding a fixed set of keys while a writer's inserts move their shards
    /// from narrow to wide tables (the switch is an ordinary rebuild: readers of the old table
    /// stay valid through the epoch).
    #[test]
    fn readers_never_miss_a_key_while_its_shard_goes_wide() {
        let t = KeyTable::with_narrow_limit(2 << 15);
        put_keys(&t, 0..2_000, 2);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                put_keys(&t, 1_000_000..1_060_000, 3);
                done.store(true, Ordering::Release);
            });
            for _ in 0..2 {
                sc.spawn(|| {
                    let mut rounds = 0;
                    while !done.load(Ordering::Acquire) || rounds == 0 {
                        let guard = epoch::pin();
                        for k in 0..2_000u64 {
                            let n = t.find(&k.to_be_bytes(), &guard).expect("never missed");
                            assert_eq!(n.holders().len(), 2);
                            assert_eq!(n.holders()[1].last_seen_ms(), k as i64);
                        }
                        rounds += 1;
                    }
                });
            }
        });
        assert!((0..SHARDS).all(|s| t.is_wide(s)));
    }

    #[test]
    fn credits_below_the_threshold_land_in_the_base() {
        let (t, ks) = (KeyTable::new(), key_sum());
        let c = cell(&ks);
        let got: Vec<_> = (0..4).map(|_| c.credit(2, 4, &t)).collect();
        assert_eq!(
            got,
            [
                Credited::BelowThreshold,
                Credited::BelowThreshold,
                Credited::AtOrAbove,
                Credited::AtOrAbove
            ]
        );
        assert_eq!(c.count(), 4);
        assert!(c.stripes.load(Ordering::Relaxed).is_null());
    }

    #[test]
    fn stripes_add_to_the_count_and_die_with_the_cell() {
        let (t, ks) = (KeyTable::new(), key_sum());
        let bytes0 = t.bytes();
        let c = cell(&ks);
        for _ in 0..3 {
            c.credit(2, 4, &t);
        }
        for _ in 0..5 {
            assert!(c.credit_striped(4, &t));
        }
        assert_eq!(c.count(), 8);
        assert_eq!(t.bytes() - bytes0, Stripes::bytes(4) as i64);
        let (total, base, stripe_bytes) = c.kill();
        assert_eq!((total, base, stripe_bytes), (8, 3, Stripes::bytes(4)));
        assert_eq!(c.credit(2, 4, &t), Credited::Refused);
        assert!(!c.credit_striped(4, &t), "a dead stripe refuses credits");
        assert_eq!(c.count(), 0, "a dead cell's words are all DEAD (count 0)");
    }

    #[test]
    fn a_killed_cell_never_grows_stripes() {
        let (t, ks) = (KeyTable::new(), key_sum());
        let c = cell(&ks);
        for _ in 0..3 {
            c.credit(2, 4, &t);
        }
        assert_eq!(c.kill(), (3, 3, 0));
        let bytes = t.bytes();
        assert!(!c.credit_striped(4, &t));
        assert_eq!(c.stripes.load(Ordering::Relaxed), stripes_dead());
        assert_eq!(t.bytes(), bytes, "no stripe set was created");
    }

    #[test]
    fn counts_saturate_at_u32_max() {
        let (t, ks) = (KeyTable::new(), key_sum());
        let c = cell(&ks);
        c.access.store(COUNT_MAX - 1, Ordering::Relaxed);
        assert_eq!(c.credit(2, 4, &t), Credited::AtOrAbove);
        assert_eq!(c.credit(2, 4, &t), Credited::Refused);
        assert!(c.credit_striped(4, &t));
        assert_eq!(c.count(), COUNT_MAX, "the sum is clamped");
    }

    #[test]
    fn node_layout_roundtrip() {
        for key in [&b"12345678"[..], b"", b"x", b"a-much-longer-key-than-eight"] {
            let hs = [
                Holder::new(1, 1, 16, -5, 7),
                Holder::new(3, 4, -2, (1 << 42) - 1, (1 << 28) - 1),
            ];
            let buf = KeyNode::build_boxed(key, crate::raw::table::digest(key), &hs, None);
            // SAFETY: `buf` holds a node written by `build_boxed`, alive for this iteration.
            let r = unsafe { &*(buf.as_ptr() as *const KeyNode) };
            assert_eq!(r.key(), key);
            assert_eq!(r.holders().len(), 2);
            assert!(r.holders()[0].same_data(&hs[0]) && r.holders()[1].same_data(&hs[1]));
            assert_eq!(r.holders()[1].last_seen_ms(), (1 << 42) - 1);
            assert!(!r.is_member());
            assert_eq!(r.holders()[1].tier(), 4);
            assert_eq!(r.holders()[1].tokens(), -2);
            assert_eq!(r.holders()[0].last_seen_ms(), -5);
            assert!(r.matches(key, crate::raw::table::digest(key)));
            let exact = 8 + 2 * 16 + if key.len() == 8 { 0 } else { 4 + key.len() };
            assert_eq!(
                r.units() as usize,
                exact.div_ceil(8),
                "exact size in 8-byte units"
            );
        }
        assert_eq!(
            Holder::new(0, 1, 0, i64::MAX, 0).last_seen_ms(),
            crate::raw::table::clamp_ts(i64::MAX)
        );
    }

    /// A run node of one holder takes the 16-byte member form exactly when its holder is the
    /// run's member (same replica and `last_seen`), and reads back the same either way; no
    /// plain node ever looks like a member node, whatever its first holder's timestamp.
    #[test]
    fn member_nodes_roundtrip_and_never_alias_plain_nodes() {
        use crate::raw::table::clamp_ts;
        let guard = epoch::pin();
        let keys: Vec<[u8; 8]> = (0..8u64).map(|k| (k * 31 + 5).to_be_bytes()).collect();
        for ts in [
            0,
            -5,
            1_700_000_000_000,
            i64::MAX,
            i64::MIN,
            (1 << 42) - 1,
            -(1 << 42),
        ] {
            let member = Holder::member_word(9, ts);
            let run = ChainRun::create(keys.iter().copied(), member).unwrap();
            for (h, member_form) in [
                (Holder::new(9, 2, 48, ts, 77), true),
                (
                    Holder::new(9, 2, 48, ts.saturating_add(1), 77),
                    clamp_ts(ts.saturating_add(1)) == clamp_ts(ts),
                ),
                (Holder::new(8, 2, 48, ts, 77), false),
            ] {
                let w = crate::raw::runs::run_word(run, 3);
                let buf =
                    KeyNode::build_boxed(&keys[3], u64::from_be_bytes(keys[3]), &[h], Some(w));
                // SAFETY: `buf` holds a node written by `build_boxed`; its run is alive.
                let r = unsafe { &*(buf.as_ptr() as *const KeyNode) };
                assert_eq!(r.is_member(), member_form, "ts {ts}, {h:?}");
                assert_eq!(r.units(), if member_form { 2 } else { 3 });
                assert_eq!(r.holders().len(), 1);
                assert!(r.holders()[0].same_data(&h), "ts {ts}");
                assert_eq!(r.holder(h.rep()).map(|x| x.generation()), Some(77));
                assert_eq!(r.key(), &keys[3]);
                assert_eq!(r.run(), Some((run, 3)));
                assert!(r.matches(&keys[3], u64::from_be_bytes(keys[3])));
                assert!(!r.matches(&keys[4], u64::from_be_bytes(keys[4])));
            }
            for key in [&keys[0][..], b"long key, stored inline"] {
                let plain = KeyNode::build_boxed(
                    key,
                    crate::raw::table::digest(key),
                    &[Holder::new(crate::raw::table::REP_MASK, 4, -1, ts, 1)],
                    None,
                );
                // SAFETY: as above.
                let r = unsafe { &*(plain.as_ptr() as *const KeyNode) };
                assert!(!r.is_member(), "plain node at ts {ts}");
                assert_eq!(r.key(), key);
            }
            // SAFETY: our own run, no node names it (the boxed nodes hold no reference).
            assert!(unsafe { ChainRun::seal(run, 0, |_| false, &Default::default(), &guard) } > 0);
        }
    }
}
