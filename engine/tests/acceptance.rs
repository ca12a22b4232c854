//! Acceptance tests of index.md §11 that run at the engine level (no server, no cap/quota).

mod common;
use common::*;
use inferencecache_engine::rank::*;
use inferencecache_engine::*;
use std::sync::Arc;

const ADD: i32 = event_type::PREFIX_ADDED;
const EVICT: i32 = event_type::PREFIX_EVICTED;
const UPD: i32 = event_type::REPLICA_UPDATED;
const CLEAR: i32 = event_type::ALL_CLEARED;

fn gauge(ix: &Index, model: &str) -> i64 {
    ix.entry_counts_by_model()
        .iter()
        .find(|(m, _)| &**m == model)
        .map_or(0, |x| x.1)
}

// ---------------------------------------------------------------- Keys and ingest

#[test]
fn t01_exact_single() {
    let e = env();
    e.put("r", b"p", 128);
    let r = e.exact(b"p");
    assert_eq!(r.strategy, Strategy::PrefixMatch);
    assert_eq!(r.scores.len(), 1);
    let s = &r.scores[0];
    assert_eq!(
        (
            &*s.replica_id,
            s.matched_tokens,
            s.score,
            s.estimated_cache_hit_prob,
            s.tier
        ),
        ("r", 128, 128.0, 1.0, tier::T1)
    );
}

#[test]
fn t02_idempotent() {
    let e = env();
    let a = e.put("r", b"p", 128);
    assert_eq!((a.keys_added, a.entries_added), (1, 1));
    for _ in 0..2 {
        let o = e.put("r", b"p", 128);
        assert_eq!((o.keys_added, o.entries_added), (0, 0));
    }
    assert_eq!(e.ix.storage_entries(), 1);
    assert_eq!(gauge(&e.ix, "m"), 1);
}

#[test]
fn t03_scheme_partition() {
    let e = env();
    e.put("r", b"p", 16);
    e.put_with(
        &Put {
            replica: "s",
            scheme: "sglang",
            ..Put::default()
        },
        b"p",
        16,
    );
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"p",
        ..LookupRequest::new("t", "m", "sglang")
    });
    assert_eq!(ids(&r.scores), vec!["s"]);
}

#[test]
fn t04_tenant_partition() {
    let e = env();
    e.put_with(
        &Put {
            tenant: "tenant-a",
            ..Put::default()
        },
        b"p",
        16,
    );
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"p",
        ..LookupRequest::new("tenant-b", "m", "vllm")
    });
    assert!(r.scores.is_empty());
}

#[test]
fn t05_empty_scheme() {
    let e = env();
    let o = e.put_with(
        &Put {
            scheme: "",
            ..Put::default()
        },
        b"p",
        16,
    );
    assert_eq!(o.entries_added, 0);
    assert_eq!(e.ix.storage_entries(), 0);
    e.put("r", b"p", 16);
    let req = LookupRequest::<Vec<u8>> {
        prefix_hash: b"p",
        ..LookupRequest::new("t", "m", "")
    };
    assert!(e.ix.lookup(&req).is_empty());
    assert!(e.route(&req).scores.is_empty());
}

#[test]
fn t06_chain_length_mismatch() {
    let e = env();
    e.chain("r", &[b"b1", b"b2", b"b3"], &[16]);
    assert_eq!(e.ix.storage_entries(), 0);
}

#[test]
fn t07_one_sided_chain() {
    let e = env();
    e.chain_with(
        &Put {
            replica: "r",
            ..Put::default()
        },
        &[b"b1", b"b2"],
        &[],
        b"full",
        128,
    );
    e.chain_with(
        &Put {
            replica: "r",
            ..Put::default()
        },
        &[],
        &[16, 16],
        b"full",
        128,
    );
    assert_eq!(e.ix.storage_entries(), 0);
    assert_eq!(e.ix.total_keys(), 0);
}

#[test]
fn t08_chain_plus_coset() {
    let e = env();
    let o = e.chain_with(
        &Put {
            replica: "r",
            ..Put::default()
        },
        &[b"b1", b"b2", b"b3"],
        &f16(3),
        b"full",
        128,
    );
    assert_eq!(o.entries_added, 4);
    assert_eq!(e.ix.storage_entries(), 4);
    let r = e.chain_route(&[b"b1", b"b2", b"b3"], &f16(3));
    assert_eq!(r.scores[0].matched_tokens, 48);
    assert_eq!(e.exact(b"full").scores[0].matched_tokens, 128);
}

#[test]
fn t09_exact_on_chain_block() {
    let e = env();
    e.chain("r", &[b"a", b"b"], &f16(2));
    let r = e.exact(b"b");
    assert_eq!(r.scores[0].matched_tokens, 32);
    assert_eq!(r.scores[0].score, 32.0);
}

#[test]
fn t10_tiers() {
    let e = env();
    e.put("r", b"p0", 16);
    assert_eq!(e.exact(b"p0").scores[0].tier, tier::T1);
    e.put_with(
        &Put {
            tier: 2,
            ..Put::default()
        },
        b"p2",
        16,
    );
    assert_eq!(e.exact(b"p2").scores[0].tier, tier::T2);
    // A run over blocks T2 then T1 → T2.
    e.put_with(
        &Put {
            tier: 2,
            ..Put::default()
        },
        b"b1",
        16,
    );
    e.put_with(
        &Put {
            tier: 1,
            ..Put::default()
        },
        b"b2",
        16,
    );
    assert_eq!(
        e.chain_route(&[b"b1", b"b2"], &f16(2)).scores[0].tier,
        tier::T2
    );
    for bad in [-1, 99] {
        e.put_with(
            &Put {
                tier: bad,
                ..Put::default()
            },
            b"b2",
            16,
        );
        assert_eq!(
            e.chain_route(&[b"b1", b"b2"], &f16(2)).scores[0].tier,
            tier::UNSPECIFIED
        );
    }
    assert_eq!(coldest(0, 3), 0);
    assert_eq!(coldest(2, 0), 0);
    assert_eq!(coldest(0, 0), 0);
    assert_eq!(coldest(1, 3), 3);
}

#[test]
fn t11_adapter_fallback() {
    let e = env();
    let none: &[Vec<u8>] = &[];
    let refs = [
        PrefixRef {
            prefix_hash: b"x",
            token_count: 16,
            block_hashes: none,
            block_token_counts: &[],
            tier: 0,
            adapter_id: "",
        },
        PrefixRef {
            prefix_hash: b"y",
            token_count: 16,
            block_hashes: none,
            block_token_counts: &[],
            tier: 0,
            adapter_id: "o",
        },
    ];
    e.ix.ingest(CacheStateUpdate {
        replica_id: "r",
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: 0,
        prefixes: refs.iter().copied(),
        stats: None,
        adapter_id: "d",
    });
    let q = |k: &'static [u8], a: &'static str| {
        e.ix.lookup(&LookupRequest::<Vec<u8>> {
            prefix_hash: k,
            adapter_id: a,
            ..LookupRequest::new("t", "m", "vllm")
        })
        .len()
    };
    assert_eq!(q(b"x", "d"), 1);
    assert_eq!(q(b"y", "o"), 1);
    assert_eq!(q(b"y", "d"), 0);
    assert_eq!(q(b"x", ""), 0);
}

