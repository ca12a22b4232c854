//! T90: random operation sequences against the engine and the reference model (tests/model).

mod model;
use inferencecache_engine::*;
use model::{MRef, Model};
use parking_lot::Mutex;
use proptest::prelude::{
    Just, ProptestConfig, TestCaseError, prop_assert_eq, prop_oneof, proptest,
};
use proptest::strategy::Strategy as _;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

const TENANTS: [&str; 3] = ["t", "u", PROBE_TENANT];
const MODELS: [&str; 2] = ["m", "n"];
const SCHEMES: [&str; 3] = ["vllm", "sglang", ""];
const ADAPTERS: [&str; 2] = ["", "a"];
const REPLICAS: [&str; 6] = ["r0", "r1", "r2", "r3", "r4", "r5"];
const HITS: [f32; 6] = [0.0, 0.05, 0.1, 0.5, 0.9, f32::NAN];
const PRESSURES: [f32; 5] = [0.0, 0.3, 0.9, 1.5, f32::INFINITY];
const T0: i64 = 1_700_000_000_000_000;
const GLOBAL_TTL: i64 = 10 * 60_000;

fn key(i: u8) -> Vec<u8> {
    match i {
        0..=3 => (0x1111u64 * (i as u64 + 1)).to_be_bytes().to_vec(),
        4 => b"x".to_vec(),
        5 => b"longer-key-5".to_vec(),
        // The chain-run ops' keys (`run_key`).
        8..=63 => (0x5151_0000u64 + i as u64).to_be_bytes().to_vec(),
        _ => Vec::new(),
    }
}

/// Block `i` of shared chain `b`: the first 4 blocks are common to the three chains.
fn run_key(b: u8, i: u8) -> u8 {
    if i < 4 { 8 + i } else { 12 + b * 12 + i }
}

/// A prefix of one of three chains that share their first 4 blocks (8-byte keys).
fn shared_chain_s() -> impl proptest::strategy::Strategy<Value = (Vec<u8>, Vec<i32>)> {
    (
        0u8..3,
        1u8..12,
        prop_oneof![3 => Just(16), 1 => Just(8), 1 => Just(0)],
    )
        .prop_map(|(b, len, c)| {
            (
                (0..len).map(|i| run_key(b, i)).collect(),
                vec![c; len as usize],
            )
        })
}

/// Ops on one namespace where replicas ingest prefixes of a few shared chains (so chain runs
/// form), then change single blocks inside them (re-ingest with another tier or time, evict),
/// while lookups walk the chains: every lookup must still equal the model's.
fn run_op_s() -> impl proptest::strategy::Strategy<Value = Op> {
    let any_key = 8u8..48;
    prop_oneof![
        8 => (0u8..3, ts_s(), shared_chain_s(), tier_s())
            .prop_map(|(r, ts, (ks, cs), tier)| Op::Ingest {
                r, t: 0, m: 0, s: 0, a: 0, ts,
                refs: vec![(RefSpec::Chain(ks, cs, None), tier, 0)],
                stats: None,
            }),
        3 => (0u8..3, ts_s(), any_key.clone(), tier_s(), 0i32..40)
            .prop_map(|(r, ts, k, tier, n)| Op::Ingest {
                r, t: 0, m: 0, s: 0, a: 0, ts,
                refs: vec![(RefSpec::Legacy(k, n), tier, 0)],
                stats: None,
            }),
        3 => (0u8..3, any_key.clone(), ts_s()).prop_map(|(r, k, ts)| Op::Evict { r, t: 0, m: 0, k, a: 0, ts }),
        1 => (0u8..3, proptest::collection::vec(any_key, 0..10), ts_s())
            .prop_map(|(r, ks, ts)| Op::EvictBatch { r, t: 0, m: 0, ks, a: 0, ts }),
        1 => (0u8..3).prop_map(|r| Op::Clear { r, t: 0, m: 0 }),
        10 => (shared_chain_s(), 0u8..3).prop_map(|((mut ks, cs), wrong)| {
            // Sometimes a request that leaves the chain after its shared blocks.
            if wrong == 0 && ks.len() > 5 {
                ks[5] = run_key((ks[4] - 16) / 12 + 1, 5);
            }
            Op::Lookup { t: 0, m: 0, s: 0, a: 0, k: ks[0], chain: Some((ks, cs)), ttft: 0 }
        }),
        2 => Just(Op::Sweep),
        2 => prop_oneof![(0i64..400_000), Just(GLOBAL_TTL)].prop_map(Op::Clock),
    ]
}

