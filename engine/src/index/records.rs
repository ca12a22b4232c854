//! Interned records: tenants, (tenant, model) pairs, scopes, partitions, per-model gauges.
//!
//! Records are created on first use (`resolution.rs`) and reclaimed by the sweep once they hold
//! nothing (see [`Life`] for the protocol and `Index::sweep_now` for the order); they live in
//! the directories of [`crate::directory`], so a reference to one is bound to the caller's epoch
//! guard. A scope's replicas live in slots recycled the same way
//! ([`ScopeRec::reclaim_slots`]).
//!
//! Ownership runs one way, from child to parent: a partition holds its tenant, (tenant, model)
//! pair and scope, a pair holds its tenant and gauge (plain `Arc`s, read on the lookup path
//! without an upgrade). A parent's lists of its children (a tenant's pairs, a pair's
//! partitions, a quota hand's partitions between enforcements) hold `Weak`s, and what keeps a
//! record alive is the index's directories and lists (and, for an unlinked record, the epoch).
//! So the records form no reference cycle and a dropped index frees them all without help.
//! The sweep takes a reclaimed record out of its parent's list under the record lock, so a
//! listed child always upgrades (between its unlink and that removal it is still held by the
//! sweep); a walk over a list skips a child that does not.

use crate::ReplicaId;
use crate::directory::{Directory, Life, Rcu, hash_strs, same_str};
use crate::raw::lazy_box::LazyBox;
use crate::raw::lfu::LfuCells;
use crate::raw::run_store::RunStore;
use crate::sync::{AtomicI64, AtomicU64, Mutex, Ordering};
use crossbeam_epoch::{self as epoch, Guard};
use std::sync::atomic::{
    AtomicU32 as StdAtomicU32, AtomicUsize as StdAtomicUsize, Ordering as StdOrdering,
};
use std::sync::{Arc, Weak};

/// Adds `child` to a parent's list of children (a tenant's pairs, a pair's partitions): the
/// first child gets a list of one (8 bytes; a growing vector's first allocation holds four,
/// 32), since most parents of churned identities never get a second.
pub(crate) fn push_child<T>(list: &mut Vec<T>, child: T) {
    if list.capacity() == 0 {
        list.reserve_exact(1);
    }
    list.push(child);
}

/// A tenant.
pub(crate) struct TenantRec {
    pub(crate) name: Arc<str>,
    pub(crate) reserved: bool,
    /// Distinct keys of the tenant (all models), stale-unswept included.
    pub(crate) keys: AtomicI64,
    /// The tenant's (tenant, model) pairs (weak: each pair holds its tenant).
    pub(crate) models: Mutex<Vec<Weak<ModelRec>>>,
    /// Keys removed by the tenant quota (V5, `tenant_evictions_total{over_entries}`).
    pub(crate) quota_evictions: AtomicU64,
    /// Victim-selection state of the tenant quota (V5; see `eviction/`), made at the
    /// tenant's first quota enforcement (most tenants never have one).
    pub(crate) quota_hand: QuotaHand,
}

/// A tenant's quota hand behind its lock, made at the tenant's first quota enforcement (8
/// bytes inline where a `Mutex<Option<Box<_>>>` took 16, which put the tenant record with its
/// `Arc` header in mimalloc's 112-byte class rather than the 96; issue 42).
pub(crate) type QuotaHand = LazyBox<Mutex<super::eviction::Hand<Partition>>>;

/// Per-model gauge (V7): distinct non-reserved keys across tenants.
pub(crate) struct GaugeRec {
    pub(crate) model: Arc<str>,
    pub(crate) keys: AtomicI64,
    /// (tenant, model) pairs counting into this gauge (changed under the record lock).
    pub(crate) pairs: StdAtomicUsize,
}

/// One stats record (S1–S3).
#[derive(Clone, Debug)]
pub(crate) struct StatsRecord {
    pub(crate) replica: ReplicaId,
    pub(crate) cache_memory_bytes: i64,
    pub(crate) hit_rate: f32,
    pub(crate) pressure: f32,
    pub(crate) t2_hit_tokens: i64,
    pub(crate) t2_query_tokens: i64,
    /// Liveness clock (ms).
    pub(crate) last_seen_ms: i64,
    /// Payload freshness clock (ms).
    pub(crate) reported_ms: i64,
}

/// A (tenant, model) pair.
pub(crate) struct ModelRec {
    pub(crate) tenant: Arc<TenantRec>,
    pub(crate) name: Arc<str>,
    /// Distinct keys of (tenant, model).
    pub(crate) keys: AtomicI64,
    /// Keys whose access sum ≥ the hot threshold (D4).
    pub(crate) hot: AtomicI64,
    pub(crate) gauge: Arc<GaugeRec>,
    /// Stats records sorted by replica id; their writer lock guards the pair's partitions
    /// ([`ModelRec::parts`]): one lock where two put the record with its `Arc` header in
    /// mimalloc's 128-byte class rather than the 112 (issue 42).
    pub(crate) stats: Rcu<Vec<StatsRecord>, Vec<Weak<Partition>>>,
    /// Reclamation gate of the stats writers (see [`Life`]).
    pub(crate) life: Life,
}