#[test]
fn t12_adapter_isolation() {
    let e = env();
    e.chain_with(
        &Put {
            replica: "r1",
            adapter: "sql-lora",
            ..Put::default()
        },
        &[b"b1", b"b2"],
        &f16(2),
        b"",
        0,
    );
    e.chain_with(
        &Put {
            replica: "r2",
            adapter: "chat-lora",
            ..Put::default()
        },
        &[b"b1", b"b2"],
        &f16(2),
        b"",
        0,
    );
    e.chain_with(
        &Put {
            replica: "r3",
            ..Put::default()
        },
        &[b"b1", b"b2"],
        &f16(2),
        b"",
        0,
    );
    let q = |a: &'static str| {
        ids(&e
            .route(&LookupRequest {
                block_hashes: &[b"b1", b"b2"],
                block_token_counts: &[16, 16],
                adapter_id: a,
                ..LookupRequest::new("t", "m", "vllm")
            })
            .scores)
    };
    assert_eq!(q("sql-lora"), vec!["r1"]);
    assert_eq!(q("chat-lora"), vec!["r2"]);
    assert_eq!(q(""), vec!["r3"]);
}

#[test]
fn t13_lfu_count_survives_reingest() {
    let e = env();
    e.set_lfu("t");
    e.put("r", b"p", 10);
    let r = e.exact(b"p");
    assert_eq!(r.hits.len(), 1);
    e.ix.credit_hits(&r.hits);
    e.put("r", b"p", 10);
    assert_eq!(
        e.ix.entry("t", "m", "vllm", "", b"p", "r")
            .unwrap()
            .access_count,
        1
    );
}

#[test]
fn t14_empty_prefix_hash() {
    let e = env();
    let none: &[Vec<u8>] = &[];
    let refs = [
        PrefixRef {
            prefix_hash: b"",
            token_count: 16,
            block_hashes: none,
            block_token_counts: &[],
            tier: 0,
            adapter_id: "",
        },
        PrefixRef {
            prefix_hash: b"q",
            token_count: 16,
            block_hashes: none,
            block_token_counts: &[],
            tier: 0,
            adapter_id: "",
        },
    ];
    e.ix.ingest(CacheStateUpdate {
        replica_id: "warm",
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: 0,
        prefixes: refs.iter().copied(),
        stats: None,
        adapter_id: "",
    });
    assert_eq!(e.ix.storage_entries(), 1);
    let r = e.exact(b"");
    assert!(r.scores.is_empty());
    assert_eq!(r.strategy, Strategy::None); // classifier: known scope, novel prefix
    e.stats("warm", 0.7, 0.0);
    let r = e.exact(b"");
    assert_eq!(r.strategy, Strategy::TenantHot);
    assert_eq!(ids(&r.scores), vec!["warm"]);
}

// ---------------------------------------------------------------- Events and stats

#[test]
fn t15_evict_and_clear() {
    let e = env();
    e.put("r1", b"p1", 16);
    e.put("r1", b"p2", 16);
    e.put("r2", b"p1", 16);
    e.event(EVICT, "r1", b"p1", "");
    assert_eq!(
        e.ix.holders("t", "m", "vllm", "", b"p1"),
        vec![Arc::from("r2")]
    );
    e.event(CLEAR, "r1", b"", "");
    assert!(e.ix.holders("t", "m", "vllm", "", b"p2").is_empty());
    assert_eq!(e.ix.storage_entries(), 1);
    assert_eq!(e.ix.cache_state("t", "m").total_prefixes, 1);
}

#[test]
fn t16_evict_adapter_scope() {
    let e = env();
    for a in ["sql-lora", "chat-lora"] {
        e.put_with(
            &Put {
                adapter: a,
                ..Put::default()
            },
            b"p",
            16,
        );
    }
    e.event(EVICT, "r", b"p", "sql-lora");
    assert!(e.ix.holders("t", "m", "vllm", "sql-lora", b"p").is_empty());
    assert_eq!(e.ix.holders("t", "m", "vllm", "chat-lora", b"p").len(), 1);
    e.put_with(
        &Put {
            adapter: "sql-lora",
            ..Put::default()
        },
        b"p",
        16,
    );
    e.event(EVICT, "r", b"p", "");
    assert_eq!(e.ix.storage_entries(), 0);
}

#[test]
fn t17_prefix_added_does_not_refresh() {
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        ..cfg_1h()
    });
    e.put("r", b"p", 16);
    e.put_with(
        &Put {
            scheme: "sglang",
            ..Put::default()
        },
        b"p",
        16,
    );
    e.clock.advance_us(9 * MIN_US);
    e.event(ADD, "r", b"p", "");
    e.clock.advance_us(2 * MIN_US);
    let s = e.ix.sweep_now();
    assert_eq!(s.entries_removed, 2);
    assert_eq!(e.ix.storage_entries(), 0);
}

#[test]
fn t18_liveness_vs_payload_clock() {
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        ..cfg_1h()
    });
    e.stats("r", 0.9, 0.9);
    for _ in 0..5 {
        e.clock.advance_us(4 * MIN_US);
        e.event(UPD, "r", b"", "");
        e.ix.sweep_now();
    }
    assert_eq!(e.ix.cache_state("t", "m").replicas.len(), 1);
    e.put("r", b"p", 50);
    let r = e.exact(b"p");
    assert_eq!(r.scores[0].score, 50.0);
    let r = e.exact(b"novel");
    assert_eq!(r.strategy, Strategy::None);
}

#[test]
fn t19_replica_updated_never_creates_stats() {
    let e = env();
    e.put("r", b"p", 16);
    e.event(UPD, "r", b"", "");
    assert!(e.ix.cache_state("t", "m").replicas.is_empty());
    assert!(e.ix.stats_clocks("t", "m", "r").is_none());
}

#[test]
fn t20_non_finite_stats() {
    let e = env();
    e.stats("a", f32::NAN, f32::INFINITY);
    e.stats("b", f32::NEG_INFINITY, 0.5);
    let cs = e.ix.cache_state("t", "m");
    assert_eq!(
        (cs.replicas[0].hit_rate, cs.replicas[0].pressure),
        (0.0, 0.0)
    );
    assert_eq!(
        (cs.replicas[1].hit_rate, cs.replicas[1].pressure),
        (0.0, 0.5)
    );
    let snap = e.ix.snapshot();
    let rows: Vec<serde_json::Value> = snap
        .replicas
        .iter()
        .map(|r| serde_json::json!({"replica": &*r.replica_id, "hitRate": r.hit_rate, "pressure": r.pressure}))
        .collect();
    let s = serde_json::to_string(&rows).unwrap();
    assert!(!s.contains("null"), "{s}");
}

#[test]
fn t21_update_replica_id_wins() {
    let e = env();
    e.stats("real", 0.5, 0.0);
    let cs = e.ix.cache_state("t", "m");
    assert_eq!(
        cs.replicas
            .iter()
            .map(|r| r.replica_id.to_string())
            .collect::<Vec<_>>(),
        vec!["real"]
    );
}

