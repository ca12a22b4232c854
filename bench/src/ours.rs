//! InferenceCache on W1M (`benchmarks.md` §2.3): one partition (`t`, `m`, `vllm`, adapter `""`),
//! replicas `w0..w7`, cap unbounded, TTL 30 min, a fixed [`ManualClock`] equal to the ingest
//! timestamp, 8-byte big-endian `seq` keys, one chain-form ingest per event.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferencecache_engine::fingerprint::to_wire;
use inferencecache_engine::{
    CacheStateUpdate, DEFAULT_TTL_MS, DefaultResolvers, Index, IndexConfig, LookupRequest,
    ManualClock, MatchScratch, PrefixRef, RouteBuffer, Strategy, tier,
};

use crate::measure::{LookupStats, Plan, Recorder, Sums, bench_lookups, vm_rss_bytes};
use crate::w1m::{
    BLOCK_TOKENS, Chain, Kind, LEN, Queries, QuerySet, WORKERS, WireChain, Workload,
    expected_blocks, worker,
};

/// Tenant of the W1M partition.
pub const TENANT: &str = "t";
/// Model.
pub const MODEL: &str = "m";
/// Hash scheme.
pub const SCHEME: &str = "vllm";
/// Adapter.
pub const ADAPTER: &str = "";
/// The fixed clock and ingest timestamp (µs).
pub const T0_US: i64 = 1_700_000_000_000_000;
/// Replica ids.
pub const REPLICAS: [&str; WORKERS] = ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"];
/// Block token counts of every chain and query.
pub const COUNTS: [i32; LEN] = [BLOCK_TOKENS; LEN];

/// Row names.
pub const ROW_CORE: &str = "inferencecache core";
/// Full `lookup_route` row.
pub const ROW_ROUTE: &str = "inferencecache lookup_route";
/// `lookup_route_into` row.
pub const ROW_ROUTE_INTO: &str = "inferencecache lookup_route_into";
/// The core match timed in turns with the two routes (P6's denominator); [`ROW_CORE`] is the
/// core match timed alone, as every peer's lookup is (P1, P2, Q100).
pub const ROW_CORE_BESIDE: &str = "inferencecache core beside route";

/// The index configured for W1M: cap unbounded, TTL 30 min, clock fixed at [`T0_US`].
#[must_use]
pub fn new_index() -> Index {
    let cfg = IndexConfig {
        global_ttl_ms: DEFAULT_TTL_MS,
        max_entries: 0,
        ..IndexConfig::default()
    };
    Index::new(
        cfg,
        Arc::new(DefaultResolvers),
        Arc::new(ManualClock::new(T0_US)),
    )
}

/// Ingests one chain (one chain-form `CacheStateUpdate`).
#[inline]
pub fn ingest_chain(ix: &Index, c: usize, keys: &WireChain) {
    ingest_chain_as(ix, REPLICAS[worker(c)], keys, tier::T1, T0_US);
}

/// Ingests `keys` as one chain-form `CacheStateUpdate` (no co-set key, [`COUNTS`] tokens per
/// block) of `replica` into the W1M partition, at wire tier `tier` and `timestamp_us` (0 = now).
/// The other benches that store 64-block chains (`churn`, `eviction`) go through this too, so
/// every bench builds the update the same way.
#[inline]
pub fn ingest_chain_as(ix: &Index, replica: &str, keys: &WireChain, tier: i32, timestamp_us: i64) {
    let r = PrefixRef {
        prefix_hash: &[],
        token_count: 0,
        block_hashes: &keys[..],
        block_token_counts: &COUNTS[..],
        tier,
        adapter_id: ADAPTER,
    };
    ix.ingest(CacheStateUpdate {
        replica_id: replica,
        model_id: MODEL,
        tenant_id: TENANT,
        hash_scheme: SCHEME,
        timestamp_us,
        prefixes: std::iter::once(r),
        stats: None,
        adapter_id: ADAPTER,
    });
}

/// Inserts every event in chain order; returns the wall time.
pub fn insert(ix: &Index, events: &[WireChain]) -> Duration {
    let t = Instant::now();
    for (c, keys) in events.iter().enumerate() {
        ingest_chain(ix, c, keys);
    }
    t.elapsed()
}

