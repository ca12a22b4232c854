//! Eviction acceptance tests (index.md §11, "Eviction and LFU" and D6): global cap (V2), tenant
//! quotas (V5), reserved tenant, approximate-eviction quality (T86, T87), seeds (T89) and a sweep
//! racing lookups and ingest.

mod common;
mod model;

use common::*;
use inferencecache_engine::*;
use std::sync::Arc;

fn gauge(ix: &Index, model: &str) -> i64 {
    ix.entry_counts_by_model()
        .iter()
        .find(|(m, _)| &**m == model)
        .map_or(0, |x| x.1)
}

fn env_seed(max_entries: i64, seed: u64) -> Env {
    env_with(IndexConfig {
        max_entries,
        eviction_seed: seed,
        ..cfg_1h()
    })
}

fn has(e: &Env, tenant: &str, key: &[u8], replica: &str) -> bool {
    e.ix.entry(tenant, "m", "vllm", "", key, replica).is_some()
}

fn put_t(e: &Env, tenant: &str, key: &[u8]) {
    e.put_with(
        &Put {
            tenant,
            ..Put::default()
        },
        key,
        16,
    );
}

/// Exact lookup of `key` under `tenant` credited `n` times.
fn credit(e: &Env, tenant: &str, key: &[u8], n: usize) {
    assert!(
        credit_if_stored(e, tenant, key, n),
        "one captured hit for {key:?}"
    );
}

/// Exact lookup of `key` under `tenant`, credited `n` times if it captured the key's hit; false
/// when the key is not stored (under LFU at the cap an entry can be its own ingest's victim).
fn credit_if_stored(e: &Env, tenant: &str, key: &[u8], n: usize) -> bool {
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: key,
        ..LookupRequest::new(tenant, "m", "vllm")
    });
    if r.hits.is_empty() {
        return false;
    }
    assert_eq!(r.hits.len(), 1, "one captured hit for {key:?}");
    for _ in 0..n {
        e.ix.credit_hits(&r.hits);
    }
    true
}

// ---------------------------------------------------------------- scenarios (seeded)

fn t64(seed: u64) {
    let e = env_seed(2, seed);
    for k in [b"old", b"mid", b"new"] {
        e.put("r", k, 16);
        e.clock.advance_us(MIN_US);
    }
    assert!(!has(&e, "t", b"old", "r"));
    assert!(has(&e, "t", b"mid", "r") && has(&e, "t", b"new", "r"));
    assert_eq!(gauge(&e.ix, "m"), 2);
    assert_eq!(e.ix.storage_entries(), 2);
    assert_eq!(e.ix.evictions(Algorithm::Lru, EvictionReason::Cap), 1);
}

fn t65(seed: u64) {
    let e = env_seed(3, seed);
    e.set_lfu("t");
    for (k, n) in [(b"hot", 5), (b"wrm", 2), (b"cld", 0)] {
        e.put("r", k, 16);
        credit(&e, "t", k, n);
        e.clock.advance_us(MIN_US);
    }
    e.put("r", b"new", 16);
    assert!(!has(&e, "t", b"cld", "r"), "cold (older than new) evicted");
    for k in [b"hot", b"wrm", b"new"] {
        assert!(has(&e, "t", k, "r"));
    }
    assert_eq!(e.ix.evictions(Algorithm::Lfu, EvictionReason::Cap), 1);
}

fn t66(seed: u64) {
    for lfu in [false, true] {
        let e = env_seed(3, seed);
        if lfu {
            e.set_lfu("t");
        }
        for (k, n) in [(b"A", 9), (b"B", 3), (b"C", 5)] {
            e.put("r", k, 16);
            if lfu {
                credit(&e, "t", k, n);
            }
            e.clock.advance_us(MIN_US);
        }
        e.put("r", b"D", 16);
        let gone = if lfu { b"D" } else { b"A" };
        for k in [b"A", b"B", b"C", b"D"] {
            assert_eq!(has(&e, "t", k, "r"), k != gone, "lfu={lfu} key {k:?}");
        }
    }
}

