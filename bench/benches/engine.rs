//! Criterion micro-benchmarks of the engine's operations, grouped so a regression shows at a
//! glance: `ingest`, `chain_lookup` (core match and full route, by depth and replica count),
//! `exact_lookup`, `tenant_hot`, `route_stats`, `events`, `credit`.
//! Run: `cargo bench -p inferencecache-bench --bench engine`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use inferencecache_bench::fixed_policy::FixedPolicy;
use inferencecache_engine::{
    CacheEventInput, CacheStateUpdate, Clock, Index, IndexConfig, LookupRequest, ManualClock,
    MatchScratch, PrefixRef, ReplicaStatsInput, RouteBuffer, Strategy, event_type,
};
use std::hint::black_box;
use std::sync::Arc;

const T0_US: i64 = 1_767_225_600_000_000;

fn index(lfu: bool) -> (Index, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0_US));
    let config = IndexConfig {
        max_entries: 0,
        ..Default::default()
    };
    let clock_dyn: Arc<dyn Clock> = clock.clone();
    (
        Index::new(config, Arc::new(FixedPolicy::lru_or_lfu(lfu)), clock_dyn),
        clock,
    )
}

/// Distinct 8-byte keys for chain `c`, block `i`.
fn key(c: u64, i: u64) -> [u8; 8] {
    (c.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i << 48) ^ i).to_be_bytes()
}

fn chain(c: u64, len: usize) -> Vec<[u8; 8]> {
    (0..len as u64).map(|i| key(c, i)).collect()
}

fn ingest(ix: &Index, replica: &str, hashes: &[[u8; 8]]) {
    ingest_with_stats(ix, replica, hashes, None);
}

/// One chain ingest (16 tokens per block) by `replica`, with its stats report if any.
fn ingest_with_stats(
    ix: &Index,
    replica: &str,
    hashes: &[[u8; 8]],
    stats: Option<ReplicaStatsInput>,
) {
    let counts = vec![16; hashes.len()];
    let refs = [PrefixRef {
        prefix_hash: &[],
        token_count: 0,
        block_hashes: hashes,
        block_token_counts: &counts,
        tier: 1,
        adapter_id: "",
    }];
    ix.ingest(CacheStateUpdate {
        replica_id: replica,
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: 0,
        prefixes: refs,
        stats,
        adapter_id: "",
    });
}

fn bench_ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("ingest");
    for len in [16usize, 64, 256] {
        g.throughput(Throughput::Elements(len as u64));
        g.bench_with_input(
            BenchmarkId::new("new_chain_blocks", len),
            &len,
            |b, &len| {
                let (ix, _) = index(false);
                let mut n = 0u64;
                b.iter(|| {
                    n += 1;
                    ingest(&ix, "r0", &chain(n, len));
                });
            },
        );
        g.bench_with_input(
            BenchmarkId::new("refresh_chain_blocks", len),
            &len,
            |b, &len| {
                let (ix, clock) = index(false);
                let hashes = chain(1, len);
                ingest(&ix, "r0", &hashes);
                b.iter(|| {
                    clock.advance_ms(1);
                    ingest(&ix, "r0", &hashes);
                });
            },
        );
    }
    g.finish();
}

/// `replicas` replicas each hold the first `depth` blocks of one shared chain.
fn shared_prefix(replicas: usize, depth: usize) -> (Index, Vec<[u8; 8]>) {
    let (ix, _) = index(false);
    let hashes = chain(7, depth);
    for r in 0..replicas {
        ingest(&ix, &format!("r{r}"), &hashes);
    }
    // Unrelated data so the table is not trivially small.
    for c in 1000..3000u64 {
        ingest(&ix, "noise", &chain(c, 16));
    }
    (ix, hashes)
}