#[test]
fn t22_all_cleared_scoped_to_model() {
    let e = env();
    e.put_with(
        &Put {
            model: "m1",
            ..Put::default()
        },
        b"p",
        16,
    );
    e.put_with(
        &Put {
            model: "m2",
            ..Put::default()
        },
        b"p",
        16,
    );
    e.stats_with("t", "m1", "r", 0.5, 0.0, 0);
    e.stats_with("t", "m2", "r", 0.5, 0.0, 0);
    e.event_full(CLEAR, "t", "m1", "r", b"", "", 0);
    assert_eq!(e.ix.cache_state("t", "m1").total_prefixes, 0);
    assert!(e.ix.cache_state("t", "m1").replicas.is_empty());
    assert_eq!(e.ix.cache_state("t", "m2").total_prefixes, 1);
    assert_eq!(e.ix.cache_state("t", "m2").replicas.len(), 1);
}

// ---------------------------------------------------------------- Lookup and chain

#[test]
fn t23_longest_run_per_replica() {
    let e = env();
    e.chain("A", &[b"b1", b"b2", b"b3", b"x4", b"x5"], &f16(5));
    e.chain("B", &[b"b1", b"b2", b"y3", b"y4", b"y5"], &f16(5));
    let r = e.chain_route(&[b"b1", b"b2", b"b3", b"b4", b"b5"], &f16(5));
    assert_eq!(r.strategy, Strategy::PrefixMatch);
    assert_eq!(ids(&r.scores), vec!["A", "B"]);
    assert_eq!(
        (r.scores[0].matched_tokens, r.scores[1].matched_tokens),
        (48, 32)
    );
    assert_eq!((r.scores[0].score, r.scores[1].score), (48.0 * 0.5, 0.0));
}

#[test]
fn t24_full_hold() {
    let e = env();
    e.chain("r", &[b"a", b"b", b"c", b"d"], &f16(4));
    let r = e.chain_route(&[b"a", b"b", b"c", b"d"], &f16(4));
    assert_eq!((r.scores[0].matched_tokens, r.scores[0].score), (64, 64.0));
}

#[test]
fn t25_no_reentry() {
    let e = env();
    e.chain("r", &[b"q1", b"q2"], &f16(2));
    assert!(e.chain_route(&[b"z1", b"z2"], &f16(2)).scores.is_empty());
    e.put("h", b"a", 16);
    e.put("h", b"c", 16);
    let r = e.chain_route(&[b"a", b"b", b"c"], &f16(3));
    assert_eq!(r.scores.len(), 1);
    assert_eq!(
        (&*r.scores[0].replica_id, r.scores[0].matched_tokens),
        ("h", 16)
    );
    assert!(
        e.ix.lookup(&LookupRequest {
            block_hashes: &[b"x", b"a"],
            block_token_counts: &[16, 16],
            ..LookupRequest::new("t", "m", "vllm")
        })
        .is_empty()
    );
}

#[test]
fn t26_weakest_link() {
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        ..cfg_1h()
    });
    e.put("r", b"b1", 16);
    e.clock.advance_us(8 * MIN_US);
    e.chain("r", &[b"b2", b"b3"], &f16(2));
    let r = e.chain_route(&[b"b1", b"b2", b"b3"], &f16(3));
    let p = r.scores[0].estimated_cache_hit_prob;
    assert_eq!(p, (1.0 - 480_000f64 / 600_000f64) as f32);
    assert!((p - 0.2).abs() < 1e-6);
    assert_eq!(r.scores[0].matched_tokens, 48);
}

#[test]
fn t27_legacy_as_block0() {
    let e = env();
    e.put("r", b"p", 999);
    let r = e.chain_route(&[b"p", b"x", b"y"], &f16(3));
    assert_eq!(r.scores[0].matched_tokens, 16);
}

#[test]
fn t28_malformed_request_chain() {
    let e = env();
    e.put("r", b"p", 16);
    let req = LookupRequest {
        prefix_hash: b"p",
        block_hashes: &[b"p", b"x"],
        block_token_counts: &[16],
        ..LookupRequest::new("t", "m", "vllm")
    };
    assert!(e.ix.lookup(&req).is_empty());
    let r = e.route(&req);
    assert_eq!(r.strategy, Strategy::None);
    assert!(r.scores.is_empty());
}

#[test]
fn t29_zero_counts() {
    let e = env();
    e.chain("r", &[b"a", b"b"], &f16(2));
    assert!(
        e.ix.lookup(&LookupRequest {
            block_hashes: &[b"a", b"b"],
            block_token_counts: &[0, 0],
            ..LookupRequest::new("t", "m", "vllm")
        })
        .is_empty()
    );
}

#[test]
fn t30_zero_token_exact() {
    let e = env();
    e.put("r", b"p", 0);
    e.stats("r", 0.9, 0.0);
    let r = e.exact(b"p");
    assert_eq!(r.strategy, Strategy::PrefixMatch);
    assert_eq!(r.scores[0].score, 0.0);
}

// ---------------------------------------------------------------- Ranking

#[test]
fn t31_dp_exact() {
    let e = env();
    e.put("r1", b"p", 80);
    e.put("r2", b"p", 40);
    e.put("decoy", b"q", 16);
    let r = e.exact(b"p");
    let dp = (1.0 - 2.0f64 / 3.0) as f32;
    assert_eq!(ids(&r.scores), vec!["r1", "r2"]);
    assert_eq!(r.scores[0].score, 80.0 * dp);
    assert_eq!(r.scores[1].score, 40.0 * dp);
    assert!((r.scores[0].score - 80.0 / 3.0).abs() < 1e-4);
}

#[test]
fn t32_everybody_holds() {
    let e = env();
    for r in ["a", "b", "c"] {
        e.put(r, b"p", 16);
    }
    let r = e.exact(b"p");
    assert_eq!(r.scores.len(), 3);
    assert!(
        r.scores
            .iter()
            .all(|s| s.score == 0.0 && s.matched_tokens == 16)
    );
    assert_eq!(ids(&r.scores), vec!["a", "b", "c"]);
}

#[test]
fn t33_single_replica() {
    let e = env();
    e.put("r", b"p", 64);
    assert_eq!(e.exact(b"p").scores[0].score, 64.0);
    let hs: Vec<Vec<u8>> = (0..8u8).map(|i| vec![b'c', i]).collect();
    e.ix.ingest(CacheStateUpdate {
        replica_id: "r",
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: 0,
        adapter_id: "",
        stats: None,
        prefixes: std::iter::once(PrefixRef {
            prefix_hash: b"",
            token_count: 0,
            block_hashes: &hs,
            block_token_counts: &f16(8),
            tier: 0,
            adapter_id: "",
        }),
    });
    let r = e.route(&LookupRequest {
        block_hashes: &hs,
        block_token_counts: &f16(8),
        ..LookupRequest::new("t", "m", "vllm")
    });
    assert_eq!(r.scores[0].score, 128.0);
}