struct Res {
    lfu: HashSet<&'static str>,
    ttl: HashMap<&'static str, i64>,
    quota: HashMap<&'static str, i64>,
}
impl Resolvers for Res {
    fn ttl_ms(&self, t: &str) -> Option<i64> {
        self.ttl.get(t).copied()
    }
    fn algorithm(&self, t: &str) -> Algorithm {
        if self.lfu.contains(t) {
            Algorithm::Lfu
        } else {
            Algorithm::Lru
        }
    }
    fn quota(&self, t: &str) -> Option<i64> {
        self.quota.get(t).copied()
    }
}

#[derive(Debug, Clone)]
enum RefSpec {
    Legacy(u8, i32),
    Chain(Vec<u8>, Vec<i32>, Option<(u8, i32)>),
}

#[derive(Debug, Clone)]
enum Op {
    Ingest {
        r: u8,
        t: u8,
        m: u8,
        s: u8,
        a: u8,
        ts: i64,
        refs: Vec<(RefSpec, i32, u8)>,
        stats: Option<(u8, u8)>,
    },
    Evict {
        r: u8,
        t: u8,
        m: u8,
        k: u8,
        a: u8,
        ts: i64,
    },
    /// `Index::evict_prefixes` (batch E3); 8 or more keys take the shard-grouped path. Key 7
    /// stands for an empty key (skipped, D8).
    EvictBatch {
        r: u8,
        t: u8,
        m: u8,
        ks: Vec<u8>,
        a: u8,
        ts: i64,
    },
    Clear {
        r: u8,
        t: u8,
        m: u8,
    },
    Updated {
        r: u8,
        t: u8,
        m: u8,
        ts: i64,
    },
    Added {
        r: u8,
        t: u8,
        m: u8,
        k: u8,
    },
    Lookup {
        t: u8,
        m: u8,
        s: u8,
        a: u8,
        k: u8,
        chain: Option<(Vec<u8>, Vec<i32>)>,
        ttft: i32,
    },
    Credit,
    Sweep,
    Clock(i64),
}

/// Ops where up to six replicas report stats in random order (a replica's first report inserts
/// its record and moves the later ones) between lookups that score them on both paths: R2 must
/// read each scored replica's own record (`ModelRec::stats_for` starts at a remembered position).
fn stats_op_s() -> impl proptest::strategy::Strategy<Value = Op> {
    let chain = vec![0u8, 1, 2, 3, 4];
    let counts = vec![16; 5];
    let shared = vec![
        (RefSpec::Legacy(0, 64), 1, 0),
        (RefSpec::Chain(chain.clone(), counts.clone(), None), 1, 0),
    ];
    // Replicas that hold only another key keep R4's dp above 0 (with every serving replica
    // holding a key, every score is 0 whatever the pressure).
    let other = vec![(RefSpec::Legacy(1, 64), 1, 0)];
    prop_oneof![
        4 => (0u8..6, 0u8..5, prop_oneof![3 => Just(shared), 1 => Just(other)]).prop_map(
            |(r, p, refs)| Op::Ingest { r, t: 0, m: 0, s: 0, a: 0, ts: 0, refs, stats: Some((3, p)) },
        ),
        3 => Just(Op::Lookup { t: 0, m: 0, s: 0, a: 0, k: 0, chain: None, ttft: 0 }),
        3 => Just(Op::Lookup { t: 0, m: 0, s: 0, a: 0, k: 0, chain: Some((chain, counts)), ttft: 0 }),
        1 => (0i64..60_000).prop_map(Op::Clock),
    ]
}

