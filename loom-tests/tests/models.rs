//! Loom models of the engine's concurrent protocols, run against the real engine code.
//!
//! Build: `RUSTFLAGS="--cfg loom --cfg crossbeam_loom"` (see `README.md` / `run.sh`). Under that
//! build the engine's atomics, its locks and crossbeam-epoch are loom's, and every block run,
//! LFU cell and key sum has a shadow `loom::cell::UnsafeCell` (`engine/src/raw/loom_api.rs`):
//! creation and free are writes, every engine dereference is a read. A torn publication (an object
//! visible before its initialisation happens-before the read) or a use-after-free (free not
//! ordered after a pinned reader's read) is therefore a loom causality failure, and a read of an
//! already-freed object or a double free panics.
//!
//! Every model but m13–m15 drives the public `Index` API (ingest, events, lookups, crediting, sweeps) on a
//! partition and replicas created before the threads start (directory records are created once
//! and never removed, so creating them up front keeps the models small; the directory's own RCU is
//! exercised by the lookups' wait-free reads). Index-wide parking_lot locks other than the shard
//! writer are only taken in critical sections without loom operations, so they are never held
//! across a loom context switch.
#![cfg(loom)]

#[path = "../../engine/tests/fixed_policy/mod.rs"]
mod fixed_policy;

use crossbeam_epoch::Guard;
use fixed_policy::FixedPolicy;
use inferencecache_engine::layout::{
    BlockRun, HintTarget, Holder, IdAllocator, Reaper, RunIds, RunStore, ScanStep, SlotTable,
    SlotValue, SlotWriter, StoreOptions, Writing, pack, unpack,
};
use inferencecache_engine::loom_api::{self, Kind};
use inferencecache_engine::{
    Algorithm, CacheEventInput, CacheStateUpdate, CapturedHits, ChangeEvent, ChangeKind,
    ChangeSink, DEFAULT_MAX_ENTRIES, Index, IndexConfig, IngestOutcome, LookupRequest, ManualClock,
    PrefixRef, Strategy, event_type,
};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

const T: &str = "t";
const M: &str = "m";
const S: &str = "s";
const A: &str = "a";
const B: &str = "b";
const NO_BLOCKS: [[u8; 8]; 0] = [];

fn key(i: u64) -> [u8; 8] {
    i.to_be_bytes()
}

/// An index whose clock reads `now_ms` (no cap to speak of, no quota).
fn index(alg: Algorithm, ttl_ms: Option<i64>, hot: u32, now_ms: i64) -> Arc<Index> {
    index_with(alg, ttl_ms, hot, now_ms, DEFAULT_MAX_ENTRIES, None)
}

/// An index with a global cap of `max_entries` storage entries (V2) and tenant quota `quota`
/// (V5, distinct keys).
fn index_with(
    alg: Algorithm,
    ttl_ms: Option<i64>,
    hot: u32,
    now_ms: i64,
    max_entries: i64,
    quota: Option<i64>,
) -> Arc<Index> {
    let cfg = IndexConfig {
        hot_access_threshold: hot,
        max_entries,
        ..IndexConfig::default()
    };
    Arc::new(Index::new(
        cfg,
        Arc::new(FixedPolicy { alg, ttl_ms, quota }),
        Arc::new(ManualClock::new(now_ms * 1000)),
    ))
}

/// One ingest of `prefixes` by `replica` into (T, M, S) at `ts_ms`, without stats.
fn ingest_refs<'a>(
    ix: &Index,
    replica: &'a str,
    ts_ms: i64,
    prefixes: impl IntoIterator<Item = PrefixRef<'a, [u8; 8]>>,
) -> IngestOutcome {
    ix.ingest(CacheStateUpdate {
        replica_id: replica,
        model_id: M,
        tenant_id: T,
        hash_scheme: S,
        timestamp_us: ts_ms * 1000,
        adapter_id: "",
        prefixes,
        stats: None,
    })
}

/// A legacy (exact-key) ref of `k` with `tokens` at wire tier `tier`.
fn legacy_ref(k: &[u8], tokens: i32, tier: i32) -> PrefixRef<'_, [u8; 8]> {
    PrefixRef {
        prefix_hash: k,
        token_count: tokens,
        block_hashes: &NO_BLOCKS,
        block_token_counts: &[],
        tier,
        adapter_id: "",
    }
}

/// One legacy (exact-key) ingest of `keys` by `replica` at `ts_ms`.
fn put(ix: &Index, replica: &str, keys: &[([u8; 8], i32)], ts_ms: i64) -> IngestOutcome {
    ingest_refs(
        ix,
        replica,
        ts_ms,
        keys.iter().map(|(k, tokens)| legacy_ref(k, *tokens, 1)),
    )
}

fn event(ix: &Index, kind: i32, replica: &str, k: &[u8]) {
    ix.apply_event(CacheEventInput {
        event_type: kind,
        replica_id: replica,
        model_id: M,
        tenant_id: T,
        prefix_hash: k,
        timestamp_us: 0,
        adapter_id: "",
    });
}

fn req(k: &[u8]) -> LookupRequest<'_, [u8; 8]> {
    LookupRequest {
        prefix_hash: k,
        ..LookupRequest::new(T, M, S)
    }
}

/// Bare lookup of one exact key: (replica, matched tokens).
fn lookup(ix: &Index, k: &[u8]) -> Vec<(String, i32)> {
    ix.lookup(&req(k))
        .into_iter()
        .map(|s| (s.replica_id.to_string(), s.matched_tokens))
        .collect()
}

fn holders(ix: &Index, k: &[u8]) -> Vec<String> {
    ix.holders(T, M, S, "", k)
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Tokens and last_seen (ms) of entry (k, replica).
fn entry(ix: &Index, k: &[u8], replica: &str) -> Option<(i32, i64)> {
    ix.entry(T, M, S, "", k, replica)
        .map(|e| (e.token_count, e.last_seen_us / 1000))
}

/// Captured LFU hits of a routed lookup of `k`.
fn capture(ix: &Index, k: &[u8]) -> CapturedHits {
    let r = ix.lookup_route(&req(k));
    assert!(!r.hits.is_empty(), "LFU lookup captured no hit");
    r.hits
}

/// Derived counters are exact once writes quiesce (C3): they must equal a recount of the final
/// state. `entries` = storage entries of replica `a` (the only replica in these models unless
/// stated), `keys` = distinct keys.
fn assert_counters(ix: &Index, keys: i64, entries: i64) {
    assert_eq!(ix.total_keys(), keys, "total_keys");
    assert_eq!(ix.storage_entries(), entries, "storage_entries");
    assert_eq!(ix.cache_state(T, M).total_prefixes, keys, "model keys");
    assert_eq!(ix.serving_count(T, M, S, A), entries, "serving[a]");
    assert_eq!(
        ix.loom_serving_n(T, M, S),
        i64::from(entries > 0),
        "serving_n"
    );
}

/// The final state of the models where only replica `a` holds entries and no LFU cell is left:
/// `n` keys of one entry each, exact counters (C3), every run unlinked freed.
fn assert_final(ix: &Index, n: i64) {
    assert_counters(ix, n, n);
    assert_reclaimed(ix, 0, 0);
}

/// The LFU models' starting point: `a` holds k1 (10 tokens, 1 s) under LFU with hot threshold
/// `hot`, and a routed lookup has captured its hit.
fn setup_lfu(hot: u32) -> (Arc<Index>, CapturedHits) {
    let ix = index(Algorithm::Lfu, None, hot, 1_000);
    put(&ix, A, &[(key(1), 10)], 1_000);
    let hits = capture(&ix, &key(1));
    (ix, hits)
}

/// [`setup_lfu`] with the hit credited once, so the entry's LFU cell exists (the lock-free
/// credit path).
fn setup_credited(hot: u32) -> (Arc<Index>, CapturedHits) {
    let (ix, hits) = setup_lfu(hot);
    ix.credit_hits(&hits);
    (ix, hits)
}

/// The cap models' starting point: cap 2 entries, clock at 3 s, `a` holding k1 (1 s) and k2
/// (2 s), so the next ingest enforces the cap.
fn setup_capped(alg: Algorithm, hot: u32) -> Arc<Index> {
    let ix = index_with(alg, None, hot, 3_000, 2, None);
    put(&ix, A, &[(key(1), 10)], 1_000);
    put(&ix, A, &[(key(2), 10)], 2_000);
    ix
}

/// After k1 of `a` was removed in an LFU model: the entry is gone, its credits left the hot count
/// with it, the index is empty and every run, cell and key sum is freed.
fn assert_killed(ix: &Index) {
    assert!(ix.entry(T, M, S, "", &key(1), A).is_none());
    assert_eq!(ix.cache_state(T, M).hot_prefixes, 0, "hot count after kill");
    assert_counters(ix, 0, 0);
    assert_reclaimed(ix, 0, 0);
}

/// PREFIX_EVICTED of key `k` by `replica`.
fn evict(ix: &Index, replica: &str, k: &[u8]) {
    event(ix, event_type::PREFIX_EVICTED, replica, k);
}

/// Runs `f` on a clone of `ix` in a new loom thread.
fn spawn_on<R: Send + 'static>(
    ix: &Arc<Index>,
    f: impl FnOnce(&Index) -> R + Send + 'static,
) -> loom::thread::JoinHandle<R> {
    let ix = ix.clone();
    spawn(move || f(&ix))
}

/// `loom::thread::spawn` (a seam kept for per-thread setup; the thread's epoch handle pushes its
/// garbage bag when loom drops the thread's locals, see `loom_api::collect_garbage`).
fn spawn<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> loom::thread::JoinHandle<R> {
    loom::thread::spawn(f)
}

/// Runs `f` under `loom::model` with the shadow-object ledger armed.
/// Loom's default branch limit (1,000 atomic operations per execution) is too small for the
/// sliced walks (sweep, ALL_CLEARED visit all 16 shards); bounds otherwise come from the `LOOM_*`
/// environment variables (`LOOM_MAX_PREEMPTIONS`, `LOOM_MAX_DURATION`, see `run.sh`).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.max_branches = b.max_branches.max(100_000);
    b.check(move || {
        loom_api::arm();
        f();
        loom_api::disarm();
        outcome("");
    });
    OUTCOMES.with(|o| {
        let mut o = std::mem::take(&mut *o.borrow_mut());
        // `run.sh` shows this line: how many complete executions were explored, and which of the
        // allowed final states they reached.
        let n = o.remove("").unwrap_or(0);
        let list: Vec<String> = o.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        println!("\nexplored {n} executions; outcomes: {}", list.join("; "));
    });
}

std::thread_local! {
    /// Final-state tally of the current `#[test]` (each test runs on its own OS thread; loom
    /// runs every execution of a model on that thread).
    static OUTCOMES: std::cell::RefCell<std::collections::BTreeMap<&'static str, u64>> =
        Default::default();
}