/// T67, engine part: LFU, cap 1; A credited 3× survives B's ingest, uncredited A does not.
fn t67(seed: u64) {
    for credited in [true, false] {
        let e = env_seed(1, seed);
        e.set_lfu("t");
        e.put("rA", b"A", 64);
        if credited {
            credit(&e, "t", b"A", 3);
        }
        e.clock.advance_us(MIN_US);
        e.put("rB", b"B", 64);
        assert_eq!(has(&e, "t", b"A", "rA"), credited);
        assert_eq!(has(&e, "t", b"B", "rB"), !credited);
        assert_eq!(e.ix.storage_entries(), 1);
    }
}

fn t69(seed: u64) {
    let e = env_seed(2, seed);
    e.set_lfu("lfu");
    put_t(&e, "lfu", b"old");
    credit(&e, "lfu", b"old", 1);
    e.clock.advance_us(MIN_US);
    put_t(&e, "t", b"lru1");
    e.clock.advance_us(MIN_US);
    put_t(&e, "t", b"lru2");
    assert!(has(&e, "lfu", b"old", "r"));
    assert!(!has(&e, "t", b"lru1", "r"));
    assert!(has(&e, "t", b"lru2", "r"));
}

/// T70, cap part: `{lfu,cap}` or `{lru,cap}` = 1 per the victim's tenant algorithm; N1 REMOVED
/// carries the removal time.
fn t70(seed: u64) {
    for lfu in [false, true] {
        let e = env_seed(1, seed);
        let rec = Arc::new(Recorder::default());
        e.ix.set_change_sink(rec.clone());
        if lfu {
            e.set_lfu("t");
        }
        e.put_with(
            &Put {
                ts: T0 - 5 * MIN_US,
                ..Put::default()
            },
            b"p",
            16,
        );
        e.put("r", b"q", 16);
        let (a, b) = if lfu {
            (Algorithm::Lfu, Algorithm::Lru)
        } else {
            (Algorithm::Lru, Algorithm::Lfu)
        };
        assert_eq!(e.ix.evictions(a, EvictionReason::Cap), 1);
        assert_eq!(e.ix.evictions(b, EvictionReason::Cap), 0);
        assert_eq!(e.ix.evictions(a, EvictionReason::Ttl), 0);
        let ev = rec.events.lock().clone();
        let kinds: Vec<_> = ev.iter().map(|x| (x.0, x.3.clone())).collect();
        assert_eq!(
            kinds,
            vec![
                (ChangeKind::Added, b"p".to_vec()),
                (ChangeKind::Added, b"q".to_vec()),
                (ChangeKind::Removed, b"p".to_vec())
            ]
        );
        assert_eq!(ev[2].5, T0, "REMOVED timestamp = removal time");
    }
}

fn t72(seed: u64) {
    let e = env_seed(0, seed);
    e.set_quota("t", 3);
    for k in [b"a", b"b", b"c", b"d", b"e"] {
        e.put("r", k, 16);
        e.clock.advance_us(MIN_US);
    }
    for (k, present) in [
        (b"a", false),
        (b"b", false),
        (b"c", true),
        (b"d", true),
        (b"e", true),
    ] {
        assert_eq!(has(&e, "t", k, "r"), present, "{k:?}");
    }
    assert_eq!(e.ix.tenant_evictions(), vec![(Arc::from("t"), 2)]);
    assert_eq!(e.ix.evictions(Algorithm::Lru, EvictionReason::Cap), 0);
    // Quota 2: a on r1 and r2, then b, then c → a removed from both, count 1.
    let e = env_seed(0, seed);
    let rec = Arc::new(Recorder::default());
    e.ix.set_change_sink(rec.clone());
    e.set_quota("t", 2);
    e.put("r1", b"a", 16);
    e.put("r2", b"a", 16);
    e.clock.advance_us(MIN_US);
    e.put("r1", b"b", 16);
    e.clock.advance_us(MIN_US);
    e.put("r1", b"c", 16);
    assert!(e.ix.holders("t", "m", "vllm", "", b"a").is_empty());
    assert!(has(&e, "t", b"b", "r1") && has(&e, "t", b"c", "r1"));
    assert_eq!(e.ix.tenant_evictions(), vec![(Arc::from("t"), 1)]);
    assert_eq!(e.ix.storage_entries(), 2);
    assert_eq!(e.ix.serving_count("t", "m", "vllm", "r2"), 0);
    let removed: Vec<_> = rec
        .events
        .lock()
        .iter()
        .filter(|x| x.0 == ChangeKind::Removed)
        .map(|x| (x.2.clone(), x.3.clone()))
        .collect();
    assert_eq!(
        removed,
        vec![("r1".into(), b"a".to_vec()), ("r2".into(), b"a".to_vec())]
    );
}

