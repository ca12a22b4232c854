//! Interned records (tenants, (tenant, model) pairs, scopes, partitions, per-model gauges) and the
//! read-copy-update cells that hold them.
//!
//! Records are created on first use and never removed while the index lives (an emptied
//! partition keeps its ~3 KiB shell), so a reference obtained from a directory is valid for the
//! lifetime of the directory. Directory tables are immutable maps swapped by writers under a
//! mutex (copy on insert, O(records) per new record, which is rare) and read wait-free under an
//! epoch guard.

use crate::ReplicaId;
use crate::sync::{AtomicI64, AtomicU64, Ordering};
use crate::table::KeyTable;
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32 as StdAtomicU32, Ordering as StdOrdering};

/// Identity hasher for pre-hashed u64 keys.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = i;
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Hash of a tuple of strings (no allocation).
#[inline]
pub(crate) fn hash_strs(parts: &[&str]) -> u64 {
    let mut h = 0x5158_4b5a_u64;
    for p in parts {
        h = xxhash_rust::xxh3::xxh3_64_with_seed(
            p.as_bytes(),
            h ^ (p.len() as u64).rotate_left(32),
        );
    }
    h
}

/// String equality for the directory's names, which are short (tenant, model, scheme, adapter):
/// lengths first, then 8-byte words, inline. `==` on `str` calls `memcmp`, whose call and setup
/// were ~1/5 of a W1M `lookup_route` in a profile (the partition lookup compares four names);
/// this form took W1M Q50's `lookup_route_into` from ~505 to ~385 ns in alternating runs.
#[inline]
pub(crate) fn same_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        if x != y {
            return false;
        }
    }
    let (ra, rb) = (ca.remainder(), cb.remainder());
    let mut i = 0;
    while i < ra.len() {
        if ra[i] != rb[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// A read-copy-update cell: wait-free reads, writers copy and swap under a mutex.
pub(crate) struct Rcu<T> {
    cur: Atomic<T>,
    /// Writer lock through the sync seam (parking_lot; loom's under `cfg(loom)`).
    lock: crate::sync::Mutex<()>,
}

impl<T> Rcu<T> {
    pub(crate) fn new(v: T) -> Self {
        Self {
            cur: Atomic::new(v),
            lock: crate::sync::Mutex::new(()),
        }
    }

    /// The current value.
    #[inline]
    pub(crate) fn load<'g>(&self, guard: &'g Guard) -> &'g T {
        // SAFETY: never null (set in `new`, replaced only by non-null values); old values are
        // retired through the epoch, so they outlive `guard`.
        unsafe { self.cur.load(Ordering::Acquire, guard).deref() }
    }

    /// Runs `f` on the current value under the writer lock; `Some(new)` replaces it.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&T) -> (Option<T>, R)) -> R {
        let _l = self.lock.lock();
        let guard = epoch::pin();
        let old = self.cur.load(Ordering::Acquire, &guard);
        // SAFETY: non-null, see `load`; we hold the writer lock so it is the current value.
        let (new, r) = f(unsafe { old.deref() });
        if let Some(new) = new {
            self.cur.store(Owned::new(new), Ordering::Release);
            // SAFETY: `old` is unlinked; readers may hold it until their guard drops.
            unsafe { guard.defer_destroy(old) };
        }
        r
    }
}

impl<T> Drop for Rcu<T> {
    fn drop(&mut self) {
        // SAFETY: exclusive access; the current value is owned by the cell.
        unsafe {
            let g = epoch::unprotected();
            let p = self.cur.load(Ordering::Relaxed, g);
            if !p.is_null() {
                drop(p.into_owned());
            }
        }
    }
}

/// A directory of records keyed by a string-tuple hash.
pub(crate) struct Dir<T> {
    map: Rcu<IdMap<Vec<Arc<T>>>>,
}

impl<T> Dir<T> {
    pub(crate) fn new() -> Self {
        Self {
            map: Rcu::new(IdMap::default()),
        }
    }

    /// Finds the record with hash `h` satisfying `pred`. Wait-free.
    #[inline]
    pub(crate) fn get(&self, h: u64, pred: impl Fn(&T) -> bool) -> Option<&T> {
        let guard = epoch::pin();
        let m = self.map.load(&guard);
        let r = m.get(&h)?.iter().find(|r| pred(r))?;
        let p: *const T = &**r;
        // SAFETY: records are never removed and every table version holds an `Arc` to every
        // record inserted before it, so the record lives as long as `self`.
        Some(unsafe { &*p })
    }