fn bench_chain_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("chain_lookup");
    for (replicas, depth) in [(1usize, 16usize), (8, 16), (8, 64), (64, 64), (8, 256)] {
        let (ix, hashes) = shared_prefix(replicas, depth);
        let counts = vec![16; depth];
        let id = format!("{replicas}r_{depth}b");
        let part = ix
            .partition("t", "m", "vllm", "")
            .expect("partition exists");
        let mut scratch = MatchScratch::default();
        g.bench_function(BenchmarkId::new("core_match", &id), |b| {
            b.iter(|| {
                let mut total = 0i64;
                ix.match_chain_into(
                    part,
                    black_box(&hashes),
                    &counts,
                    T0_US,
                    &mut scratch,
                    |m| total += i64::from(m.matched_tokens),
                );
                black_box(total)
            })
        });
        let req = LookupRequest {
            block_hashes: &hashes[..],
            block_token_counts: &counts[..],
            ..LookupRequest::new("t", "m", "vllm")
        };
        let mut buf = RouteBuffer::new();
        g.bench_function(BenchmarkId::new("route_into", &id), |b| {
            b.iter(|| black_box(ix.lookup_route_into(black_box(&req), &mut buf)))
        });
        g.bench_function(BenchmarkId::new("route_alloc", &id), |b| {
            b.iter(|| black_box(ix.lookup_route(black_box(&req))))
        });
    }
    let (ix, _) = shared_prefix(8, 64);
    let miss = chain(999_999, 64);
    let counts = vec![16; 64];
    let req = LookupRequest {
        block_hashes: &miss[..],
        block_token_counts: &counts[..],
        ..LookupRequest::new("t", "m", "vllm")
    };
    let mut buf = RouteBuffer::new();
    g.bench_function("miss_64b", |b| {
        b.iter(|| black_box(ix.lookup_route_into(black_box(&req), &mut buf)))
    });
    g.finish();
}

fn bench_exact_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("exact_lookup");
    let (ix, hashes) = shared_prefix(8, 16);
    let hit = LookupRequest::<[u8; 8]> {
        prefix_hash: &hashes[15],
        ..LookupRequest::new("t", "m", "vllm")
    };
    let miss_key = key(123_456, 0);
    let miss = LookupRequest::<[u8; 8]> {
        prefix_hash: &miss_key,
        ..LookupRequest::new("t", "m", "vllm")
    };
    let mut buf = RouteBuffer::new();
    g.bench_function("hit_8_holders", |b| {
        b.iter(|| black_box(ix.lookup_route_into(black_box(&hit), &mut buf)))
    });
    g.bench_function("miss", |b| {
        b.iter(|| black_box(ix.lookup_route_into(black_box(&miss), &mut buf)))
    });
    g.finish();
}

/// An index where `replicas` pods (ids like Kubernetes pod names: long, with a shared prefix)
/// each hold `hashes` and report stats with hit rate 0.5 and pressure `pressure(pod)`.
fn pod_fleet(replicas: usize, hashes: &[[u8; 8]], pressure: impl Fn(usize) -> f32) -> Index {
    let (ix, _clock) = index(false);
    for r in 0..replicas {
        let stats = ReplicaStatsInput {
            cache_memory_bytes: 1 << 30,
            hit_rate: 0.5,
            pressure: pressure(r),
            t2_hit_tokens: 0,
            t2_query_tokens: 0,
        };
        let replica = format!("vllm-llama-3-70b-instruct-7d9f8c6b5d-{r:05x}");
        ingest_with_stats(&ix, &replica, hashes, Some(stats));
    }
    ix
}

/// O2 at fleet scale: an exact-path miss answered by TENANT_HOT, every replica serving the
/// scope and reporting the same stats (so every score ties and R5 orders by id).
fn bench_tenant_hot(c: &mut Criterion) {
    let mut g = c.benchmark_group("tenant_hot");
    for replicas in [16usize, 256, 2048] {
        let ix = pod_fleet(replicas, &[key(1, 0)], |_| 0.25);
        let miss_key = key(123_456, 0);
        let miss = LookupRequest::<[u8; 8]> {
            prefix_hash: &miss_key,
            ..LookupRequest::new("t", "m", "vllm")
        };
        let mut buf = RouteBuffer::new();
        assert_eq!(ix.lookup_route_into(&miss, &mut buf), Strategy::TenantHot);
        assert_eq!(buf.scores.len(), replicas, "every replica is a candidate");
        g.throughput(Throughput::Elements(replicas as u64));
        g.bench_function(BenchmarkId::from_parameter(replicas), |b| {
            b.iter(|| black_box(ix.lookup_route_into(black_box(&miss), &mut buf)))
        });
    }
    g.finish();
}