/// Records which allowed final state an execution ended in (printed after the model).
fn outcome(label: &'static str) {
    OUTCOMES.with(|o| *o.borrow_mut().entry(label).or_default() += 1);
}

/// After every other thread has been joined: collect the epoch garbage (and free the runs it
/// handed to the partitions' reapers, as the next writer would), then check the ledger exactly.
/// Every object still linked in the index is alive (never freed early), every object that was
/// unlinked has been freed (no leak once the readers have left), and nothing was freed twice
/// (the ledger panics on a double free). The linked objects are the block runs the index's key
/// tables name and `cells_linked` LFU cells (one per credited live entry) and `sums_linked` key
/// sums (one per key with a cell).
fn assert_reclaimed(ix: &Index, cells_linked: usize, sums_linked: usize) {
    let want = [
        (Kind::BlockRun, ix.loom_live_runs()),
        (Kind::LfuCell, cells_linked),
        (Kind::KeySum, sums_linked),
    ];
    let settled = || {
        ix.loom_reap();
        want.iter().all(|&(k, n)| loom_api::live(k) == n)
    };
    loom_api::collect_garbage(settled);
    for (k, linked) in want {
        assert_eq!(
            loom_api::built(k) - loom_api::freed(k),
            linked as u64,
            "{k:?}: built {} freed {}, {linked} linked: leak or early free",
            loom_api::built(k),
            loom_api::freed(k)
        );
        assert_eq!(loom_api::live(k), linked, "{k:?}: live objects");
    }
}

// ------------------------------------------------------------------------------------------------
// 1. Publication

/// Model 1: a writer adds a holder to an existing key (a join in its run's spare holder entry:
/// the entry's words, then the count with Release) and writes a brand-new key (a new run,
/// published by its registration and its slot's Release store) in one ingest, while a reader
/// looks both keys up. The reader sees each entry either before or after the write, never torn
/// (C3): the holder set is `[a]` or `[a, b]`, and an entry it sees carries exactly the written
/// token count and last_seen. Shadow cells make loom check that a run's initialisation
/// happens-before every read through the published pointer.
#[test]
fn m1_publish_vs_reader() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(1), 20)], 1_000);
        let w = spawn_on(&ix, |ix| {
            put(ix, B, &[(key(1), 20), (key(2), 30)], 1_000);
            loom_api::reclaim_step();
            loom_api::reclaim_step();
        });
        let h = holders(&ix, &key(1));
        assert!(h == [A] || h == [A, B], "torn holder set {h:?}");
        let k2 = entry(&ix, &key(2), B);
        if let Some(e) = k2 {
            assert_eq!(e, (30, 1_000), "torn entry");
        }
        outcome(match (h.len(), k2.is_some()) {
            (1, false) => "saw k1 old, k2 absent",
            (1, true) => "saw k1 old, k2 new",
            (_, false) => "saw k1 new, k2 absent",
            (_, true) => "saw k1 new, k2 new",
        });
        w.join().unwrap();
        assert_eq!(holders(&ix, &key(1)), [A, B]);
        assert_eq!(entry(&ix, &key(1), B), Some((20, 1_000)));
        assert_eq!(entry(&ix, &key(2), B), Some((30, 1_000)));
        // Two runs built (k1's, which b joined in place, and k2's), none retired.
        assert_eq!(loom_api::built(Kind::BlockRun), 2);
        assert_reclaimed(&ix, 0, 0);
    });
}

/// Model 1b: a key-table rebuild (growth) copies every slot into a new table and publishes it
/// (Release) while a reader probes: an existing key is always found with its holder, whichever
/// table the reader loaded; the new key is absent or complete. Six keys fill the 8-slot table
/// to its load bound; the 7th insert rebuilds it.
#[test]
fn m1b_rebuild_vs_reader() {
    const N: u64 = 7;
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        let first: Vec<_> = (1..N).map(|i| (key(i), 1)).collect();
        put(&ix, A, &first, 1_000);
        let last = key(N);
        let w = spawn_on(&ix, move |ix| {
            put(ix, A, &[(last, 7)], 1_000);
        });
        assert_eq!(entry(&ix, &key(1), A), Some((1, 1_000)));
        assert!(matches!(entry(&ix, &last, A), None | Some((7, 1_000))));
        w.join().unwrap();
        for i in 1..N {
            assert_eq!(entry(&ix, &key(i), A), Some((1, 1_000)));
        }
        assert_eq!(entry(&ix, &last, A), Some((7, 1_000)));
        assert_final(&ix, N as i64);
    });
}

// ------------------------------------------------------------------------------------------------
// 2. Removal and reclamation

/// Model 2: a writer changes a key three ways and then removes it while a pinned reader looks
/// it up: `b` joins `a`'s run (spare entry), `a` re-ingests with another token count (a copy on
/// write: a new run, the old one retired), `a` is evicted (its gone bit), then `b` (the run
/// retired). The reader sees one of the four holder sets; loom checks that no run is freed
/// while a reader pinned before its unlink can still read it (shadow cells), and once the
/// reader has left every retired run is freed exactly once (no leak, no double free).
#[test]
fn m2_remove_reclaim_vs_pinned_reader() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(1), 10)], 1_000);
        let w = spawn_on(&ix, |ix| {
            put(ix, B, &[(key(1), 10)], 1_000);
            put(ix, A, &[(key(1), 20)], 1_000);
            evict(ix, A, &key(1));
            evict(ix, B, &key(1));
            // Eager reclamation: retired runs can be freed while the reader is pinned.
            loom_api::reclaim_step();
            loom_api::reclaim_step();
        });
        let h = holders(&ix, &key(1));
        assert!(
            h.is_empty() || h == [A] || h == [A, B] || h == [B],
            "impossible holder set {h:?}"
        );
        outcome(match h.len() {
            0 => "reader saw []",
            2 => "reader saw [a, b]",
            _ if h == [A] => "reader saw [a]",
            _ => "reader saw [b]",
        });
        w.join().unwrap();
        assert!(holders(&ix, &key(1)).is_empty());
        assert_eq!(ix.total_keys(), 0);
        assert_eq!(ix.storage_entries(), 0);
        assert_eq!(loom_api::built(Kind::BlockRun), 2);
        assert_reclaimed(&ix, 0, 0);
    });
}

// ------------------------------------------------------------------------------------------------
// 3. Concurrent upserts of one key

/// Model 3: two producers upsert the same new (key, replica) entry with different timestamps.
/// Exactly one of them creates the key and the entry (keys_added / entries_added sum to 1), the
/// final entry has `last_seen` = the newer timestamp whatever the order (D7: max), and the
/// derived counters are exact.
#[test]
fn m3_concurrent_upserts_same_key() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 3_000);
        // Replica `a` interned and the partition created (another key, so counters start at 1).
        put(&ix, A, &[(key(9), 1)], 3_000);
        let p = spawn_on(&ix, move |ix| put(ix, A, &[(key(1), 10)], 2_000));
        let q = put(&ix, A, &[(key(1), 20)], 3_000);
        let p = p.join().unwrap();
        assert_eq!(p.keys_added + q.keys_added, 1, "key created once");
        outcome(if p.keys_added == 1 {
            "2 s producer created the key"
        } else {
            "3 s producer created the key"
        });
        assert_eq!(p.entries_added + q.entries_added, 1, "entry created once");
        let (tokens, last_seen) = entry(&ix, &key(1), A).expect("entry");
        assert_eq!(last_seen, 3_000, "last_seen is the newer timestamp (D7)");
        assert!(tokens == 10 || tokens == 20);
        assert_eq!(holders(&ix, &key(1)), [A]);
        assert_final(&ix, 2);
    });
}

// ------------------------------------------------------------------------------------------------
// 4. LFU crediting

/// Model 4a: two threads credit the same captured hit of a never-credited entry: both race to
/// create its LFU cell (first credit takes the shard mutex and re-validates), then increment
/// lock-free. No increment is lost (count 2), the hot-key counter crosses the threshold (2)
/// exactly once, and exactly one cell and one key sum exist.
#[test]
fn m4a_lfu_first_credit_race() {
    model(|| {
        let (ix, hits) = setup_lfu(2);
        let c = {
            let hits = hits.clone();
            spawn_on(&ix, move |ix| ix.credit_hits(&hits))
        };
        ix.credit_hits(&hits);
        c.join().unwrap();
        let e = ix.entry(T, M, S, "", &key(1), A).expect("entry");
        assert_eq!(e.access_count, 2, "lost increment");
        assert_eq!(ix.cache_state(T, M).hot_prefixes, 1);
        assert_reclaimed(&ix, 1, 1);
    });
}

/// Model 4b: a credit races with the removal and re-creation of its entry (same key and replica,
/// new generation). The credit either lands on the old entry before its removal (its count is
/// then lost with the entry, V3) or is ignored; it never reaches the re-created entry (T92). The
/// hot counter (threshold 1) ends at 0, and every cell / key sum created is freed.
#[test]
fn m4b_lfu_credit_vs_remove_recreate() {
    model(|| {
        let (ix, hits) = setup_lfu(1);
        let c = spawn_on(&ix, move |ix| ix.credit_hits(&hits));
        evict(&ix, A, &key(1));
        put(&ix, A, &[(key(1), 10)], 1_000);
        c.join().unwrap();
        let e = ix.entry(T, M, S, "", &key(1), A).expect("re-created entry");
        assert_eq!(e.access_count, 0, "credit reached a re-created entry (T92)");
        assert_eq!(ix.cache_state(T, M).hot_prefixes, 0, "hot count");
        assert_final(&ix, 1);
    });
}

/// Model 4c: an already-credited entry (cell exists: lock-free path) is credited by two threads
/// while a third removes it. The removal swaps DEAD into the cell and subtracts the final count
/// from the key sum: whatever the interleaving, no credit is applied after the kill, the key sum
/// ends at 0 (hot count 0 with threshold 1) and the cell and key sum are reclaimed.
#[test]
fn m4c_lfu_credits_vs_kill() {
    model(|| {
        let (ix, hits) = setup_credited(1);
        assert_eq!(ix.cache_state(T, M).hot_prefixes, 1);
        let c = {
            let hits = hits.clone();
            spawn_on(&ix, move |ix| ix.credit_hits(&hits))
        };
        let r = spawn_on(&ix, move |ix| evict(ix, A, &key(1)));
        ix.credit_hits(&hits);
        c.join().unwrap();
        r.join().unwrap();
        assert_killed(&ix);
    });
}

/// Model 4d: two-thread core of m4c, exhaustive at bound 2 in CI: one lock-free credit of an
/// already-credited entry races with its removal (DEAD swap, key-sum subtraction). The credit
/// lands before the kill (and is subtracted with the final count) or is refused; the hot count
/// ends at 0, counters are 0, the cell and key sum are freed.
#[test]
fn m4d_lfu_credit_vs_kill() {
    model(|| {
        let (ix, hits) = setup_credited(1);
        let r = spawn_on(&ix, move |ix| evict(ix, A, &key(1)));
        ix.credit_hits(&hits);
        r.join().unwrap();
        assert_killed(&ix);
    });
}