    /// Finds or creates a record; returns it and whether it was created.
    pub(crate) fn get_or_insert(
        &self,
        h: u64,
        pred: impl Fn(&T) -> bool,
        make: impl FnOnce() -> Arc<T>,
    ) -> (Arc<T>, bool) {
        if let Some(r) = self.get_arc(h, &pred) {
            return (r, false);
        }
        self.map.update(|m| {
            if let Some(r) = m.get(&h).and_then(|v| v.iter().find(|r| pred(r))) {
                return (None, (r.clone(), false));
            }
            let r = make();
            let mut m2 = m.clone();
            m2.entry(h).or_default().push(r.clone());
            (Some(m2), (r, true))
        })
    }

    pub(crate) fn get_arc(&self, h: u64, pred: &impl Fn(&T) -> bool) -> Option<Arc<T>> {
        let guard = epoch::pin();
        let m = self.map.load(&guard);
        m.get(&h)?.iter().find(|r| pred(r)).cloned()
    }

    /// Every record (writer-side / aggregate use; allocates).
    pub(crate) fn all(&self) -> Vec<Arc<T>> {
        let guard = epoch::pin();
        let m = self.map.load(&guard);
        m.values().flat_map(|v| v.iter().cloned()).collect()
    }
}

/// A tenant.
pub(crate) struct TenantRec {
    pub(crate) name: Arc<str>,
    pub(crate) reserved: bool,
    /// Distinct keys of the tenant (all models), stale-unswept included.
    pub(crate) keys: AtomicI64,
    pub(crate) models: Mutex<Vec<Arc<ModelRec>>>,
    /// Keys removed by the tenant quota (V5, `tenant_evictions_total{over_entries}`).
    pub(crate) quota_evictions: AtomicU64,
    /// Victim-selection state of the tenant quota (V5; see `eviction.rs`).
    pub(crate) quota_hand: Mutex<crate::index::eviction::Hand>,
}

/// Per-model gauge (V7): distinct non-reserved keys across tenants.
pub(crate) struct GaugeRec {
    pub(crate) model: Arc<str>,
    pub(crate) keys: AtomicI64,
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
    /// Stats records sorted by replica id.
    pub(crate) stats: Rcu<Vec<StatsRecord>>,
    /// Partitions of this pair (E3/E4 cost).
    pub(crate) parts: Mutex<Vec<Arc<Partition>>>,
}

impl ModelRec {
    pub(crate) fn stats_of<'g>(&self, replica: &str, guard: &'g Guard) -> Option<&'g StatsRecord> {
        let v = self.stats.load(guard);
        v.binary_search_by(|r| (*r.replica).cmp(replica))
            .ok()
            .map(|i| &v[i])
    }

    /// The stats record of scope replica `rep` (same as `stats_of(&rep.name)`). Ranking asks
    /// this for every scored replica; a binary search compares long ids (~11 `memcmp`s of
    /// 40-byte pod names in a 2,048-replica fleet), so each replica remembers where its record
    /// was last found and checks that position first. Records only move when a replica's
    /// first report inserts one before them, so the hint is almost always right.
    #[inline]
    pub(crate) fn stats_for<'g>(
        &self,
        rep: &ScopeReplica,
        guard: &'g Guard,
    ) -> Option<&'g StatsRecord> {
        let v = self.stats.load(guard);
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
    /// [`ModelRec::stats_for`]). Only a hint, checked by id (a pointer compare) before use, so
    /// any reader may overwrite it and a stale or racing value only costs a search: `std`
    /// atomics even in loom builds, as nothing is ordered by it.
    stats_hint: StdAtomicU32,
}

/// The replicas of a scope by scope-local index, with each one's rank among their ids in byte
/// order: ranking orders replicas with equal scores (R4, R5) by comparing ranks instead of ids.
/// One immutable snapshot per change, so a reader's ranks are consistent with its list.
#[derive(Clone, Default)]
pub(crate) struct ReplicaList {
    list: Vec<Arc<ScopeReplica>>,
    /// `rank[i]`: position of replica `i`'s id in byte order among the scope's ids.
    rank: Vec<u32>,
    /// Replica indices in byte order of their ids (the inverse of `rank`).
    sorted: Vec<u32>,
}

impl ReplicaList {
    /// Rank of replica `i`'s id among the scope's ids (byte order); `i` must be a valid index.
    #[inline]
    pub(crate) fn rank(&self, i: u32) -> u32 {
        self.rank[i as usize]
    }