fn tn() -> impl proptest::strategy::Strategy<Value = u8> {
    prop_oneof![6 => Just(0u8), 3 => Just(1u8), 1 => Just(2u8)]
}
fn mn() -> impl proptest::strategy::Strategy<Value = u8> {
    prop_oneof![5 => Just(0u8), 1 => Just(1u8)]
}
fn sn() -> impl proptest::strategy::Strategy<Value = u8> {
    prop_oneof![6 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8)]
}
fn an() -> impl proptest::strategy::Strategy<Value = u8> {
    prop_oneof![5 => Just(0u8), 1 => Just(1u8)]
}
fn ran() -> impl proptest::strategy::Strategy<Value = u8> {
    prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)]
}

fn tier_s() -> impl proptest::strategy::Strategy<Value = i32> {
    prop_oneof![Just(0), Just(1), Just(2), Just(3), Just(-1), Just(7)]
}

fn ref_s() -> impl proptest::strategy::Strategy<Value = (RefSpec, i32, u8)> {
    let legacy = (0u8..7, -2i32..100).prop_map(|(k, n)| RefSpec::Legacy(k, n));
    // Chains up to 8 blocks, mostly of 8-byte keys: long enough for chain runs (shared leading
    // stretches of at least 4 blocks, `runs::MIN_RUN`) to form and be stepped over.
    let chain = (
        proptest::collection::vec(prop_oneof![6 => 0u8..4, 1 => 4u8..6], 0..9),
        proptest::collection::vec(prop_oneof![Just(16), Just(0), Just(-4), Just(8)], 0..9),
        proptest::option::of((0u8..7, 0i32..200)),
    )
        .prop_map(|(mut ks, mut cs, full)| {
            // Mostly well-formed chains.
            if cs.len() != ks.len() && ks.len() % 2 == 0 {
                cs.resize(ks.len(), 16);
            }
            if ks.is_empty() && cs.is_empty() {
                ks.push(0);
                cs.push(16);
            }
            RefSpec::Chain(ks, cs, full)
        });
    (prop_oneof![legacy, chain], tier_s(), ran())
}

fn ts_s() -> impl proptest::strategy::Strategy<Value = i64> {
    prop_oneof![4 => Just(0i64), 1 => (-700_000i64..100_000).prop_map(|d| d * 1000 + 1)]
}

fn op_s() -> impl proptest::strategy::Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..3, tn(), mn(), sn(), an(), ts_s(), proptest::collection::vec(ref_s(), 0..3), proptest::option::of((0u8..6, 0u8..5)))
            .prop_map(|(r, t, m, s, a, ts, refs, stats)| Op::Ingest { r, t, m, s, a, ts, refs, stats }),
        2 => (0u8..3, tn(), mn(), 0u8..7, ran(), ts_s()).prop_map(|(r, t, m, k, a, ts)| Op::Evict { r, t, m, k, a, ts }),
        2 => (0u8..3, tn(), mn(), proptest::collection::vec(0u8..8, 0..12), ran(), ts_s())
            .prop_map(|(r, t, m, ks, a, ts)| Op::EvictBatch { r, t, m, ks, a, ts }),
        1 => (0u8..3, tn(), mn()).prop_map(|(r, t, m)| Op::Clear { r, t, m }),
        1 => (0u8..3, tn(), mn(), ts_s()).prop_map(|(r, t, m, ts)| Op::Updated { r, t, m, ts }),
        1 => (0u8..3, 0u8..3, 0u8..2, 0u8..7).prop_map(|(r, t, m, k)| Op::Added { r, t, m, k }),
        10 => (tn(), mn(), sn(), an(), 0u8..7,
               proptest::option::of((proptest::collection::vec(prop_oneof![6 => 0u8..4, 1 => 4u8..7], 0..10), proptest::collection::vec(prop_oneof![Just(16), Just(0), Just(-4), Just(8)], 0..10))),
               prop_oneof![Just(0), Just(50), Just(500)])
            .prop_map(|(t, m, s, a, k, chain, ttft)| {
                let chain = chain.map(|(ks, mut cs)| {
                    if cs.len() != ks.len() && ks.len() % 3 != 0 {
                        cs.resize(ks.len(), 16);
                    }
                    (ks, cs)
                });
                Op::Lookup { t, m, s, a, k, chain, ttft }
            }),
        3 => Just(Op::Credit),
        2 => Just(Op::Sweep),
        3 => prop_oneof![(0i64..400_000), Just(-120_000i64), Just(GLOBAL_TTL), Just(180_000i64)].prop_map(Op::Clock),
    ]
}