impl ModelRec {
    /// Partitions of this pair (E3/E4 cost; weak: each partition holds its pair), locked.
    /// The lock is the stats cell's writer lock: not held across a stats update.
    pub(crate) fn parts(&self) -> crate::sync::MutexGuard<'_, Vec<Weak<Partition>>> {
        self.stats.guarded()
    }

    pub(crate) fn stats_of<'g>(&self, replica: &str, guard: &'g Guard) -> Option<&'g StatsRecord> {
        let v = self.stats.load(guard);
        v.binary_search_by(|r| (*r.replica).cmp(replica))
            .ok()
            .map(|i| &v[i])
    }

    /// The stats record of scope replica `rep` among the model's records `v` (loaded once per
    /// lookup; same as `stats_of(&rep.name)`). Ranking asks
    /// this for every scored replica; a binary search compares long ids (~11 `memcmp`s of
    /// 40-byte pod names in a 2,048-replica fleet), so each replica remembers where its record
    /// was last found and checks that position first. Records only move when a replica's
    /// first report inserts one before them, so the hint is almost always right.
    #[inline]
    pub(crate) fn stats_in<'g>(
        v: &'g [StatsRecord],
        rep: &ScopeReplica,
    ) -> Option<&'g StatsRecord> {
        let hint = rep.stats_hint.load(StdOrdering::Relaxed) as usize;
        if let Some(r) = v.get(hint)
            && r.replica == rep.name
        {
            return Some(r);
        }
        let i = v.binary_search_by(|r| (*r.replica).cmp(&*rep.name)).ok()?;
        rep.stats_hint.store(i as u32, StdOrdering::Relaxed);
        Some(&v[i])
    }
}

/// A replica known in a scope, with its serving count (K16).
pub(crate) struct ScopeReplica {
    pub(crate) name: ReplicaId,
    pub(crate) serving: AtomicI64,
    /// Where this replica's record was last found in its model's stats (see
    /// [`ModelRec::stats_in`]). Only a hint, checked by id (a pointer compare) before use, so
    /// any reader may overwrite it and a stale or racing value only costs a search: `std`
    /// atomics even in loom builds, as nothing is ordered by it.
    stats_hint: StdAtomicU32,
    /// Order label: for any two replicas of the scope, a smaller label means a smaller id in
    /// byte order (labels never decrease along the id order; equal labels say nothing, and the
    /// ids decide). Ranking orders equal scores (R4, R5) by it (see [`label_between`]).
    pub(crate) label: u64,
    /// Reclamation gate of the slot (see [`Life`] and [`ScopeRec::reclaim_slots`]).
    life: Life,
}

/// Where appended labels go: a label below/above every other one is this far from its
/// neighbour (or half the room left, when less), so ids that keep arriving in ascending (or
/// descending) order, like numbered pods, get 2^31 distinct labels before they start to tie.
const LABEL_STEP: u64 = 1 << 32;

/// A label for a new id between the labels of its neighbours in id order (`None`: no neighbour
/// on that side): the midpoint, or the lower label when they are adjacent. Any label within
/// `[lo, hi]` keeps the invariant of [`ScopeReplica::label`]; a tie only costs an id compare.
pub(crate) fn label_between(lo: Option<u64>, hi: Option<u64>) -> u64 {
    match (lo, hi) {
        (None, None) => 1 << 63,
        (Some(lo), None) => lo + LABEL_STEP.min((u64::MAX - lo) / 2),
        (None, Some(hi)) => hi - LABEL_STEP.min(hi / 2),
        (Some(lo), Some(hi)) => lo + (hi - lo) / 2,
    }
}

/// First slot chunk's length; chunk `k` holds `SLOT_BASE << k` slots. (One: most scopes of
/// churned tenants and models name one replica, and every scope with one pays for its first
/// chunk: 8 bytes, where four slots took 32.)
const SLOT_BASE: usize = 1;
/// Chunks needed for [`MAX_SCOPE_REPLICAS`] slots: `SLOT_BASE · (2^21 − 1) ≥ 2^20`.
const SLOT_CHUNKS: usize = 21;
/// Chunks whose pointers [`ReplicaSlots`] holds inline (slot 0: most scopes of churned tenants
/// and models name one replica; two more inline pointers put the scope record with its `Arc`
/// header in mimalloc's 224-byte class rather than the 192).
const INLINE_SLOT_CHUNKS: usize = 1;
/// Chunks whose pointers are in [`ReplicaSlots`]'s `rest` array.
const REST_SLOT_CHUNKS: usize = SLOT_CHUNKS - INLINE_SLOT_CHUNKS;

/// A slot chunk's pointer.
type ChunkPointer = crate::sync::AtomicPtr<crate::sync::AtomicPtr<ScopeReplica>>;

/// Chunk and offset of slot `i` (`raw::doubling`).
#[inline]
fn slot_place(i: usize) -> (usize, usize) {
    crate::raw::doubling::place(i, SLOT_BASE)
}

/// A scope's replicas by scope-local index: chunks of doubling length, allocated when the first
/// index in them is handed out, so appending a replica is O(1) (no copy of the earlier ones)
/// and an empty scope costs one small array of chunk pointers: the first
/// [`INLINE_SLOT_CHUNKS`] (1 slot) inline, the others' in an array allocated with the first
/// chunk past them (`rest`, never replaced or freed before the slots), so a scope of one
/// replica carries 2 pointers, not 21 (issue 42's churned tenants and models). A reader of a
/// slot past the inline chunks loads `rest` (Acquire) before the chunk pointer; the writer
/// stores `rest` (Release) once its null pointers are written.
///
/// Invariants: a slot is written by the interning writer (scope name lock held), with a
/// Release store of a fully built record, before any holder naming the index is published;
/// it then does not change while any holder names the index. A chunk pointer is stored
/// (Release) before any of its slots. A reader reaches a slot only through a holder it loaded
/// with Acquire, so it sees the chunk and the record. A reclaimed slot is emptied, and its
/// record dropped, by a writer (scope name lock held) once the epoch-deferred function of its
/// reclamation has released the index, before the index is handed out again: by then no holder
/// names the index and no reader pinned before the reclamation is still pinned, so no reader
/// can reach the record (see [`ScopeRec::reclaim_slots`]).
pub(crate) struct ReplicaSlots {
    /// Chunks `0..INLINE_SLOT_CHUNKS`.
    inline: [ChunkPointer; INLINE_SLOT_CHUNKS],
    /// Chunks `INLINE_SLOT_CHUNKS..SLOT_CHUNKS`: a boxed `[ChunkPointer; REST_SLOT_CHUNKS]`,
    /// null until the writer first needs one of them.
    rest: crate::sync::AtomicPtr<ChunkPointer>,
    /// Slots handed out so far (indices `0..len` are set or being set).
    len: crate::sync::AtomicU64,
}

