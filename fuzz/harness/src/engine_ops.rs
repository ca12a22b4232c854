//! `engine_ops`: bytes → (via `arbitrary`) a sequence of ingest / event / lookup / credit /
//! sweep / clock operations, applied to the engine and to the single-threaded reference model of
//! `engine/tests/model` (the one the T90 oracle test uses), compared after every step.
//!
//! The operation domain is the oracle's: a few tenants (one LFU with its own TTL, the reserved
//! one), models, schemes, adapters, replicas and keys (including the empty key), small chains and
//! an optional global cap and tenant quotas. Sizes stay within the bound where the engine must
//! evict in exactly the ideal order (V2, V5: ≤ 16 live entries), so the model's order is the
//! expected one.

#[path = "../../../engine/tests/model/mod.rs"]
mod model;

use arbitrary::{Arbitrary, Unstructured};
use inferencecache_engine::{
    Algorithm, CacheEventInput, CacheStateUpdate, CapturedHits, Clock, Index, IndexConfig,
    ManualClock, PROBE_TENANT, PrefixRef, ReplicaStatsInput, Resolvers, event_type,
};
use model::{MRef, Model};
use std::collections::HashMap;
use std::sync::Arc;

const TENANTS: [&str; 3] = ["t", "u", PROBE_TENANT];
const MODELS: [&str; 2] = ["m", "n"];
const SCHEMES: [&str; 3] = ["vllm", "sglang", ""];
const ADAPTERS: [&str; 2] = ["", "a"];
const REF_ADAPTERS: [&str; 3] = ["", "a", "b"];
const REPLICAS: [&str; 3] = ["r0", "r1", "r2"];
const HITS: [f32; 6] = [0.0, 0.05, 0.1, 0.5, 0.9, f32::NAN];
const PRESSURES: [f32; 5] = [0.0, 0.3, 0.9, 1.5, f32::INFINITY];
const TIERS: [i32; 6] = [0, 1, 2, 3, -1, 7];
const COUNTS: [i32; 4] = [16, 0, -4, 8];
const CLOCK_STEPS_MS: [i64; 8] = [1, 1_000, 60_000, 179_999, 180_000, 600_000, -120_000, 30];
const T0: i64 = 1_700_000_000_000_000;
const GLOBAL_TTL_MS: i64 = 10 * 60_000;
/// Operations per input; longer inputs are cut (the bugs of interest need few steps).
const MAX_OPS: usize = 48;

/// Keys 0–3 are 8-byte hashes, 4 and 5 short and long ones, 6 the empty key (never a key, D8).
fn key(i: u8) -> Vec<u8> {
    match i % 7 {
        i @ 0..=3 => (0x1111u64 * (u64::from(i) + 1)).to_be_bytes().to_vec(),
        4 => b"x".to_vec(),
        5 => b"longer-key-5".to_vec(),
        _ => Vec::new(),
    }
}

fn pick<T: Copy>(items: &[T], i: u8) -> T {
    items[usize::from(i) % items.len()]
}

/// A timestamp: mostly 0 ("now"), else an offset from now in (−700 s, +100 s].
#[derive(Debug, Clone, Copy, Arbitrary)]
struct Ts(u8, u32);

impl Ts {
    fn offset_us(self) -> i64 {
        if !self.0.is_multiple_of(5) {
            return 0;
        }
        (i64::from(self.1 % 800_000) - 700_000) * 1000 + 1
    }
}

#[derive(Debug, Clone, Arbitrary)]
struct RefIn {
    chain: bool,
    key: u8,
    tokens: u8,
    blocks: Vec<u8>,
    counts: Vec<u8>,
    full: Option<(u8, u8)>,
    tier: u8,
    adapter: u8,
}

impl RefIn {
    fn to_mref(&self) -> MRef {
        let adapter = pick(&REF_ADAPTERS, self.adapter).to_string();
        let tier = pick(&TIERS, self.tier);
        if !self.chain {
            return MRef {
                hash: key(self.key),
                tokens: i32::from(self.tokens % 102) - 2,
                blocks: vec![],
                counts: vec![],
                tier,
                adapter,
            };
        }
        // At most three blocks (the eviction-exactness bound of the module docs); the empty key
        // may appear and must drop the whole chain (K7).
        let blocks: Vec<Vec<u8>> = self.blocks.iter().take(3).map(|k| key(*k)).collect();
        let counts: Vec<i32> = self
            .counts
            .iter()
            .take(3)
            .map(|c| pick(&COUNTS, *c))
            .collect();
        MRef {
            hash: self.full.map_or(vec![], |f| key(f.0)),
            tokens: self.full.map_or(0, |f| i32::from(f.1)),
            blocks,
            counts,
            tier,
            adapter,
        }
    }
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Ingest {
        r: u8,
        t: u8,
        m: u8,
        s: u8,
        a: u8,
        ts: Ts,
        refs: Vec<RefIn>,
        stats: Option<(u8, u8)>,
    },
    Evict {
        r: u8,
        t: u8,
        m: u8,
        k: u8,
        a: u8,
        ts: Ts,
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
        ts: Ts,
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
        chain: Option<(Vec<u8>, Vec<u8>)>,
        ttft: u8,
    },
    Credit,
    Sweep,
    Clock(u8, u32),
}