#[test]
fn t34_depth_groups() {
    let e = env();
    let c = [64, 64, 64, 64];
    e.chain("r0", &[b"a", b"b", b"c", b"d"], &c);
    e.chain("r1", &[b"a", b"b"], &c[..2]);
    e.chain("r2", &[b"a"], &c[..1]);
    let r = e.chain_route(&[b"a", b"b", b"c", b"d"], &c);
    assert_eq!(ids(&r.scores), vec!["r0", "r1", "r2"]);
    assert_eq!(r.scores[0].score, 256.0 * (1.0 - 1.0f64 / 3.0) as f32);
    assert_eq!(r.scores[1].score, 128.0 * (1.0 - 2.0f64 / 3.0) as f32);
    assert_eq!(r.scores[2].score, 0.0);
    assert!((r.scores[0].score - 170.67).abs() < 0.01 && (r.scores[1].score - 42.67).abs() < 0.01);
}

#[test]
fn t35_pressure() {
    let pf9 = pressure_factor(1.0, 0.9);
    assert!(prefix_score(50, 1.0, pf9, 0.0) < prefix_score(50, 1.0, 1.0, 0.0));
    assert!(
        prefix_score(100, 1.0, pf9, 0.0) < prefix_score(50, 1.0, pressure_factor(1.0, 0.0), 0.0)
    );
    assert!(
        prefix_score(100, 1.0, pressure_factor(0.0, 0.9), 0.0) > prefix_score(50, 1.0, 1.0, 0.0)
    );
    assert_eq!(pressure_factor(1.0, 1.5), 0.0);
    assert!(
        prefix_score(100, 1.0, pressure_factor(1.0, 1.5), 0.0) < prefix_score(1, 1.0, 1.0, 0.0)
    );
    assert_eq!(pressure_factor(1.0, -0.5), 1.0);
    // Through the index: exact score 100 × 0.1 (R9: 10).
    let e = env();
    e.put("busy", b"p", 100);
    e.stats("busy", 0.5, 0.9);
    assert_eq!(e.exact(b"p").scores[0].score, 100.0 * (1.0f32 - 0.9));
}

/// R2 reads each scored replica's own stats record while first reports keep inserting records
/// in front of the ones already read (ids arrive in descending order, so every earlier record
/// moves), on both lookup paths.
#[test]
fn t35_pressure_follows_each_replica_as_stats_records_move() {
    let e = env();
    // A key nobody else holds keeps R4's dp below 1 but equal for every holder.
    e.put("a-bystander", b"other", 16);
    let blocks: Vec<Vec<u8>> = (0..8u8).map(|i| vec![b'c', i]).collect();
    let chain: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
    let names: Vec<String> = (0..12).rev().map(|i| format!("pod-{i:02}")).collect();
    let pressure = |i: usize| (i as f32 * 0.37) % 0.9;
    for (i, name) in names.iter().enumerate() {
        e.put(name, b"p", 128);
        e.chain(name, &chain, &[16; 8]);
        e.stats(name, 0.5, pressure(i));
        let exact = e.exact(b"p");
        let walked = e.chain_route(&chain, &[16; 8]);
        for (r, tokens) in [(&exact, 128), (&walked, 128)] {
            assert_eq!(r.scores.len(), i + 1);
            let dp = distinguishing_power(i as i64 + 1, i as i64 + 2) as f32;
            for s in &r.scores {
                let j = names.iter().position(|n| **n == *s.replica_id).unwrap();
                let want = prefix_score(tokens, 1.0, pressure_factor(1.0, pressure(j)), 0.0) * dp;
                assert_eq!(s.score, want, "{} after {} reports", s.replica_id, i + 1);
            }
        }
    }
}

#[test]
fn t36_slo_bias() {
    let ranker = RankerConfig {
        slo_tight_ttft_ms: 100,
        slo_tight_bias: 5.0,
        ..RankerConfig::default()
    };
    let f_old = freshness(20 * 60_000, 0, HOUR_MS);
    let score = |cfg: &RankerConfig, ttft: i32| {
        let c = slo_c(cfg, ttft);
        (
            prefix_score(100, f_old, 1.0, c),
            prefix_score(50, 1.0, 1.0, c),
        )
    };
    for ttft in [0, 500] {
        let (big, small) = score(&ranker, ttft);
        assert!(big > small, "ttft {ttft}");
    }
    let (big, small) = score(&ranker, 50);
    assert!(small > big);
    let zero = RankerConfig {
        slo_tight_bias: 0.0,
        ..ranker.clone()
    };
    let (big, small) = score(&zero, 50);
    assert!(big > small);
    // R9: tight SLO, 100 tokens at fresh 0.6 → 96; 50 at 1.0 → 100.
    let c = slo_c(&RankerConfig::default(), 50);
    assert!((prefix_score(100, 0.6, 1.0, c) - 96.0).abs() < 1e-4);
    assert_eq!(prefix_score(50, 1.0, 1.0, c), 100.0);
    // Through the index: one replica (dp 1), 20 min old, tight SLO → ((100 × f) × 1) × (1 + 5f).
    let e = env_with(IndexConfig { ranker, ..cfg_1h() });
    e.put("big-old", b"old", 100);
    e.clock.advance_us(20 * MIN_US);
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"old",
        ttft_ms: 50,
        ..LookupRequest::new("t", "m", "vllm")
    });
    assert_eq!(r.scores[0].score, prefix_score(100, f_old, 1.0, 5.0));
    assert_eq!(
        r.scores[0].score,
        ((100.0 * f_old) * 1.0) * (1.0 + f_old * 5.0)
    );
}

#[test]
fn t37_stale_stats_pressure_ignored() {
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        ..cfg_1h()
    });
    e.stats("r", 0.5, 0.9);
    e.clock.advance_us(15 * MIN_US);
    e.put("r", b"p", 50);
    assert_eq!(e.exact(b"p").scores[0].score, 50.0);
}

#[test]
fn t38_hot_vs_cool_chain() {
    let e = env();
    e.chain("big", &[b"a", b"b", b"c"], &f16(3));
    e.chain("small", &[b"a", b"b"], &f16(2));
    e.put("decoy", b"zz", 16);
    e.stats("big", 0.5, 0.9);
    let r = e.chain_route(&[b"a", b"b", b"c"], &f16(3));
    assert_eq!(ids(&r.scores), vec!["small", "big"]);
    let big = (48.0f32 * 1.0 * (1.0f32 - 0.9)) * (1.0 - 1.0f64 / 3.0) as f32;
    let small = 32.0f32 * (1.0 - 2.0f64 / 3.0) as f32;
    assert_eq!((r.scores[0].score, r.scores[1].score), (small, big));
}

#[test]
fn t39_stale_unswept_counts_in_dp() {
    let e = env();
    e.put("r1", b"p", 100);
    e.clock.advance_us(61 * MIN_US);
    e.put("r2", b"p", 100);
    let r = e.exact(b"p");
    assert_eq!(ids(&r.scores), vec!["r2"]);
    assert_eq!(r.scores[0].score, 50.0);
    e.ix.sweep_now();
    assert_eq!(e.exact(b"p").scores[0].score, 100.0);
}