impl ReplicaSlots {
    fn new() -> Self {
        Self {
            inline: std::array::from_fn(|_| crate::sync::AtomicPtr::new(std::ptr::null_mut())),
            rest: crate::sync::AtomicPtr::new(std::ptr::null_mut()),
            len: crate::sync::AtomicU64::new(0),
        }
    }

    /// The pointer of chunk `k < SLOT_CHUNKS`, if its place exists (`None` past the inline
    /// chunks before `rest` is allocated: as a null chunk).
    #[inline]
    fn chunk(&self, k: usize) -> Option<&ChunkPointer> {
        if k < INLINE_SLOT_CHUNKS {
            return Some(&self.inline[k]);
        }
        // Acquire: the array's null pointers before their use.
        let rest = self.rest.load(Ordering::Acquire);
        if rest.is_null() || k >= SLOT_CHUNKS {
            return None;
        }
        // SAFETY: a non-null `rest` is a boxed array of `REST_SLOT_CHUNKS` initialised
        // pointers, freed only with the slots; `k - INLINE_SLOT_CHUNKS < REST_SLOT_CHUNKS`.
        Some(unsafe { &*rest.add(k - INLINE_SLOT_CHUNKS) })
    }

    /// The reader's view under `guard`.
    #[inline]
    pub(crate) fn load<'g>(&'g self, _guard: &'g Guard) -> ReplicaView<'g> {
        ReplicaView { slots: self }
    }

    /// Stores `rec` at index `i` (writer, name lock held; `i` is the next index).
    fn set(&self, i: usize, rec: Arc<ScopeReplica>) {
        let (k, off) = slot_place(i);
        if k >= INLINE_SLOT_CHUNKS && self.rest.load(Ordering::Relaxed).is_null() {
            let pointers: Box<[ChunkPointer]> = (0..REST_SLOT_CHUNKS)
                .map(|_| crate::sync::AtomicPtr::new(std::ptr::null_mut()))
                .collect();
            // Release: the null pointers before the array's address.
            self.rest.store(
                Box::into_raw(pointers) as *mut ChunkPointer,
                Ordering::Release,
            );
        }
        let place = self
            .chunk(k)
            .expect("a chunk below SLOT_CHUNKS has a place once rest is allocated");
        let mut chunk = place.load(Ordering::Acquire);
        if chunk.is_null() {
            let slots: Box<[crate::sync::AtomicPtr<ScopeReplica>]> = (0..SLOT_BASE << k)
                .map(|_| crate::sync::AtomicPtr::new(std::ptr::null_mut()))
                .collect();
            chunk = Box::into_raw(slots) as *mut crate::sync::AtomicPtr<ScopeReplica>;
            place.store(chunk, Ordering::Release);
        }
        // SAFETY: `off < SLOT_BASE << k`, the chunk's length; chunks live as long as `self`.
        let slot = unsafe { &*chunk.add(off) };
        let old = slot.swap(Arc::into_raw(rec) as *mut ScopeReplica, Ordering::AcqRel);
        debug_assert!(old.is_null(), "a slot is emptied before its index is freed");
        if i as u64 >= self.len.load(Ordering::Relaxed) {
            self.len.store(i as u64 + 1, Ordering::Release);
        }
    }

    /// Empties slot `i` and drops its record: a reclaimed slot whose grace period has passed
    /// (see the type's invariants).
    fn clear(&self, i: usize) {
        let (k, off) = slot_place(i);
        let Some(place) = self.chunk(k) else {
            return;
        };
        let chunk = place.load(Ordering::Acquire);
        if chunk.is_null() {
            return;
        }
        // SAFETY: as in `set`.
        let slot = unsafe { &*chunk.add(off) };
        let old = slot.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !old.is_null() {
            // SAFETY: the slot owned one `Arc` count of `old`; no reader can reach it any more
            // (no holder names the index and readers reach slots only through holders).
            drop(unsafe { Arc::from_raw(old as *const ScopeReplica) });
        }
    }

