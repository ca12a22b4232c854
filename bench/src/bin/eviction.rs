//! Eviction quality and cost bench (`benchmarks.md` §6 "Eviction quality", `index.md` T86, T87,
//! T94): the timed halves of those scenarios, which are benchmarks rather than unit tests.
//!
//! ```text
//! eviction [--n N]... [--seed S] [--repeat R] [--alg lru|lfu] [--no-t94] [--quiet]
//! ```
//!
//! `eviction --help` describes every flag; a progress bar on stderr counts the runs (hidden
//! with `--quiet` or when stderr is not a terminal).
//!
//! For each population `N` (default 100,000 and 1,000,000) with cap `N / 2`, `R` runs (default
//! 5, sampler seeds `S`, `S + 1`, …; each a fresh index), reporting the worst and the median
//! quality and the median (and range) of the per-run cost ratios, since one run on a shared
//! machine swings by ±10%:
//! - **T86 (LRU)**: `N` single-key ingests with distinct increasing times. Quality = share of the
//!   survivors from the newest half (bar ≥ 95%); cost = median per-ingest ns over batches of
//!   1,000 ingests below the cap (batches 5%–45% of the run) and at it (55%–100%); bar: at the
//!   cap ≤ 2× below it.
//! - **T87 (LFU)**: the same ingests, every even-numbered entry credited twice right after its
//!   ingest; quality = credited survivors (bar ≥ 95% of the cap).
//!
//! Then **T94**: 1,048,576 entries (16,384 chains × 64 blocks, 8 replicas), 200 PREFIX_EVICTED
//! events and 200 `cache_state` calls timed one by one (bar: < 20 µs each; p50 / p90 / max
//! reported).
//!
//! One Markdown table per scenario goes to stdout.

use clap::{Parser, ValueEnum};
use inferencecache_bench::fixed_policy::FixedPolicy;
use inferencecache_bench::ours::{self, T0_US};
use inferencecache_bench::progress;
use inferencecache_engine::*;
use std::sync::Arc;
use std::time::Instant;

const BATCH: u64 = 1_000;

fn index(cap: i64, lfu: bool, seed: u64) -> (Index, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0_US));
    let cfg = IndexConfig {
        global_ttl_ms: 3_600_000,
        max_entries: cap,
        eviction_seed: seed,
        ..IndexConfig::default()
    };
    let dyn_clock: Arc<dyn Clock> = clock.clone();
    (
        Index::new(cfg, Arc::new(FixedPolicy::lru_or_lfu(lfu)), dyn_clock),
        clock,
    )
}

fn put(ix: &Index, key: &[u8], ts_us: i64) {
    let none: [[u8; 8]; 0] = [];
    let refs = [PrefixRef {
        prefix_hash: key,
        token_count: 16,
        block_hashes: &none[..],
        block_token_counts: &[],
        tier: 1,
        adapter_id: "",
    }];
    ix.ingest(CacheStateUpdate {
        replica_id: "r",
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: ts_us,
        adapter_id: "",
        prefixes: refs.iter().copied(),
        stats: None,
    });
}

fn has(ix: &Index, key: &[u8]) -> bool {
    ix.entry("t", "m", "vllm", "", key, "r").is_some()
}

fn quantile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p) as usize]
}

struct Outcome {
    quality: f64,
    below_ns: f64,
    at_ns: f64,
}

/// One T86 (LRU) or T87 (LFU) run over `n` ingests with cap `n / 2`.
fn run(n: u64, lfu: bool, seed: u64) -> Outcome {
    let cap = (n / 2) as i64;
    let (ix, _clock) = index(cap, lfu, seed);
    let batches = n / BATCH;
    let (mut below, mut at) = (Vec::new(), Vec::new());
    for b in 0..batches {
        let t = Instant::now();
        for i in b * BATCH..(b + 1) * BATCH {
            let k = i.to_be_bytes();
            put(&ix, &k, T0_US + i as i64 * 1000);
            if lfu && i % 2 == 0 {
                let r = ix.lookup_route(&LookupRequest::<[u8; 8]> {
                    prefix_hash: &k,
                    ..LookupRequest::new("t", "m", "vllm")
                });
                ix.credit_hits(&r.hits);
                ix.credit_hits(&r.hits);
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / BATCH as f64;
        // Skip the batches around the transition (table growth below, first estimates at).
        if (batches / 20..batches * 9 / 20).contains(&b) {
            below.push(ns);
        } else if b >= batches * 11 / 20 {
            at.push(ns);
        }
    }
    assert_eq!(ix.storage_entries(), cap, "exactly the cap survives");
    let good = if lfu {
        (0..n)
            .step_by(2)
            .filter(|i| has(&ix, &i.to_be_bytes()))
            .count()
    } else {
        (n / 2..n).filter(|i| has(&ix, &i.to_be_bytes())).count()
    };
    Outcome {
        quality: good as f64 / cap as f64,
        below_ns: quantile(&mut below, 0.5),
        at_ns: quantile(&mut at, 0.5),
    }
}

fn t94() {
    let (ix, _clock) = index(0, false, 0);
    let names: Vec<String> = (0..8).map(|r| format!("r{r}")).collect();
    let mut hashes = [[0u8; 8]; 64];
    for c in 0..16_384u64 {
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = (c << 8 | i as u64).to_be_bytes();
        }
        ours::ingest_chain_as(&ix, &names[(c % 8) as usize], &hashes, tier::T1, T0_US);
    }
    assert_eq!(ix.storage_entries(), 16_384 * 64);
    let (mut ev, mut st) = (Vec::new(), Vec::new());
    for c in 0..200u64 {
        let k = (c << 8 | 5).to_be_bytes();
        let t = Instant::now();
        ix.apply_event(CacheEventInput {
            event_type: event_type::PREFIX_EVICTED,
            replica_id: &names[(c % 8) as usize],
            model_id: "m",
            tenant_id: "t",
            prefix_hash: &k,
            timestamp_us: T0_US,
            adapter_id: "",
        });
        ev.push(t.elapsed().as_nanos() as f64 / 1000.0);
        let t = Instant::now();
        let cs = ix.cache_state("t", "m");
        st.push(t.elapsed().as_nanos() as f64 / 1000.0);
        assert!(cs.total_prefixes > 0);
    }
    assert_eq!(
        ix.storage_entries(),
        16_384 * 64 - 200,
        "200 entries removed"
    );
    println!("\n### T94: single operations on 1,048,576 entries (bar < 20 µs)\n");
    println!("| Operation | p50 µs | p90 µs | max µs |");
    println!("|---|---|---|---|");
    for (name, v) in [("PREFIX_EVICTED", &mut ev), ("cache_state", &mut st)] {
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            quantile(v, 0.5),
            quantile(v, 0.9),
            quantile(v, 1.0)
        );
    }
}

