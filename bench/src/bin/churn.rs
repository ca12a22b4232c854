//! P8 churn bench (`benchmarks.md` §6, issue #4): memory bounded by the cap under insert /
//! remove / ALL_CLEARED / TTL churn.
//!
//! ```text
//! churn [--minutes N] [--cap N | --caps N,N[,…]] [--warmup-s N] [--ttl-ms N] [--clear-every N]
//!       [--quiet]
//! ```
//!
//! `churn --help` describes every flag; a progress bar on stderr (hidden with `--quiet` or when
//! stderr is not a terminal) shows the elapsed part of the run.
//!
//! Cap 1,000,000 storage entries, TTL 10 s (`--ttl-ms`), sweep every 1 s (the index's own ticker
//! thread). One writer ingests fresh 64-block chains as fast as it can (the rate is reported; the
//! scenario asks for ≥ 1 M blocks/s), keeping the index at the cap through cap evictions; 25% of
//! its chains are removed by PREFIX_EVICTED (batch form) 1,000 chains after their ingest, every
//! `--clear-every` chains (default 10,000) one replica (round robin) is cleared by ALL_CLEARED,
//! the rest is left to the cap and the TTL. At ≥ 1 M blocks/s the cap turns the index over in
//! about a second, so with the default TTL of 10 s nothing lives long enough to expire; a run
//! with `--ttl-ms 500` makes the sweep expire entries too. After a 60 s warm-up, `VmRSS`,
//! `storage_entries` and
//! `memory_bytes` are sampled every 10 s. Verdict (P8): max RSS of the second half of the
//! measured window ≤ 1.05 × max RSS of the first half (minutes 5–10 vs 1–5 for the default
//! 10-minute run). Exits non-zero when P8 fails.

use clap::Parser;
use inferencecache_bench::host::ALLOCATOR;
use inferencecache_bench::measure::vm_rss_bytes;
use inferencecache_bench::ours;
use inferencecache_bench::progress;
use inferencecache_bench::w1m::LEN;
use inferencecache_engine::*;
use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

// The server ships mimalloc; `--features mimalloc` measures the churn under it (the default is
// the system allocator, as for every bench).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Blocks per chain: W1M's chain length, so a chain is one `ours::ingest_chain_as` update.
const BLOCKS: usize = LEN;
const REPLICAS: u64 = 8;
const EVICT_LAG: usize = 1000;

struct Sample {
    t_s: u64,
    rss_kib: u64,
    entries: i64,
    mem: i64,
    parts: MemoryBreakdown,
    blocks: u64,
}