    /// The index of the replica named `name`, if any (binary search in id order).
    pub(crate) fn find(&self, name: &str) -> Option<u32> {
        let pos = self
            .sorted
            .partition_point(|&j| *self.list[j as usize].name < *name);
        let &j = self.sorted.get(pos)?;
        (*self.list[j as usize].name == *name).then_some(j)
    }

    /// A cursor over the replicas in id order, for looking up names given in ascending order.
    pub(crate) fn cursor(&self) -> IdCursor<'_> {
        IdCursor { list: self, pos: 0 }
    }

    /// This list plus `name` (not yet in it) at the next index.
    fn with(&self, name: ReplicaId) -> Self {
        let i = self.list.len() as u32;
        let pos = self
            .sorted
            .partition_point(|&j| *self.list[j as usize].name < *name);
        let mut list = self.list.clone();
        list.push(Arc::new(ScopeReplica {
            name,
            serving: AtomicI64::new(0),
            stats_hint: StdAtomicU32::new(u32::MAX),
        }));
        let mut sorted = self.sorted.clone();
        sorted.insert(pos, i);
        let mut rank = self.rank.clone();
        rank.push(0);
        for (r, &j) in sorted.iter().enumerate().skip(pos) {
            rank[j as usize] = r as u32;
        }
        Self { list, rank, sorted }
    }
}

impl std::ops::Deref for ReplicaList {
    type Target = [Arc<ScopeReplica>];
    fn deref(&self) -> &Self::Target {
        &self.list
    }
}

/// Most replicas one scope can name: a holder stores the scope-local index in 20 bits.
pub(crate) const MAX_SCOPE_REPLICAS: usize = crate::table::REP_MASK as usize + 1;

/// A scope (tenant, model, scheme).
pub(crate) struct ScopeRec {
    pub(crate) tenant: Arc<str>,
    pub(crate) model: Arc<str>,
    pub(crate) scheme: Arc<str>,
    /// Replicas by scope-local index (append only), with their id ranks.
    pub(crate) replicas: Rcu<ReplicaList>,
    /// Writer-side name → local index (sync seam: held across the replicas RCU update).
    pub(crate) by_name: crate::sync::Mutex<HashMap<ReplicaId, u32>>,
    /// Replicas with serving > 0.
    pub(crate) serving_n: AtomicI64,
}

impl ScopeRec {
    pub(crate) fn new(tenant: Arc<str>, model: Arc<str>, scheme: Arc<str>) -> Self {
        Self {
            tenant,
            model,
            scheme,
            replicas: Rcu::new(ReplicaList::default()),
            by_name: crate::sync::Mutex::new(HashMap::new()),
            serving_n: AtomicI64::new(0),
        }
    }

    /// Local index of `name`, creating it; `None` once the scope holds [`MAX_SCOPE_REPLICAS`]
    /// replicas (a holder stores the index in 20 bits), so a producer inventing ids cannot
    /// crash the index: its entries for new ids are dropped instead.
    pub(crate) fn intern(&self, name: &str) -> Option<u32> {
        self.intern_within(name, MAX_SCOPE_REPLICAS)
    }

    fn intern_within(&self, name: &str, limit: usize) -> Option<u32> {
        let mut m = self.by_name.lock();
        if let Some(&i) = m.get(name) {
            return Some(i);
        }
        if m.len() >= limit {
            return None;
        }
        let name = ReplicaId::intern(name);
        let i = self.replicas.update(|v| {
            let v2 = v.with(name);
            let i = (v2.len() - 1) as u32;
            (Some(v2), i)
        });
        m.insert(name, i);
        Some(i)
    }

    /// Local index of `name` if known (writer side).
    pub(crate) fn index_of(&self, name: &str) -> Option<u32> {
        self.by_name.lock().get(name).copied()
    }

    /// Serving count of `name` (reader side, a binary search; TENANT_HOT, which asks for
    /// many names in id order, merges with [`ReplicaList::cursor`] instead).
    pub(crate) fn serving_of(&self, name: &str, guard: &Guard) -> i64 {
        let reps = self.replicas.load(guard);
        reps.find(name)
            .map_or(0, |i| reps[i as usize].serving.load(Ordering::Relaxed))
    }
}

/// Finds replicas by names given in ascending byte order (a merge with the id order).
///
/// Each `seek` gallops forward from the previous position, so `m` ascending names in a list
/// of `n` cost O(m log(n / m)) id compares, never more than a binary search per name.
pub(crate) struct IdCursor<'a> {
    list: &'a ReplicaList,
    /// Every replica before `pos` in id order has an id below the last name sought.
    pos: usize,
}

