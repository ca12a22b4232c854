//! T93: zero allocations for the core match and LRU `lookup_route_into` on Q50/Q100/Q0 shapes.

use inferencecache_engine::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

struct Counting;
thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
    static ON: Cell<bool> = const { Cell::new(false) };
}
// SAFETY: forwards to the system allocator; the counters are thread-local cells (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if ON.try_with(|o| o.get()).unwrap_or(false) {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if ON.try_with(|o| o.get()).unwrap_or(false) {
            let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static A: Counting = Counting;

fn counted<R>(f: impl FnOnce() -> R) -> (R, u64) {
    COUNT.with(|c| c.set(0));
    ON.with(|o| o.set(true));
    let r = f();
    ON.with(|o| o.set(false));
    (r, COUNT.with(|c| c.get()))
}

fn k(c: u64, i: u64) -> [u8; 8] {
    (c << 16 | i).to_be_bytes()
}

#[test]
fn t93_zero_alloc() {
    let ix = Index::new(
        IndexConfig::default(),
        Arc::new(DefaultResolvers),
        Arc::new(ManualClock::new(1_700_000_000_000_000)),
    );
    // 8 workers; chain c held by worker c % 8; first 16 blocks shared by all, 16..32 by pairs.
    for c in 0..64u64 {
        let hs: Vec<[u8; 8]> = (0..64)
            .map(|i| {
                if i < 16 {
                    k(1000, i)
                } else if i < 32 {
                    k(2000 + c / 2, i)
                } else {
                    k(c, i)
                }
            })
            .collect();
        let rep = format!("w{}", c % 8);
        ix.ingest(CacheStateUpdate {
            replica_id: &rep,
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
                block_token_counts: &[16; 64],
                tier: 0,
                adapter_id: "",
            }),
        });
    }
    let q100: Vec<[u8; 8]> = (0..64)
        .map(|i| {
            if i < 16 {
                k(1000, i)
            } else if i < 32 {
                k(2000 + 5 / 2, i)
            } else {
                k(5, i)
            }
        })
        .collect();
    let mut q50 = q100.clone();
    for (i, x) in q50.iter_mut().enumerate().skip(32) {
        *x = k(99_999, i as u64);
    }
    let q0: Vec<[u8; 8]> = (0..64).map(|i| k(77_777, i)).collect();
    let counts = [16i32; 64];
    let part = ix.partition("t", "m", "vllm", "").unwrap();
    let mut scratch = MatchScratch::default();
    let mut buf = RouteBuffer::new();
    let now = 1_700_000_000_000_000;
    for (q, want_sum, want_strategy) in [
        (&q50, 160 * 16, Strategy::PrefixMatch),
        (&q100, 192 * 16, Strategy::PrefixMatch),
        (&q0, 0, Strategy::None),
    ] {
        // Warm up (grows the buffers, registers the epoch handle).
        let mut sum = 0i64;
        ix.match_chain_into(part, q, &counts, now, &mut scratch, |m| {
            sum += m.matched_tokens as i64
        });
        let req = LookupRequest {
            block_hashes: q,
            block_token_counts: &counts,
            ..LookupRequest::new("t", "m", "vllm")
        };
        ix.lookup_route_into(&req, &mut buf);
        let (sum2, n) = counted(|| {
            let mut s = 0i64;
            ix.match_chain_into(part, q, &counts, now, &mut scratch, |m| {
                s += m.matched_tokens as i64
            });
            s
        });
        assert_eq!(n, 0, "core match allocated");
        assert_eq!(sum2, want_sum);
        assert_eq!(sum, want_sum);
        let (st, n) = counted(|| ix.lookup_route_into(&req, &mut buf));
        assert_eq!(n, 0, "lookup_route_into allocated");
        assert_eq!(st, want_strategy);
        assert_eq!(
            buf.scores
                .iter()
                .map(|s| s.matched_tokens as i64)
                .sum::<i64>(),
            want_sum
        );
    }
}