    #[inline]
    fn get(&self, i: usize) -> Option<&ScopeReplica> {
        if i >= MAX_SCOPE_REPLICAS {
            return None;
        }
        let (k, off) = slot_place(i);
        let chunk = self.chunk(k)?.load(Ordering::Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: as in `set`; a non-null slot holds a record owned by the slot (one `Arc`
        // count), dropped only once no holder names the index and no reader pinned while one
        // did is still pinned (`clear`), and the caller reached it through such a holder (or
        // is the writer, with the slot entered).
        unsafe {
            let rec = (*chunk.add(off)).load(Ordering::Acquire);
            rec.as_ref()
        }
    }
}

impl Drop for ReplicaSlots {
    fn drop(&mut self) {
        for k in 0..SLOT_CHUNKS {
            let Some(place) = self.chunk(k) else {
                break; // no `rest`: no chunk past the inline ones
            };
            let chunk = place.load(Ordering::Relaxed);
            if chunk.is_null() {
                continue;
            }
            let n = SLOT_BASE << k;
            // SAFETY: exclusive access; the chunk was a boxed slice of `n` slots, and each
            // non-null slot owns one `Arc` count of its record.
            unsafe {
                let slots = Box::from_raw(std::ptr::slice_from_raw_parts_mut(chunk, n));
                for s in slots.iter() {
                    let r = s.load(Ordering::Relaxed);
                    if !r.is_null() {
                        drop(Arc::from_raw(r as *const ScopeReplica));
                    }
                }
            }
        }
        let rest = self.rest.load(Ordering::Relaxed);
        if !rest.is_null() {
            // SAFETY: built by `set` from a boxed slice of `REST_SLOT_CHUNKS` pointers, freed
            // once, here; the chunks it named were freed above.
            drop(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(rest, REST_SLOT_CHUNKS))
            });
        }
    }
}

/// A reader's view of a scope's replicas (see [`ReplicaSlots`]).
#[derive(Clone, Copy)]
pub(crate) struct ReplicaView<'g> {
    slots: &'g ReplicaSlots,
}

impl<'g> ReplicaView<'g> {
    /// Replica `i`, if that index was handed out.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&'g ScopeReplica> {
        self.slots.get(i)
    }

    /// Replica `i`'s record as a pointer, its line fetched into cache (a lookup that will rank
    /// it: the record is a line of its own, read per ranked replica); null if the index was
    /// not handed out.
    #[inline]
    pub(crate) fn fetch(&self, i: usize) -> *const ScopeReplica {
        match self.slots.get(i) {
            Some(record) => {
                crate::raw::slots::prefetch(record);
                record
            }
            None => std::ptr::null(),
        }
    }

    /// Indices handed out so far (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.len.load(Ordering::Acquire) as usize
    }

    /// Every replica, by index (tests: readers reach slots only through holders, see
    /// [`ReplicaSlots`]).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &'g ScopeReplica> + 'g {
        let slots = self.slots;
        (0..self.len()).filter_map(move |i| slots.get(i))
    }
}

impl std::ops::Index<usize> for ReplicaView<'_> {
    type Output = ScopeReplica;
    /// Replica `i` of a holder: holders only name indices whose slot was set before the holder
    /// was published (see [`ReplicaSlots`]).
    fn index(&self, i: usize) -> &ScopeReplica {
        self.slots
            .get(i)
            .expect("a holder names a replica slot set before it")
    }
}

/// Most replicas one scope can name: a holder stores the scope-local index in 20 bits.
pub(crate) const MAX_SCOPE_REPLICAS: usize = crate::raw::holder::REP_MASK as usize + 1;

/// Ids a scope's [`NameMap`] keeps in a sorted vector before it becomes a B-tree.
const SMALL_NAME_MAP: usize = 32;

/// A scope's id → local index map, in id order (the neighbours' slots give a new id's label):
/// a sorted vector, grown one entry at a time, while the scope names at most
/// [`SMALL_NAME_MAP`] ids, a B-tree from then on. Every scope has one, and most name one or a
/// few replicas: one (id, index) pair costs 16 bytes in the vector, where a B-tree's first
/// leaf is 144 (issue 42's churned tenants and models). Past the threshold an insertion or
/// removal stays O(log n) (a producer inventing ids cannot make each new one cost a copy of
/// the scope's names); a scope that shrank keeps its B-tree.
enum NameMap {
    Small(Vec<(ReplicaId, u32)>),
    Large(std::collections::BTreeMap<ReplicaId, u32>),
}

impl Default for NameMap {
    fn default() -> Self {
        NameMap::Small(Vec::new())
    }
}

impl NameMap {
    /// Where `name` is, or would be inserted, in the sorted vector.
    fn search(small: &[(ReplicaId, u32)], name: &str) -> Result<usize, usize> {
        small.binary_search_by(|(id, _)| (**id).cmp(name))
    }

    fn get(&self, name: &str) -> Option<u32> {
        match self {
            NameMap::Small(small) => Self::search(small, name).ok().map(|k| small[k].1),
            NameMap::Large(large) => large.get(name).copied(),
        }
    }

    /// The indices of the ids just below and just above `name` (absent from the map).
    fn neighbours(&self, name: &str) -> (Option<u32>, Option<u32>) {
        use std::ops::Bound::{Excluded, Unbounded};
        match self {
            NameMap::Small(small) => {
                let k = Self::search(small, name).unwrap_or_else(|k| k);
                let below = k.checked_sub(1).map(|j| small[j].1);
                (below, small.get(k).map(|&(_, i)| i))
            }
            NameMap::Large(large) => (
                large
                    .range::<str, _>((Unbounded, Excluded(name)))
                    .next_back()
                    .map(|(_, &i)| i),
                large
                    .range::<str, _>((Excluded(name), Unbounded))
                    .next()
                    .map(|(_, &i)| i),
            ),
        }
    }