/// The chain path in a fleet that reports stats (S1), as every real one does: `replicas` pods
/// (Kubernetes-like ids) hold one shared 64-block chain and each has a stats record, so every
/// scored replica's pressure (R2) comes from its model's stats. W1M reports no stats.
fn bench_route_stats(c: &mut Criterion) {
    let mut g = c.benchmark_group("route_stats");
    for replicas in [8usize, 64] {
        let hashes = chain(7, 64);
        let counts = vec![16; 64];
        let ix = pod_fleet(replicas, &hashes, |r| 0.25 + r as f32 / 1024.0);
        let req = LookupRequest {
            block_hashes: &hashes[..],
            block_token_counts: &counts[..],
            ..LookupRequest::new("t", "m", "vllm")
        };
        let mut buf = RouteBuffer::new();
        assert_eq!(ix.lookup_route_into(&req, &mut buf), Strategy::PrefixMatch);
        assert_eq!(buf.scores.len(), replicas, "every replica is scored");
        g.bench_function(BenchmarkId::new("route_into", replicas), |b| {
            b.iter(|| black_box(ix.lookup_route_into(black_box(&req), &mut buf)))
        });
    }
    g.finish();
}

fn bench_events(c: &mut Criterion) {
    let mut g = c.benchmark_group("events");
    g.bench_function("prefix_evicted_then_reingest", |b| {
        let (ix, hashes) = shared_prefix(2, 16);
        b.iter(|| {
            ix.apply_event(CacheEventInput {
                event_type: event_type::PREFIX_EVICTED,
                replica_id: "r0",
                model_id: "m",
                tenant_id: "t",
                prefix_hash: &hashes[3],
                timestamp_us: 0,
                adapter_id: "",
            });
            ingest(&ix, "r0", &hashes[3..4]);
        })
    });
    g.bench_function("all_cleared_64_blocks_then_reingest", |b| {
        let (ix, _) = index(false);
        let hashes = chain(5, 64);
        b.iter(|| {
            ingest(&ix, "r0", &hashes);
            ix.apply_event(CacheEventInput {
                event_type: event_type::ALL_CLEARED,
                replica_id: "r0",
                model_id: "m",
                tenant_id: "t",
                prefix_hash: &[],
                timestamp_us: 0,
                adapter_id: "",
            });
        })
    });
    g.finish();
}

fn bench_credit(c: &mut Criterion) {
    let mut g = c.benchmark_group("credit");
    let (ix, _) = index(true);
    let hashes = chain(9, 16);
    for r in 0..8 {
        ingest(&ix, &format!("r{r}"), &hashes);
    }
    let counts = [16; 16];
    let req = LookupRequest {
        block_hashes: &hashes[..],
        block_token_counts: &counts[..],
        ..LookupRequest::new("t", "m", "vllm")
    };
    let result = ix.lookup_route(&req);
    g.bench_function("lfu_route_then_credit_8x16", |b| {
        b.iter(|| {
            let r = ix.lookup_route(black_box(&req));
            ix.credit_hits(&r.hits);
        })
    });
    g.bench_function("credit_only_8x16", |b| {
        b.iter(|| ix.credit_hits(black_box(&result.hits)))
    });
    // The same 128 hot entries credited from every core at once (a shared system prompt):
    // per-core stripes keep this from serializing on one cache line per entry. One iteration
    // is one credit of all 128 entries on each thread.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    g.throughput(Throughput::Elements((threads * result.hits.len()) as u64));
    g.bench_function(format!("credit_hot_8x16_{threads}_threads"), |b| {
        b.iter_custom(|iters| {
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| {
                        for _ in 0..iters {
                            ix.credit_hits(black_box(&result.hits));
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_ingest,
    bench_chain_lookup,
    bench_exact_lookup,
    bench_tenant_hot,
    bench_route_stats,
    bench_events,
    bench_credit
);
criterion_main!(benches);