fn t73(seed: u64) {
    // Quota 0 → 0 keys (on every ingest).
    let e = env_seed(0, seed);
    e.set_quota("t", 0);
    e.chain("r", &[b"b1", b"b2"], &f16(2));
    e.put("r", b"p", 16);
    assert_eq!(e.ix.cache_state("t", "m").total_prefixes, 0);
    assert_eq!(e.ix.storage_entries(), 0);
    assert_eq!(e.ix.tenant_evictions(), vec![(Arc::from("t"), 3)]);
    // No resolver entry → unbounded; team-a capped at 2 leaves team-b's 4 keys.
    let e = env_seed(0, seed);
    e.set_quota("team-a", 2);
    for k in [b"k1", b"k2", b"k3", b"k4"] {
        put_t(&e, "team-a", k);
        put_t(&e, "team-b", k);
        e.clock.advance_us(MIN_US);
    }
    assert_eq!(e.ix.cache_state("team-a", "m").total_prefixes, 2);
    assert_eq!(e.ix.cache_state("team-b", "m").total_prefixes, 4);
    assert!(has(&e, "team-a", b"k3", "r") && has(&e, "team-a", b"k4", "r"));
    // Equal ages differing only in model, scheme, adapter or hash → the smaller is evicted,
    // whichever is ingested first.
    type P = (&'static str, &'static str, &'static str, &'static [u8]);
    let pairs: [(P, P); 4] = [
        (("m1", "vllm", "", b"p"), ("m2", "vllm", "", b"p")),
        (("m", "sglang", "", b"p"), ("m", "vllm", "", b"p")),
        (("m", "vllm", "a1", b"p"), ("m", "vllm", "a2", b"p")),
        (("m", "vllm", "", b"p1"), ("m", "vllm", "", b"p2")),
    ];
    for (small, big) in pairs {
        for order in [[small, big], [big, small]] {
            let e = env_seed(0, seed);
            e.set_quota("t", 1);
            for (m, s, a, k) in order {
                e.put_with(
                    &Put {
                        model: m,
                        scheme: s,
                        adapter: a,
                        ts: T0,
                        ..Put::default()
                    },
                    k,
                    16,
                );
            }
            let (m, s, a, k) = big;
            assert!(e.ix.entry("t", m, s, a, k, "r").is_some(), "{big:?} kept");
            let (m, s, a, k) = small;
            assert!(
                e.ix.entry("t", m, s, a, k, "r").is_none(),
                "{small:?} evicted"
            );
        }
    }
}

fn t74(seed: u64) {
    let e = env_seed(0, seed);
    e.set_quota("t", 1);
    e.put("r", b"cur", 16);
    e.put_with(
        &Put {
            ts: T0 - MIN_US,
            ..Put::default()
        },
        b"old",
        16,
    );
    assert!(has(&e, "t", b"cur", "r"));
    assert!(!has(&e, "t", b"old", "r"));
    assert_eq!(e.ix.tenant_evictions(), vec![(Arc::from("t"), 1)]);
}