/// Removes every chain by PREFIX_EVICTED semantics (E3, empty adapter) through the engine's batch
/// API `evict_prefixes`, tail to head, the key list built inside the timed loop (as the peers do).
pub fn remove(ix: &Index, seq: &[Chain]) -> Duration {
    let t = Instant::now();
    for (c, s) in seq.iter().enumerate() {
        let mut keys = [[0u8; 8]; LEN];
        for (k, v) in keys.iter_mut().zip(s.iter().rev()) {
            *k = to_wire(*v);
        }
        ix.evict_prefixes(TENANT, MODEL, REPLICAS[worker(c)], ADAPTER, &keys, T0_US);
    }
    t.elapsed()
}

/// A lookup request for one wire query.
#[inline]
#[must_use]
pub fn request(q: &WireChain) -> LookupRequest<'_, [u8; 8]> {
    LookupRequest {
        block_hashes: &q[..],
        block_token_counts: &COUNTS[..],
        ..LookupRequest::new(TENANT, MODEL, SCHEME)
    }
}

/// Expected core-match sums per query: (Σ blocks, Σ tokens, replicas).
#[must_use]
pub fn core_expected(kind: Kind) -> Sums {
    [
        kind.blocks_per_query(),
        kind.tokens_per_query(),
        kind.replicas_per_query(),
    ]
}

/// Expected full-route sums per query: (strategy right, Σ score in thousandths, scores).
#[must_use]
pub fn route_expected(kind: Kind) -> Sums {
    [
        1,
        (kind.score_sum_per_query() * 1000.0) as u64,
        kind.replicas_per_query(),
    ]
}

fn expected_strategy(kind: Kind) -> Strategy {
    match kind {
        Kind::Q0 => Strategy::None,
        _ => Strategy::PrefixMatch,
    }
}

fn milli(score: f32) -> u64 {
    (f64::from(score) * 1000.0).round() as u64
}

/// One core match (allocation-free once `scratch` has grown); returns its check sums.
#[inline]
pub fn core_op(
    ix: &Index,
    part: inferencecache_engine::PartitionHandle<'_>,
    q: &WireChain,
    scratch: &mut MatchScratch,
) -> Sums {
    let mut s = [0u64; 3];
    ix.match_chain_into(part, &q[..], &COUNTS[..], T0_US, scratch, |m| {
        s[0] += u64::from(m.blocks);
        s[1] += m.matched_tokens as u64;
        s[2] += 1;
    });
    s
}

/// One full `lookup_route`; returns its check sums.
#[inline]
pub fn route_op(ix: &Index, q: &WireChain, want: Strategy) -> Sums {
    let r = ix.lookup_route(&request(q));
    let mut s = [u64::from(r.strategy == want), 0, r.scores.len() as u64];
    for x in &r.scores {
        s[1] += milli(x.score);
    }
    s
}

/// One `lookup_route_into`; returns its check sums.
#[inline]
pub fn route_into_op(ix: &Index, q: &WireChain, want: Strategy, buf: &mut RouteBuffer) -> Sums {
    let st = ix.lookup_route_into(&request(q), buf);
    let mut s = [u64::from(st == want), 0, buf.scores.len() as u64];
    for x in &buf.scores {
        s[1] += milli(x.score);
    }
    s
}