/// A wire timestamp: 0 stays "now", an offset is taken from the clock.
fn stamp(clock: &ManualClock, ts: Ts) -> i64 {
    match ts.offset_us() {
        0 => 0,
        d => clock.now_us() + d,
    }
}

/// Global cap (0 = unbounded) and the quotas of tenants "t" and "u".
#[derive(Debug, Clone, Copy, Arbitrary)]
struct LimitsIn {
    cap: u8,
    quota_t: u8,
    quota_u: u8,
    seed: u16,
}

struct Res {
    quota: HashMap<&'static str, i64>,
}

impl Resolvers for Res {
    fn ttl_ms(&self, t: &str) -> Option<i64> {
        (t == "u").then_some(3 * 60_000)
    }
    fn algorithm(&self, t: &str) -> Algorithm {
        if t == "u" {
            Algorithm::Lfu
        } else {
            Algorithm::Lru
        }
    }
    fn quota(&self, t: &str) -> Option<i64> {
        self.quota.get(t).copied()
    }
}

/// Interprets `data` as limits plus operations and runs them against engine and model.
pub fn engine_ops(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(limits) = LimitsIn::arbitrary(&mut u) else {
        return;
    };
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    Harness::new(limits).run(&ops);
}

struct Harness {
    clock: Arc<ManualClock>,
    ix: Index,
    md: Model,
    last_hits: model::Hits,
}

impl Harness {
    fn new(lim: LimitsIn) -> Self {
        let cap = pick(&[0i64, 0, 0, 1, 3, 6], lim.cap);
        let quota_t = pick(
            &[None, None, None, Some(0i64), Some(2), Some(-1)],
            lim.quota_t,
        );
        let quota_u = pick(&[None, None, None, Some(1i64), Some(3)], lim.quota_u);
        let mut quota = HashMap::new();
        if let Some(q) = quota_t {
            quota.insert("t", q);
        }
        if let Some(q) = quota_u {
            quota.insert("u", q);
        }
        let clock = Arc::new(ManualClock::new(T0));
        let cfg = IndexConfig {
            global_ttl_ms: GLOBAL_TTL_MS,
            max_entries: cap,
            hot_access_threshold: 2,
            eviction_seed: u64::from(lim.seed),
            ..IndexConfig::default()
        };
        let ix = Index::new(
            cfg.clone(),
            Arc::new(Res {
                quota: quota.clone(),
            }),
            clock.clone(),
        );
        let mut md = Model::new(T0, GLOBAL_TTL_MS, cfg.ranker.clone(), 2);
        md.lfu.insert("u".into());
        md.ttl.insert("u".into(), 3 * 60_000);
        md.cap = cap;
        md.quota = quota.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        Self {
            clock,
            ix,
            md,
            last_hits: (CapturedHits::default(), vec![]),
        }
    }

    fn run(mut self, ops: &[Op]) {
        for op in ops {
            self.apply(op);
            self.check_state(op);
        }
    }

