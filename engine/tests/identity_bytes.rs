//! What a churned identity costs the engine, by allocation (issue 42): 10,000 tenants, then
//! 10,000 models, each ingested as one update of one 2-block chain with 16-byte block hashes
//! (the `churn-waves` bench's update), counted by a global allocator that keeps the live
//! allocations by size. Reported per identity: the live allocations by size, the bytes
//! requested, and the bytes the server's allocator (mimalloc) serves them from, its size class
//! (`mimalloc_class`). The bars are regression bars on the class bytes, 1,712 B (1,626 B a
//! tenant and 1,584 B a model measured): the server's peak RSS per live identity is these bytes
//! plus the allocator's page slack and the server's own (`bench/results/churn-waves.md`), held
//! against issue 42's 2,048 B.
//!
//! `cargo test -p inferencecache-engine --test identity_bytes -- --nocapture` prints the table.

use inferencecache_engine::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Live allocations of each size up to `SMALL` bytes, by size in 8-byte steps (rounded up).
const SMALL: usize = 4096;
static LIVE_BY_SIZE: [AtomicI64; SMALL / 8 + 1] = [const { AtomicI64::new(0) }; SMALL / 8 + 1];
/// Live allocations aligned to more than 16 bytes, by size as above (mimalloc serves them from
/// their class only when its next block happens to be aligned).
static LIVE_ALIGNED_BY_SIZE: [AtomicI64; SMALL / 8 + 1] =
    [const { AtomicI64::new(0) }; SMALL / 8 + 1];
/// Bytes of live allocations above `SMALL`.
static LIVE_LARGE_BYTES: AtomicI64 = AtomicI64::new(0);

fn account(layout: Layout, sign: i64) {
    let size = layout.size();
    if size > SMALL {
        LIVE_LARGE_BYTES.fetch_add(sign * size as i64, Ordering::Relaxed);
        return;
    }
    let bucket = size.div_ceil(8);
    let table = if layout.align() > 16 {
        &LIVE_ALIGNED_BY_SIZE
    } else {
        &LIVE_BY_SIZE
    };
    table[bucket].fetch_add(sign, Ordering::Relaxed);
}

struct Counting;
// SAFETY: forwards to the system allocator; the counters are plain atomics (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        account(l, 1);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        account(l, 1);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        account(l, -1);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        account(l, -1);
        // SAFETY: `n` is non-zero and fits (the caller's contract); the alignment is `l`'s.
        account(
            unsafe { Layout::from_size_align_unchecked(n, l.align()) },
            1,
        );
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static A: Counting = Counting;

/// mimalloc's size class of a request of `size` bytes (its bins: exact words up to 64 bytes,
/// then four classes per power of two: 80, 96, 112, 128, 160, 192, 224, 256, 320, ...).
fn mimalloc_class(size: usize) -> usize {
    let words = size.div_ceil(8).max(1);
    if words <= 8 {
        return words * 8;
    }
    let high = usize::BITS - 1 - (words - 1).leading_zeros(); // floor(log2(words - 1))
    let step = 1usize << (high - 2);
    (words.div_ceil(step) * step) * 8
}

/// The live allocations now: (size bucket, aligned, count) and the large bytes.
fn snapshot() -> (Vec<(usize, bool, i64)>, i64) {
    let mut out = Vec::new();
    for (aligned, table) in [(false, &LIVE_BY_SIZE), (true, &LIVE_ALIGNED_BY_SIZE)] {
        for (bucket, count) in table.iter().enumerate() {
            out.push((bucket * 8, aligned, count.load(Ordering::Relaxed)));
        }
    }
    (out, LIVE_LARGE_BYTES.load(Ordering::Relaxed))
}

const IDENTITIES: usize = 10_000;

/// Per identity: (requested bytes, class bytes, table rows), over `IDENTITIES` identities made
/// by `name_of` (the tenant and model of identity `i`).
fn measure(name_of: impl Fn(usize) -> (String, String)) -> (f64, f64, String) {
    let ix = Index::new(
        IndexConfig::default(),
        Arc::new(DefaultResolvers),
        Arc::new(ManualClock::new(1_700_000_000_000_000)),
    );
    let ingest = |i: usize| {
        let (tenant, model) = name_of(i);
        let hashes: Vec<[u8; 16]> = (0..2u64)
            .map(|b| {
                let mut hash = [0u8; 16];
                hash[..8].copy_from_slice(&(i as u64).to_be_bytes());
                hash[8..].copy_from_slice(&b.to_be_bytes());
                hash
            })
            .collect();
        let outcome = ix.ingest(CacheStateUpdate {
            replica_id: "r0",
            model_id: &model,
            tenant_id: &tenant,
            hash_scheme: "vllm",
            timestamp_us: 0,
            adapter_id: "",
            stats: None,
            prefixes: std::iter::once(PrefixRef {
                prefix_hash: &hashes[1],
                token_count: 32,
                block_hashes: &hashes,
                block_token_counts: &[16, 16],
                tier: 0,
                adapter_id: "",
            }),
        });
        assert_eq!(outcome.keys_added, 2, "identity {i}: {outcome:?}");
    };
    // Warm up: the directories' first buckets, the thread's epoch handle and write scratch.
    for i in 0..200 {
        ingest(1_000_000 + i);
    }
    let (before, large_before) = snapshot();
    for i in 0..IDENTITIES {
        ingest(i);
    }
    let (after, large_after) = snapshot();
    let n = IDENTITIES as f64;
    let (mut requested, mut classes) = (0.0, 0.0);
    let mut rows = String::new();
    for ((size, aligned, b), (_, _, a)) in before.iter().zip(&after) {
        let per = (a - b) as f64 / n;
        if per.abs() < 0.05 {
            continue;
        }
        // An aligned request is served from the smallest class that keeps its alignment, at
        // worst its class plus the alignment (the server's blocks: 128 B at 64, a power of two).
        let class = mimalloc_class(*size);
        requested += per * *size as f64;
        classes += per * class as f64;
        rows.push_str(&format!(
            "{size:>5} B{} x {per:>5.2} -> class {class}\n",
            if *aligned { " (aligned > 16)" } else { "" }
        ));
    }
    let large = (large_after - large_before) as f64 / n;
    rows.push_str(&format!("large (> {SMALL} B): {large:.1} B\n"));
    drop(ix);
    (requested + large, classes + large, rows)
}

/// One test (the counters are process-wide): tenants, then models.
#[test]
fn a_churned_tenant_or_model_costs_the_engine_its_records_only() {
    let (requested, classes, rows) = measure(|i| (format!("churn-{i:010}"), "m".into()));
    println!("tenant: {requested:.0} B requested, {classes:.0} B in classes per tenant\n{rows}");
    assert!(
        classes <= 1_712.0,
        "tenant: {classes:.0} B in classes\n{rows}"
    );
    let (requested, classes, rows) = measure(|i| ("t".into(), format!("churn-{i:010}")));
    println!("model: {requested:.0} B requested, {classes:.0} B in classes per model\n{rows}");
    assert!(
        classes <= 1_712.0,
        "model: {classes:.0} B in classes\n{rows}"
    );
}