#[test]
fn t40_lora_denominator() {
    let e = env();
    e.put_with(
        &Put {
            replica: "r1",
            adapter: "lora",
            ..Put::default()
        },
        b"p",
        100,
    );
    e.put_with(
        &Put {
            replica: "r2",
            ..Put::default()
        },
        b"base",
        100,
    );
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"p",
        adapter_id: "lora",
        ..LookupRequest::new("t", "m", "vllm")
    });
    assert_eq!(ids(&r.scores), vec!["r1"]);
    assert_eq!(r.scores[0].score, 50.0);
}

#[test]
fn t41_dp_values() {
    assert_eq!(distinguishing_power(1, 1), 1.0);
    assert_eq!(distinguishing_power(0, 1), 1.0);
    assert_eq!(distinguishing_power(0, 0), 1.0);
    assert_eq!(distinguishing_power(3, 3), 0.0);
    assert_eq!(distinguishing_power(10, 10), 0.0);
    assert_eq!(distinguishing_power(1, 3), 1.0 - 1.0 / 3.0);
    assert_eq!(distinguishing_power(2, 3), 1.0 - 2.0 / 3.0);
    assert_eq!(distinguishing_power(5, 3), 0.0);
    assert_eq!(distinguishing_power(-1, 3), 1.0);
}

// ---------------------------------------------------------------- TENANT_HOT, diagnostics

#[test]
fn t42_tenant_hot() {
    let e = env();
    e.put("warm", b"other", 16);
    e.put("cold", b"other2", 16);
    e.stats("warm", 0.7, 0.1);
    e.stats("cold", 0.0, 0.0);
    let r = e.exact(b"p");
    assert_eq!(r.strategy, Strategy::TenantHot);
    assert_eq!(ids(&r.scores), vec!["warm"]);
    let s = &r.scores[0];
    assert_eq!(s.matched_tokens, 0);
    assert_eq!(s.estimated_cache_hit_prob, 0.7);
    assert_eq!(s.score, ((0.7f32 * 1.0) * (1.0f32 - 0.1)) * 1.0);
    assert_eq!(s.tier, tier::UNSPECIFIED);
    assert!(r.hits.is_empty());
    // R9: hit 0.8, stats 30 s old, pressure 0.1 → 0.648.
    let e = env();
    e.put("w", b"k", 16);
    e.stats("w", 0.8, 0.1);
    e.clock.advance_us(30_000_000);
    let s = e.exact(b"p").scores[0].score;
    assert!((s - 0.648).abs() < 1e-6, "{s}");
}

#[test]
fn t43_tenant_hot_gates() {
    let mk = |ranker: RankerConfig| {
        let e = env_with(IndexConfig { ranker, ..cfg_1h() });
        e.put("w", b"k", 16);
        e
    };
    let e = mk(RankerConfig {
        tenant_hot_min_hit_rate: 0.5,
        ..RankerConfig::default()
    });
    e.stats("w", 0.2, 0.0);
    assert_eq!(e.exact(b"p").strategy, Strategy::None);
    let e = mk(RankerConfig {
        tenant_hot_max_age_ms: 0,
        ..RankerConfig::default()
    });
    e.stats("w", 0.9, 0.0);
    assert_eq!(e.exact(b"p").strategy, Strategy::None);
    let e = mk(RankerConfig::default());
    e.stats("w", 0.9, 0.0);
    e.clock.advance_us(10 * MIN_US);
    assert_eq!(e.exact(b"p").strategy, Strategy::None);
}

#[test]
fn t44_tenant_hot_needs_scheme() {
    let e = env();
    e.put_with(
        &Put {
            replica: "w",
            scheme: "sglang",
            ..Put::default()
        },
        b"k",
        16,
    );
    e.stats("w", 0.9, 0.0);
    assert_eq!(e.exact(b"p").strategy, Strategy::UnknownHashScheme);
}

#[test]
fn t45_clock_back() {
    let e = env();
    e.put("w", b"k", 16);
    e.stats("w", 0.5, 0.0);
    e.clock.advance_us(-2 * MIN_US);
    let r = e.exact(b"p");
    assert_eq!(r.strategy, Strategy::TenantHot);
    assert!(r.scores[0].score <= 0.5);
}

#[test]
fn t46_swept_key_ends_tenant_hot() {
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        ranker: RankerConfig {
            tenant_hot_max_age_ms: HOUR_MS,
            ..RankerConfig::default()
        },
        ..cfg_1h()
    });
    e.put("w", b"k", 16);
    e.stats("w", 0.9, 0.0);
    e.clock.advance_us(15 * MIN_US);
    e.stats("w", 0.9, 0.0);
    e.ix.sweep_now();
    assert_eq!(e.ix.storage_entries(), 0);
    assert_eq!(e.exact(b"p").strategy, Strategy::None);
}

#[test]
fn t47_stats_only() {
    let e = env();
    e.stats_with("tenant-a", "model-a", "r", 0.9, 0.0, 0);
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"p",
        ..LookupRequest::new("tenant-b", "model-b", "vllm")
    });
    assert_eq!(r.strategy, Strategy::None);
}

#[test]
fn t48_classifier() {
    let e = env();
    e.put_with(
        &Put {
            tenant: "ic-smoke",
            model: "m1",
            ..Put::default()
        },
        b"k",
        16,
    );
    let c = |t: &str, m: &str, s: &str| {
        e.route(&LookupRequest::<Vec<u8>> {
            prefix_hash: b"novel",
            ..LookupRequest::new(t, m, s)
        })
        .strategy
    };
    assert_eq!(c("default", "m1", "vllm"), Strategy::UnknownTenant);
    assert_eq!(c("ic-smoke", "m2", "vllm"), Strategy::UnknownModel);
    assert_eq!(c("ic-smoke", "m1", "vllm-v1"), Strategy::UnknownHashScheme);
    assert_eq!(c("default", "m2", "vllm-v1"), Strategy::UnknownTenant);
    assert_eq!(c("ic-smoke", "m2", "vllm-v1"), Strategy::UnknownModel);
    assert_eq!(c("ic-smoke", "m1", "vllm"), Strategy::None);
}

#[test]
fn t49_empty_and_probe_only() {
    let e = env();
    assert_eq!(e.exact(b"p").strategy, Strategy::None);
    e.put_with(
        &Put {
            tenant: PROBE_TENANT,
            ..Put::default()
        },
        b"k",
        16,
    );
    assert_eq!(e.ix.storage_entries(), 0);
    assert_eq!(e.exact(b"p").strategy, Strategy::UnknownTenant);
}

#[test]
fn t50_empty_ids() {
    let e = env();
    e.put_with(
        &Put {
            tenant: "",
            ..Put::default()
        },
        b"p",
        16,
    );
    e.put_with(
        &Put {
            model: "",
            ..Put::default()
        },
        b"p",
        16,
    );
    for (t, m, s) in [("", "m", "vllm"), ("t", "", "vllm"), ("t", "m", "")] {
        let r = e.route(&LookupRequest::<Vec<u8>> {
            prefix_hash: b"p",
            ..LookupRequest::new(t, m, s)
        });
        assert_eq!(r.strategy, Strategy::None);
        assert!(r.scores.is_empty());
    }
    // The bare lookup does not check tenant/model emptiness (L1).
    assert_eq!(
        e.ix.lookup(&LookupRequest::<Vec<u8>> {
            prefix_hash: b"p",
            ..LookupRequest::new("", "m", "vllm")
        })
        .len(),
        1
    );
}