fn to_mref(spec: &(RefSpec, i32, u8)) -> MRef {
    let (rs, tier, a) = spec;
    let adapter = ["", "a", "b"][*a as usize].to_string();
    match rs {
        RefSpec::Legacy(k, n) => MRef {
            hash: key(*k),
            tokens: *n,
            blocks: vec![],
            counts: vec![],
            tier: *tier,
            adapter,
        },
        RefSpec::Chain(ks, cs, full) => MRef {
            hash: full.map_or(vec![], |f| key(f.0)),
            tokens: full.map_or(0, |f| f.1),
            blocks: ks.iter().map(|k| key(*k)).collect(),
            counts: cs.clone(),
            tier: *tier,
            adapter,
        },
    }
}

/// Eviction configuration of a run: global cap (0 = unbounded) and quotas of "t" and "u".
#[derive(Debug, Clone, Copy)]
struct Limits {
    cap: i64,
    quota_t: Option<i64>,
    quota_u: Option<i64>,
    seed: u64,
}

fn limits_s() -> impl proptest::strategy::Strategy<Value = Limits> {
    (
        prop_oneof![3 => Just(0i64), 1 => Just(1), 1 => Just(3), 1 => Just(6)],
        prop_oneof![3 => Just(None), 1 => Just(Some(0i64)), 1 => Just(Some(2)), 1 => Just(Some(-1))],
        prop_oneof![3 => Just(None), 1 => Just(Some(1i64)), 1 => Just(Some(3))],
        0u64..1000,
    )
        .prop_map(|(cap, quota_t, quota_u, seed)| Limits {
            cap,
            quota_t,
            quota_u,
            seed,
        })
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_with(
        Limits {
            cap: 0,
            quota_t: None,
            quota_u: None,
            seed: 0,
        },
        ops,
    )
}

