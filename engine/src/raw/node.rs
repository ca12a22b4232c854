//! Key nodes and their holders: the immutable entries of a key table (`table.rs`, invariant 1:
//! a published node is never written; a change builds a new node).
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

use crate::raw::arena::{Arena, ArenaState, units_for};
use crate::raw::runs::ChainRun;
use crossbeam_epoch::Guard;
use std::alloc::Layout;
use std::ptr::NonNull;

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
pub struct Holder {
    a: u64,
    b: u64,
}

impl Holder {
    #[inline]
    pub fn new(rep: u32, tier: u8, tokens: i32, last_seen_ms: i64, generation: u32) -> Self {
        debug_assert!(rep <= REP_MASK);
        debug_assert!((1..=4).contains(&tier));
        let a = ((clamp_ts(last_seen_ms) as u64) << REP_BITS) | rep as u64;
        let b = (tokens as u32 as u64)
            | (((tier - 1) as u64 & 3) << 32)
            | (((generation & GEN_MASK) as u64) << 34);
        Self { a, b }
    }
    /// A holder from its two stored words (a run's holder entry, `raw::block_run`).
    #[inline]
    pub fn from_words(a: u64, b: u64) -> Self {
        Self { a, b }
    }
    /// The two stored words.
    #[inline]
    pub fn words(&self) -> (u64, u64) {
        (self.a, self.b)
    }
    /// The first word of every holder of replica `rep` last seen at `last_seen_ms`: a run's
    /// member word (see [`KeyNode`]).
    #[inline]
    pub(crate) fn member_word(rep: u32, last_seen_ms: i64) -> u64 {
        Self::new(rep, 1, 0, last_seen_ms, 0).a
    }
    #[inline]
    pub fn rep(&self) -> u32 {
        (self.a & REP_MASK as u64) as u32
    }
    #[inline]
    pub fn last_seen_ms(&self) -> i64 {
        (self.a as i64) >> REP_BITS
    }
    #[inline]
    pub fn tokens(&self) -> i32 {
        self.b as u32 as i32
    }
    /// This holder with its token count replaced.
    #[inline]
    pub fn with_tokens(&self, tokens: i32) -> Self {
        Self {
            a: self.a,
            b: (self.b & !u64::from(u32::MAX)) | u64::from(tokens as u32),
        }
    }
    #[inline]
    pub fn tier(&self) -> u8 {
        ((self.b >> 32) & 3) as u8 + 1
    }
    #[inline]
    pub fn generation(&self) -> u32 {
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
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Node,
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
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Node,
            self as *const KeyNode as usize,
        );
        // SAFETY: a plain node is always allocated with at least one holder right after the
        // header (see `build`); the offset stays inside that allocation.
        unsafe { (self as *const KeyNode as *const u8).add(HDR) as *const Holder }
    }

    /// The digest of the key (see [`digest`]).
    #[inline]
    pub(crate) fn digest(&self) -> u64 {
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Node,
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
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Node,
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
            crate::raw::hooks::created(crate::raw::hooks::Kind::Node, p as usize);
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
        crate::raw::hooks::created(crate::raw::hooks::Kind::Node, p as usize);
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
pub fn digest(b: &[u8]) -> u64 {
    match <[u8; 8]>::try_from(b) {
        Ok(a) => u64::from_be_bytes(a),
        Err(_) => xxhash_rust::xxh3::xxh3_64(b),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_epoch as epoch;

    #[test]
    fn node_layout_roundtrip() {
        for key in [&b"12345678"[..], b"", b"x", b"a-much-longer-key-than-eight"] {
            let hs = [
                Holder::new(1, 1, 16, -5, 7),
                Holder::new(3, 4, -2, (1 << 42) - 1, (1 << 28) - 1),
            ];
            let buf = KeyNode::build_boxed(key, digest(key), &hs, None);
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
            assert!(r.matches(key, digest(key)));
            let exact = 8 + 2 * 16 + if key.len() == 8 { 0 } else { 4 + key.len() };
            assert_eq!(
                r.units() as usize,
                exact.div_ceil(8),
                "exact size in 8-byte units"
            );
        }
        assert_eq!(
            Holder::new(0, 1, 0, i64::MAX, 0).last_seen_ms(),
            clamp_ts(i64::MAX)
        );
    }

    /// A run node of one holder takes the 16-byte member form exactly when its holder is the
    /// run's member (same replica and `last_seen`), and reads back the same either way; no
    /// plain node ever looks like a member node, whatever its first holder's timestamp.
    #[test]
    fn member_nodes_roundtrip_and_never_alias_plain_nodes() {
        use clamp_ts;
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
                    digest(key),
                    &[Holder::new(REP_MASK, 4, -1, ts, 1)],
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
