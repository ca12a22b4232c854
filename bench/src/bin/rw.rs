//! P7, concurrent read/write (`benchmarks.md` §6): W1M loaded; one reader thread runs Q50 core
//! matches with per-op timing, first on an idle index, then while one writer thread ingests and
//! removes fresh chains at a fixed rate. Bar: the reader's p99 with the writer ≤ 2× its idle p99.
//! Every reader answer is checked against the W1M expected sums (the writer never touches W1M
//! chains, so they must stay exact).
//!
//! ```text
//! rw [--seconds N] [--rate BLOCKS_PER_S] [--chains N] [--quiet]
//! ```
//!
//! `rw --help` describes every flag; a progress bar on stderr shows the elapsed time of the two
//! phases (hidden with `--quiet` or when stderr is not a terminal).
//!
//! Defaults: 30 s per phase, 1,000,000 blocks/s, 16,384 chains.

use clap::Parser;
use inferencecache_bench::measure::percentile;
use inferencecache_bench::ours::{self, REPLICAS, T0_US, TENANT};
use inferencecache_bench::progress;
use inferencecache_bench::w1m::{Kind, LEN, Queries, WireChain, Workload};
use inferencecache_engine::{Index, MatchScratch};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Fresh chains the writer keeps before removing the oldest (bounds the index growth).
const BACKLOG: usize = 256;
/// Chains per pacing step.
const STEP_CHAINS: u64 = 16;

struct Phase {
    ops: usize,
    p50: f64,
    p99: f64,
    p999: f64,
    mismatches: u64,
}

fn read_phase(ix: &Index, queries: &[WireChain], secs: u64) -> Phase {
    let part = ix
        .partition(TENANT, ours::MODEL, ours::SCHEME, ours::ADAPTER)
        .expect("W1M partition exists");
    let want = ours::core_expected(Kind::Q50);
    let mut scratch = MatchScratch::default();
    let mut ns = Vec::with_capacity(4_000_000);
    let mut mismatches = 0u64;
    let end = Instant::now() + Duration::from_secs(secs);
    let mut i = 0usize;
    while Instant::now() < end {
        for _ in 0..1024 {
            let q = &queries[i % queries.len()];
            i += 1;
            let t = Instant::now();
            let s = ours::core_op(ix, part, q, &mut scratch);
            ns.push(t.elapsed().as_nanos() as u64);
            if s != want {
                mismatches += 1;
            }
        }
    }
    ns.sort_unstable();
    Phase {
        ops: ns.len(),
        p50: percentile(&ns, 0.5),
        p99: percentile(&ns, 0.99),
        p999: percentile(&ns, 0.999),
        mismatches,
    }
}

/// Fresh chain `i` (keys disjoint from W1M's: a distinct top byte).
fn fresh_chain(i: u64) -> WireChain {
    let mut k = [[0u8; 8]; LEN];
    for (j, h) in k.iter_mut().enumerate() {
        *h = (0xF7 << 56 | i << 6 | j as u64).to_be_bytes();
    }
    k
}

fn writer(ix: &Index, rate: f64, stop: &AtomicBool, blocks: &AtomicU64) {
    let mut live: VecDeque<(u64, WireChain)> = VecDeque::new();
    let start = Instant::now();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..STEP_CHAINS {
            let c = fresh_chain(i);
            ours::ingest_chain(ix, i as usize, &c);
            live.push_back((i, c));
            if live.len() > BACKLOG {
                let (old, keys) = live.pop_front().expect("non-empty");
                ix.evict_prefixes(
                    TENANT,
                    ours::MODEL,
                    REPLICAS[(old % 8) as usize],
                    ours::ADAPTER,
                    &keys,
                    T0_US,
                );
            }
            i += 1;
        }
        let done = blocks.fetch_add(STEP_CHAINS * LEN as u64, Ordering::Relaxed)
            + STEP_CHAINS * LEN as u64;
        // Fixed rate: sleep until this many blocks are due.
        let due = Duration::from_secs_f64(done as f64 / rate);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
    }
}

/// P7: a Q50 reader's p99 on an idle index and while one writer ingests and removes fresh
/// chains (exit 1 on a wrong answer).
#[derive(Debug, Parser)]
#[command(name = "rw", version)]
struct Args {
    /// Seconds per phase (idle, then with the writer).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    seconds: u64,
    /// Writer target rate in blocks per second.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    rate: u64,
    /// W1M chains loaded before the phases.
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(64..))]
    chains: u64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

fn main() {
    let args = Args::parse();
    let secs = args.seconds;
    let rate = args.rate as f64;
    let chains = usize::try_from(args.chains).unwrap_or(usize::MAX);
    let bar = progress::counted(2, args.quiet);
    bar.set_message(format!("loading {chains} chains"));
    let w = Workload::new(chains);
    let ix = ours::new_index();
    ours::insert(&ix, &w.wire_events());
    let q = Queries::generate(chains, 100_000);
    let queries = q.q50.wire_rolling();
    // Warm-up, then the idle phase.
    read_phase(&ix, &queries, 2);
    bar.set_message(format!("idle phase, {secs} s"));
    let idle = read_phase(&ix, &queries, secs);
    bar.inc(1);
    bar.set_message(format!("phase with the writer, {secs} s"));
    let stop = AtomicBool::new(false);
    let blocks = AtomicU64::new(0);
    let (loaded, written, elapsed) = std::thread::scope(|s| {
        let t0 = Instant::now();
        s.spawn(|| writer(&ix, rate, &stop, &blocks));
        let r = read_phase(&ix, &queries, secs);
        stop.store(true, Ordering::Relaxed);
        (r, &blocks, t0.elapsed())
    });
    bar.inc(1);
    bar.finish_and_clear();
    let achieved = written.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    println!("### P7: Q50 reader p99 while one writer ingests (W1M, {chains} chains)\n");
    println!(
        "Writer: fresh 64-block chains at a target of {:.2} M blocks/s, achieved {:.2} M blocks/s \
         (ingest + removal of the chain {BACKLOG} behind); reader: one thread, per-op `Instant` \
         timing, {secs} s per phase.\n",
        rate / 1e6,
        achieved / 1e6
    );
    println!("| Phase | ops | p50 ns | p99 ns | p99.9 ns | wrong answers |");
    println!("|---|---|---|---|---|---|");
    for (name, p) in [("idle", &idle), ("with writer", &loaded)] {
        println!(
            "| {name} | {} | {:.0} | {:.0} | {:.0} | {} |",
            p.ops, p.p50, p.p99, p.p999, p.mismatches
        );
    }
    let ratio = loaded.p99 / idle.p99;
    println!(
        "\nP7: p99 with writer / idle p99 = {ratio:.2}× (bar ≤ 2×): {}",
        if ratio <= 2.0 { "PASS" } else { "FAIL" }
    );
    if idle.mismatches + loaded.mismatches > 0 {
        println!("**Wrong answers: the run is a failure.**");
        std::process::exit(1);
    }
}