/// Model 4e: per-core LFU counting. A hot entry (threshold 1, already credited once) is credited
/// by two threads at once, twice each; a failed CAS on the base moves a credit to the thread's
/// stripe (allocated by whichever thread gets there first, the loser frees its copy). Whatever
/// the interleaving, the count is exactly 5, the key stays hot once (no double transition), and
/// removing the entry afterwards leaves the hot count at 0 with everything reclaimed.
#[test]
fn m4e_lfu_striped_credits_are_exact() {
    model(|| {
        let (ix, hits) = setup_credited(1);
        let c = {
            let hits = hits.clone();
            spawn_on(&ix, move |ix| {
                ix.credit_hits(&hits);
                ix.credit_hits(&hits);
            })
        };
        ix.credit_hits(&hits);
        ix.credit_hits(&hits);
        c.join().unwrap();
        let e = ix.entry(T, M, S, "", &key(1), A).expect("entry");
        assert_eq!(e.access_count, 5, "a credit was lost or doubled");
        assert_eq!(ix.cache_state(T, M).hot_prefixes, 1, "hot count");
        evict(&ix, A, &key(1));
        assert_eq!(ix.cache_state(T, M).hot_prefixes, 0, "hot count after kill");
        assert_final(&ix, 0);
    });
}

// ------------------------------------------------------------------------------------------------
// 5. TTL sweep vs ingest vs lookup

/// Model 5: one stale entry; a TTL sweep, a refreshing re-ingest and a lookup run concurrently.
/// The sweep decides under the shard mutex on the node it reads, so it either removes the stale
/// entry before the refresh (which then re-creates it) or sees the refreshed one and keeps it:
/// the entry always ends fresh with the new token count; the lookup sees nothing (stale or
/// absent) or the fresh entry, never a stale hit; counters are exact.
#[test]
fn m5_sweep_vs_ingest_vs_lookup() {
    model(|| {
        // TTL 1 s; the entry was seen at 3 s, the clock (sweep and lookups) reads 5 s.
        let ix = index(Algorithm::Lru, Some(1_000), 8, 5_000);
        put(&ix, A, &[(key(1), 10)], 3_000);
        let s = spawn_on(&ix, move |ix| ix.sweep_now().entries_removed);
        let i = spawn_on(&ix, move |ix| put(ix, A, &[(key(1), 20)], 5_000));
        let l = lookup(&ix, &key(1));
        assert!(
            l.is_empty() || l == [(A.to_string(), 20)],
            "lookup saw {l:?}"
        );
        let removed = s.join().unwrap();
        let out = i.join().unwrap();
        assert_eq!(entry(&ix, &key(1), A), Some((20, 5_000)));
        assert_eq!(removed, out.entries_added, "re-created iff swept first");
        outcome(match (removed, l.is_empty()) {
            (1, true) => "swept first; lookup saw nothing",
            (1, false) => "swept first; lookup saw the fresh entry",
            (_, true) => "refreshed first; lookup saw nothing",
            (_, false) => "refreshed first; lookup saw the fresh entry",
        });
        assert_eq!(
            ix.evictions(Algorithm::Lru, inferencecache_engine::EvictionReason::Ttl),
            removed
        );
        assert_final(&ix, 1);
    });
}

/// Model 5b: two-thread core of m5, exhaustive at bound 2 in CI: the TTL sweep against the
/// refreshing re-ingest of its stale entry (the lookup of m5 removed). Same assertions: the entry
/// ends fresh at `(20, 5 s)`, removed by the sweep iff re-created by the ingest, metrics agree.
#[test]
fn m5b_sweep_vs_ingest() {
    model(|| {
        let ix = index(Algorithm::Lru, Some(1_000), 8, 5_000);
        put(&ix, A, &[(key(1), 10)], 3_000);
        let s = spawn_on(&ix, move |ix| ix.sweep_now().entries_removed);
        let out = put(&ix, A, &[(key(1), 20)], 5_000);
        let removed = s.join().unwrap();
        assert_eq!(entry(&ix, &key(1), A), Some((20, 5_000)));
        assert_eq!(removed, out.entries_added, "re-created iff swept first");
        assert_eq!(
            ix.evictions(Algorithm::Lru, inferencecache_engine::EvictionReason::Ttl),
            removed
        );
        outcome(if removed == 1 {
            "swept first"
        } else {
            "refreshed first"
        });
        assert_final(&ix, 1);
    });
}

// ------------------------------------------------------------------------------------------------
// 6. ALL_CLEARED

/// Model 6: ALL_CLEARED for replica `a` (a sliced walk over every shard) runs against a re-ingest
/// of one of its keys and a lookup of that key. The other key is always gone; the re-ingested
/// one survives iff the clear's walk passed its shard before the re-ingest (either is allowed);
/// the lookup sees the key or nothing, never a torn entry; counters match the final state.
#[test]
fn m6_all_cleared_vs_lookup_vs_reingest() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(1), 10), (key(2), 10)], 1_000);
        let c = spawn_on(&ix, move |ix| event(ix, event_type::ALL_CLEARED, A, &[]));
        let i = spawn_on(&ix, move |ix| put(ix, A, &[(key(1), 20)], 1_000));
        let l = lookup(&ix, &key(1));
        assert!(
            l.is_empty() || l == [(A.to_string(), 10)] || l == [(A.to_string(), 20)],
            "lookup saw {l:?}"
        );
        c.join().unwrap();
        i.join().unwrap();
        assert!(entry(&ix, &key(2), A).is_none(), "ALL_CLEARED missed a key");
        let k1 = entry(&ix, &key(1), A);
        assert!(k1.is_none() || k1 == Some((20, 1_000)), "k1 = {k1:?}");
        let n = i64::from(k1.is_some());
        outcome(if k1.is_some() {
            "k1 re-ingested after the clear passed"
        } else {
            "k1 cleared after the re-ingest"
        });
        assert_final(&ix, n);
    });
}

/// Model 6b: two-thread core of m6, exhaustive at bound 2 in CI: ALL_CLEARED for `a` against a
/// re-ingest of k1 (the lookup of m6 removed). k2 always gone; k1 survives (re-ingested, 20
/// tokens) iff the walk had passed its shard; counters match the final state; every node freed.
#[test]
fn m6b_all_cleared_vs_reingest() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(1), 10), (key(2), 10)], 1_000);
        let c = spawn_on(&ix, move |ix| event(ix, event_type::ALL_CLEARED, A, &[]));
        put(&ix, A, &[(key(1), 20)], 1_000);
        c.join().unwrap();
        assert!(entry(&ix, &key(2), A).is_none(), "ALL_CLEARED missed a key");
        let k1 = entry(&ix, &key(1), A);
        assert!(k1.is_none() || k1 == Some((20, 1_000)), "k1 = {k1:?}");
        outcome(if k1.is_some() {
            "k1 re-ingested after the clear passed"
        } else {
            "k1 cleared after the re-ingest"
        });
        let n = i64::from(k1.is_some());
        assert_final(&ix, n);
    });
}

// ------------------------------------------------------------------------------------------------
// 7. Other atomic protocols

/// Model 7a: serving counts and `serving_n` are maintained by threshold crossings of per-replica
/// `fetch_add`s. One thread removes the replica's only entry (serving 1 → 0, a down-crossing)
/// while another adds a new entry (an up-crossing from whichever value it sees); a third replica
/// is unaffected. Crossings telescope, so `serving_n` ends exact (2) and `classify` sees a
/// serving scope.
#[test]
fn m7a_serving_n_crossings() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(1), 10)], 1_000);
        put(&ix, B, &[(key(3), 10)], 1_000);
        let r = spawn_on(&ix, move |ix| evict(ix, A, &key(1)));
        put(&ix, A, &[(key(2), 10)], 1_000);
        r.join().unwrap();
        assert_eq!(ix.serving_count(T, M, S, A), 1);
        assert_eq!(ix.serving_count(T, M, S, B), 1);
        assert_eq!(ix.loom_serving_n(T, M, S), 2);
        assert_eq!(ix.classify(T, M, S), Strategy::None);
        evict(&ix, A, &key(2));
        assert_eq!(ix.loom_serving_n(T, M, S), 1);
        assert_reclaimed(&ix, 0, 0);
    });
}

#[derive(Default)]
struct RecordingSink {
    events: Mutex<Vec<(ChangeKind, Vec<u8>)>>,
}

impl ChangeSink for RecordingSink {
    fn is_active(&self) -> bool {
        true
    }
    fn publish(&self, e: &ChangeEvent<'_>) {
        self.events
            .lock()
            .unwrap()
            .push((e.kind, e.prefix_hash.to_vec()));
    }
}

/// Model 7b: the change-sink fast path (`sink_set` flag, Release on install / Acquire in
/// writers, then the sink lock). A sink installed concurrently with an ingest receives the
/// ingest's ADDED event or nothing — never a partial event — and every write after the install
/// happens-before is published.
#[test]
fn m7b_change_sink_install_vs_ingest() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(9), 1)], 1_000);
        let sink = Arc::new(RecordingSink::default());
        let i = spawn_on(&ix, move |ix| put(ix, A, &[(key(1), 10)], 1_000));
        ix.set_change_sink(sink.clone());
        i.join().unwrap();
        {
            let ev = sink.events.lock().unwrap();
            assert!(
                ev.is_empty() || *ev == [(ChangeKind::Added, key(1).to_vec())],
                "events {ev:?}"
            );
        }
        let n = sink.events.lock().unwrap().len();
        put(&ix, A, &[(key(2), 10)], 1_000);
        assert_eq!(sink.events.lock().unwrap().len(), n + 1);
        assert_reclaimed(&ix, 0, 0);
    });
}

// ------------------------------------------------------------------------------------------------
// 8. Global cap (V2) and tenant quota (V5)
//
// Enforcement holds a parking_lot mutex (the cap hand, the tenant's quota hand) across loom
// operations, so loom must never see two enforcements contend for it (a blocked OS thread would
// hang the model). In these models exactly one thread ingests past the cap / quota; the racing
// threads use paths that never enforce (events, E7; credits; lookups).