fn t75(seed: u64) {
    let e = env_seed(1, seed);
    e.put("r", b"real", 16);
    e.clock.advance_us(MIN_US);
    e.put_with(
        &Put {
            tenant: PROBE_TENANT,
            ..Put::default()
        },
        b"probe",
        16,
    );
    assert!(has(&e, "t", b"real", "r"));
    assert_eq!(e.ix.storage_entries(), 1);
    assert_eq!(e.ix.reserved_storage_entries(), 1);
    assert_eq!(gauge(&e.ix, "m"), 1);
    let snap = e.ix.snapshot();
    assert_eq!(snap.total_prefixes, 1);
    assert!(snap.tenants.iter().all(|t| &*t.tenant_id != PROBE_TENANT));
    assert!(snap.replicas.iter().all(|r| &*r.tenant_id != PROBE_TENANT));
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"probe",
        ..LookupRequest::new(PROBE_TENANT, "m", "vllm")
    });
    assert_eq!(ids(&r.scores), vec!["r"]);
    // A real ingest at the cap evicts the real entry, never the probe.
    e.clock.advance_us(MIN_US);
    e.put("r", b"real2", 16);
    assert!(!has(&e, "t", b"real", "r"));
    assert!(has(&e, PROBE_TENANT, b"probe", "r"));
}

#[test]
fn t64_cap_lru() {
    t64(0);
}
#[test]
fn t65_cap_lfu() {
    t65(0);
}
#[test]
fn t66_cap_lru_vs_lfu() {
    t66(0);
}
#[test]
fn t67_cap_one_credits() {
    t67(0);
}
#[test]
fn t69_mixed_namespaces() {
    t69(0);
}
#[test]
fn t70_cap_metrics() {
    t70(0);
}
#[test]
fn t72_quota() {
    t72(0);
}
#[test]
fn t73_quota_zero_unbounded_ties() {
    for seed in 0..64 {
        t73(seed);
    }
}
#[test]
fn t74_quota_old_ingest() {
    t74(0);
}
#[test]
fn t75_probe_under_cap() {
    t75(0);
}

/// K4: an update with an empty hash_scheme still runs quota and cap enforcement (a lowered
/// budget trims the tenant); E7: events never do.
#[test]
fn k4_e7_enforcement_triggers() {
    let e = env_seed(0, 0);
    for k in [b"a", b"b", b"c"] {
        e.put("r", k, 16);
        e.clock.advance_us(MIN_US);
    }
    e.set_quota("t", 1);
    e.event(event_type::PREFIX_ADDED, "r", b"z", "");
    e.event(event_type::REPLICA_UPDATED, "r", b"", "");
    assert_eq!(e.ix.cache_state("t", "m").total_prefixes, 3, "E7");
    e.put_with(
        &Put {
            scheme: "",
            ..Put::default()
        },
        b"ignored",
        16,
    );
    assert_eq!(e.ix.cache_state("t", "m").total_prefixes, 1, "K4");
    assert!(has(&e, "t", b"c", "r"));
    let e = env_seed(1, 0);
    e.put("r", b"a", 16);
    e.put("s", b"a", 16); // cap counts storage entries: 2 > 1
    assert_eq!(e.ix.storage_entries(), 1);
    assert_eq!(e.ix.holders("t", "m", "vllm", "", b"a").len(), 1);
}

// ---------------------------------------------------------------- D6 quality and cost

