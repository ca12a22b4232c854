//! Quick W1M timing (benchmarks.md §2): insert, Q50/Q100/Q0 core match and LookupRoute, remove.
//! `cargo run --release -p inferencecache-engine --example w1m_quick`

use inferencecache_engine::*;
use std::sync::Arc;
use std::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn splitmix64(x: u64) -> u64 {
    let x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
fn local(c: u64, pos: u64) -> u64 {
    let (level, owner) = if pos < 16 {
        (1u64, c / 8)
    } else if pos < 32 {
        (2, c / 2)
    } else {
        (3, c)
    };
    splitmix64((level << 56) ^ (owner << 8) ^ pos)
}
fn next(prev: u64, cur: u64) -> u64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&prev.to_le_bytes());
    b[8..].copy_from_slice(&cur.to_le_bytes());
    xxh3_64_with_seed(&b, 1337)
}
fn rolling(q: &[u64]) -> Vec<[u8; 8]> {
    let mut out = Vec::with_capacity(q.len());
    let mut h = q[0];
    out.push(h.to_be_bytes());
    for &x in &q[1..] {
        h = next(h, x);
        out.push(h.to_be_bytes());
    }
    out
}

fn main() {
    const CHAINS: u64 = 16384;
    let now = 1_700_000_000_000_000i64;
    let ix = Index::new(
        IndexConfig {
            max_entries: 0,
            ..IndexConfig::default()
        },
        Arc::new(DefaultResolvers),
        Arc::new(ManualClock::new(now)),
    );
    let chains: Vec<Vec<[u8; 8]>> = (0..CHAINS)
        .map(|c| rolling(&(0..64).map(|i| local(c, i)).collect::<Vec<_>>()))
        .collect();
    assert_eq!(local(0, 0), 0xc9ed992411bbb661);
    assert_eq!(u64::from_be_bytes(chains[0][63]), 0x8dd81ce132346b03);
    let reps: Vec<String> = (0..8).map(|w| format!("w{w}")).collect();
    let counts = [16i32; 64];
    let mem0 = ix.memory_bytes();
    let t = Instant::now();
    for (c, hs) in chains.iter().enumerate() {
        ix.ingest(CacheStateUpdate {
            replica_id: &reps[c % 8],
            model_id: "m",
            tenant_id: "t",
            hash_scheme: "vllm",
            timestamp_us: now,
            adapter_id: "",
            stats: None,
            prefixes: std::iter::once(PrefixRef {
                prefix_hash: b"",
                token_count: 0,
                block_hashes: hs,
                block_token_counts: &counts,
                tier: 0,
                adapter_id: "",
            }),
        });
    }
    let dt = t.elapsed();
    let n = CHAINS * 64;
    println!(
        "insert: {:.2} M blocks/s ({:.1} ns/block); storage_entries {}; memory_bytes {} ({:.1} B/entry)",
        n as f64 / dt.as_secs_f64() / 1e6,
        dt.as_nanos() as f64 / n as f64,
        ix.storage_entries(),
        ix.memory_bytes() - mem0,
        (ix.memory_bytes() - mem0) as f64 / n as f64
    );
    // Queries.
    let mut rng = 42u64;
    let mut xs = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut k = 0u64;
    let mut qs: [Vec<Vec<[u8; 8]>>; 3] = [vec![], vec![], vec![]];
    for _ in 0..100_000 {
        let c = xs() % CHAINS;
        let mut q: Vec<u64> = (0..32).map(|i| local(c, i)).collect();
        for _ in 0..32 {
            k += 1;
            q.push(splitmix64((7 << 56) ^ k));
        }
        qs[0].push(rolling(&q));
        let c = xs() % CHAINS;
        qs[1].push(rolling(&(0..64).map(|i| local(c, i)).collect::<Vec<_>>()));
        let q: Vec<u64> = (0..64)
            .map(|_| {
                k += 1;
                splitmix64((7 << 56) ^ k)
            })
            .collect();
        qs[2].push(rolling(&q));
    }
    let part = ix.partition("t", "m", "vllm", "").unwrap();
    let mut scratch = MatchScratch::default();
    let mut buf = RouteBuffer::new();
    for (name, set, want) in [
        ("Q50", &qs[0], 2560i64),
        ("Q100", &qs[1], 3072),
        ("Q0", &qs[2], 0),
    ] {
        for round in 0..3 {
            let t = Instant::now();
            let mut total = 0i64;
            for q in set.iter() {
                let mut s = 0i64;
                ix.match_chain_into(part, q, &counts, now, &mut scratch, |m| {
                    s += m.matched_tokens as i64
                });
                total += s;
            }
            let core = t.elapsed().as_nanos() as f64 / set.len() as f64;
            assert_eq!(total, want * set.len() as i64);
            let t = Instant::now();
            let mut score = 0f64;
            for q in set.iter() {
                let req = LookupRequest {
                    block_hashes: q,
                    block_token_counts: &counts,
                    ..LookupRequest::new("t", "m", "vllm")
                };
                ix.lookup_route_into(&req, &mut buf);
                score += buf.scores.iter().map(|s| s.score as f64).sum::<f64>();
            }
            let route = t.elapsed().as_nanos() as f64 / set.len() as f64;
            println!(
                "{name} round {round}: core match {core:.0} ns/op, lookup_route_into {route:.0} ns/op (score sum/query {:.0})",
                score / set.len() as f64
            );
        }
    }
    let t = Instant::now();
    for (c, hs) in chains.iter().enumerate() {
        for h in hs.iter().rev() {
            ix.apply_event(CacheEventInput {
                event_type: event_type::PREFIX_EVICTED,
                replica_id: &reps[c % 8],
                model_id: "m",
                tenant_id: "t",
                prefix_hash: h,
                timestamp_us: now,
                adapter_id: "",
            });
        }
    }
    let dt = t.elapsed();
    println!(
        "remove: {:.2} M blocks/s; storage_entries after {}",
        n as f64 / dt.as_secs_f64() / 1e6,
        ix.storage_entries()
    );
}