/// Model 8a: the cap (2 entries, LRU) evicts while its victim disappears under it. `a` holds k1
/// (1 s) and k2 (2 s); the main thread ingests k3 (3 s), so the exact path enumerates the
/// population and evicts the oldest entry, k1, re-validating it under its shard lock; another
/// thread removes k1 by PREFIX_EVICTED at the same time. k1 ends gone, and k2 and k3 always
/// survive: the cap removes k1 itself or nothing, never a second entry for one that is already
/// gone (a removal lowers the entry count before it unlinks, and the cap re-reads the count
/// under the victim's shard lock). Counters end exact and `index_evictions_total{lru, cap}`
/// equals the entries the cap removed.
#[test]
fn m8a_cap_eviction_vs_victim_removal() {
    model(|| {
        let ix = setup_capped(Algorithm::Lru, 8);
        let r = spawn_on(&ix, move |ix| evict(ix, A, &key(1)));
        put(&ix, A, &[(key(3), 10)], 3_000);
        r.join().unwrap();
        assert!(entry(&ix, &key(1), A).is_none(), "k1 survived");
        assert_eq!(
            entry(&ix, &key(3), A),
            Some((10, 3_000)),
            "the newest entry was evicted"
        );
        assert_eq!(
            entry(&ix, &key(2), A),
            Some((10, 2_000)),
            "the cap over-evicted k2"
        );
        let cap = ix.evictions(Algorithm::Lru, inferencecache_engine::EvictionReason::Cap);
        assert!(cap <= 1, "cap evicted {cap} entries");
        assert_final(&ix, 2);
        outcome(if cap == 1 {
            "cap evicted k1"
        } else {
            "removal first, no cap eviction"
        });
    });
}

/// Model 8b: LFU cap eviction vs the first credit of its would-be victim. Cap 2, LFU, hot
/// threshold 1: `a` holds k1 (1 s, credited once by a concurrent thread) and k2 (2 s); the main
/// thread ingests k3 (3 s). Victim order is `(count, last_seen)`: if the credit is visible to the
/// enumeration, k1 ranks `(1, 1 s)` and k2 `(0, 2 s)` goes; otherwise k1 goes and the credit
/// either lands before the removal (the removal kills the cell and subtracts its count from the
/// key sum) or is ignored. Exactly one entry is evicted, k3 survives, a surviving k1 carries
/// exactly the one credit, the hot-key count matches it, and cells / key sums are exact.
#[test]
fn m8b_lfu_cap_eviction_vs_credit() {
    model(|| {
        let ix = setup_capped(Algorithm::Lfu, 1);
        let hits = capture(&ix, &key(1));
        let c = spawn_on(&ix, move |ix| ix.credit_hits(&hits));
        put(&ix, A, &[(key(3), 10)], 3_000);
        c.join().unwrap();
        assert_eq!(
            ix.evictions(Algorithm::Lfu, inferencecache_engine::EvictionReason::Cap),
            1
        );
        assert_eq!(entry(&ix, &key(3), A), Some((10, 3_000)));
        let k1 = ix.entry(T, M, S, "", &key(1), A).map(|e| e.access_count);
        let k2 = entry(&ix, &key(2), A);
        assert!(
            k1.is_some() != k2.is_some(),
            "k1 {k1:?} k2 {k2:?}: not exactly one evicted"
        );
        if let Some(count) = k1 {
            assert_eq!(count, 1, "a surviving k1 was saved by its credit");
        }
        assert_eq!(
            ix.cache_state(T, M).hot_prefixes,
            i64::from(k1.is_some()),
            "hot count"
        );
        assert_counters(&ix, 2, 2);
        let cells = usize::from(k1.is_some());
        assert_reclaimed(&ix, cells, cells);
        outcome(if k1.is_some() {
            "credit first, k2 evicted"
        } else {
            "k1 evicted"
        });
    });
}

/// Model 8c: quota eviction of a whole key vs a concurrent removal of one of its holders.
/// Quota 1 key: k1 is held by `a` and `b` (1 s); the main thread (replica `a`) ingests k2 (2 s),
/// so the tenant's oldest key k1 is deleted with all its holders, while another thread removes
/// `b`'s holder by PREFIX_EVICTED. Whatever the order, k1 ends gone and k2 present, exactly one
/// key is counted in `tenant_evictions_total`, serving counts are `a` = 1 and `b` = 0, and every
/// replaced / removed node is retired exactly once.
#[test]
fn m8c_quota_key_eviction_vs_holder_removal() {
    model(|| {
        let ix = index_with(Algorithm::Lru, None, 8, 2_000, DEFAULT_MAX_ENTRIES, Some(1));
        put(&ix, A, &[(key(1), 10)], 1_000);
        put(&ix, B, &[(key(1), 10)], 1_000);
        let r = spawn_on(&ix, move |ix| evict(ix, B, &key(1)));
        put(&ix, A, &[(key(2), 10)], 2_000);
        r.join().unwrap();
        assert!(holders(&ix, &key(1)).is_empty(), "k1 survived the quota");
        assert_eq!(entry(&ix, &key(2), A), Some((10, 2_000)));
        assert_eq!(ix.tenant_evictions(), [(Arc::from(T), 1)]);
        assert_eq!(ix.serving_count(T, M, S, B), 0);
        assert_final(&ix, 1);
    });
}

// ------------------------------------------------------------------------------------------------
// 9. Directory records (RCU)

/// Model 9: two producers ingest the same key into a brand-new (tenant, model, scheme) at once, so
/// both race through the directory's read-copy-update inserts (tenant, gauge, model, scope,
/// partition: wait-free lookup, then re-check under the writer lock) and intern their replica
/// into the same scope (name map + replica-vector RCU). Exactly one record of each kind is
/// created (one partition holds both entries: 1 key, 2 entries), the two replicas get distinct
/// scope indices (both holders present), serving counts and `serving_n` are exact, and the key
/// node built by the second writer is the only one left linked.
#[test]
fn m9_concurrent_partition_creation() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        let p = spawn_on(&ix, move |ix| put(ix, B, &[(key(1), 10)], 1_000));
        let q = put(&ix, A, &[(key(1), 10)], 1_000);
        let p = p.join().unwrap();
        assert_eq!(p.keys_added + q.keys_added, 1, "key created once");
        outcome(if p.keys_added == 1 {
            "b created the key"
        } else {
            "a created the key"
        });
        // `holders` maps each holder's scope index to its name: two distinct indices.
        assert_eq!(
            holders(&ix, &key(1)),
            [A, B],
            "both holders, distinct replica indices"
        );
        assert_eq!(ix.total_keys(), 1);
        assert_eq!(ix.storage_entries(), 2);
        assert_eq!(ix.cache_state(T, M).total_prefixes, 1, "one model record");
        assert_eq!(ix.serving_count(T, M, S, A), 1);
        assert_eq!(ix.serving_count(T, M, S, B), 1);
        assert_eq!(ix.loom_serving_n(T, M, S), 2);
        assert_reclaimed(&ix, 0, 0);
    });
}

// ------------------------------------------------------------------------------------------------
// 10. Chain runs (`engine/src/raw/block_run.rs`, `engine/src/raw/run_store/`)

/// The four blocks of the models' shared chain.
fn run_chain() -> [[u8; 8]; 4] {
    [key(11), key(12), key(13), key(14)]
}

/// One chain-form ingest of `keys` for `replica` (16 tokens per block, tier 1).
fn put_chain(ix: &Index, replica: &str, keys: &[[u8; 8]], ts_ms: i64) {
    let counts = vec![16; keys.len()];
    let chain = PrefixRef {
        prefix_hash: &[],
        token_count: 0,
        block_hashes: keys,
        block_token_counts: &counts,
        tier: 1,
        adapter_id: "",
    };
    ingest_refs(ix, replica, ts_ms, std::iter::once(chain));
}

/// Matched blocks per replica of a chain lookup of `keys` (a replica absent: 0).
fn chain_blocks(ix: &Index, keys: &[[u8; 8]]) -> (i32, i32) {
    let counts = vec![16; keys.len()];
    let r = ix.lookup(&LookupRequest {
        block_hashes: keys,
        block_token_counts: &counts,
        ..LookupRequest::new(T, M, S)
    });
    let of = |name: &str| {
        r.iter()
            .find(|s| &*s.replica_id == name)
            .map_or(0, |s| s.matched_tokens / 16)
    };
    (of(A), of(B))
}

/// Checks that the index links exactly `linked` runs and that every other run built was freed
/// once ([`assert_reclaimed`]).
fn assert_runs(ix: &Index, linked: usize) {
    assert_eq!(ix.loom_live_runs(), linked, "runs the index links");
    assert_reclaimed(ix, 0, 0);
}

/// Model 10a: a reader walks a chain while a writer removes one block from inside the run that
/// holds it. `b` joined `a`'s run over the four blocks, and the writer evicts `b` from block 3:
/// a copy of that block without `b` (a new run held by `a`), the shared run's offset 2 marked
/// dead before its slot is repointed. The reader steps over block 3 only while the bit is unset,
/// so it sees `b` with 4 blocks (before the removal) or 2 (after), never anything else, and `a`
/// with 4 throughout. The runs' reads (keys, bits, holders) must happen-after their creation
/// (loom causality, via the ledger).
#[test]
fn m10a_run_block_removed_vs_walk() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        let c = run_chain();
        put_chain(&ix, A, &c, 1_000);
        put_chain(&ix, B, &c, 1_000);
        assert_eq!(
            loom_api::built(Kind::BlockRun),
            1,
            "b joined a's run in its spare holder entry"
        );
        let w = spawn_on(&ix, move |ix| evict(ix, B, &c[2]));
        let (a, b) = chain_blocks(&ix, &c);
        assert_eq!(a, 4, "a holds the whole chain throughout");
        assert!(b == 4 || b == 2, "b matched {b} blocks");
        outcome(if b == 4 {
            "reader saw b's 4 blocks"
        } else {
            "reader saw b's 2 blocks"
        });
        w.join().unwrap();
        assert_eq!(chain_blocks(&ix, &c), (4, 2));
        // The shared run (blocks 1, 2, 4) and block 3's copy.
        assert_runs(&ix, 2);
    });
}

/// Model 10b: a reader walks a chain while `b` joins the run `a`'s ingest built (the spare
/// holder entry's words, then the count with Release). The run's four blocks have one holder
/// set, so the reader sees `b` with all 4 blocks or none, and reads the new entry only after
/// its words (loom causality).
#[test]
fn m10b_run_join_vs_walk() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        let c = run_chain();
        put_chain(&ix, A, &c, 1_000);
        let w = spawn_on(&ix, move |ix| put_chain(ix, B, &c, 1_000));
        let (a, b) = chain_blocks(&ix, &c);
        assert_eq!(a, 4);
        assert!(b == 0 || b == 4, "b matched {b} blocks");
        outcome(if b == 4 {
            "reader saw b with 4 blocks"
        } else {
            "reader saw b with 0 blocks"
        });
        w.join().unwrap();
        assert_eq!(chain_blocks(&ix, &c), (4, 4));
        assert_runs(&ix, 1);
    });
}