impl<'a> IdCursor<'a> {
    /// The replica named `name`, if any. Names must not decrease from one call to the next.
    pub(crate) fn seek(&mut self, name: &str) -> Option<&'a ScopeReplica> {
        let list = self.list;
        let rest = &list.sorted[self.pos..];
        let below = |j: &u32| *list.list[*j as usize].name < *name;
        // Gallop to a window whose end is not below `name`, then search inside it.
        let mut end = 1;
        while end < rest.len() && below(&rest[end - 1]) {
            end *= 2;
        }
        let end = end.min(rest.len());
        let start = end / 2;
        self.pos += start + rest[start..end].partition_point(below);
        let &j = list.sorted.get(self.pos)?;
        let r = &*list.list[j as usize];
        (*r.name == *name).then_some(r)
    }
}

/// A partition: scope + adapter, with its key table.
pub(crate) struct Partition {
    pub(crate) tenant: Arc<TenantRec>,
    pub(crate) model: Arc<ModelRec>,
    pub(crate) scope: Arc<ScopeRec>,
    pub(crate) scheme: Arc<str>,
    pub(crate) adapter: Arc<str>,
    pub(crate) table: KeyTable,
    /// Distinct keys of the partition (eviction sampling weights, V5).
    pub(crate) keys: AtomicI64,
    /// Storage entries of the partition (eviction sampling weights, V2).
    pub(crate) entries: AtomicI64,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// After every insertion, in any order, each replica's rank is its id's position in byte
    /// order, and indices stay insertion order.
    #[test]
    fn replica_ranks_follow_byte_order() {
        let names = [
            "r-07", "r-10", "a", "r-1", "", "zz", "r-07x", "Z", "é", "r-0", "b", "r-100",
        ];
        let mut list = ReplicaList::default();
        for (k, &name) in names.iter().enumerate() {
            list = list.with(name.into());
            let mut by_id: Vec<&str> = names[..=k].to_vec();
            by_id.sort_unstable();
            for (i, r) in list.iter().enumerate() {
                assert_eq!(&*r.name, names[i], "index order");
                assert_eq!(list.find(names[i]), Some(i as u32), "find {:?}", names[i]);
                let want = by_id.iter().position(|&n| n == names[i]).unwrap();
                assert_eq!(
                    list.rank(i as u32) as usize,
                    want,
                    "{:?} after {k}",
                    names[i]
                );
            }
            for absent in ["r-07y", "zzz", "r-", "\u{0}"] {
                assert_eq!(list.find(absent), None, "{absent:?} is not a replica");
            }
        }
    }

    /// A cursor finds exactly the present names of every ascending query sequence, whatever
    /// the gaps between them (galloping over 0, 1, 2, 3, ... replicas).
    #[test]
    fn id_cursor_merges_ascending_names() {
        let mut list = ReplicaList::default();
        // Present: even numbers (inserted in a scrambled order); the odd ones are absent.
        let n = 300u32;
        for k in 0..n {
            let v = (k * 7919) % n * 2;
            list = list.with(ReplicaId::intern(&format!("r-{v:05}")));
        }
        let queries: Vec<u32> = (0..2 * n + 2).collect();
        for step in 1..40 {
            for offset in 0..step.min(5) {
                let seq: Vec<u32> = queries.iter().copied().skip(offset).step_by(step).collect();
                let mut cursor = list.cursor();
                for q in seq {
                    let name = format!("r-{q:05}");
                    let got = cursor.seek(&name).map(|r| r.name.to_string());
                    let want = (q % 2 == 0 && q < 2 * n).then(|| name.clone());
                    assert_eq!(got, want, "step {step}, offset {offset}, {name}");
                    // Names may repeat: seeking the same name again finds it again.
                    assert_eq!(cursor.seek(&name).map(|r| r.name.to_string()), want);
                }
            }
        }
        assert!(ReplicaList::default().cursor().seek("r").is_none());
    }

    /// `same_str` is `==`: every length up to 24, a difference at every position.
    #[test]
    fn same_str_is_string_equality() {
        let base = "abcdefghijklmnopqrstuvwx";
        for n in 0..=base.len() {
            let a = &base[..n];
            assert!(same_str(a, &String::from(a)));
            for m in 0..=base.len() {
                assert_eq!(same_str(a, &base[..m]), n == m, "{n} vs {m}");
            }
            for i in 0..n {
                let mut b = a.as_bytes().to_vec();
                b[i] = b'#';
                let b = String::from_utf8(b).unwrap();
                assert!(!same_str(a, &b), "{a:?} vs {b:?}");
            }
        }
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