/// Eviction quality and per-ingest cost at the cap (T86 LRU, T87 LFU), then PREFIX_EVICTED and
/// cache_state latency on a 1 M-entry index (T94). Markdown tables on stdout.
#[derive(Debug, Parser)]
#[command(name = "eviction", version)]
struct Args {
    /// Population N (cap N / 2); repeat for several rows (default: 100000 and 1000000).
    #[arg(long = "n", value_name = "N", value_parser = clap::value_parser!(u64).range(20 * BATCH..))]
    sizes: Vec<u64>,
    /// Sampler seed of the first run (run r uses seed + r).
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Runs per row (each a fresh index).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    repeat: u64,
    /// Only this algorithm (default: both).
    #[arg(long, value_enum)]
    alg: Option<Alg>,
    /// Skip T94.
    #[arg(long)]
    no_t94: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Alg {
    Lru,
    Lfu,
}

fn main() {
    let args = Args::parse();
    let (seed, repeat, with_t94) = (args.seed, args.repeat, !args.no_t94);
    let algs = match args.alg {
        Some(Alg::Lru) => vec![false],
        Some(Alg::Lfu) => vec![true],
        None => vec![false, true],
    };
    let mut sizes = args.sizes.clone();
    if sizes.is_empty() {
        sizes = vec![100_000, 1_000_000];
    }
    println!("### T86 / T87: eviction quality and per-ingest cost at the cap (cap = N / 2)\n");
    println!(
        "{repeat} run(s) per row, sampler seeds {seed}–{}; ns/ingest are medians over the runs.\n",
        seed + repeat - 1
    );
    println!(
        "| N | Algorithm | Quality: worst / median | Bar | ns/ingest below cap | ns/ingest at cap | \
         Ratio: median (range) (bar ≤ 2×) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let steps = (sizes.len() * algs.len()) as u64 * repeat + u64::from(with_t94);
    let bar = progress::counted(steps, args.quiet);
    for &n in &sizes {
        for &lfu in &algs {
            let runs: Vec<Outcome> = (0..repeat)
                .map(|r| {
                    bar.set_message(format!("N {n}, {}", if lfu { "LFU" } else { "LRU" }));
                    let outcome = run(n, lfu, seed + r);
                    bar.inc(1);
                    outcome
                })
                .collect();
            let mut quality: Vec<f64> = runs.iter().map(|o| o.quality * 100.0).collect();
            let mut below: Vec<f64> = runs.iter().map(|o| o.below_ns).collect();
            let mut at: Vec<f64> = runs.iter().map(|o| o.at_ns).collect();
            let mut ratio: Vec<f64> = runs.iter().map(|o| o.at_ns / o.below_ns).collect();
            let (alg, what) = if lfu {
                ("LFU (T87)", "credited survivors")
            } else {
                ("LRU (T86)", "survivors from newest half")
            };
            println!(
                "| {n} | {alg} | {:.2}% / {:.2}% {what} | ≥ 95% | {:.0} | {:.0} | {:.2}× ({:.2}–{:.2}) |",
                quantile(&mut quality, 0.0),
                quantile(&mut quality, 0.5),
                quantile(&mut below, 0.5),
                quantile(&mut at, 0.5),
                quantile(&mut ratio, 0.5),
                quantile(&mut ratio, 0.0),
                quantile(&mut ratio, 1.0),
            );
        }
    }
    if with_t94 {
        bar.set_message("T94");
        t94();
        bar.inc(1);
    }
    bar.finish_and_clear();
}