    /// Maps `id` (absent) to `i`.
    fn insert(&mut self, id: ReplicaId, i: u32) {
        match self {
            NameMap::Small(small) if small.len() < SMALL_NAME_MAP => {
                let k = Self::search(small, &id).unwrap_or_else(|k| k);
                // One entry at a time: the vector holds what the scope names, not a doubling's
                // spare room (at most SMALL_NAME_MAP entries are moved per insertion).
                small.reserve_exact(1);
                small.insert(k, (id, i));
            }
            NameMap::Small(small) => {
                let mut large: std::collections::BTreeMap<ReplicaId, u32> =
                    std::mem::take(small).into_iter().collect();
                large.insert(id, i);
                *self = NameMap::Large(large);
            }
            NameMap::Large(large) => {
                large.insert(id, i);
            }
        }
    }

    fn remove(&mut self, name: &str) {
        match self {
            NameMap::Small(small) => {
                if let Ok(k) = Self::search(small, name) {
                    small.remove(k);
                    small.shrink_to_fit();
                }
            }
            NameMap::Large(large) => {
                large.remove(name);
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            NameMap::Small(small) => small.len(),
            NameMap::Large(large) => large.len(),
        }
    }

    /// Calls `f` with every (id, index), in id order.
    fn for_each(&self, mut f: impl FnMut(&ReplicaId, u32)) {
        match self {
            NameMap::Small(small) => small.iter().for_each(|(id, i)| f(id, *i)),
            NameMap::Large(large) => large.iter().for_each(|(id, i)| f(id, *i)),
        }
    }
}

/// Writer-side state of a scope's replica names.
#[derive(Default)]
pub(crate) struct ScopeNames {
    /// Id → local index, in id order. Labels are read from the slots rather than kept here
    /// (every scope has a map, and most scopes name one replica).
    by_name: NameMap,
    /// Indices of emptied slots, ready for new ids: boxed and made by the first emptied slot
    /// (most scopes never empty one; the inline vector, 16 bytes more, put the scope record
    /// with its `Arc` header in mimalloc's 224-byte class rather than the 192).
    #[expect(
        clippy::box_collection,
        reason = "8 bytes inline where a vector takes 24: the record's size class"
    )]
    free: Option<Box<Vec<u32>>>,
}

/// A scope (tenant, model, scheme).
pub(crate) struct ScopeRec {
    pub(crate) tenant: Arc<str>,
    pub(crate) model: Arc<str>,
    pub(crate) scheme: Arc<str>,
    /// Replicas by scope-local index (append only).
    pub(crate) replicas: ReplicaSlots,
    /// Replicas by id, for readers (serving counts by name: TENANT_HOT, tests).
    lookup: Directory<ScopeReplica>,
    /// Writer-side names (held across the slot stores).
    names: Mutex<ScopeNames>,
    /// Indices of reclaimed slots whose grace period has passed, their slots not yet emptied.
    /// Its own lock, taken by epoch-deferred functions: nothing pins while holding it (a pin
    /// may run deferred functions, which must not wait for a lock their thread holds). Boxed
    /// and made by the first release: most scopes never release a slot, and an inline vector
    /// (16 bytes more) would put the record with its `Arc` header past mimalloc's 192-byte
    /// class (`scope_record_fits_the_192_byte_class`).
    #[expect(
        clippy::box_collection,
        reason = "8 bytes inline where a vector takes 24: the record's size class"
    )]
    released: Mutex<Option<Box<Vec<u32>>>>,
    /// Replicas with serving > 0.
    pub(crate) serving_n: AtomicI64,
    /// Partitions of the scope (changed under the record lock).
    pub(crate) parts: StdAtomicUsize,
}

impl ScopeRec {
    pub(crate) fn new(tenant: Arc<str>, model: Arc<str>, scheme: Arc<str>) -> Self {
        Self {
            tenant,
            model,
            scheme,
            replicas: ReplicaSlots::new(),
            lookup: Directory::new(),
            names: Mutex::new(ScopeNames::default()),
            released: Mutex::new(None),
            serving_n: AtomicI64::new(0),
            parts: StdAtomicUsize::new(0),
        }
    }

    /// Local index of `name`, creating it, with its slot entered (the caller calls
    /// [`ScopeRec::exit`] after its last counter update for it); `None` once the scope has
    /// [`MAX_SCOPE_REPLICAS`] replicas at once (a holder stores the index in 20 bits), so a
    /// producer inventing ids cannot crash the index: its entries for new ids are dropped.
    pub(crate) fn intern(&self, name: &str) -> Option<u32> {
        self.intern_within(name, MAX_SCOPE_REPLICAS)
    }

    fn intern_within(&self, name: &str, limit: usize) -> Option<u32> {
        let mut names = self.names.lock();
        if let Some(i) = names.by_name.get(name) {
            // Slots are retired under the name lock, together with their name: a named slot
            // is live.
            let entered = self.slot(i).life.enter();
            debug_assert!(entered, "a named slot is never retired");
            return entered.then_some(i);
        }
        self.empty_released(&mut names);
        let recycled = names.free.as_mut().and_then(|free| free.pop());
        let i = match recycled {
            Some(i) => i as usize,
            None => {
                let next = self.replicas.len.load(Ordering::Relaxed) as usize;
                if next >= limit {
                    return None;
                }
                next
            }
        };
        let (below, above) = names.by_name.neighbours(name);
        let label = label_between(
            below.map(|j| self.slot(j).label),
            above.map(|j| self.slot(j).label),
        );
        let id = ReplicaId::intern(name);
        let rec = Arc::new(ScopeReplica {
            name: id.clone(),
            serving: AtomicI64::new(0),
            stats_hint: StdAtomicU32::new(u32::MAX),
            label,
            life: Life::new(),
        });
        rec.life.enter();
        self.replicas.set(i, rec.clone());
        self.lookup
            .get_or_insert(hash_strs(&[name]), |r| same_str(&r.name, name), || rec);
        names.by_name.insert(id, i as u32);
        Some(i as u32)
    }