/// V2 with chain runs: once the cap takes one entry of a chain ingest, the chain's other
/// unchanged entries (same replica, same `last_seen`: tied next in LRU order) go next, so chains
/// leave whole and their runs with them instead of lingering half-evicted for a whole lap of
/// the cap's walk. The cap is still met exactly, oldest chains first.
#[test]
fn cap_evicts_chains_whole_with_their_run_mates() {
    const CHAINS: u64 = 300;
    const LEN: u64 = 32;
    const CAP: i64 = 3_200; // 100 chains
    let e = env_seed(CAP, 11);
    let key = |c: u64, b: u64| (c << 32 | b).to_be_bytes();
    let counts = vec![16; LEN as usize];
    for c in 0..CHAINS {
        let keys: Vec<[u8; 8]> = (0..LEN).map(|b| key(c, b)).collect();
        let hashes: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let replica = format!("r{}", c % 4);
        e.chain_with(
            &Put {
                replica: &replica,
                ts: T0 + c as i64 * 1000,
                ..Put::default()
            },
            &hashes,
            &counts,
            b"",
            0,
        );
        assert!(e.ix.storage_entries() <= CAP, "chain {c}");
    }
    assert_eq!(e.ix.storage_entries(), CAP);
    let present = |c: u64| {
        let replica = format!("r{}", c % 4);
        (0..LEN)
            .filter(|&b| has(&e, "t", &key(c, b), &replica))
            .count() as u64
    };
    let held: Vec<u64> = (0..CHAINS).map(present).collect();
    let partial = held.iter().filter(|&&n| n > 0 && n < LEN).count();
    let whole_new = (CHAINS - 100..CHAINS)
        .filter(|&c| held[c as usize] == LEN)
        .count();
    println!("partial chains {partial}, whole among the newest 100: {whole_new}");
    assert!(partial <= 2, "chains left half-evicted: {partial}");
    // Exact LRU keeps all 100 and a random choice about a third; the sampled threshold keeps
    // 91–100 (median 98 over 100 processes: the placement seed moves the samples), so the bar
    // sits below that spread rather than at its edge.
    assert!(whole_new >= 85, "newest chains kept: {whole_new}");
    // What is left of the runs: the live chains' and at most the partial ones'.
    // A chain's run: its keys, a header, four hints and two holder entries (one spare).
    let runs = e.ix.memory_breakdown().runs;
    assert!(
        runs <= (100 + 2) * (LEN as i64 * 8 + 192),
        "runs hold {runs} bytes"
    );
}

/// T86 (D6), quality part: N = 100,000 distinct increasing times, cap 50,000, LRU. The cost part
/// (per-ingest cost at the cap vs below it) is a benchmark, not a test:
/// `cargo run --release -p inferencecache-bench --bin eviction` (results in bench/RESULTS.md).
#[test]
fn t86_lru_quality() {
    const N: u64 = 100_000;
    const CAP: i64 = 50_000;
    let e = env_seed(CAP, 7);
    for i in 0..N {
        e.put_with(
            &Put {
                ts: T0 + i as i64 * 1000,
                ..Put::default()
            },
            &i.to_be_bytes(),
            16,
        );
    }
    assert_eq!(e.ix.storage_entries(), CAP);
    let newest = (N / 2..N)
        .filter(|i| has(&e, "t", &i.to_be_bytes(), "r"))
        .count();
    let q = newest as f64 / CAP as f64;
    println!(
        "T86: {newest} of {CAP} survivors from the newest half ({:.2}%)",
        q * 100.0
    );
    assert!(q >= 0.95, "quality {q}");
    assert_eq!(
        e.ix.evictions(Algorithm::Lru, EvictionReason::Cap),
        N - CAP as u64
    );
}

#[test]
fn t87_lfu_quality() {
    t87_credited_survivors(11);
}

/// T87 under other sampler seeds: the recent-entries ring keeps the quality well above the bar
/// (without it, 1 seed in 10 fell to ~94.7%).
#[test]
fn t87_lfu_quality_across_seeds() {
    for seed in 1..=6 {
        t87_credited_survivors(seed);
    }
}

fn t87_credited_survivors(seed: u64) {
    const N: u64 = 100_000;
    const CAP: i64 = 50_000;
    let e = env_seed(CAP, seed);
    e.set_lfu("t");
    // An entry the cap took at its own ingest (count 0, allowed under LFU: `index.md`, V2) is
    // never credited; it counts against the bar like any credited entry lost.
    let mut taken_at_ingest = 0;
    for i in 0..N {
        let k = i.to_be_bytes();
        e.put_with(
            &Put {
                ts: T0 + i as i64 * 1000,
                ..Put::default()
            },
            &k,
            16,
        );
        if i.is_multiple_of(2) && !credit_if_stored(&e, "t", &k, 2) {
            taken_at_ingest += 1;
        }
    }
    assert_eq!(e.ix.storage_entries(), CAP);
    let credited = (0..N)
        .step_by(2)
        .filter(|i| has(&e, "t", &i.to_be_bytes(), "r"))
        .count();
    println!(
        "T87 (seed {seed}): {credited} credited entries of {CAP} survivors \
         ({taken_at_ingest} taken by their own ingest)"
    );
    assert!(
        credited >= 47_500,
        "seed {seed}: credited survivors {credited}"
    );
}