#[test]
fn t51_chain_miss_no_tenant_hot() {
    let e = env();
    e.put("w", b"k", 16);
    e.stats("w", 0.9, 0.0);
    assert_eq!(
        e.chain_route(&[b"x", b"y"], &f16(2)).strategy,
        Strategy::None
    );
    let r = e.route(&LookupRequest {
        block_hashes: &[b"x"],
        block_token_counts: &[16],
        ..LookupRequest::new("t", "m", "other")
    });
    assert_eq!(r.strategy, Strategy::UnknownHashScheme);
}

#[test]
fn t52_adapters_in_classifier() {
    let e = env();
    e.put_with(
        &Put {
            adapter: "known",
            ..Put::default()
        },
        b"k",
        16,
    );
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"k",
        adapter_id: "unseen",
        ..LookupRequest::new("t", "m", "vllm")
    });
    assert_eq!(r.strategy, Strategy::None);
    let r = e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: b"k",
        adapter_id: "known",
        ..LookupRequest::new("t", "m", "other")
    });
    assert_eq!(r.strategy, Strategy::UnknownHashScheme);
}

// ---------------------------------------------------------------- Affinity

fn chain_seed(hs: &[&[u8]]) -> Vec<u8> {
    let mut v = Vec::new();
    for h in hs {
        v.extend_from_slice(&(h.len() as u32).to_be_bytes());
        v.extend_from_slice(h);
    }
    v
}

#[test]
fn t53_affinity_golden() {
    let orders = [
        ["r-1", "r-2", "r-3"],
        ["r-3", "r-1", "r-2"],
        ["r-2", "r-3", "r-1"],
    ];
    for order in orders {
        let e = env();
        for r in order {
            e.put(r, format!("k-{r}").as_bytes(), 16);
        }
        for _ in 0..100 {
            assert_eq!(
                &*e.ix
                    .affinity_hint("t", "m", "vllm", b"any-fingerprint")
                    .unwrap(),
                "r-3"
            );
            assert_eq!(
                &*e.ix.affinity_hint("t", "m", "vllm", b"seed").unwrap(),
                "r-1"
            );
            let seed = chain_seed(&[b"b1", b"b2"]);
            assert_eq!(seed, [0, 0, 0, 2, 0x62, 0x31, 0, 0, 0, 2, 0x62, 0x32]);
            assert_eq!(
                &*e.ix.affinity_hint("t", "m", "vllm", &seed).unwrap(),
                "r-3"
            );
            let seed = chain_seed(&[b"prompt-block-1", b"prompt-block-2"]);
            assert_eq!(
                &*e.ix.affinity_hint("t", "m", "vllm", &seed).unwrap(),
                "r-1"
            );
        }
    }
    let e = env();
    for i in 1..=8 {
        e.put(&format!("r-{i}"), b"k", 16);
    }
    assert_eq!(
        &*e.ix
            .affinity_hint("t", "m", "vllm", b"prompt-fingerprint")
            .unwrap(),
        "r-2"
    );
}

#[test]
fn t54_affinity_edges() {
    let e = env();
    assert!(e.ix.affinity_hint("t", "m", "vllm", b"s").is_none());
    e.put("only", b"k", 16);
    assert!(e.ix.affinity_hint("t", "m", "vllm", b"").is_none());
    assert!(e.ix.affinity_hint("t", "m", "", b"s").is_none());
    assert_eq!(
        &*e.ix.affinity_hint("t", "m", "vllm", b"s").unwrap(),
        "only"
    );
    e.event(EVICT, "only", b"k", "");
    assert!(e.ix.affinity_hint("t", "m", "vllm", b"s").is_none());
    let e = env();
    for i in 0..8 {
        e.put(&format!("r{i}"), b"k", 16);
    }
    let mut counts = std::collections::HashMap::<String, u32>::new();
    let mut x: u64 = 12345;
    for _ in 0..1000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let r =
            e.ix.affinity_hint("t", "m", "vllm", &x.to_le_bytes())
                .unwrap();
        *counts.entry(r.to_string()).or_default() += 1;
    }
    assert_eq!(counts.len(), 8);
    assert!(
        counts.values().all(|&c| (80..=220).contains(&c)),
        "{counts:?}"
    );
}

#[test]
fn t55_affinity_per_scheme() {
    let e = env();
    e.put_with(
        &Put {
            replica: "r-vllm",
            ..Put::default()
        },
        b"k",
        16,
    );
    e.put_with(
        &Put {
            replica: "r-sglang",
            scheme: "sglang",
            ..Put::default()
        },
        b"k",
        16,
    );
    assert_eq!(
        &*e.ix.affinity_hint("t", "m", "vllm", b"s").unwrap(),
        "r-vllm"
    );
    assert_eq!(
        &*e.ix.affinity_hint("t", "m", "sglang", b"s").unwrap(),
        "r-sglang"
    );
    assert!(e.ix.affinity_hint("t", "m", "missing", b"s").is_none());
}

// ---------------------------------------------------------------- LFU crediting

#[test]
fn t68_lfu_crediting() {
    let e = env();
    e.set_lfu("t");
    e.chain("r", &[b"b1", b"b2", b"b3", b"x4"], &f16(4));
    for _ in 0..2 {
        let r = e.chain_route(&[b"b1", b"b2", b"b3", b"y4"], &f16(4));
        assert_eq!(r.hits.len(), 3);
        e.ix.credit_hits(&r.hits);
    }
    let ac = |k: &[u8]| {
        e.ix.entry("t", "m", "vllm", "", k, "r")
            .unwrap()
            .access_count
    };
    assert_eq!((ac(b"b1"), ac(b"b2"), ac(b"b3"), ac(b"x4")), (2, 2, 2, 0));
    // Bare lookups never credit; LookupRoute alone does not either.
    e.ix.lookup(&LookupRequest {
        block_hashes: &[b"b1"],
        block_token_counts: &[16],
        ..LookupRequest::new("t", "m", "vllm")
    });
    e.chain_route(&[b"b1"], &[16]);
    assert_eq!(ac(b"b1"), 2);
    // 50 threads × 200 credits.
    e.put("r", b"p", 16);
    let hits = e.exact(b"p").hits;
    std::thread::scope(|s| {
        for _ in 0..50 {
            s.spawn(|| {
                for _ in 0..200 {
                    e.ix.credit_hits(&hits);
                }
            });
        }
    });
    assert_eq!(ac(b"p"), 10_000);
    // LRU tenant: nothing captured.
    let e2 = env();
    e2.put("r", b"p", 16);
    let r = e2.exact(b"p");
    assert!(r.hits.is_empty());
    e2.ix.credit_hits(&r.hits);
    assert_eq!(
        e2.ix
            .entry("t", "m", "vllm", "", b"p", "r")
            .unwrap()
            .access_count,
        0
    );
}