    /// The record in slot `i` (writer side: `i` was handed out).
    fn slot(&self, i: u32) -> &ScopeReplica {
        self.replicas
            .get(i as usize)
            .expect("a handed-out index has a slot")
    }

    /// Ends an [`intern`](ScopeRec::intern) or [`enter_existing`](ScopeRec::enter_existing).
    pub(crate) fn exit(&self, i: u32) {
        self.slot(i).life.exit();
    }

    /// Local index of `name` if known, with its slot entered (removal paths: the index cannot
    /// be given to another id until the caller [`exit`](ScopeRec::exit)s).
    pub(crate) fn enter_existing(&self, name: &str) -> Option<u32> {
        let names = self.names.lock();
        let i = names.by_name.get(name)?;
        self.slot(i).life.enter().then_some(i)
    }

    /// Local index of `name` if known (tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn index_of(&self, name: &str) -> Option<u32> {
        self.names.lock().by_name.get(name)
    }

    /// Ids currently named by the scope.
    pub(crate) fn named(&self) -> usize {
        self.names.lock().by_name.len()
    }

    /// Reclaims the slots of replicas that hold nothing in the scope (serving count 0, no
    /// writer in): the id leaves the name maps at once, and the index becomes available to
    /// new ids once every reader pinned now has unpinned (an epoch-deferred function releases
    /// the index), so no reader can map a holder it read before the removal to the slot's
    /// next replica. The next writer to intern an id, or the next reclamation, empties the
    /// released slots: the record, and with it the id's interned text, go then, whether or
    /// not a new id takes the index. (Not the deferred function itself: garbage is collected
    /// by whichever thread pins, often a reader inside a lookup, which should not drop ids
    /// under the interner's lock.)
    ///
    /// Why serving 0 means no holder names the index: the count is the replica's entries
    /// in the scope; ingests add to it only while entered (so not after the retirement), and
    /// removals subtract after their unlink (AcqRel, read here with Acquire), so the unlinks
    /// of all its entries happen before this check and before the deferral. Returns the slots
    /// reclaimed.
    pub(crate) fn reclaim_slots(self: &Arc<Self>) -> usize {
        let mut names = self.names.lock();
        self.empty_released(&mut names);
        let guard = epoch::pin();
        let mut gone = Vec::new();
        names.by_name.for_each(|id, i| {
            let rec = self.slot(i);
            if rec.serving.load(Ordering::Acquire) != 0 || !rec.life.try_retire() {
                return;
            }
            if rec.serving.load(Ordering::Acquire) != 0 {
                rec.life.revive();
                return;
            }
            gone.push((id.clone(), i));
        });
        let reclaimed = gone.len();
        for (id, i) in gone {
            names.by_name.remove(&id);
            let rec: *const ScopeReplica = self.slot(i);
            self.lookup.remove(hash_strs(&[&id]), rec);
            let scope = self.clone();
            guard.defer(move || {
                scope
                    .released
                    .lock()
                    .get_or_insert_with(Box::default)
                    .push(i)
            });
        }
        reclaimed
    }

    /// Empties the slots released since the last call and puts their indices on the free
    /// list (writer side: `names` is the scope's locked name state).
    fn empty_released(&self, names: &mut ScopeNames) {
        let released = self.released.lock().take();
        for i in released.map_or_else(Vec::new, |released| *released) {
            self.replicas.clear(i as usize);
            names.free.get_or_insert_with(Box::default).push(i);
        }
    }

    /// The replica named `name` (reader side, wait-free).
    #[inline]
    pub(crate) fn find<'g>(&self, name: &str, guard: &'g Guard) -> Option<&'g ScopeReplica> {
        self.lookup
            .get(hash_strs(&[name]), |r| same_str(&r.name, name), guard)
    }

    /// Ids of the scope's replicas with serving > 0 (reader side, allocates; by the name
    /// directory, which keeps its records for the guard's life, not by the slots, which only
    /// holders reach).
    pub(crate) fn serving_ids(&self) -> Vec<ReplicaId> {
        self.lookup
            .all()
            .iter()
            .filter(|r| r.serving.load(Ordering::Relaxed) > 0)
            .map(|r| r.name.clone())
            .collect()
    }

    /// Serving count of `name` (reader side).
    pub(crate) fn serving_of(&self, name: &str, guard: &Guard) -> i64 {
        self.find(name, guard)
            .map_or(0, |r| r.serving.load(Ordering::Relaxed))
    }
}

/// Names kept for the index's scopes and partitions to share (hash schemes and adapters: a
/// fleet uses a handful, and every churned tenant or model would otherwise carry its own copy
/// of "vllm" and of the empty adapter, 40 bytes with their counts). Behind the record lock.
#[derive(Default)]
pub(crate) struct SharedNames {
    /// The names handed out last, at most [`SharedNames::KEEP`].
    recent: Vec<Arc<str>>,
    /// Where the next name not kept goes once `recent` is full.
    next: usize,
}

impl SharedNames {
    /// Names kept: enough for a fleet's schemes and adapters in use at once; a name not kept
    /// only costs its record a copy of its own.
    const KEEP: usize = 8;

    /// `name` as a shared string: a kept copy, else a new one, kept in place of the oldest.
    pub(crate) fn share(&mut self, name: &str) -> Arc<str> {
        if let Some(kept) = self.recent.iter().find(|kept| ***kept == *name) {
            return kept.clone();
        }
        let fresh: Arc<str> = name.into();
        if self.recent.len() < Self::KEEP {
            self.recent.push(fresh.clone());
        } else {
            self.recent[self.next] = fresh.clone();
            self.next = (self.next + 1) % Self::KEEP;
        }
        fresh
    }
}