#[test]
fn t88_reserved_never_counted() {
    let e = env_seed(1000, 3);
    let mut real = 0u64;
    for i in 0..7000u64 {
        let probe = i % 7 < 5;
        let tenant = if probe { PROBE_TENANT } else { "t" };
        if !probe {
            real += 1;
        }
        e.put_with(
            &Put {
                tenant,
                ts: T0 + i as i64 * 1000,
                ..Put::default()
            },
            &i.to_be_bytes(),
            16,
        );
    }
    assert_eq!(real, 2000);
    assert_eq!(e.ix.storage_entries(), 1000);
    assert_eq!(e.ix.reserved_storage_entries(), 5000);
    for i in (0..7000u64).filter(|i| i % 7 < 5) {
        assert!(has(&e, PROBE_TENANT, &i.to_be_bytes(), "r"));
    }
}

/// Quota quality at scale (V5 "≥ 95% of survivors from the newest half" in the N/2 test), on
/// the approximate path, spread over several models and adapters, for several sampler seeds
/// (the sampled threshold makes the quality vary with the seed).
#[test]
fn v5_quota_quality_at_scale() {
    for seed in [5, 1, 9, 13] {
        v5_quota_quality(seed);
    }
}

fn v5_quota_quality(seed: u64) {
    const N: u64 = 20_000;
    let e = env_seed(0, seed);
    e.set_quota("t", (N / 2) as i64);
    for i in 0..N {
        e.put_with(
            &Put {
                model: ["m", "m2"][(i % 2) as usize],
                adapter: ["", "a"][(i / 2 % 2) as usize],
                ts: T0 + i as i64 * 1000,
                ..Put::default()
            },
            &i.to_be_bytes(),
            16,
        );
    }
    let total: i64 = ["m", "m2"]
        .iter()
        .map(|m| e.ix.cache_state("t", m).total_prefixes)
        .sum();
    assert_eq!(total, (N / 2) as i64);
    let newest = (N / 2..N)
        .filter(|i| {
            e.ix.entry(
                "t",
                ["m", "m2"][(i % 2) as usize],
                "vllm",
                ["", "a"][(i / 2 % 2) as usize],
                &i.to_be_bytes(),
                "r",
            )
            .is_some()
        })
        .count();
    println!(
        "V5 seed {seed}: {newest} of {} survivors from the newest half",
        N / 2
    );
    assert!(
        newest as f64 >= 0.95 * (N / 2) as f64,
        "seed {seed}: {newest}"
    );
    assert_eq!(e.ix.tenant_evictions(), vec![(Arc::from("t"), N / 2)]);
}

#[test]
fn t89_seeds() {
    for seed in 0..1000 {
        t64(seed);
        t65(seed);
        t66(seed);
        t67(seed);
        t69(seed);
        t70(seed);
        t72(seed);
        t73(seed);
        t74(seed);
        t75(seed);
    }
}

// T94 (PREFIX_EVICTED and CacheState on 1 M entries, each < 20 µs) is timed, so it lives in the
// eviction bench: `cargo run --release -p inferencecache-bench --bin eviction`.

// ---------------------------------------------------------------- concurrency