/// Model 10c: reclamation. `a` and `b` hold a chain in one run; a writer re-ingests `a`'s chain
/// at tier 3 (a copy on write of the whole run: the old run retired once its last slot is
/// repointed) and collects eagerly, while a pinned reader may be walking the old run. The old
/// run is freed only after the reader is done (a free not ordered after the reader's reads is
/// a causality failure, a read of a freed run panics), and it is freed: no leak. The reader
/// sees both replicas with all 4 blocks throughout.
#[test]
fn m10c_run_reclaim_vs_pinned_walk() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        let c = run_chain();
        put_chain(&ix, A, &c, 1_000);
        put_chain(&ix, B, &c, 1_000);
        let w = spawn_on(&ix, move |ix| {
            let counts = [16; 4];
            let chain = PrefixRef {
                prefix_hash: &[],
                token_count: 0,
                block_hashes: &c,
                block_token_counts: &counts,
                tier: 3,
                adapter_id: "",
            };
            ingest_refs(ix, A, 1_000, std::iter::once(chain));
            loom_api::reclaim_step();
            loom_api::reclaim_step();
        });
        assert_eq!(chain_blocks(&ix, &c), (4, 4));
        w.join().unwrap();
        assert_eq!(chain_blocks(&ix, &c), (4, 4));
        assert_eq!(loom_api::built(Kind::BlockRun), 2, "one copy on write");
        assert_runs(&ix, 1);
    });
}

/// Model 10d: stretches follow holder state. `a` holds the chain at tier 1 except block 3,
/// which it re-ingested at tier 3 (colder), so block 3 sits in a run of its own; `b`'s ingest
/// meanwhile copies or joins the runs it meets. A walk that stepped over block 3 with the first
/// stretch's holders would report `a`'s coldest tier as 1; every walk must report 3, whatever it
/// reads of `b`'s write.
#[test]
fn m10d_stretch_state_vs_walk() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        let c = run_chain();
        put_chain(&ix, A, &c, 1_000);
        ingest_refs(&ix, A, 1_000, std::iter::once(legacy_ref(&c[2], 48, 3)));
        let w = spawn_on(&ix, move |ix| put_chain(ix, B, &c, 1_000));
        let counts = [16; 4];
        let r = ix.lookup(&LookupRequest {
            block_hashes: &c,
            block_token_counts: &counts,
            ..LookupRequest::new(T, M, S)
        });
        let a = r.iter().find(|s| &*s.replica_id == A).expect("a matched");
        assert_eq!(
            (a.matched_tokens, a.tier),
            (64, 3),
            "a's coldest tier over the chain"
        );
        w.join().unwrap();
        assert_eq!(chain_blocks(&ix, &c), (4, 4));
        // Blocks 1–2 copied with `b`, block 3's run joined, block 4 trimmed out of the
        // first run with `b` in its spare entry.
        assert_runs(&ix, 3);
    });
}

/// Model 11: the run reaper (a lock-free stack the epoch's deferred functions push retired
/// runs onto, drained by writers with one swap): two threads push while the main thread frees
/// the stack; each run is freed exactly once, after its link was written.
#[test]
fn m11_reaper_push_vs_free_all() {
    model(|| {
        let reaper: Arc<Reaper<BlockRun>> = Arc::new(Reaper::default());
        let new_run = || {
            BlockRun::create(&[Holder::new(0, 1, 16, 1_000, 1)], 1, &[1, 2, 3, 4])
                .expect("run address")
                .as_ptr() as usize
        };
        let (r1, r2, r3) = (new_run(), new_run(), new_run());
        let pusher = |runs: Vec<usize>| {
            let reaper = Arc::clone(&reaper);
            loom::thread::spawn(move || {
                for r in runs {
                    // SAFETY: a run of this model's own, pushed once, read by nothing else.
                    unsafe { reaper.push(r as *mut BlockRun) };
                }
            })
        };
        let a = pusher(vec![r1, r2]);
        let b = pusher(vec![r3]);
        let mut freed = reaper.free_all();
        a.join().expect("pusher");
        b.join().expect("pusher");
        freed += reaper.free_all();
        assert_eq!(freed, 3, "every run freed once");
        assert!(reaper.is_empty());
        assert_eq!(
            loom_api::built(Kind::BlockRun),
            loom_api::freed(Kind::BlockRun),
            "every run freed"
        );
    });
}

// ------------------------------------------------------------------------------------------------
// 12. Record reclamation (`engine/src/directory.rs`, `Life`; `Index::sweep_now`)

/// Model 12: the sweep reclaims records that hold nothing while an ingest writes into them.
/// The partition, its scope slot for `A` and the records above it exist and are empty (a key
/// was ingested and evicted); one thread ingests a new key for `A` while another sweeps,
/// retiring every empty record. Whichever gets in first — the ingest entering the partition and
/// the slot (the sweep then keeps them), or the sweep retiring them (the ingest then resolves
/// again and creates successors) — the new entry is stored once, counted exactly (entries,
/// keys, serving, `serving_n`), answered by a lookup, and lives in the one partition left.
/// Two variants: the sweep on the main thread (m12a) or on the spawned one (m12b), so that the
/// bounded exploration starts from each order.
fn m12_reclaim_vs_ingest(sweep_spawned: bool) {
    model(move || {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, A, &[(key(1), 10)], 1_000);
        event(&ix, event_type::PREFIX_EVICTED, A, &key(1));
        let (q, swept) = if sweep_spawned {
            let s = spawn_on(&ix, |ix| ix.sweep_now());
            let q = put(&ix, A, &[(key(2), 10)], 1_000);
            (q, s.join().unwrap())
        } else {
            let p = spawn_on(&ix, move |ix| put(ix, A, &[(key(2), 10)], 1_000));
            let swept = ix.sweep_now();
            (p.join().unwrap(), swept)
        };
        assert_eq!(q.entries_added, 1);
        outcome(if swept.records_reclaimed > 0 {
            "records reclaimed before the ingest"
        } else {
            "ingest entered first"
        });
        assert_eq!(lookup(&ix, &key(2)), [(A.to_string(), 10)]);
        assert_eq!(ix.storage_entries(), 1);
        assert_eq!(ix.total_keys(), 1);
        assert_eq!(ix.serving_count(T, M, S, A), 1);
        assert_eq!(ix.loom_serving_n(T, M, S), 1);
        let c = ix.record_counts();
        assert_eq!((c.tenants, c.models, c.scopes, c.partitions), (1, 1, 1, 1));
        assert_eq!(c.scope_replicas, 1);
    });
}

#[test]
fn m12a_reclaim_vs_ingest() {
    m12_reclaim_vs_ingest(false);
}

#[test]
fn m12b_reclaim_vs_ingest() {
    m12_reclaim_vs_ingest(true);
}

/// Model 12c: a reclaimed replica slot goes to a new replica only after every reader that may
/// have mapped a holder naming it has left. `a` held key 1 and `c` key 9 (`c` keeps the scope
/// alive); a reader looks key 1 up while the main thread clears `a` (ALL_CLEARED), sweeps
/// (reclaiming `a`'s slot), collects garbage twice (releasing the index once no reader pinned
/// at the reclamation is still pinned) and ingests key 2 for a new replica `b`, whose intern
/// empties a released slot and takes it. The reader answers `a` (it read the holder before the
/// removal) or nothing, never `b`; afterwards key 2 answers `b`, key 1 nothing, and the scope
/// names `b` and `c`.
#[test]
fn m12c_slot_reuse_vs_reader() {
    model(|| {
        let ix = index(Algorithm::Lru, None, 8, 1_000);
        put(&ix, "c", &[(key(9), 10)], 1_000);
        put(&ix, A, &[(key(1), 10)], 1_000);
        let r = spawn_on(&ix, |ix| lookup(ix, &key(1)));
        event(&ix, event_type::ALL_CLEARED, A, &[]);
        let swept = ix.sweep_now();
        assert_eq!(swept.replica_slots_reclaimed, 1, "a's slot");
        loom_api::reclaim_step();
        loom_api::reclaim_step();
        put(&ix, B, &[(key(2), 10)], 1_000);
        let seen = r.join().unwrap();
        if seen.is_empty() {
            outcome("reader found nothing");
        } else {
            assert_eq!(seen, [(A.to_string(), 10)], "the reader names a, never b");
            outcome("reader found a");
        }
        assert_eq!(lookup(&ix, &key(2)), [(B.to_string(), 10)]);
        assert!(lookup(&ix, &key(1)).is_empty());
        assert_eq!(ix.record_counts().scope_replicas, 2);
    });
}

// ------------------------------------------------------------------------------------------------
// 13. Key-inline slots (the run layout's key table, `engine/src/raw/slots/`, reached through
// `inferencecache_engine::layout`: the index does not use it yet)

/// Keys sharing key 1's home in an 8-slot table of seed 0 (so also in a 4-slot one: a home is the
/// top bits of the mixed key).
fn slot_mates(n: usize) -> Vec<u64> {
    let home = SlotTable::home_of(0, 8, 1);
    (1..)
        .filter(|&k| SlotTable::home_of(0, 8, k) == home)
        .take(n)
        .collect()
}

/// Keys of key 1's segment in a table of seed 0 (a segment is rebuilt on its own).
fn segment_mates(n: usize) -> Vec<u64> {
    let segment = SlotTable::home_of(0, 8, 1) >> 32;
    (1..)
        .filter(|&k| SlotTable::home_of(0, 8, k) >> 32 == segment)
        .take(n)
        .collect()
}

fn slot_value(x: u64) -> SlotValue {
    SlotValue::new(x).expect("non-zero")
}

/// Model 13a: a reader looks key `k` up while the writer replaces its value (1 → 2), removes it
/// and inserts key `j` of the same home, which takes `k`'s vacated slot (a live key after them
/// keeps the slot vacated rather than empty), through `insert_absent` (an ingest's absent
/// stretch: no probe on to an empty slot). The reader answers 1, 2 or nothing, never `j`'s
/// 3: its second key load sees the reuse. Afterwards `k` is absent and `j` and the third key
/// answer their values.
#[test]
fn m13a_slot_reuse_vs_reader() {
    model(|| {
        let keys = slot_mates(3);
        let (k, j, after) = (keys[0], keys[1], keys[2]);
        let table = Arc::new(SlotTable::with_seed(0));
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            w.insert(k, slot_value(1), &guard);
            w.insert(after, slot_value(9), &guard);
        }
        let reader = {
            let table = table.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                table.find(k, &guard).map(SlotValue::get)
            })
        };
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            assert_eq!(w.insert(k, slot_value(2), &guard), Some(slot_value(1)));
            assert_eq!(w.remove(k, &guard), Some(slot_value(2)));
            w.insert_absent(j, slot_value(3), &guard);
        }
        match reader.join().unwrap() {
            None => outcome("reader found nothing"),
            Some(1) => outcome("reader found 1"),
            Some(2) => outcome("reader found 2"),
            Some(other) => panic!("the reader of k read {other}, another key's value"),
        }
        let guard = crossbeam_epoch::pin();
        assert_eq!(table.find(k, &guard), None);
        assert_eq!(table.find(j, &guard), Some(slot_value(3)));
        assert_eq!(table.find(after, &guard), Some(slot_value(9)));
        assert_eq!(table.len(), 2, "j took k's place");
        // The smallest table (4 slots) holds the three keys at load 3/4: no rebuild.
        assert_eq!(table.capacity(&guard), 4, "no rebuild in this model");
    });
}