/// A partition: scope + adapter, with its storage and its entries' LFU cells.
pub(crate) struct Partition {
    pub(crate) tenant: Arc<TenantRec>,
    pub(crate) model: Arc<ModelRec>,
    /// The scope (its `scheme` is the partition's hash scheme: not kept twice).
    pub(crate) scope: Arc<ScopeRec>,
    pub(crate) adapter: Arc<str>,
    pub(crate) store: RunStore,
    pub(crate) lfu: LfuCells,
    /// Distinct keys of the partition (eviction sampling weights, V5).
    pub(crate) keys: AtomicI64,
    /// Storage entries of the partition (eviction sampling weights, V2).
    pub(crate) entries: AtomicI64,
    /// Reclamation gate of the ingests writing into the partition (see [`Life`]).
    pub(crate) life: Life,
}

impl Partition {
    /// Whether this is the partition of tenant `t`, model `m`, scheme `s` and adapter `a` (the
    /// directory's key).
    #[inline]
    pub(crate) fn is_named(&self, t: &str, m: &str, s: &str, a: &str) -> bool {
        same_str(&self.adapter, a)
            && same_str(&self.model.name, m)
            && same_str(&self.tenant.name, t)
            && same_str(&self.scope.scheme, s)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn scope_record_fits_the_192_byte_class() {
        // A scope lives in an `Arc` (two counts, 16 bytes); mimalloc's classes around it are
        // 160, 192 and 224 bytes. One scope per tenant or model: issue 42's churn figures.
        let with_header = std::mem::size_of::<ScopeRec>() + 2 * std::mem::size_of::<usize>();
        assert!(
            with_header <= 192,
            "ScopeRec with its Arc header: {with_header} B"
        );
    }

    #[test]
    fn tenant_pair_and_partition_records_fit_their_classes() {
        // Each lives in an `Arc` (two counts, 16 bytes); mimalloc's classes: 96, 112, 128 and
        // 320, 384 bytes. One of each per churned tenant (issue 42). A unit-test build's slot
        // tables carry a rebuild counter each (8 bytes, `raw/slots`), not in the product.
        let header = 2 * std::mem::size_of::<usize>();
        let tenant = std::mem::size_of::<TenantRec>() + header;
        assert!(tenant <= 96, "TenantRec with its Arc header: {tenant} B");
        let pair = std::mem::size_of::<ModelRec>() + header;
        assert!(pair <= 112, "ModelRec with its Arc header: {pair} B");
        let test_only = 2 * std::mem::size_of::<u64>();
        let partition = std::mem::size_of::<Partition>() + header - test_only;
        assert!(
            partition <= 320,
            "Partition with its Arc header: {partition} B"
        );
    }

    /// Checks the label invariant over every pair of a scope's replicas, and that indices,
    /// names and lookups by name agree.
    fn check_scope(scope: &ScopeRec, names: &[String]) {
        let guard = epoch::pin();
        let reps = scope.replicas.load(&guard);
        assert_eq!(reps.len(), names.len());
        for (i, a) in names.iter().enumerate() {
            let ra = &reps[i];
            assert_eq!(&*ra.name, a.as_str(), "index order");
            assert_eq!(scope.index_of(a), Some(i as u32));
            assert!(std::ptr::eq(
                scope.find(a, &guard).expect("found by name"),
                ra
            ));
            for (j, b) in names.iter().enumerate() {
                let rb = &reps[j];
                if ra.label < rb.label {
                    assert!(a < b, "label order {a:?} < {b:?}");
                }
            }
        }
    }

    /// Labels never contradict byte order, whatever the insertion order: mixed ids, ascending
    /// and descending numbered pods (the append paths) and ids squeezed into one gap until
    /// the labels tie (ties are allowed; an inversion is not).
    #[test]
    fn replica_labels_follow_byte_order() {
        let mixed = [
            "r-07", "r-10", "a", "r-1", "", "zz", "r-07x", "Z", "é", "r-0", "b", "r-100",
        ];
        let scope = ScopeRec::new("t".into(), "m".into(), "vllm".into());
        let mut names = Vec::new();
        for name in mixed {
            scope.intern(name);
            names.push(name.to_string());
            check_scope(&scope, &names);
        }
        for absent in ["r-07y", "zzz", "r-", "\u{0}"] {
            assert!(
                scope.find(absent, &epoch::pin()).is_none(),
                "{absent:?} is not a replica"
            );
            assert_eq!(scope.index_of(absent), None);
        }
        let up = ScopeRec::new("t".into(), "m".into(), "vllm".into());
        let down = ScopeRec::new("t".into(), "m".into(), "vllm".into());
        let squeeze = ScopeRec::new("t".into(), "m".into(), "vllm".into());
        let (mut nu, mut nd, mut ns) = (Vec::new(), Vec::new(), Vec::new());
        for k in 0..100 {
            nu.push(format!("pod-{k:04}"));
            up.intern(&nu[k]);
            nd.push(format!("pod-{:04}", 1000 - k));
            down.intern(&nd[k]);
            // "m", "mm", "mmm", ...: each new id sorts between the last one and "n".
            if k == 0 {
                ns.push("n".to_string());
            } else {
                ns.push("m".repeat(k));
            }
            squeeze.intern(&ns[k]);
        }
        check_scope(&up, &nu);
        check_scope(&down, &nd);
        check_scope(&squeeze, &ns);
        let guard = epoch::pin();
        let labels = |s: &ScopeRec| {
            let mut v: Vec<u64> = s.replicas.load(&guard).iter().map(|r| r.label).collect();
            v.sort_unstable();
            v.dedup();
            v.len()
        };
        assert_eq!(labels(&up), 100, "ascending ids get distinct labels");
        assert_eq!(labels(&down), 100, "descending ids get distinct labels");
        assert!(labels(&squeeze) < 100, "one gap halved 99 times ties");
    }

    /// The name map answers as a B-tree would, below, across and above its switch from a
    /// sorted vector: lookups, neighbours and order after random insertions and removals.
    #[test]
    fn name_map_matches_a_btree() {
        use std::collections::BTreeMap;
        let mut map = NameMap::default();
        let mut want: BTreeMap<String, u32> = BTreeMap::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..4_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct ids at first (the vector), then more (past the switch).
            let spread = if step < 2_000 { 24 } else { 80 };
            let name = format!("r-{}", x % spread);
            if want.contains_key(&name) {
                if x.is_multiple_of(3) {
                    map.remove(&name);
                    want.remove(&name);
                }
            } else {
                let below = want
                    .range::<String, _>(..name.clone())
                    .next_back()
                    .map(|(_, &i)| i);
                let above = want
                    .range::<String, _>(name.clone()..)
                    .next()
                    .map(|(_, &i)| i);
                assert_eq!(map.neighbours(&name), (below, above), "step {step}");
                map.insert(ReplicaId::intern(&name), step);
                want.insert(name.clone(), step);
            }
            assert_eq!(map.get(&name), want.get(&name).copied(), "step {step}");
            assert_eq!(map.len(), want.len());
        }
        assert!(
            matches!(map, NameMap::Large(_)),
            "80 ids switch to the B-tree"
        );
        let mut got = Vec::new();
        map.for_each(|id, i| got.push((id.to_string(), i)));
        assert_eq!(got, want.into_iter().collect::<Vec<_>>());
    }