/// The TTL sweep racing lookups and ingest (4 writers, a sweeper, 2 readers); after quiescence
/// and a final sweep, the index equals the reference model fed the same ingests.
#[test]
fn sweep_concurrent_with_lookups_and_ingest() {
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        max_entries: 0,
        ..cfg_1h()
    });
    let stop = std::sync::atomic::AtomicBool::new(false);
    // (writer, key, ts_us): every third ingest is stale (20 min old), the others fresh.
    let plan = |w: u64, i: u64| {
        let key = (w << 32 | (i % 300)).to_be_bytes();
        let ts = if i.is_multiple_of(3) {
            T0 - 20 * MIN_US
        } else {
            T0
        };
        (key, ts)
    };
    std::thread::scope(|s| {
        for w in 0..4u64 {
            let e = &e;
            s.spawn(move || {
                for i in 0..2000u64 {
                    let (key, ts) = plan(w, i);
                    e.put_with(
                        &Put {
                            replica: ["r0", "r1"][(i % 2) as usize],
                            ts,
                            ..Put::default()
                        },
                        &key,
                        16,
                    );
                }
            });
        }
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                e.ix.sweep_now();
            }
        });
        for _ in 0..2 {
            s.spawn(|| {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (key, _) = plan(i % 4, i);
                    let r = e.exact(&key);
                    for sc in &r.scores {
                        assert_eq!(sc.matched_tokens, 16, "no torn entry");
                    }
                    i += 1;
                }
            });
        }
        // Let the writers finish, then stop the sweeper and readers.
        std::thread::sleep(std::time::Duration::from_millis(50));
        loop {
            if e.ix.ingest_blocks_total() >= 8000 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    e.ix.sweep_now();
    let mut md = model::Model::new(T0, 10 * 60_000, RankerConfig::default(), 8);
    for w in 0..4u64 {
        for i in 0..2000u64 {
            let (key, ts) = plan(w, i);
            md.ingest(
                ["r0", "r1"][(i % 2) as usize],
                "t",
                "m",
                "vllm",
                "",
                ts,
                &[model::MRef {
                    hash: key.to_vec(),
                    tokens: 16,
                    blocks: vec![],
                    counts: vec![],
                    tier: 0,
                    adapter: String::new(),
                }],
                None,
            );
        }
    }
    md.sweep();
    let n: usize = md.entries.values().map(|h| h.len()).sum();
    assert_eq!(e.ix.storage_entries() as usize, n);
    assert_eq!(e.ix.total_keys() as usize, md.entries.len());
    assert_eq!(gauge(&e.ix, "m") as usize, md.entries.len());
    for (k, h) in &md.entries {
        let got: Vec<String> =
            e.ix.holders(&k.0, &k.1, &k.2, &k.3, &k.4)
                .iter()
                .map(|s| s.to_string())
                .collect();
        assert_eq!(got, h.keys().cloned().collect::<Vec<_>>());
        for (r, en) in h {
            let v = e.ix.entry(&k.0, &k.1, &k.2, &k.3, &k.4, r).unwrap();
            assert_eq!(v.last_seen_us, en.last * 1000);
        }
    }
    for r in ["r0", "r1"] {
        assert_eq!(
            e.ix.serving_count("t", "m", "vllm", r),
            md.serving("t", "m", "vllm").get(r).copied().unwrap_or(0)
        );
    }
}

/// The cap enforced by many concurrent writers: the index ends exactly at the cap with
/// consistent counters.
#[test]
fn cap_with_concurrent_writers() {
    let e = env_seed(2_000, 1);
    std::thread::scope(|s| {
        for w in 0..4u64 {
            let e = &e;
            s.spawn(move || {
                for i in 0..3000u64 {
                    e.put_with(
                        &Put {
                            replica: ["r0", "r1", "r2"][(i % 3) as usize],
                            ..Put::default()
                        },
                        &(w << 32 | i).to_be_bytes(),
                        16,
                    );
                }
            });
        }
    });
    // Concurrent enforcement may leave a few over the cap transiently; the next ingest trims.
    e.put("r0", b"last", 16);
    assert_eq!(e.ix.storage_entries(), 2_000);
    assert_eq!(e.ix.total_keys(), 2_000);
    let serving: i64 = ["r0", "r1", "r2"]
        .iter()
        .map(|r| e.ix.serving_count("t", "m", "vllm", r))
        .sum();
    assert_eq!(serving, 2_000);
    assert_eq!(gauge(&e.ix, "m"), 2_000);
}