#[test]
fn t68b_retain_prunes_hits() {
    let e = env();
    e.set_lfu("t");
    e.put("a", b"p", 64);
    e.put("b", b"p", 16);
    e.put("c", b"q", 16);
    let mut r = e.exact(b"p");
    assert_eq!(r.hits.len(), 2);
    r.retain_replicas(|s| s.matched_tokens >= 64);
    assert_eq!(ids(&r.scores), vec!["a"]);
    assert_eq!((r.hits.len(), r.hits.count_for("a")), (1, 1));
    e.ix.credit_hits(&r.hits);
    assert_eq!(
        e.ix.entry("t", "m", "vllm", "", b"p", "a")
            .unwrap()
            .access_count,
        1
    );
    assert_eq!(
        e.ix.entry("t", "m", "vllm", "", b"p", "b")
            .unwrap()
            .access_count,
        0
    );
}

// ---------------------------------------------------------------- TTL

#[test]
fn t70_ttl_sweep() {
    for age in [11, 10] {
        let e = env_with(IndexConfig {
            global_ttl_ms: 10 * 60_000,
            ..cfg_1h()
        });
        e.set_lfu("t");
        e.put("r", b"p", 16);
        e.clock.advance_us(age * MIN_US);
        e.ix.sweep_now();
        assert_eq!(e.ix.storage_entries(), 0);
        assert_eq!(gauge(&e.ix, "m"), 0);
        assert_eq!(e.ix.evictions(Algorithm::Lfu, EvictionReason::Ttl), 1);
        assert_eq!(e.ix.evictions(Algorithm::Lru, EvictionReason::Ttl), 0);
    }
    let e = env_with(IndexConfig {
        global_ttl_ms: 10 * 60_000,
        ..cfg_1h()
    });
    e.put("r", b"p", 16);
    e.clock.advance_us(9 * MIN_US + 59_000_000);
    e.ix.sweep_now();
    assert_eq!(e.ix.storage_entries(), 1);
}

#[test]
fn t71_tenant_ttl() {
    let e = env();
    e.set_ttl("short", 5 * 60_000);
    e.set_ttl("zero", 0);
    for t in ["short", "long", "zero"] {
        e.put_with(
            &Put {
                tenant: t,
                ..Put::default()
            },
            b"p",
            16,
        );
    }
    e.clock.advance_us(10 * MIN_US);
    e.ix.sweep_now();
    assert_eq!(e.ix.cache_state("short", "m").total_prefixes, 0);
    assert_eq!(e.ix.cache_state("long", "m").total_prefixes, 1);
    assert_eq!(e.ix.cache_state("zero", "m").total_prefixes, 1);
}

// ---------------------------------------------------------------- Aggregates

#[test]
fn t76_snapshot() {
    let e = env();
    e.put_with(
        &Put {
            tenant: "tenant-a",
            model: "m1",
            replica: "replica-a",
            ..Put::default()
        },
        b"p1",
        16,
    );
    e.put_with(
        &Put {
            tenant: "tenant-a",
            model: "m2",
            replica: "replica-a",
            ..Put::default()
        },
        b"p2",
        16,
    );
    e.stats_with("tenant-a", "m1", "replica-a", 0.8, 0.0, 0);
    e.put_with(
        &Put {
            tenant: "tenant-b",
            replica: "replica-b",
            ..Put::default()
        },
        b"p3",
        16,
    );
    e.stats_with("tenant-b", "m", "replica-b", 0.6, 0.0, 0);
    let s = e.ix.snapshot();
    assert_eq!((s.total_prefixes, s.hot_prefixes), (3, 0));
    assert_eq!(
        s.replicas
            .iter()
            .map(|r| r.prefix_count)
            .collect::<Vec<_>>(),
        vec![2, 1]
    );
    assert_eq!(s.tenants.len(), 2);
    assert_eq!(
        (
            &*s.tenants[0].tenant_id,
            s.tenants[0].index_entries,
            s.tenants[0].hit_rate as f32
        ),
        ("tenant-a", 2, 0.8)
    );
    assert_eq!(
        (
            &*s.tenants[1].tenant_id,
            s.tenants[1].index_entries,
            s.tenants[1].hit_rate as f32
        ),
        ("tenant-b", 1, 0.6)
    );
    assert!(
        s.tenants
            .iter()
            .all(|t| t.memory_used == 0 && t.hit_rate_reported)
    );
    assert_eq!(s.replicas[0].last_update_us, T0);
    assert_eq!(s.replicas[0].last_event_at_us, T0);
}

#[test]
fn t77_prefix_only_replica() {
    let e = env();
    e.put("r", b"a", 16);
    e.put("r", b"b", 16);
    let s = e.ix.snapshot();
    let row = &s.replicas[0];
    assert!(!row.stats_reported);
    assert_eq!(
        (
            row.hit_rate,
            row.cache_memory_bytes,
            row.prefix_count,
            row.last_update_us
        ),
        (0.0, 0, 2, 0)
    );
    assert!(!s.tenants[0].hit_rate_reported);
    assert_eq!(s.tenants[0].index_entries, 2);
}

#[test]
fn t78_sum_index_entries() {
    let e = env();
    let check = |e: &Env| {
        let s = e.ix.snapshot();
        assert_eq!(
            s.tenants.iter().map(|t| t.index_entries).sum::<i64>(),
            s.total_prefixes
        );
        s.total_prefixes
    };
    assert_eq!(check(&e), 0);
    e.put("a", b"k", 16);
    e.put("b", b"k", 16);
    assert_eq!(check(&e), 1);
    e.put_with(
        &Put {
            tenant: "",
            ..Put::default()
        },
        b"k",
        16,
    );
    assert_eq!(check(&e), 2);
    assert!(
        e.ix.snapshot()
            .tenants
            .iter()
            .any(|t| t.tenant_id.is_empty())
    );
}

#[test]
fn t79_cache_state() {
    let e = env();
    e.put("r", b"k", 16);
    e.ix.ingest(CacheStateUpdate {
        replica_id: "r",
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: 0,
        adapter_id: "",
        prefixes: std::iter::empty::<PrefixRef<'_, Vec<u8>>>(),
        stats: Some(ReplicaStatsInput {
            cache_memory_bytes: 1 << 30,
            hit_rate: 0.5,
            pressure: 0.2,
            t2_hit_tokens: 7,
            t2_query_tokens: 9,
        }),
    });
    let cs = e.ix.cache_state("t", "m");
    assert_eq!(
        (cs.total_prefixes, cs.hot_prefixes, cs.replicas.len()),
        (1, 0, 1)
    );
    let r = &cs.replicas[0];
    assert_eq!(
        (r.cache_memory_bytes, r.t2_hit_tokens, r.t2_query_tokens),
        (1 << 30, 7, 9)
    );
}

#[test]
fn t80_concurrent_ingest_defaults_ready() {
    let e = env();
    std::thread::scope(|s| {
        for i in 0..50 {
            let e = &e;
            s.spawn(move || {
                e.put(&format!("r{}", i % 5), format!("key-{i}").as_bytes(), 16);
            });
        }
    });
    assert_eq!(gauge(&e.ix, "m"), 50);
    let cfg = IndexConfig {
        global_ttl_ms: 0,
        sweep_interval_ms: 0,
        ..IndexConfig::default()
    };
    let ix = Arc::new(Index::new(
        cfg,
        Arc::new(DefaultResolvers),
        Arc::new(SystemClock),
    ));
    assert_eq!(ix.config().global_ttl_ms, DEFAULT_TTL_MS);
    assert_eq!(ix.config().sweep_interval_ms, DEFAULT_SWEEP_INTERVAL_MS);
    assert!(!ix.ready());
    ix.start();
    assert!(ix.ready());
    ix.stop();
    assert!(!ix.ready());
}

