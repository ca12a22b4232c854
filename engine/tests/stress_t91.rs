//! T91: concurrent writers (ingest, evict, sweep) and readers; no torn entry; exact after quiesce.

mod model;
use inferencecache_engine::*;
use model::{MRef, Model};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const T0: i64 = 1_700_000_000_000_000;
const TTL: i64 = 24 * 3_600_000;
const WRITERS: usize = 3;
const READERS: usize = 2;
const KEYS: u64 = 64;
const ROUNDS: u64 = 60;

fn key(k: u64) -> [u8; 8] {
    (0xABCD_0000 + k).to_be_bytes()
}
fn tokens(round: u64) -> i32 {
    (round as i32 + 1) * 16
}
fn tier_of(round: u64) -> i32 {
    (round % 3) as i32 + 1
}
fn ts_of(round: u64) -> i64 {
    T0 + round as i64 * 1000
}

#[test]
fn t91_concurrent_readers_writers() {
    let clock = Arc::new(ManualClock::new(T0 + 1_000_000_000));
    let ix = Arc::new(Index::new(
        IndexConfig {
            global_ttl_ms: TTL,
            max_entries: 0,
            ..IndexConfig::default()
        },
        Arc::new(DefaultResolvers),
        clock.clone(),
    ));
    let now_ms = (T0 + 1_000_000_000) / 1000;
    // Baseline: partitions exist, no entries. Shards are created by their first writer and
    // kept, and a key table splits into its segment directory when it first holds more than
    // 48 keys (kept too), so the baseline writes every key the test uses, all at once, then
    // removes them: the same shards and segments exist before and after.
    let baseline_keys = || {
        ["t", "old"]
            .into_iter()
            .flat_map(|t| (0..KEYS).chain([9999]).map(move |k| (t, key(k))))
    };
    for (t, k) in baseline_keys() {
        let none: &[Vec<u8>] = &[];
        ix.ingest(CacheStateUpdate {
            replica_id: "w0",
            model_id: "m",
            tenant_id: t,
            hash_scheme: "vllm",
            timestamp_us: 0,
            adapter_id: "",
            stats: None,
            prefixes: std::iter::once(PrefixRef {
                prefix_hash: &k,
                token_count: 1,
                block_hashes: none,
                block_token_counts: &[],
                tier: 0,
                adapter_id: "",
            }),
        });
    }
    for (t, k) in baseline_keys() {
        ix.apply_event(CacheEventInput {
            event_type: event_type::PREFIX_EVICTED,
            replica_id: "w0",
            model_id: "m",
            tenant_id: t,
            prefix_hash: &k,
            timestamp_us: 0,
            adapter_id: "",
        });
    }
    let empty_mem = ix.memory_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for rd in 0..READERS {
        let ix = ix.clone();
        let stop = stop.clone();
        readers.push(std::thread::spawn(move || {
            let mut checked = 0u64;
            let mut buf = RouteBuffer::new();
            let mut i = rd as u64;
            // On a loaded host a reader may first run after the writers are done: it then
            // checks one pass over the keys (what the writers left) before it stops.
            let mut passes_after_stop = 0;
            loop {
                if stop.load(Ordering::Relaxed) {
                    if checked > 0 || passes_after_stop >= KEYS {
                        break;
                    }
                    passes_after_stop += 1;
                }
                i = (i + 7) % KEYS;
                let k = key(i);
                let req = LookupRequest::<[u8; 8]> {
                    prefix_hash: &k,
                    ..LookupRequest::new("t", "m", "vllm")
                };
                ix.lookup_route_into(&req, &mut buf);
                for s in &buf.scores {
                    // The entry must be whole: tokens, tier and last_seen from the same round.
                    assert!(
                        s.matched_tokens > 0 && s.matched_tokens % 16 == 0,
                        "torn tokens {s:?}"
                    );
                    let round = (s.matched_tokens / 16 - 1) as u64;
                    assert_eq!(s.tier, tier_of(round), "torn tier {s:?}");
                    let f =
                        inferencecache_engine::rank::freshness(now_ms, ts_of(round) / 1000, TTL);
                    assert_eq!(s.estimated_cache_hit_prob, f, "torn last_seen {s:?}");
                    checked += 1;
                }
                // Chain lookups over the same keys: every run is made of whole entries.
                let ks: Vec<[u8; 8]> = (0..4).map(|j| key((i + j) % KEYS)).collect();
                let r = ix.lookup(&LookupRequest {
                    block_hashes: &ks,
                    block_token_counts: &[16, 16, 16, 16],
                    ..LookupRequest::new("t", "m", "vllm")
                });
                for s in &r {
                    assert!(s.matched_tokens % 16 == 0 && s.matched_tokens <= 64);
                }
            }
            checked
        }));
    }
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let ix = ix.clone();
        writers.push(std::thread::spawn(move || {
            let rep = format!("w{w}");
            let none: &[Vec<u8>] = &[];
            for round in 0..ROUNDS {
                for k in 0..KEYS {
                    let kb = key(k);
                    ix.ingest(CacheStateUpdate {
                        replica_id: &rep,
                        model_id: "m",
                        tenant_id: "t",
                        hash_scheme: "vllm",
                        timestamp_us: ts_of(round),
                        adapter_id: "",
                        stats: None,
                        prefixes: std::iter::once(PrefixRef {
                            prefix_hash: &kb,
                            token_count: tokens(round),
                            block_hashes: none,
                            block_token_counts: &[],
                            tier: tier_of(round),
                            adapter_id: "",
                        }),
                    });
                    // Stale entries for the sweeper.
                    ix.ingest(CacheStateUpdate {
                        replica_id: &rep,
                        model_id: "m",
                        tenant_id: "old",
                        hash_scheme: "vllm",
                        timestamp_us: 1,
                        adapter_id: "",
                        stats: None,
                        prefixes: std::iter::once(PrefixRef {
                            prefix_hash: &kb,
                            token_count: 1,
                            block_hashes: none,
                            block_token_counts: &[],
                            tier: 0,
                            adapter_id: "",
                        }),
                    });
                    if (round + k) % 5 == 0 {
                        ix.apply_event(CacheEventInput {
                            event_type: event_type::PREFIX_EVICTED,
                            replica_id: &rep,
                            model_id: "m",
                            tenant_id: "t",
                            prefix_hash: &kb,
                            timestamp_us: 0,
                            adapter_id: "",
                        });
                    }
                }
            }
        }));
    }
    let sweeper = {
        let ix = ix.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += ix.sweep_now().entries_removed;
            }
            n
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let checked: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    sweeper.join().unwrap();
    assert!(checked > 0);
    ix.sweep_now();

    // Replay each writer's operations into the model (writers touch disjoint replicas, so any
    // interleaving gives the same final state).
    let mut md = Model::new(T0 + 1_000_000_000, TTL, RankerConfig::default(), 8);
    for w in 0..WRITERS {
        let rep = format!("w{w}");
        for round in 0..ROUNDS {
            for k in 0..KEYS {
                let r = MRef {
                    hash: key(k).to_vec(),
                    tokens: tokens(round),
                    blocks: vec![],
                    counts: vec![],
                    tier: tier_of(round),
                    adapter: String::new(),
                };
                md.ingest(&rep, "t", "m", "vllm", "", ts_of(round), &[r], None);
                if (round + k) % 5 == 0 {
                    md.evict("t", "m", &rep, &key(k), "");
                }
            }
        }
    }
    assert_eq!(ix.total_keys(), md.entries.len() as i64);
    assert_eq!(
        ix.storage_entries(),
        md.entries.values().map(|h| h.len() as i64).sum::<i64>()
    );
    for (k, h) in &md.entries {
        for (r, e) in h {
            let v = ix.entry(&k.0, &k.1, &k.2, &k.3, &k.4, r).unwrap();
            assert_eq!(
                (v.token_count, v.last_seen_us, v.tier),
                (e.tokens, e.last * 1000, e.tier)
            );
        }
    }
    assert_eq!(ix.cache_state("old", "m").total_prefixes, 0);
    // Remove everything; memory returns to the empty baseline.
    for w in 0..WRITERS {
        for k in 0..KEYS {
            ix.apply_event(CacheEventInput {
                event_type: event_type::PREFIX_EVICTED,
                replica_id: &format!("w{w}"),
                model_id: "m",
                tenant_id: "t",
                prefix_hash: &key(k),
                timestamp_us: 0,
                adapter_id: "",
            });
        }
    }
    assert_eq!(ix.storage_entries(), 0);
    let mem = ix.memory_bytes();
    assert!(
        (mem as f64) <= empty_mem as f64 * 1.10,
        "memory {mem} vs empty {empty_mem}"
    );
}