/// Model 13d: the cap's two readers of the key table against 13a's slot reuse. A reader probes
/// `k` past the summary word (`find_present`, a victim's re-probe) and draws `k`'s home slot
/// (`sample`, the threshold estimate) while the writer replaces `k`'s value (1 → 2), removes it
/// and inserts `j` of the same home into the vacated slot. The probe answers as `find` does: 1,
/// 2 or nothing, never `j`'s value; the draw answers a value the slot held (1, 2 or 3) or
/// nothing (the slot vacated), never the next slot's.
#[test]
fn m13d_present_probe_and_sample_vs_slot_reuse() {
    model(|| {
        let keys = slot_mates(3);
        let (k, j, after) = (keys[0], keys[1], keys[2]);
        let table = Arc::new(SlotTable::with_seed(0));
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            w.insert(k, slot_value(1), &guard);
            w.insert(after, slot_value(9), &guard);
        }
        let draw = table.home_draw(k);
        let reader = {
            let table = table.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                let probe = table.find_present(k, &guard).map(SlotValue::get);
                (probe, table.sample(draw, &guard))
            })
        };
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            assert_eq!(w.insert(k, slot_value(2), &guard), Some(slot_value(1)));
            assert_eq!(w.remove(k, &guard), Some(slot_value(2)));
            assert_eq!(w.insert(j, slot_value(3), &guard), None);
        }
        let (probe, drawn) = reader.join().unwrap();
        match probe {
            None => outcome("probe found nothing"),
            Some(1) => outcome("probe found 1"),
            Some(2) => outcome("probe found 2"),
            Some(other) => panic!("the probe of k read {other}, another key's value"),
        }
        match drawn {
            None => outcome("draw found the slot vacated"),
            Some(1 | 2) => outcome("draw found k's value"),
            Some(3) => outcome("draw found j's value"),
            Some(other) => panic!("the draw of k's slot read {other}"),
        }
        let guard = crossbeam_epoch::pin();
        assert_eq!(table.find_present(k, &guard), None);
        assert_eq!(table.find_present(j, &guard), Some(slot_value(3)));
        assert_eq!(table.sample(table.home_draw(j), &guard), Some(3));
    });
}

/// Model 13b: a reader looks up a key present throughout while the writer's seventh insert
/// into one segment rebuilds its 8-slot table at 16 slots, and a key the writer inserts
/// meanwhile. The present key is always found with its value, whichever table the reader is
/// on; the new key is found or not, with its own value. The old table is freed through the
/// epoch after the reader.
#[test]
fn m13b_slot_rebuild_vs_reader() {
    model(|| {
        let keys = segment_mates(7);
        let table = Arc::new(SlotTable::with_seed(0));
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            for (i, &k) in keys[..6].iter().enumerate() {
                w.insert(k, slot_value(i as u64 * 10 + 10), &guard);
            }
        }
        let reader = {
            let table = table.clone();
            let (present, fresh) = (keys[2], keys[6]);
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                (
                    table.find(present, &guard).map(SlotValue::get),
                    table.find(fresh, &guard).map(SlotValue::get),
                )
            })
        };
        {
            let guard = crossbeam_epoch::pin();
            table.lock().insert(keys[6], slot_value(70), &guard);
            assert_eq!(table.capacity(&guard), 16, "the insert rebuilt the segment");
        }
        let (present, fresh) = reader.join().unwrap();
        assert_eq!(
            present,
            Some(30),
            "a key present throughout is always found"
        );
        match fresh {
            None => outcome("new key not yet seen"),
            Some(70) => outcome("new key seen"),
            Some(other) => panic!("the new key read {other}"),
        }
    });
}

/// Model 13c: a reader looks up a key of a table that has no slots yet while the writer's
/// first insert creates its single table and publishes it through the root. The reader finds
/// nothing (the null root) or the key with its value, never anything else.
#[test]
fn m13c_segment_creation_vs_reader() {
    model(|| {
        let table = Arc::new(SlotTable::with_seed(0));
        let reader = {
            let table = table.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                table.find(1, &guard).map(SlotValue::get)
            })
        };
        {
            let guard = crossbeam_epoch::pin();
            assert_eq!(table.lock().insert(1, slot_value(10), &guard), None);
        }
        match reader.join().unwrap() {
            None => outcome("segment not yet seen"),
            Some(10) => outcome("key seen"),
            Some(other) => panic!("key 1 read {other}"),
        }
        let guard = crossbeam_epoch::pin();
        assert_eq!(
            table.capacity(&guard),
            4,
            "one single table of 4 slots created"
        );
    });
}

/// Model 13e: a reader looks up a key present throughout, and the key whose insert splits the
/// table, while the writer's insert of a 49th key passes the single table's 64 slots: the
/// writer builds the segment directory (a table per segment with keys), publishes it through
/// the root and retires the single table. The present key is always found with its value,
/// whether the reader loaded the single table or the directory; the new key is found or not,
/// with its own value. The single table is freed through the epoch after the reader.
#[test]
fn m13e_directory_split_vs_reader() {
    model(|| {
        let table = Arc::new(SlotTable::with_seed(0));
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            for k in 1..=48u64 {
                w.insert(k, slot_value(k * 10), &guard);
            }
            assert!(!table.is_split(), "48 keys fit the single table");
        }
        let reader = {
            let table = table.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                (
                    table.find(17, &guard).map(SlotValue::get),
                    table.find(49, &guard).map(SlotValue::get),
                )
            })
        };
        {
            let guard = crossbeam_epoch::pin();
            assert_eq!(table.lock().insert(49, slot_value(490), &guard), None);
            assert!(table.is_split(), "the 49th key split the table");
        }
        let (present, fresh) = reader.join().unwrap();
        assert_eq!(
            present,
            Some(170),
            "a key present throughout is always found"
        );
        match fresh {
            None => outcome("new key not yet seen"),
            Some(490) => outcome("new key seen"),
            Some(other) => panic!("the new key read {other}"),
        }
        let guard = crossbeam_epoch::pin();
        assert!((1..=49u64).all(|k| table.find(k, &guard) == Some(slot_value(k * 10))));
    });
}

// ------------------------------------------------------------------------------------------------
// 14. Block runs (the run layout's storage unit, `engine/src/raw/block_run.rs`, with its run ids,
// over the key-inline slots of section 13; reached through `inferencecache_engine::layout`: the
// index does not use them yet)

/// A holder of replica `rep` (tier 1, 16 tokens, `last_seen` 1,000, generation 1).
fn run_holder(rep: u32) -> Holder {
    Holder::new(rep, 1, 16, 1_000, 1)
}

/// A run held by `reps` with room for `capacity` holders over `keys`.
fn block_run(reps: &[u32], capacity: usize, keys: &[u64]) -> NonNull<BlockRun> {
    let holders: Vec<Holder> = reps.iter().map(|&r| run_holder(r)).collect();
    BlockRun::create(&holders, capacity, keys).expect("a valid run")
}

/// An empty key table, run-id registry with its allocator, and reaper.
fn run_fixture() -> (
    Arc<SlotTable>,
    Arc<RunIds>,
    IdAllocator,
    Arc<Reaper<BlockRun>>,
) {
    (
        Arc::new(SlotTable::with_seed(0)),
        Arc::new(RunIds::new()),
        IdAllocator::default(),
        Arc::new(Reaper::default()),
    )
}

/// The replicas of a run's live holder entries, in entry order.
fn run_reps(run: &BlockRun) -> Vec<u32> {
    let mut reps = Vec::new();
    run.for_each_holder(|_, h| reps.push(h.rep()));
    reps
}

/// Points the slots of `keys` at `run`'s offsets `from..` and counts the references.
fn point(w: &mut SlotWriter<'_>, run: NonNull<BlockRun>, from: usize, keys: &[u64], guard: &Guard) {
    for (i, &k) in keys.iter().enumerate() {
        w.insert(k, slot_value(pack(run, from + i)), guard);
    }
    // SAFETY: the model's own live run.
    unsafe { run.as_ref() }.add_refs(keys.len() as u64);
}

/// A longest-prefix walk as the run layout does it, returning each matched block's replicas:
/// probe a block's slot, step over the run's keys up to its next dead bit, then take the
/// run's hint for the landing key, else probe again.
fn run_walk(table: &SlotTable, ids: &RunIds, request: &[u64], guard: &Guard) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    let mut next = table.find(request[0], guard).map(SlotValue::get);
    let mut i = 0;
    while let Some(value) = next {
        let (run, mut o) = unpack(value);
        // SAFETY: a slot or a checked hint named the run under `guard` (block_run invariant 4).
        let run = unsafe { run.as_ref() };
        assert_eq!(run.key(o), request[i], "a slot names its own key's block");
        let reps = run_reps(run);
        let end = run.live_end(o);
        loop {
            out.push(reps.clone());
            i += 1;
            o += 1;
            if i == request.len() || o == end || run.key(o) != request[i] {
                break;
            }
        }
        if i == request.len() {
            break;
        }
        next = run
            .hint(request[i], ids, guard)
            .or_else(|| table.find(request[i], guard).map(SlotValue::get));
    }
    out
}

/// Model 14a: slot repointing and dead bits vs a walking reader. Run A (replica 1) holds keys
/// 1, 2, 3; replica 2 joins keys 2 and 3 only, so the writer builds run B (replicas 1, 2) over
/// them, hints it from A, marks A's offsets 1 and 2 dead and repoints their slots. The reader
/// walks 1, 2, 3: block 1 is replica 1's, blocks 2 and 3 each show the old or the new holders,
/// and a block 2 read through B brings block 3 from B too. A keeps block 1; nothing is freed.
#[test]
fn m14a_run_repoint_vs_walk() {
    model(|| {
        let (table, ids, mut alloc, _) = run_fixture();
        let a = block_run(&[1], 2, &[1, 2, 3]);
        {
            let guard = crossbeam_epoch::pin();
            ids.register(&mut alloc, a).expect("an id");
            point(&mut table.lock(), a, 0, &[1, 2, 3], &guard);
        }
        let reader = {
            let (table, ids) = (table.clone(), ids.clone());
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                run_walk(&table, &ids, &[1, 2, 3], &guard)
            })
        };
        let b = block_run(&[1, 2], 3, &[2, 3]);
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            let id_b = ids.register(&mut alloc, b).expect("an id");
            // SAFETY: the model's live runs.
            let (ra, _) = unsafe { (a.as_ref(), b.as_ref()) };
            ra.set_hint(
                2,
                HintTarget {
                    value: pack(b, 0),
                    id: id_b,
                    span: 1,
                    front_lines: 4,
                },
            );
            ra.set_dead(1);
            ra.set_dead(2);
            point(&mut w, b, 0, &[2, 3], &guard);
            assert!(!ra.release(2), "A keeps block 1");
        }
        let seen = reader.join().unwrap();
        let (old, new) = (vec![1], vec![1, 2]);
        assert_eq!(seen.len(), 3, "every block is held throughout");
        assert_eq!(seen[0], old);
        assert!(seen[1] == old || seen[1] == new, "block 2: {:?}", seen[1]);
        assert!(seen[2] == old || seen[2] == new, "block 3: {:?}", seen[2]);
        assert!(
            seen[1] == old || seen[2] == new,
            "block 2 from B, block 3 from A"
        );
        outcome(match (seen[1] == new, seen[2] == new) {
            (false, false) => "blocks 2, 3 old",
            (false, true) => "block 2 old, 3 new",
            _ => "blocks 2, 3 new",
        });
        let guard = crossbeam_epoch::pin();
        assert_eq!(
            run_walk(&table, &ids, &[1, 2, 3], &guard),
            [old, new.clone(), new]
        );
        drop(guard);
        assert_eq!(loom_api::live(Kind::BlockRun), 2);
        // SAFETY: the model is over: nothing reads the runs any more.
        unsafe {
            BlockRun::discard(a);
            BlockRun::discard(b);
        }
    });
}