    fn apply(&mut self, op: &Op) {
        let clock = &*self.clock;
        let (ix, md) = (&self.ix, &mut self.md);
        match op {
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
                let ts = stamp(clock, *ts);
                let (r, t, m, s, a) = (
                    pick(&REPLICAS, *r),
                    pick(&TENANTS, *t),
                    pick(&MODELS, *m),
                    pick(&SCHEMES, *s),
                    pick(&ADAPTERS, *a),
                );
                // At most two refs per update (the eviction-exactness bound).
                let mrefs: Vec<MRef> = refs.iter().take(2).map(RefIn::to_mref).collect();
                let st = stats.map(|(h, p)| ReplicaStatsInput {
                    cache_memory_bytes: 5,
                    hit_rate: pick(&HITS, h),
                    pressure: pick(&PRESSURES, p),
                    t2_hit_tokens: 1,
                    t2_query_tokens: 2,
                });
                ix.ingest(CacheStateUpdate {
                    replica_id: r,
                    model_id: m,
                    tenant_id: t,
                    hash_scheme: s,
                    timestamp_us: ts,
                    adapter_id: a,
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
                md.ingest(r, t, m, s, a, ts, &mrefs, st);
            }
            Op::Evict { r, t, m, k, a, ts } => {
                let (r, t, m, a) = (
                    pick(&REPLICAS, *r),
                    pick(&TENANTS, *t),
                    pick(&MODELS, *m),
                    pick(&REF_ADAPTERS, *a),
                );
                let hash = key(*k);
                ix.apply_event(CacheEventInput {
                    event_type: event_type::PREFIX_EVICTED,
                    replica_id: r,
                    model_id: m,
                    tenant_id: t,
                    prefix_hash: &hash,
                    timestamp_us: ts.offset_us(),
                    adapter_id: a,
                });
                md.evict(t, m, r, &hash, a);
            }
            Op::Clear { r, t, m } => {
                let (r, t, m) = (pick(&REPLICAS, *r), pick(&TENANTS, *t), pick(&MODELS, *m));
                ix.apply_event(CacheEventInput {
                    event_type: event_type::ALL_CLEARED,
                    replica_id: r,
                    model_id: m,
                    tenant_id: t,
                    prefix_hash: &[],
                    timestamp_us: 0,
                    adapter_id: "",
                });
                md.clear(t, m, r);
            }
            Op::Updated { r, t, m, ts } => {
                let ts = stamp(clock, *ts);
                let (r, t, m) = (pick(&REPLICAS, *r), pick(&TENANTS, *t), pick(&MODELS, *m));
                ix.apply_event(CacheEventInput {
                    event_type: event_type::REPLICA_UPDATED,
                    replica_id: r,
                    model_id: m,
                    tenant_id: t,
                    prefix_hash: &[],
                    timestamp_us: ts,
                    adapter_id: "",
                });
                md.replica_updated(t, m, r, ts);
            }
            // E5: does nothing, so the model has nothing to apply.
            Op::Added { r, t, m, k } => {
                ix.apply_event(CacheEventInput {
                    event_type: event_type::PREFIX_ADDED,
                    replica_id: pick(&REPLICAS, *r),
                    model_id: pick(&MODELS, *m),
                    tenant_id: pick(&TENANTS, *t),
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
            } => self.lookup(*t, *m, *s, *a, *k, chain.as_ref(), *ttft),
            Op::Credit => {
                self.ix.credit_hits(&self.last_hits.0);
                self.md.credit(&self.last_hits.1);
            }
            Op::Sweep => {
                let got = self.ix.sweep_now().entries_removed;
                let want = self.md.sweep();
                assert_eq!(
                    got, want as u64,
                    "V1 sweep removed a different number of entries"
                );
            }
            Op::Clock(sel, ms) => {
                // Half fixed steps around the TTL boundaries, half any step below 400 s.
                let d = if sel % 2 == 0 {
                    pick(&CLOCK_STEPS_MS, sel / 2) * 1000
                } else {
                    i64::from(ms % 400_000) * 1000
                };
                self.clock.advance_us(d);
                self.md.now_us += d;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn lookup(
        &mut self,
        t: u8,
        m: u8,
        s: u8,
        a: u8,
        k: u8,
        chain: Option<&(Vec<u8>, Vec<u8>)>,
        ttft: u8,
    ) {
        let partition = (
            pick(&TENANTS, t),
            pick(&MODELS, m),
            pick(&SCHEMES, s),
            pick(&ADAPTERS, a),
        );
        let hash = key(k);
        let (blocks, counts): (Vec<Vec<u8>>, Vec<i32>) = match chain {
            Some((ks, cs)) => (
                ks.iter().take(5).map(|k| key(*k)).collect(),
                cs.iter().take(5).map(|c| pick(&COUNTS, *c)).collect(),
            ),
            None => (vec![], vec![]),
        };
        let ttft = pick(&[0, 50, 500], ttft);
        let req = model::lookup_request(partition, &hash, &blocks, &counts, ttft);
        self.last_hits = model::check_lookup(&self.ix, &self.md, &req, &REPLICAS)
            .unwrap_or_else(|e| panic!("{e} for {req:?}"));
    }

    /// The engine's observable state equals the model's (the shared subset of the oracle's
    /// checks: counters, holders, entries, aggregates, evictions).
    fn check_state(&self, op: &Op) {
        if let Err(e) =
            model::check_state(&self.ix, &self.md, &TENANTS, &MODELS, &SCHEMES, &REPLICAS)
        {
            panic!("{e} after {op:?}");
        }
    }
}