/// Exact per-query verification (untimed): per-replica matched blocks/tokens of the core match
/// and the full LookupRoute result (strategy, order, scores, matched tokens) of §2.4.
pub fn verify(ix: &Index, set: &QuerySet, wire: &[WireChain]) -> Result<(), String> {
    let part = ix
        .partition(TENANT, MODEL, SCHEME, ADAPTER)
        .ok_or("W1M partition missing")?;
    let mut scratch = MatchScratch::default();
    let kind = set.kind;
    for (i, q) in wire.iter().enumerate() {
        let c = set.chain[i];
        let mut got = [0u32; WORKERS];
        let mut bad: Option<String> = None;
        ix.match_chain_into(part, &q[..], &COUNTS[..], T0_US, &mut scratch, |m| {
            let w = REPLICAS.iter().position(|r| *r == m.replica_id);
            match w {
                Some(w) if m.matched_tokens == m.blocks as i32 * BLOCK_TOKENS => got[w] = m.blocks,
                _ => bad = Some(format!("unexpected match {m:?}")),
            }
        });
        if let Some(b) = bad {
            return Err(format!("{}[{i}]: {b}", kind.label()));
        }
        for (w, g) in got.iter().enumerate() {
            let want = if kind == Kind::Q0 {
                0
            } else {
                expected_blocks(kind, c, w)
            };
            if *g != want {
                return Err(format!(
                    "{}[{i}] chain {c}: core match w{w} = {g} blocks, expected {want}",
                    kind.label()
                ));
            }
        }
        // Full LookupRoute.
        let r = ix.lookup_route(&request(q));
        let expect: Vec<(String, f32, i32)> = match kind {
            Kind::Q0 => Vec::new(),
            _ => {
                let owner = worker(c);
                let partner = owner ^ 1;
                let top = |w: usize| -> f32 {
                    if kind == Kind::Q100 && w == owner {
                        896.0
                    } else {
                        384.0
                    }
                };
                let mut v: Vec<(String, f32, i32)> = (0..WORKERS)
                    .map(|w| {
                        let blocks = expected_blocks(kind, c, w) as i32;
                        let score = if w == owner || w == partner {
                            top(w)
                        } else {
                            0.0
                        };
                        (REPLICAS[w].to_string(), score, blocks * BLOCK_TOKENS)
                    })
                    .collect();
                v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                v
            }
        };
        let got: Vec<(String, f32, i32)> = r
            .scores
            .iter()
            .map(|s| (s.replica_id.to_string(), s.score, s.matched_tokens))
            .collect();
        if r.strategy != expected_strategy(kind) || got != expect {
            return Err(format!(
                "{}[{i}] chain {c}: lookup_route = {:?} {got:?}, expected {:?} {expect:?}",
                kind.label(),
                r.strategy,
                expected_strategy(kind)
            ));
        }
        if kind != Kind::Q0 && r.scores.iter().any(|s| s.estimated_cache_hit_prob != 1.0) {
            return Err(format!("{}[{i}]: freshness != 1", kind.label()));
        }
    }
    Ok(())
}

/// Wire-form queries of the three sets (built before timing).
pub struct WireQueries {
    /// Per kind, in [`Kind::ALL`] order.
    pub sets: [Vec<WireChain>; 3],
}

impl WireQueries {
    /// Converts the content lists into the rolling hashes a gateway sends.
    #[must_use]
    pub fn new(q: &Queries) -> Self {
        Self {
            sets: [
                q.q50.wire_rolling(),
                q.q100.wire_rolling(),
                q.q0.wire_rolling(),
            ],
        }
    }

    /// The set of a kind.
    #[must_use]
    pub fn set(&self, kind: Kind) -> &[WireChain] {
        match kind {
            Kind::Q50 => &self.sets[0],
            Kind::Q100 => &self.sets[1],
            Kind::Q0 => &self.sets[2],
        }
    }
}

/// The core match of one set, timed alone (the method every peer's lookup gets).
pub fn bench_core(
    ix: &Index,
    kind: Kind,
    wire: &[WireChain],
    plan: Plan,
) -> Result<LookupStats, String> {
    let part = ix
        .partition(TENANT, MODEL, SCHEME, ADAPTER)
        .ok_or("W1M partition missing")?;
    let mut scratch = MatchScratch::default();
    let label = format!("{ROW_CORE} {}", kind.label());
    let mut stats = bench_lookups(
        &[label.as_str()],
        wire.len(),
        plan,
        &[core_expected(kind)],
        |_, i| core_op(ix, part, &wire[i], &mut scratch),
    )?;
    Ok(stats.remove(0))
}