/// Model 14b: a holder joining a run in its spare entry and another leaving it by its gone bit
/// vs a reader of the run's holders. Replica 2 joins run A (replica 1, room for two), then
/// replica 1 leaves it. The reader sees {1}, {1, 2} or {2}: never a torn entry, never no holder.
#[test]
fn m14b_run_join_and_gone_vs_reader() {
    model(|| {
        let table = Arc::new(SlotTable::with_seed(0));
        let a = block_run(&[1], 2, &[1, 2]);
        {
            let guard = crossbeam_epoch::pin();
            point(&mut table.lock(), a, 0, &[1, 2], &guard);
        }
        let reader = {
            let table = table.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                let value = table.find(2, &guard).expect("key 2 is present").get();
                let (run, o) = unpack(value);
                assert_eq!(o, 1);
                // SAFETY: named by a slot under the guard; the model frees it at its end.
                run_reps(unsafe { run.as_ref() })
            })
        };
        {
            let _w = table.lock();
            // SAFETY: the model's live run.
            let ra = unsafe { a.as_ref() };
            assert!(ra.push_holder(run_holder(2)), "the spare entry");
            ra.set_gone(0);
        }
        match reader.join().unwrap().as_slice() {
            [1] => outcome("before the join"),
            [1, 2] => outcome("joined"),
            [2] => outcome("after the leave"),
            other => panic!("the reader saw holders {other:?}"),
        }
        // SAFETY: the model is over.
        unsafe { BlockRun::discard(a) };
    });
}

/// Model 14c: run retirement vs a pinned reader. Key 1's slot names run A (replica 1); the
/// writer builds run B (replica 2), marks A's offset dead, repoints the slot, drops A's last
/// reference, retires A and collects garbage eagerly while the reader reads whichever run it
/// found. The ledger fails the model if A is freed before the reader's reads; afterwards A is
/// freed and B alive.
#[test]
fn m14c_run_retire_vs_pinned_reader() {
    model(|| {
        let (table, ids, mut alloc, reaper) = run_fixture();
        let a = block_run(&[1], 1, &[1]);
        {
            let guard = crossbeam_epoch::pin();
            ids.register(&mut alloc, a).expect("an id");
            point(&mut table.lock(), a, 0, &[1], &guard);
        }
        let reader = {
            let (table, ids) = (table.clone(), ids.clone());
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                run_walk(&table, &ids, &[1], &guard)
            })
        };
        let b = block_run(&[2], 1, &[1]);
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            ids.register(&mut alloc, b).expect("an id");
            // SAFETY: the model's live run.
            let ra = unsafe { a.as_ref() };
            ra.set_dead(0);
            point(&mut w, b, 0, &[1], &guard);
            assert!(ra.release(1), "A's last reference");
            // SAFETY: registered, no slot names it, retired once.
            unsafe { BlockRun::retire(a, &ids, &mut alloc, &reaper, &guard) };
        }
        loom_api::reclaim_step();
        loom_api::reclaim_step();
        match reader.join().unwrap().as_slice() {
            [r] if r == &[1] => outcome("reader read A"),
            [r] if r == &[2] => outcome("reader read B"),
            other => panic!("the reader saw {other:?}"),
        }
        assert!(
            loom_api::collect_garbage(|| {
                reaper.free_all();
                loom_api::live(Kind::BlockRun) == 1
            }),
            "A is freed once the reader has left"
        );
        assert_eq!(
            loom_api::built(Kind::BlockRun) - loom_api::freed(Kind::BlockRun),
            1
        );
        // SAFETY: the model is over.
        unsafe { BlockRun::discard(b) };
    });
}

/// Model 14d: hint validation vs run reuse. Run A (key 1) hints key 2 at run B (replica 2).
/// The writer removes key 2 (B's last block: dead bit, slot removal, retirement), then
/// re-creates it in run C (replica 3), which takes B's freed id; A's hint still names B, as
/// hints are not kept up to date. The reader, on A, asks the hint for key 2: a checked hint
/// names B while B is live (replica 2), and once B is gone the hint is refused and the reader
/// falls back to the slot; it never reads freed memory.
#[test]
fn m14d_run_hint_vs_reuse() {
    model(|| {
        let (table, ids, mut alloc, reaper) = run_fixture();
        let a = block_run(&[1], 1, &[1]);
        let b = block_run(&[2], 1, &[2]);
        let id_b = {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            ids.register(&mut alloc, a).expect("an id");
            let id_b = ids.register(&mut alloc, b).expect("an id");
            point(&mut w, a, 0, &[1], &guard);
            point(&mut w, b, 0, &[2], &guard);
            // SAFETY: the model's live run.
            unsafe { a.as_ref() }.set_hint(
                2,
                HintTarget {
                    value: pack(b, 0),
                    id: id_b,
                    span: 1,
                    front_lines: 4,
                },
            );
            id_b
        };
        let reader = {
            let (table, ids) = (table.clone(), ids.clone());
            // A raw pointer is not `Send`; the address is.
            let a_addr = a.as_ptr() as usize;
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                // SAFETY: A stays live throughout the model.
                let ra = unsafe { &*(a_addr as *const BlockRun) };
                // As the walk does: the hint is read, its block fetched, and only later
                // checked (the writer may act in between).
                let peeked = ra.peek_hint(2);
                if let Some(hinted) = peeked {
                    hinted.prefetch(&ids);
                }
                match peeked.and_then(|hinted| hinted.check(&ids, &guard)) {
                    Some(value) => {
                        let (run, o) = unpack(value);
                        // SAFETY: a checked hint names a live run under the guard.
                        let run = unsafe { run.as_ref() };
                        assert_eq!(run.key(o), 2, "a checked hint names key 2's block");
                        (true, run_reps(run))
                    }
                    None => (false, run_walk(&table, &ids, &[2], &guard).concat()),
                }
            })
        };
        let c = block_run(&[3], 1, &[2]);
        {
            let guard = crossbeam_epoch::pin();
            let mut w = table.lock();
            // SAFETY: the model's live run.
            let rb = unsafe { b.as_ref() };
            rb.set_dead(0);
            w.remove(2, &guard);
            assert!(rb.release(1));
            // SAFETY: registered, no slot names it, retired once.
            unsafe { BlockRun::retire(b, &ids, &mut alloc, &reaper, &guard) };
            let id_c = ids.register(&mut alloc, c).expect("an id");
            assert_eq!(id_c, id_b, "C takes B's freed id");
            point(&mut w, c, 0, &[2], &guard);
        }
        // Enough collection steps to free B before the reader runs, in the schedules where
        // it runs last: its stale hint must then be refused, not followed.
        for _ in 0..4 {
            loom_api::reclaim_step();
        }
        match reader.join().unwrap() {
            (true, reps) if reps == [2] => outcome("hint to B"),
            (false, reps) if reps.is_empty() => outcome("no hint, key absent"),
            (false, reps) if reps == [2] => outcome("no hint, slot to B"),
            (false, reps) if reps == [3] => outcome("no hint, slot to C"),
            other => panic!("the reader saw {other:?}"),
        }
        assert!(
            loom_api::collect_garbage(|| {
                reaper.free_all();
                loom_api::live(Kind::BlockRun) == 2
            }),
            "B is freed once the reader has left"
        );
        // SAFETY: the model is over.
        unsafe {
            BlockRun::discard(a);
            BlockRun::discard(c);
        }
    });
}

/// The registry's ages vs a scan (`RunIds::scan`, the cap's walk): run B (age 1,000) is
/// retired and its id taken by run C (age 5,000) while a reader scans for runs of age ≤ 2,000.
/// The reader sees B as old (reading it, live under its pin) or C as young, or neither — never
/// C as old: C's age is stored before the entry that names it.
#[test]
fn m14e_run_age_vs_scan() {
    model(|| {
        let (_table, ids, mut alloc, reaper) = run_fixture();
        let b = block_run(&[1], 1, &[2]);
        let c = BlockRun::create(&[Holder::new(2, 1, 16, 5_000, 1)], 1, &[3]).expect("a run");
        let id_b = ids.register(&mut alloc, b).expect("an id");
        let reader = {
            let ids = ids.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                let mut seen = Vec::new();
                ids.scan(0, 64, 2_000, &guard, |step| {
                    seen.push(match step {
                        ScanStep::Old(run) => Some(run.key(0)),
                        ScanStep::Young => None,
                    });
                    true
                });
                seen
            })
        };
        {
            let guard = crossbeam_epoch::pin();
            // SAFETY: the model's live run, in no slot.
            let rb = unsafe { b.as_ref() };
            rb.add_refs(1);
            assert!(rb.release(1));
            // SAFETY: registered, no slot names it, retired once.
            unsafe { BlockRun::retire(b, &ids, &mut alloc, &reaper, &guard) };
            assert_eq!(ids.register(&mut alloc, c), Some(id_b), "C takes B's id");
        }
        for _ in 0..4 {
            loom_api::reclaim_step();
        }
        match reader.join().unwrap().as_slice() {
            [Some(2)] => outcome("B, old"),
            [None] => outcome("C, young"),
            [] => outcome("neither"),
            other => panic!("the reader saw {other:?}"),
        }
        assert!(
            loom_api::collect_garbage(|| {
                reaper.free_all();
                loom_api::live(Kind::BlockRun) == 1
            }),
            "B is freed once the reader has left"
        );
        // SAFETY: the model is over.
        unsafe { BlockRun::discard(c) };
    });
}