/// A hot entry credited from many threads at once (the shared-system-prompt case): every
/// credit is counted exactly, whether it landed in the base counter or a per-core stripe, and
/// the hot-key count follows the key's summed count through removals.
#[test]
fn lfu_hot_entry_credited_from_many_threads_is_exact() {
    let e = env_with(cfg_1h());
    e.set_lfu("t");
    e.put("r0", b"sys", 16);
    e.put("r1", b"sys", 16);
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"sys",
        ..LookupRequest::new("t", "m", "vllm")
    });
    assert_eq!(r.hits.len(), 2, "both holders captured");
    const THREADS: u32 = 4;
    const PER_THREAD: u32 = 20_000;
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                for _ in 0..PER_THREAD {
                    e.ix.credit_hits(&r.hits);
                }
            });
        }
    });
    for rep in ["r0", "r1"] {
        let v = e.ix.entry("t", "m", "vllm", "", b"sys", rep).unwrap();
        assert_eq!(v.access_count, THREADS * PER_THREAD, "{rep}");
    }
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 1);
    // Removing one holder leaves the key hot through the other; removing both clears it.
    const EVICT: i32 = event_type::PREFIX_EVICTED;
    e.event(EVICT, "r0", b"sys", "");
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 1);
    e.event(EVICT, "r1", b"sys", "");
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 0);
    // A re-ingested entry starts from zero (V3: LFU state is lost on delete).
    e.put("r0", b"sys", 16);
    let v = e.ix.entry("t", "m", "vllm", "", b"sys", "r0").unwrap();
    assert_eq!(v.access_count, 0);
}

/// At the cap, an ingest's own counter deltas are held back and its same-namespace victims
/// cancel against them (`Carry`). Across tenants, models and replicas — victims of the
/// ingesting namespace and of others, of the ingesting replica and of others, on the
/// approximate path — every derived counter must still equal a recount of the surviving
/// entries.
#[test]
fn cap_counters_match_a_recount_across_namespaces() {
    const TENANTS: [&str; 2] = ["t", "u"];
    const MODELS: [&str; 2] = ["m", "n"];
    const REPLICAS: [&str; 3] = ["r0", "r1", "r2"];
    const KEYS: u64 = 400;
    let e = env_seed(1_000, 3);
    let mut created = 0u64;
    for i in 0..6_000u64 {
        let p = Put {
            tenant: TENANTS[(i % 2) as usize],
            model: MODELS[(i / 2 % 2) as usize],
            replica: REPLICAS[(i / 4 % 3) as usize],
            ts: T0 + i as i64 * 1000,
            ..Put::default()
        };
        // Each run of 12 ingests puts one key in every (tenant, model, replica): keys have
        // several holders, and the last 100 runs revisit keys (updates, or re-creations of
        // evicted entries).
        created += e
            .put_with(&p, &(i / 12 % KEYS).to_be_bytes(), 16)
            .entries_added;
    }
    assert_eq!(e.ix.storage_entries(), 1_000);
    let (mut entries, mut keys_total) = (0i64, 0i64);
    for t in TENANTS {
        let mut tenant_keys = 0;
        for m in MODELS {
            let mut keys = 0i64;
            let mut serving = [0i64; 3];
            for k in 0..KEYS {
                let hs = e.ix.holders(t, m, "vllm", "", &k.to_be_bytes());
                keys += i64::from(!hs.is_empty());
                for h in &hs {
                    let r = REPLICAS
                        .iter()
                        .position(|r| **r == **h)
                        .expect("known replica");
                    serving[r] += 1;
                }
            }
            assert_eq!(
                e.ix.cache_state(t, m).total_prefixes,
                keys,
                "keys of {t}/{m}"
            );
            for (r, want) in REPLICAS.iter().zip(serving) {
                assert_eq!(e.ix.serving_count(t, m, "vllm", r), want, "{t}/{m}/{r}");
            }
            entries += serving.iter().sum::<i64>();
            tenant_keys += keys;
        }
        let row =
            e.ix.snapshot()
                .tenants
                .into_iter()
                .find(|r| &*r.tenant_id == t);
        assert_eq!(
            row.map_or(0, |r| r.index_entries),
            tenant_keys,
            "keys of {t}"
        );
        keys_total += tenant_keys;
    }
    assert_eq!(entries, 1_000);
    assert_eq!(e.ix.total_keys(), keys_total);
    assert_eq!(gauge(&e.ix, "m") + gauge(&e.ix, "n"), keys_total);
    assert_eq!(
        e.ix.evictions(Algorithm::Lru, EvictionReason::Cap),
        created - 1_000,
        "each entry created past the cap evicted exactly one"
    );
}