/// The three lookups of one set, taking turns over the same queries (`bench_lookups`): the
/// core match, `lookup_route` and `lookup_route_into`, in that order (P6 compares the first
/// two).
pub fn bench_set(
    ix: &Index,
    kind: Kind,
    wire: &[WireChain],
    plan: Plan,
) -> Result<[LookupStats; 3], String> {
    let part = ix
        .partition(TENANT, MODEL, SCHEME, ADAPTER)
        .ok_or("W1M partition missing")?;
    let want = expected_strategy(kind);
    let mut scratch = MatchScratch::default();
    let mut buf = RouteBuffer::new();
    let labels =
        [ROW_CORE_BESIDE, ROW_ROUTE, ROW_ROUTE_INTO].map(|row| format!("{row} {}", kind.label()));
    let stats = bench_lookups(
        &labels.each_ref().map(String::as_str),
        wire.len(),
        plan,
        &[
            core_expected(kind),
            route_expected(kind),
            route_expected(kind),
        ],
        |variant, i| match variant {
            0 => core_op(ix, part, &wire[i], &mut scratch),
            1 => route_op(ix, &wire[i], want),
            _ => route_into_op(ix, &wire[i], want, &mut buf),
        },
    )?;
    stats
        .try_into()
        .map_err(|_| "three variants, three results".to_string())
}

/// The whole InferenceCache W1M run: insert, memory, verification, core / full lookups, P6
/// ratios, remove (index empty afterwards). Every check failure is an `Err`.
pub fn run(w: &Workload, q: &Queries, plan: Plan, rec: &mut Recorder) -> Result<(), String> {
    let events = w.wire_events();
    let wq = WireQueries::new(q);
    let entries = w.entries();

    let ix = new_index();
    let rss0 = vm_rss_bytes();
    let el = insert(&ix, &events);
    let rss1 = vm_rss_bytes();
    black_box(&ix);
    let stored = ix.storage_entries();
    if stored != entries as i64 {
        return Err(format!(
            "after insert storage_entries() = {stored}, expected {entries}"
        ));
    }
    rec.put_write(ROW_CORE, "insert", entries, el);
    if std::env::var_os("W1M_BREAKDOWN").is_some() {
        eprintln!("memory after insert: {:?}", ix.memory_breakdown());
    }
    let rss_delta = rss1.saturating_sub(rss0) as f64;
    let mem = ix.memory_bytes() as f64;
    rec.put(ROW_CORE, "rss_b_entry", rss_delta / entries as f64, "B");
    rec.put(ROW_CORE, "rss_delta_mib", rss_delta / 1_048_576.0, "MiB");
    rec.put(ROW_CORE, "mem_b_entry", mem / entries as f64, "B");
    rec.put(ROW_CORE, "mem_mib", mem / 1_048_576.0, "MiB");
    if rss_delta > 0.0 {
        rec.put(ROW_CORE, "mem_over_rss", mem / rss_delta, "x");
    }

    for kind in Kind::ALL {
        verify(&ix, q.set(kind), wq.set(kind))?;
    }

    for kind in Kind::ALL {
        let core = bench_core(&ix, kind, wq.set(kind), plan)?;
        rec.put_lookup(ROW_CORE, kind.label(), &core);
    }
    for kind in Kind::ALL {
        let [core, route, into] = bench_set(&ix, kind, wq.set(kind), plan)?;
        rec.put_lookup(ROW_CORE_BESIDE, kind.label(), &core);
        rec.put_lookup(ROW_ROUTE, kind.label(), &route);
        rec.put_lookup(ROW_ROUTE_INTO, kind.label(), &into);
    }
    // P6: full / core timed beside it, mean and p99, Q50 and Q100.
    for set in ["q50", "q100"] {
        for stat in ["mean", "p99"] {
            let core = rec.get(ROW_CORE_BESIDE, &format!("{set}_{stat}"));
            let full = rec.get(ROW_ROUTE, &format!("{set}_{stat}"));
            if let (Some(c), Some(f)) = (core, full) {
                rec.put(ROW_ROUTE, &format!("p6_{set}_{stat}_ratio"), f / c, "x");
            }
        }
    }

    let el = remove(&ix, &w.seq);
    let left = ix.storage_entries();
    if left != 0 {
        return Err(format!(
            "after remove storage_entries() = {left}, expected 0"
        ));
    }
    rec.put_write(ROW_CORE, "remove", w.chains * LEN, el);
    Ok(())
}
