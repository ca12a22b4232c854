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

fn rss_bytes() -> i64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<i64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// This thread's on-CPU time in ns (`/proc/thread-self/schedstat`), robust to a shared machine.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
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
    let rss0 = rss_bytes();
    let c0 = cpu_ns();
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
    let cpu = cpu_ns() - c0;
    let rss1 = rss_bytes();
    let n = CHAINS * 64;
    println!(
        "insert (on-CPU time): {:.2} M blocks/s ({:.1} ns/block)",
        n as f64 / cpu as f64 * 1e3,
        cpu as f64 / n as f64
    );
    println!(
        "RSS delta {} ({:.1} B/entry); memory_bytes / RSS delta = {:.3}",
        rss1 - rss0,
        (rss1 - rss0) as f64 / n as f64,
        (ix.memory_bytes() - mem0) as f64 / (rss1 - rss0) as f64
    );
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
    // W1M_SKIP_QUERIES=1: insert and remove only (profiling).
    let skip = std::env::var_os("W1M_SKIP_QUERIES").is_some();
    for (name, set, want) in [
        ("Q50", &qs[0], 2560i64),
        ("Q100", &qs[1], 3072),
        ("Q0", &qs[2], 0),
    ] {
        if skip {
            break;
        }
        if std::env::var("W1M_ONLY").is_ok_and(|v| v != name) {
            continue;
        }
        for round in 0..3 {
            let c0 = cpu_ns();
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
            let core_cpu = (cpu_ns() - c0) as f64 / set.len() as f64;
            assert_eq!(total, want * set.len() as i64);
            let c0 = cpu_ns();
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
            let route_cpu = (cpu_ns() - c0) as f64 / set.len() as f64;
            println!(
                "{name} round {round}: core match {core:.0} ns/op (on-CPU {core_cpu:.0}), lookup_route_into {route:.0} ns/op (on-CPU {route_cpu:.0}) (score sum/query {:.0})",
                score / set.len() as f64
            );
        }
        let mut lat: Vec<u64> = Vec::with_capacity(set.len());
        let mut lat_r: Vec<u64> = Vec::with_capacity(set.len());
        for q in set.iter() {
            let t = Instant::now();
            let mut s = 0i64;
            ix.match_chain_into(part, q, &counts, now, &mut scratch, |m| {
                s += m.matched_tokens as i64
            });
            lat.push(t.elapsed().as_nanos() as u64);
            assert_eq!(s, want);
            let req = LookupRequest {
                block_hashes: q,
                block_token_counts: &counts,
                ..LookupRequest::new("t", "m", "vllm")
            };
            let t = Instant::now();
            ix.lookup_route_into(&req, &mut buf);
            lat_r.push(t.elapsed().as_nanos() as u64);
        }
        println!(
            "{name} timed pass: core p50 {} p99 {} ns; lookup_route p50 {} p99 {} ns",
            pct(&mut lat, 0.5),
            pct(&mut lat, 0.99),
            pct(&mut lat_r, 0.5),
            pct(&mut lat_r, 0.99)
        );
    }
    // Remove: the first half of the chains with one PREFIX_EVICTED `apply_event` per block, the
    // second half through the batch API (`evict_prefixes`, hash list built inside the loop).
    let half = chains.len() / 2;
    let c0 = cpu_ns();
    let t = Instant::now();
    for (c, hs) in chains[..half].iter().enumerate() {
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
    let nh = (half * 64) as f64;
    let cpu = (cpu_ns() - c0) as f64;
    println!(
        "remove (apply_event): {:.2} M blocks/s ({:.1} ns/block; on-CPU {:.1} ns/block)",
        nh / dt.as_secs_f64() / 1e6,
        dt.as_nanos() as f64 / nh,
        cpu / nh
    );
    let c0 = cpu_ns();
    let t = Instant::now();
    for (c, hs) in chains.iter().enumerate().skip(half) {
        let keys: Vec<&[u8]> = hs.iter().rev().map(|h| &h[..]).collect();
        ix.evict_prefixes("t", "m", &reps[c % 8], "", &keys, now);
    }
    let dt = t.elapsed();
    let nh = ((chains.len() - half) * 64) as f64;
    let cpu = (cpu_ns() - c0) as f64;
    println!(
        "remove (evict_prefixes batch): {:.2} M blocks/s ({:.1} ns/block; on-CPU {:.1} ns/block); storage_entries after {}",
        nh / dt.as_secs_f64() / 1e6,
        dt.as_nanos() as f64 / nh,
        cpu / nh,
        ix.storage_entries()
    );
}