// ---------------------------------------------------------------- D4, D5, D7, D8

#[test]
fn t81_last_seen_monotonic() {
    let e = env();
    e.put_with(
        &Put {
            ts: T0 + 10 * MIN_US,
            ..Put::default()
        },
        b"p",
        64,
    );
    e.put_with(
        &Put {
            ts: T0 + 5 * MIN_US,
            tier: 2,
            ..Put::default()
        },
        b"p",
        32,
    );
    let v = e.ix.entry("t", "m", "vllm", "", b"p", "r").unwrap();
    assert_eq!(
        (v.last_seen_us, v.token_count, v.tier),
        (T0 + 10 * MIN_US, 32, tier::T2)
    );
}

#[test]
fn t82_stats_clocks_monotonic() {
    let e = env();
    e.stats_with("t", "m", "r", 0.5, 0.0, T0 + 10 * MIN_US);
    e.event_full(UPD, "t", "m", "r", b"", "", T0 + 5 * MIN_US);
    assert_eq!(
        e.ix.stats_clocks("t", "m", "r").unwrap().0,
        T0 + 10 * MIN_US
    );
    e.stats_with("t", "m", "r", 0.25, 0.0, T0 + 5 * MIN_US);
    assert_eq!(
        e.ix.stats_clocks("t", "m", "r").unwrap(),
        (T0 + 10 * MIN_US, T0 + 10 * MIN_US)
    );
    assert_eq!(e.ix.cache_state("t", "m").replicas[0].hit_rate, 0.25);
}

#[test]
fn t83_empty_hashes() {
    let e = env();
    e.chain("r", &[b"a", b"", b"c"], &f16(3));
    assert_eq!(e.ix.storage_entries(), 0);
    e.put("r", b"p", 16);
    e.event(EVICT, "r", b"", "");
    assert_eq!(e.ix.storage_entries(), 1);
}

#[test]
fn t84_hot_prefixes() {
    let e = env();
    e.set_lfu("t");
    e.put("r", b"p", 16);
    let hits = e.exact(b"p").hits;
    for _ in 0..7 {
        e.ix.credit_hits(&hits);
    }
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 0);
    e.ix.credit_hits(&hits);
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 1);
    // Two holders credited 4× each → hot; evicting one holder → not hot.
    e.put("a", b"q", 16);
    e.put("b", b"q", 16);
    let hits = e.exact(b"q").hits;
    assert_eq!(hits.len(), 2);
    for _ in 0..4 {
        e.ix.credit_hits(&hits);
    }
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 2);
    assert_eq!(e.ix.snapshot().hot_prefixes, 2);
    e.event(EVICT, "a", b"q", "");
    assert_eq!(e.ix.cache_state("t", "m").hot_prefixes, 1);
    // LRU → 0.
    let e2 = env();
    e2.put("r", b"p", 16);
    let h = e2.exact(b"p").hits;
    for _ in 0..10 {
        e2.ix.credit_hits(&h);
    }
    assert_eq!(e2.ix.cache_state("t", "m").hot_prefixes, 0);
}

#[test]
fn t85_change_notifications() {
    let e = env();
    let rec = Arc::new(Recorder::default());
    e.ix.set_change_sink(rec.clone());
    e.put("r", b"p", 16);
    assert_eq!(rec.take(), vec![ChangeKind::Added]);
    e.put("r", b"p", 16);
    assert!(rec.take().is_empty());
    e.put_with(
        &Put {
            scheme: "sglang",
            ..Put::default()
        },
        b"p",
        16,
    );
    rec.take();
    e.event(EVICT, "r", b"p", "");
    assert_eq!(rec.take(), vec![ChangeKind::Removed, ChangeKind::Removed]);
    e.put("r", b"p", 16);
    e.put("r", b"q", 16);
    rec.take();
    e.clock.advance_us(61 * MIN_US);
    e.ix.sweep_now();
    assert_eq!(rec.take(), vec![ChangeKind::Removed, ChangeKind::Removed]);
    e.put("r", b"p", 16);
    rec.take();
    e.event(CLEAR, "r", b"", "");
    assert_eq!(rec.take(), vec![ChangeKind::Cleared]);
    e.stats("r", 0.5, 0.0);
    assert_eq!(rec.take(), vec![ChangeKind::Stats]);
    e.event(UPD, "r", b"", "");
    assert_eq!(rec.take(), vec![ChangeKind::Stats]);
    e.event(UPD, "nostats", b"", "");
    e.event(ADD, "r", b"p", "");
    e.put_with(
        &Put {
            tenant: PROBE_TENANT,
            ..Put::default()
        },
        b"p",
        16,
    );
    assert!(rec.take().is_empty());
    // Event details: the REMOVED of an explicit eviction carries the event's timestamp.
    e.put_with(
        &Put {
            adapter: "ad",
            ..Put::default()
        },
        b"z",
        16,
    );
    e.event_full(EVICT, "t", "m", "r", b"z", "", 42);
    let ev = rec.events.lock().clone();
    assert_eq!(ev[0].0, ChangeKind::Added);
    assert_eq!(ev[0].5, e.now());
    assert_eq!(
        (ev[1].0, ev[1].3.clone(), ev[1].4.clone(), ev[1].5),
        (ChangeKind::Removed, b"z".to_vec(), "ad".to_string(), 42)
    );
}

#[test]
fn t92_credit_after_reuse() {
    let e = env();
    e.set_lfu("t");
    e.put("r", b"p", 16);
    let hits = e.exact(b"p").hits;
    e.event(EVICT, "r", b"p", "");
    e.put("r", b"p", 16);
    e.ix.credit_hits(&hits);
    assert_eq!(
        e.ix.entry("t", "m", "vllm", "", b"p", "r")
            .unwrap()
            .access_count,
        0
    );
}

#[test]
fn long_and_short_keys_coexist() {
    let e = env();
    let k8 = 0x0102_0304_0506_0708u64.to_be_bytes();
    e.put("a", &k8, 16);
    e.put("b", b"a-longer-key-with-more-bytes", 32);
    e.put("c", b"x", 48);
    assert_eq!(e.exact(&k8).scores[0].matched_tokens, 16);
    assert_eq!(
        e.exact(b"a-longer-key-with-more-bytes").scores[0].matched_tokens,
        32
    );
    assert_eq!(e.exact(b"x").scores[0].matched_tokens, 48);
    // Many keys: forces table growth and shrink.
    for i in 0..5000u64 {
        e.put("d", &i.to_be_bytes(), 16);
    }
    for i in 0..5000u64 {
        assert_eq!(
            e.exact(&i.to_be_bytes()).scores.len(),
            if i == 0x0102_0304_0506_0708 { 2 } else { 1 }
        );
    }
    for i in 0..5000u64 {
        e.event(EVICT, "d", &i.to_be_bytes(), "");
    }
    assert_eq!(e.ix.storage_entries(), 3);
}