    /// Slot chunks double: every index maps to one place, chunk by chunk, up to the limit.
    #[test]
    fn slot_places_tile_the_index_space() {
        let mut want = (0usize, 0usize);
        for i in 0..MAX_SCOPE_REPLICAS {
            let got = slot_place(i);
            assert_eq!(got, want, "slot {i}");
            want.1 += 1;
            if want.1 == SLOT_BASE << want.0 {
                want = (want.0 + 1, 0);
            }
        }
        assert!(slot_place(MAX_SCOPE_REPLICAS - 1).0 < SLOT_CHUNKS);
    }

    /// A replica that holds nothing gives its slot back once every reader pinned at its
    /// reclamation has left: a scope that names at most 4 replicas at once takes 400 over
    /// time. A replica still counted (serving > 0) or entered by a writer keeps its slot.
    #[test]
    fn reclaimed_slots_are_reused_after_the_epoch() {
        let scope = Arc::new(ScopeRec::new("t".into(), "m".into(), "vllm".into()));
        let intern = |name: &str| {
            // The freed indices come back through the epoch: help it along until they do
            // (bounded in time, not in attempts: other tests' pinned threads hold the epoch
            // back for as long as they run when the machine is loaded).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                let got = scope.intern_within(name, 4);
                if got.is_some() || std::time::Instant::now() > deadline {
                    return got;
                }
                epoch::pin().flush();
                std::thread::yield_now();
            }
        };
        for round in 0..100 {
            let mut got = Vec::new();
            for k in 0..4 {
                let i = intern(&format!("r{round}-{k}")).expect("a slot comes back");
                scope.exit(i);
                got.push(i);
            }
            got.sort_unstable();
            assert_eq!(got, [0, 1, 2, 3], "round {round}");
            assert_eq!(
                scope.intern_within("extra", 4),
                None,
                "four live replicas fill it"
            );
            let [kept, busy, gone] = [got[0], got[1], got[2]].map(|i| scope.slot(i).name.clone());
            scope.slot(got[0]).serving.store(1, Ordering::Relaxed);
            let entered = scope.intern_within(&busy, 4).expect("named");
            assert_eq!(entered, got[1]);
            assert_eq!(scope.reclaim_slots(), 2, "round {round}");
            assert_eq!(scope.named(), 2);
            assert!(scope.find(&kept, &epoch::pin()).is_some());
            assert!(scope.find(&busy, &epoch::pin()).is_some());
            assert!(scope.find(&gone, &epoch::pin()).is_none());
            scope.slot(got[0]).serving.store(0, Ordering::Relaxed);
            scope.exit(entered);
            assert_eq!(scope.reclaim_slots(), 2);
            assert_eq!(scope.named(), 0);
        }
        assert_eq!(
            scope.replicas.load(&epoch::pin()).len(),
            4,
            "never more than 4 slots"
        );
    }

    /// A full scope refuses new ids (no panic) and still resolves the ones it has.
    #[test]
    fn a_full_scope_refuses_new_replicas() {
        let scope = ScopeRec::new("t".into(), "m".into(), "vllm".into());
        for k in 0..4 {
            assert_eq!(scope.intern_within(&format!("r{k}"), 4), Some(k));
        }
        assert_eq!(scope.intern_within("r4", 4), None);
        assert_eq!(scope.intern_within("r2", 4), Some(2));
        assert_eq!(scope.index_of("r4"), None);
        assert_eq!(MAX_SCOPE_REPLICAS, 1 << 20);
    }
}