/// Model 14f: the registry's chunk pointers past the inline ones (`RunIds`' `rest` array,
/// allocated with the first chunk past them) vs a reader. Ids 1..=5 fill the inline chunks;
/// the writer registers run C, whose id 6 needs the array and chunk 2, while a reader looks
/// id 6 up and scans from it. The reader finds nothing or C (its key readable), never a
/// torn array or chunk: both are written before the pointers that publish them.
#[test]
fn m14f_run_id_past_inline_chunks_vs_reader() {
    model(|| {
        let (_table, ids, mut alloc, _) = run_fixture();
        let a = block_run(&[1], 1, &[2]);
        let c = block_run(&[2], 1, &[3]);
        for want in 1..=5 {
            assert_eq!(ids.register(&mut alloc, a), Some(want));
        }
        assert_eq!(ids.scan_len(), 6, "two inline chunks: 2 + 4 positions");
        let reader = {
            let ids = ids.clone();
            spawn(move || {
                let guard = crossbeam_epoch::pin();
                // SAFETY: a registered run is live while the guard is pinned (invariant 4).
                let got = ids.get(6, &guard).map(|r| unsafe { r.as_ref() }.key(0));
                let mut scanned = Vec::new();
                ids.scan(6, 14, i64::MAX, &guard, |step| {
                    if let ScanStep::Old(run) = step {
                        scanned.push(run.key(0));
                    }
                    true
                });
                (got, scanned)
            })
        };
        assert_eq!(ids.register(&mut alloc, c), Some(6));
        let (got, scanned) = reader.join().unwrap();
        assert!(matches!(got, None | Some(3)), "id 6 named {got:?}");
        assert!(scanned.is_empty() || scanned == [3], "scan saw {scanned:?}");
        outcome(match (got, scanned.is_empty()) {
            (Some(_), false) => "C by id and by scan",
            (Some(_), true) => "C by id",
            (None, false) => "C by scan",
            (None, true) => "nothing yet",
        });
        assert_eq!(ids.scan_len(), 14, "chunk 2 holds 8 positions");
        let guard = crossbeam_epoch::pin();
        // SAFETY: the model's own runs, registered above.
        assert_eq!(
            ids.get(6, &guard).map(|r| unsafe { r.as_ref() }.key(0)),
            Some(3)
        );
        drop(guard);
        // SAFETY: the model is over; no reader is left.
        unsafe {
            BlockRun::discard(a);
            BlockRun::discard(c);
        }
    });
}

// ------------------------------------------------------------------------------------------------
// 15. One partition's storage on the run layout (`engine/src/raw/run_store/`, `RunStore`):
// its writes vs its walk

/// The holders of each block a `RunStore` walk of `request` visits.
fn store_walk(store: &RunStore, request: &[u64]) -> Vec<Vec<u32>> {
    let guard = crossbeam_epoch::pin();
    let mut out = Vec::new();
    store.walk(request, &guard, |run, from, to| {
        let reps = run_reps(run);
        out.extend((from..to).map(|_| reps.clone()));
        true
    });
    out
}

fn writing(rep: u32) -> Writing {
    Writing {
        rep,
        tier: 1,
        ts_ms: 1_000,
    }
}

/// Model 15a: replica 0 holds chain 1, 2, 3 (one run); replica 1 ingests 2, 3 (a stretch that
/// does not cover the run: copy on write, dead bits, repointed slots, a hint) while a reader
/// walks 1, 2, 3. Block 1 is replica 0's; blocks 2 and 3 show {0} or {0, 1}, block 3 never
/// older than block 2. Afterwards the walk sees the new state and no run is leaked.
#[test]
fn m15a_store_copy_on_write_vs_walk() {
    model(|| {
        let store = Arc::new(RunStore::with_seed(StoreOptions::default(), 0));
        {
            let guard = crossbeam_epoch::pin();
            store.ingest(&[1, 2, 3], &[16; 3], writing(0), &guard);
        }
        let reader = {
            let store = store.clone();
            spawn(move || store_walk(&store, &[1, 2, 3]))
        };
        {
            let guard = crossbeam_epoch::pin();
            let report = store.ingest(&[2, 3], &[16; 2], writing(1), &guard);
            assert_eq!(report.added, 2);
        }
        let seen = reader.join().unwrap();
        let (old, new) = (vec![0], vec![0, 1]);
        assert_eq!(seen.len(), 3, "every block is held throughout");
        assert_eq!(seen[0], old);
        assert!(seen[1] == old || seen[1] == new, "block 2: {:?}", seen[1]);
        assert!(seen[2] == old || seen[2] == new, "block 3: {:?}", seen[2]);
        assert!(seen[1] == old || seen[2] == new, "block 2 new, block 3 old");
        outcome(match (seen[1] == new, seen[2] == new) {
            (false, false) => "blocks 2, 3 old",
            (false, true) => "block 2 old, 3 new",
            _ => "blocks 2, 3 new",
        });
        assert_eq!(store_walk(&store, &[1, 2, 3]), [old, new.clone(), new]);
        drop(store);
        assert!(
            loom_api::collect_garbage(|| loom_api::live(Kind::BlockRun) == 0),
            "every run is freed once the store is dropped"
        );
    });
}

/// Model 15b: replicas 0 and 1 hold chain 1, 2 (one run); replica 0 leaves it (gone bit),
/// then replica 1 leaves block 2 (copy on write of block 1 for replica 1, block 2 removed, the
/// old run retired) while a pinned reader walks 1, 2. Every block the reader sees has a
/// holder set the store had; the ledger fails the model if the retired run is read after its
/// free.
#[test]
fn m15b_store_removals_vs_walk() {
    model(|| {
        let store = Arc::new(RunStore::with_seed(StoreOptions::default(), 0));
        {
            let guard = crossbeam_epoch::pin();
            store.ingest(&[1, 2], &[16; 2], writing(0), &guard);
            store.ingest(&[1, 2], &[16; 2], writing(1), &guard);
        }
        let reader = {
            let store = store.clone();
            spawn(move || store_walk(&store, &[1, 2]))
        };
        {
            let guard = crossbeam_epoch::pin();
            assert_eq!(store.evict(&[1, 2], 0, &guard).removed, 2);
            assert_eq!(store.evict(&[2], 1, &guard).keys_removed, 1);
        }
        loom_api::reclaim_step();
        loom_api::reclaim_step();
        let seen = reader.join().unwrap();
        let allowed: [&[Vec<u32>]; 4] = [
            &[vec![0, 1], vec![0, 1]],
            &[vec![1], vec![1]],
            &[vec![1]],
            &[vec![0, 1]],
        ];
        assert!(
            allowed.contains(&seen.as_slice()),
            "the reader saw {seen:?}"
        );
        outcome(match seen.as_slice() {
            [_, _] if seen[0] == [0, 1] => "both blocks, both holders",
            [_, _] => "both blocks, replica 1",
            [a] if a == &[1] => "block 1, replica 1",
            _ => "block 1, both holders",
        });
        assert_eq!(store_walk(&store, &[1, 2]), [vec![1]]);
        assert!(
            loom_api::collect_garbage(|| {
                store.free_retired();
                loom_api::live(Kind::BlockRun) == 1
            }),
            "the retired run is freed once the reader has left"
        );
    });
}

/// Models 15c and 15d: replica 0 holds chain 1, 2, 3, 4 (one run) and evicts `evicted` while a
/// pinned reader walks the chain; `reclaim_steps` epoch advances are offered before the reader
/// is joined. Returns the store, its run bytes before the eviction and what the reader saw.
fn one_replica_evicts_while_walked(
    evicted: &'static [u64],
    reclaim_steps: usize,
) -> (Arc<RunStore>, usize, Vec<Vec<u32>>) {
    let store = Arc::new(RunStore::with_seed(StoreOptions::default(), 0));
    {
        let guard = crossbeam_epoch::pin();
        store.ingest(&[1, 2, 3, 4], &[16; 4], writing(0), &guard);
    }
    let bytes = store.run_bytes();
    let reader = {
        let store = store.clone();
        spawn(move || store_walk(&store, &[1, 2, 3, 4]))
    };
    {
        let guard = crossbeam_epoch::pin();
        assert_eq!(store.evict(evicted, 0, &guard).keys_removed, evicted.len());
    }
    for _ in 0..reclaim_steps {
        loom_api::reclaim_step();
    }
    (store, bytes, reader.join().unwrap())
}

/// Model 15c: replica 0 holds chain 1, 2, 3, 4 (one run); it evicts 2, 3, 4, which leaves the
/// run one live offset in four, so the write ends by trimming it (a copy over block 1, its slot
/// and root slot repointed, the old run retired) while a pinned reader walks 1, 2, 3, 4. The
/// reader sees a prefix of the chain, each block replica 0's; the ledger fails the model if
/// either run is read after its free. Afterwards block 1 alone is present, on the copy.
#[test]
fn m15c_store_trim_vs_walk() {
    model(|| {
        let (store, bytes, seen) = one_replica_evicts_while_walked(&[2, 3, 4], 2);
        assert!(!seen.is_empty(), "block 1 is held throughout");
        assert!(
            seen.iter().all(|reps| reps == &[0]),
            "the reader saw {seen:?}"
        );
        outcome(match seen.len() {
            1 => "block 1",
            2 => "blocks 1, 2",
            3 => "blocks 1..=3",
            _ => "blocks 1..=4",
        });
        assert_eq!(store_walk(&store, &[1, 2, 3, 4]), [vec![0]]);
        assert!(store.run_bytes() < bytes, "the run was trimmed");
        assert!(
            loom_api::collect_garbage(|| {
                store.free_retired();
                loom_api::live(Kind::BlockRun) == 1
            }),
            "the trimmed run is freed once the reader has left"
        );
    });
}

/// Model 15d: a leaves-first tail removal vs a walk. Replica 0 holds chain 1, 2, 3, 4 (one
/// run); it evicts 4, 3, as an LRU does: the run's tail, held by the leaving replica alone, so
/// the writer marks offsets 3 and 2 dead and removes their slots (no copy, no new run, and
/// half the run live: no trim) while a pinned reader walks 1, 2, 3, 4. The reader sees a
/// prefix of the chain of at least two blocks, each replica 0's (a reader that loaded a dead
/// bit before it was set still sees its block, as before the removal); afterwards the walk
/// sees blocks 1, 2 on the same run. A walk that found the slot of a block past a shortened
/// length would step outside the run's keys: the run's length never falls while it is shared.
#[test]
fn m15d_store_leaves_first_tail_removal_vs_walk() {
    model(|| {
        let (store, bytes, seen) = one_replica_evicts_while_walked(&[4, 3], 0);
        assert!(
            seen.len() >= 2,
            "blocks 1 and 2 are held throughout: {seen:?}"
        );
        assert!(
            seen.iter().all(|reps| reps == &[0]),
            "the reader saw {seen:?}"
        );
        outcome(match seen.len() {
            2 => "blocks 1, 2",
            3 => "blocks 1..=3",
            _ => "blocks 1..=4",
        });
        assert_eq!(store_walk(&store, &[1, 2, 3, 4]), [vec![0], vec![0]]);
        assert_eq!(store.run_bytes(), bytes, "the run stays as it was");
        assert_eq!(loom_api::live(Kind::BlockRun), 1, "no run was built");
    });
}