/// P8 churn bench: memory stays bounded by the cap under insert, remove, ALL_CLEARED and TTL
/// churn (exit 1 when the RSS bar fails).
#[derive(Debug, Parser)]
#[command(name = "churn", version)]
struct Args {
    /// Length of the run in minutes (the first `--warmup-s` seconds are not measured).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    minutes: u64,
    /// Global cap in storage entries.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    cap: u64,
    /// Fit RSS per entry over these caps instead (comma-separated, at least two distinct): one
    /// child process per cap.
    #[arg(long, value_parser = parse_caps_arg, conflicts_with = "cap")]
    caps: Option<Caps>,
    /// Warm-up in seconds before RSS sampling starts.
    #[arg(long = "warmup-s", default_value_t = 60)]
    warmup_s: u64,
    /// Entry TTL in milliseconds (the sweep runs every second).
    #[arg(long = "ttl-ms", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    ttl_ms: u64,
    /// One ALL_CLEARED (round-robin replica) every this many chains.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    clear_every: u64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// The `--caps` list.
#[derive(Debug, Clone)]
struct Caps(Vec<u64>);

fn parse_caps_arg(v: &str) -> Result<Caps, String> {
    parse_caps(v)
        .map(Caps)
        .ok_or_else(|| "expected at least two distinct positive caps, e.g. 250000,500000".into())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let (minutes, warmup_s, ttl_ms, clear_every) =
        (args.minutes, args.warmup_s, args.ttl_ms, args.clear_every);
    let cap = i64::try_from(args.cap).unwrap_or(i64::MAX);
    if let Some(Caps(caps)) = &args.caps {
        return per_entry_fit(caps, minutes, warmup_s, ttl_ms, clear_every, args.quiet);
    }
    let total = Duration::from_secs(minutes * 60);
    let ix = Arc::new(Index::new(
        IndexConfig {
            global_ttl_ms: ttl_ms as i64,
            sweep_interval_ms: 1_000,
            max_entries: cap,
            ..IndexConfig::default()
        },
        Arc::new(DefaultResolvers),
        Arc::new(SystemClock),
    ));
    ix.start();
    let rss0 = vm_rss_bytes() / 1024;
    println!(
        "churn: cap {cap}, TTL {ttl_ms} ms, sweep 1 s, ALL_CLEARED every {clear_every} chains, \
         {minutes} min, warm-up {warmup_s} s, allocator {ALLOCATOR}, baseline RSS {} MiB",
        rss0 / 1024
    );
    let replica_names: Vec<String> = (0..REPLICAS).map(|r| format!("replica-{r}")).collect();
    let mut pending: VecDeque<(u64, [[u8; 8]; BLOCKS])> = VecDeque::new();
    let start = Instant::now();
    let mut next_sample = Duration::from_secs(warmup_s);
    let mut samples: Vec<Sample> = Vec::new();
    let mut blocks = 0u64;
    let mut removed = 0u64;
    let (mut clears, mut cleared) = (0u64, 0u64);
    let mut c = 0u64;
    let bar = progress::timed(total, args.quiet);
    loop {
        let now = start.elapsed();
        // Every 1,024 chains (a few ms at the writer's rate): the bar costs nothing measurable.
        if c.is_multiple_of(1024) {
            bar.set_position(now.as_secs());
        }
        if now >= next_sample {
            samples.push(Sample {
                t_s: now.as_secs(),
                rss_kib: vm_rss_bytes() / 1024,
                entries: ix.storage_entries(),
                mem: ix.memory_bytes(),
                parts: ix.memory_breakdown(),
                blocks,
            });
            next_sample += Duration::from_secs(10);
        }
        if now >= total {
            break;
        }
        let mut hashes = [[0u8; 8]; BLOCKS];
        for (i, h) in hashes.iter_mut().enumerate() {
            *h = (c << 6 | i as u64).to_be_bytes();
        }
        let rep = &replica_names[(c % REPLICAS) as usize];
        // Tier 0 and timestamp 0 ("now"): the churn entries age on the system clock.
        ours::ingest_chain_as(&ix, rep, &hashes, 0, 0);
        blocks += BLOCKS as u64;
        if c.is_multiple_of(4) {
            pending.push_back((c, hashes));
        }
        while pending.len() > EVICT_LAG / 4 {
            let (pc, ph) = pending.pop_front().expect("non-empty");
            removed += ix.evict_prefixes(
                "t",
                "m",
                &replica_names[(pc % REPLICAS) as usize],
                "",
                &ph[..],
                0,
            );
        }
        if c % clear_every == clear_every - 1 {
            let before = ix.storage_entries();
            ix.apply_event(CacheEventInput {
                event_type: event_type::ALL_CLEARED,
                replica_id: &replica_names[(c / clear_every % REPLICAS) as usize],
                model_id: "m",
                tenant_id: "t",
                prefix_hash: &[],
                timestamp_us: 0,
                adapter_id: "",
            });
            clears += 1;
            cleared += (before - ix.storage_entries()).max(0) as u64;
        }
        c += 1;
    }
    bar.finish_and_clear();
    ix.stop();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "writer: {blocks} blocks in {secs:.0} s = {:.2} M blocks/s (target ≥ 1 M/s); \
         {removed} removed by PREFIX_EVICTED; {clears} ALL_CLEARED (~{cleared} entries); cap \
         evictions {}, TTL evictions {}",
        blocks as f64 / secs / 1e6,
        ix.evictions(Algorithm::Lru, EvictionReason::Cap),
        ix.evictions(Algorithm::Lru, EvictionReason::Ttl),
    );
    println!();
    println!(
        "| t (s) | VmRSS (MiB) | storage_entries | memory_bytes (MiB) | RSS−baseline B/entry | \
         slot tables | runs | run ids | LFU | other (MiB) | blocks ingested (M) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &samples {
        let per = if s.entries > 0 {
            (s.rss_kib.saturating_sub(rss0) * 1024) as f64 / s.entries as f64
        } else {
            0.0
        };
        let mib = |b: i64| b as f64 / 1048576.0;
        println!(
            "| {} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            s.t_s,
            s.rss_kib as f64 / 1024.0,
            s.entries,
            mib(s.mem),
            per,
            mib(s.parts.slot_tables),
            mib(s.parts.runs),
            mib(s.parts.run_ids),
            mib(s.parts.lfu),
            mib(s.parts.other),
            s.blocks as f64 / 1e6
        );
    }
    let split = (total.as_secs() / 2).max(warmup_s);
    let first = samples
        .iter()
        .filter(|s| s.t_s < split)
        .map(|s| s.rss_kib)
        .max();
    let second = samples
        .iter()
        .filter(|s| s.t_s >= split)
        .map(|s| s.rss_kib)
        .max();
    // One line for `--caps` (the parent process parses it): the measured window's maxima.
    let max_of = |f: fn(&Sample) -> i64| samples.iter().map(f).max().unwrap_or(0);
    println!(
        "\nsummary: cap {cap} rss0_kib {rss0} rss_max_kib {} mem_max {} tables_max {} \
         runs_max {} blocks_per_s {:.0}",
        max_of(|s| s.rss_kib as i64),
        max_of(|s| s.mem),
        max_of(|s| s.parts.slot_tables),
        max_of(|s| s.parts.runs),
        blocks as f64 / secs
    );
    match (first, second) {
        (Some(a), Some(b)) => {
            let ratio = b as f64 / a as f64;
            let ok = ratio <= 1.05;
            println!();
            println!(
                "P8: max RSS {}–{} s = {:.1} MiB, {}–{} s = {:.1} MiB, ratio {ratio:.3} (bar ≤ 1.05): {}",
                warmup_s,
                split,
                a as f64 / 1024.0,
                split,
                total.as_secs(),
                b as f64 / 1024.0,
                if ok { "PASS" } else { "FAIL" }
            );
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        _ => {
            println!("P8: not enough samples (run longer than the warm-up)");
            ExitCode::FAILURE
        }
    }
}

/// `--caps`: comma-separated caps, at least two distinct, each > 0.
fn parse_caps(v: &str) -> Option<Vec<u64>> {
    let caps: Vec<u64> = v
        .split(',')
        .map(|c| c.trim().parse::<u64>().ok().filter(|&c| c > 0))
        .collect::<Option<_>>()?;
    let distinct = caps.iter().any(|&c| c != caps[0]);
    (caps.len() >= 2 && distinct).then_some(caps)
}

/// Parses a `summary:` line into its `name value` pairs.
fn parse_summary(out: &str) -> Option<Vec<(String, f64)>> {
    let line = out.lines().find_map(|l| l.strip_prefix("summary:"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .chunks(2)
        .map(|kv| match kv {
            [k, v] => v.parse::<f64>().ok().map(|v| (k.to_string(), v)),
            _ => None,
        })
        .collect()
}

/// Least-squares line `y = a + b·x`: returns `(a, b)`.
fn fit(xs: &[f64], ys: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    let b = sxy / sxx;
    (my - b * mx, b)
}

/// The issue's bar is "≤ 32 bytes per entry plus a fixed baseline": runs the churn once per cap,
/// each in its own process (RSS is per process), and fits the maximum RSS of each measured window
/// against the cap. The slope is the memory one more entry costs; the intercept is what the
/// process holds whatever the cap (binary, allocator arenas, thread stacks, per-shard chunk
/// tails, garbage waiting for its epoch at the writer's rate).
fn per_entry_fit(
    caps: &[u64],
    minutes: u64,
    warmup_s: u64,
    ttl_ms: u64,
    clear: u64,
    quiet: bool,
) -> ExitCode {
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("churn: cannot locate its own executable");
        return ExitCode::FAILURE;
    };
    println!(
        "churn per-entry fit: caps {caps:?}, {minutes} min each (warm-up {warmup_s} s), one \
         process per cap, allocator {ALLOCATOR}\n"
    );
    println!(
        "| cap | max VmRSS (MiB) | max memory_bytes (MiB) | slot tables (MiB) | runs (MiB) | \
         writer M blocks/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let mut rows: Vec<[f64; 5]> = Vec::new();
    for &cap in caps {
        let run = std::process::Command::new(&exe)
            .args(["--minutes", &minutes.to_string(), "--cap", &cap.to_string()])
            .args([
                "--warmup-s",
                &warmup_s.to_string(),
                "--ttl-ms",
                &ttl_ms.to_string(),
            ])
            .args(["--clear-every", &clear.to_string()])
            // Each child draws its own bar on the inherited stderr.
            .args(quiet.then_some("--quiet"))
            .stderr(std::process::Stdio::inherit())
            .output();
        let out = match run {
            Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
            Err(e) => {
                eprintln!("churn: run with cap {cap} failed to start: {e}");
                return ExitCode::FAILURE;
            }
        };
        let Some(kv) = parse_summary(&out) else {
            eprintln!("churn: run with cap {cap} printed no summary:\n{out}");
            return ExitCode::FAILURE;
        };
        let get = |k: &str| kv.iter().find(|(n, _)| n == k).map_or(0.0, |x| x.1);
        let row = [
            cap as f64,
            get("rss_max_kib") * 1024.0,
            get("mem_max"),
            get("tables_max"),
            get("runs_max"),
        ];
        let mib = |b: f64| b / 1048576.0;
        println!(
            "| {cap} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} |",
            mib(row[1]),
            mib(row[2]),
            mib(row[3]),
            mib(row[4]),
            get("blocks_per_s") / 1e6
        );
        rows.push(row);
    }
    let xs: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    let col = |i: usize| rows.iter().map(|r| r[i]).collect::<Vec<f64>>();
    let (rss_a, rss_b) = fit(&xs, &col(1));
    let (mem_a, mem_b) = fit(&xs, &col(2));
    let (_, tab_b) = fit(&xs, &col(3));
    let (_, node_b) = fit(&xs, &col(4));
    let ok = rss_b <= 32.0;
    println!();
    println!(
        "RSS = {:.1} MiB + {rss_b:.2} B × entries (memory_bytes = {:.1} MiB + {mem_b:.2} B × \
         entries; slot tables {tab_b:.2} B, runs {node_b:.2} B per entry)",
        rss_a / 1048576.0,
        mem_a / 1048576.0
    );
    println!(
        "per-entry RSS {rss_b:.2} B (bar ≤ 32 B per entry plus a fixed baseline): {}",
        if ok { "PASS" } else { "FAIL" }
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