fn run_with(lim: Limits, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let clock = Arc::new(ManualClock::new(T0));
    let mut quota = HashMap::new();
    if let Some(q) = lim.quota_t {
        quota.insert("t", q);
    }
    if let Some(q) = lim.quota_u {
        quota.insert("u", q);
    }
    let res = Arc::new(Res {
        lfu: ["u"].into(),
        ttl: [("u", 3 * 60_000)].into(),
        quota: quota.clone(),
    });
    let cfg = IndexConfig {
        global_ttl_ms: GLOBAL_TTL,
        max_entries: lim.cap,
        hot_access_threshold: 2,
        eviction_seed: lim.seed,
        ..IndexConfig::default()
    };
    let ix = Index::new(cfg.clone(), res.clone(), clock.clone());
    let mut md = Model::new(T0, GLOBAL_TTL, cfg.ranker.clone(), 2);
    md.lfu.insert("u".into());
    md.ttl.insert("u".into(), 3 * 60_000);
    md.cap = lim.cap;
    md.quota = quota.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let mut last_hits: model::Hits = (CapturedHits::default(), vec![]);
    let sink_events = Arc::new(Mutex::new(0usize));
    let _ = sink_events;
    for op in ops {
        match &op {
            Op::Ingest {
                r,
                t,
                m,
                s,
                a,
                ts,
                refs,
                stats,
            } => {
                let ts = if *ts == 0 { 0 } else { clock.now_us() + ts };
                let mrefs: Vec<MRef> = refs.iter().map(to_mref).collect();
                let st = stats.map(|(h, p)| ReplicaStatsInput {
                    cache_memory_bytes: 5,
                    hit_rate: HITS[h as usize],
                    pressure: PRESSURES[p as usize],
                    t2_hit_tokens: 1,
                    t2_query_tokens: 2,
                });
                ix.ingest(CacheStateUpdate {
                    replica_id: REPLICAS[*r as usize],
                    model_id: MODELS[*m as usize],
                    tenant_id: TENANTS[*t as usize],
                    hash_scheme: SCHEMES[*s as usize],
                    timestamp_us: ts,
                    adapter_id: ADAPTERS[*a as usize],
                    stats: st,
                    prefixes: mrefs.iter().map(|x| PrefixRef {
                        prefix_hash: &x.hash,
                        token_count: x.tokens,
                        block_hashes: &x.blocks,
                        block_token_counts: &x.counts,
                        tier: x.tier,
                        adapter_id: &x.adapter,
                    }),
                });
                md.ingest(
                    REPLICAS[*r as usize],
                    TENANTS[*t as usize],
                    MODELS[*m as usize],
                    SCHEMES[*s as usize],
                    ADAPTERS[*a as usize],
                    ts,
                    &mrefs,
                    st,
                );
            }
            Op::Evict { r, t, m, k, a, ts } => {
                let ad = ["", "a", "b"][*a as usize];
                ix.apply_event(CacheEventInput {
                    event_type: event_type::PREFIX_EVICTED,
                    replica_id: REPLICAS[*r as usize],
                    model_id: MODELS[*m as usize],
                    tenant_id: TENANTS[*t as usize],
                    prefix_hash: &key(*k),
                    timestamp_us: *ts,
                    adapter_id: ad,
                });
                md.evict(
                    TENANTS[*t as usize],
                    MODELS[*m as usize],
                    REPLICAS[*r as usize],
                    &key(*k),
                    ad,
                );
            }
            Op::EvictBatch { r, t, m, ks, a, ts } => {
                let ad = ["", "a", "b"][*a as usize];
                let keys: Vec<Vec<u8>> = ks
                    .iter()
                    .map(|&k| if k == 7 { Vec::new() } else { key(k) })
                    .collect();
                let removed = ix.evict_prefixes(
                    TENANTS[*t as usize],
                    MODELS[*m as usize],
                    REPLICAS[*r as usize],
                    ad,
                    &keys,
                    *ts,
                );
                let mut expected = 0;
                for k in keys.iter().filter(|k| !k.is_empty()) {
                    expected += md.evict(
                        TENANTS[*t as usize],
                        MODELS[*m as usize],
                        REPLICAS[*r as usize],
                        k,
                        ad,
                    );
                }
                assert_eq!(removed, expected as u64, "entries removed by the batch");
            }
            Op::Clear { r, t, m } => {
                ix.apply_event(CacheEventInput {
                    event_type: event_type::ALL_CLEARED,
                    replica_id: REPLICAS[*r as usize],
                    model_id: MODELS[*m as usize],
                    tenant_id: TENANTS[*t as usize],
                    prefix_hash: &[],
                    timestamp_us: 0,
                    adapter_id: "",
                });
                md.clear(
                    TENANTS[*t as usize],
                    MODELS[*m as usize],
                    REPLICAS[*r as usize],
                );
            }
            Op::Updated { r, t, m, ts } => {
                let ts = if *ts == 0 { 0 } else { clock.now_us() + ts };
                ix.apply_event(CacheEventInput {
                    event_type: event_type::REPLICA_UPDATED,
                    replica_id: REPLICAS[*r as usize],
                    model_id: MODELS[*m as usize],
                    tenant_id: TENANTS[*t as usize],
                    prefix_hash: &[],
                    timestamp_us: ts,
                    adapter_id: "",
                });
                md.replica_updated(
                    TENANTS[*t as usize],
                    MODELS[*m as usize],
                    REPLICAS[*r as usize],
                    ts,
                );
            }
            Op::Added { r, t, m, k } => {
                ix.apply_event(CacheEventInput {
                    event_type: event_type::PREFIX_ADDED,
                    replica_id: REPLICAS[*r as usize],
                    model_id: MODELS[*m as usize],
                    tenant_id: TENANTS[*t as usize],
                    prefix_hash: &key(*k),
                    timestamp_us: 0,
                    adapter_id: "",
                });
            }
            Op::Lookup {
                t,
                m,
                s,
                a,
                k,
                chain,
                ttft,
            } => {
                let partition = (
                    TENANTS[*t as usize],
                    MODELS[*m as usize],
                    SCHEMES[*s as usize],
                    ADAPTERS[*a as usize],
                );
                let hash = key(*k);
                let (blocks, counts): (Vec<Vec<u8>>, Vec<i32>) = match chain {
                    Some((ks, cs)) => (ks.iter().map(|k| key(*k)).collect(), cs.clone()),
                    None => (vec![], vec![]),
                };
                let req = model::lookup_request(partition, &hash, &blocks, &counts, *ttft);
                last_hits = model::check_lookup(&ix, &md, &req, &REPLICAS)
                    .map_err(|e| TestCaseError::fail(format!("{e} for {op:?}")))?;
            }
            Op::Credit => {
                ix.credit_hits(&last_hits.0);
                md.credit(&last_hits.1);
            }
            Op::Sweep => {
                let a = ix.sweep_now().entries_removed as usize;
                let b = md.sweep();
                prop_assert_eq!(a, b);
            }
            Op::Clock(d) => {
                clock.advance_us(d * 1000);
                md.now_us += d * 1000;
            }
        }
        check_state(&ix, &md)?;
    }
    Ok(())
}

fn check_state(ix: &Index, md: &Model) -> Result<(), TestCaseError> {
    model::check_state(ix, md, &TENANTS, &MODELS, &SCHEMES, &REPLICAS)
        .map_err(TestCaseError::fail)?;
    // On top of the shared checks: the reported stats per (tenant, model) and the snapshot.
    for t in TENANTS {
        if t == PROBE_TENANT {
            continue;
        }
        for m in MODELS {
            let cs = ix.cache_state(t, m);
            let want: Vec<(String, u32, u32)> = md
                .stats
                .iter()
                .filter(|(k, _)| k.0 == t && k.1 == m)
                .map(|(k, s)| (k.2.clone(), s.s.hit_rate.to_bits(), s.s.pressure.to_bits()))
                .collect();
            let got: Vec<(String, u32, u32)> = cs
                .replicas
                .iter()
                .map(|r| {
                    (
                        r.replica_id.to_string(),
                        r.hit_rate.to_bits(),
                        r.pressure.to_bits(),
                    )
                })
                .collect();
            prop_assert_eq!(got, want);
        }
    }
    let snap = ix.snapshot();
    let (rows, tenants, total, hot) = md.snapshot();
    let got_rows: Vec<_> = snap
        .replicas
        .iter()
        .map(|r| {
            (
                r.tenant_id.to_string(),
                r.replica_id.to_string(),
                r.prefix_count,
                r.last_event_at_us,
                if r.stats_reported {
                    Some((r.hit_rate, r.last_update_us))
                } else {
                    None
                },
            )
        })
        .collect();
    prop_assert_eq!(got_rows, rows);
    let got_t: Vec<_> = snap
        .tenants
        .iter()
        .map(|t| {
            (
                t.tenant_id.to_string(),
                t.index_entries,
                t.hit_rate,
                t.hit_rate_reported,
            )
        })
        .collect();
    prop_assert_eq!(got_t, tenants);
    prop_assert_eq!((snap.total_prefixes, snap.hot_prefixes), (total, hot));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]
    #[test]
    fn t90_oracle(ops in proptest::collection::vec(op_s(), 1..40)) {
        run(ops)?;
    }

    /// T90 on shared chains: chain runs form, blocks inside them change, lookups step over
    /// them (`runs`), and every answer must still be the model's.
    #[test]
    fn t90_oracle_chain_runs(ops in proptest::collection::vec(run_op_s(), 1..60)) {
        run(ops)?;
    }

    /// T90 while stats records move under the ranking's position hints.
    #[test]
    fn t90_oracle_stats_reports(ops in proptest::collection::vec(stats_op_s(), 1..40)) {
        run(ops)?;
    }

    /// T90 with cap and quota configurations (V2, V5: ≤ 16 live entries, so the engine must
    /// evict exactly in the ideal order).
    #[test]
    fn t90_oracle_cap_quota(lim in limits_s(), ops in proptest::collection::vec(op_s(), 1..40)) {
        run_with(lim, ops)?;
    }
}
