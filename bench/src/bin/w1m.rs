//! W1M on InferenceCache (`benchmarks.md` §2–§3).
//!
//! ```text
//! w1m [--chains N] [--queries N] [--json] [--smoke] [--quiet]
//! w1m --report FILE...      # aggregate JSON lines of several processes into markdown
//! ```
//!
//! `w1m --help` describes every flag. While the bench runs, a spinner with the elapsed time
//! draws on stderr (hidden with `--quiet` or when stderr is not a terminal).
//!
//! Exits non-zero when any check fails (sums, scores, entry counts).

use std::process::ExitCode;

use clap::Parser;
use inferencecache_bench::host::ALLOCATOR;
use inferencecache_bench::measure::{Plan, Recorder};
use inferencecache_bench::ours;
use inferencecache_bench::progress;
use inferencecache_bench::report::Aggregate;
use inferencecache_bench::w1m::{
    CHAINS_FULL, CHAINS_SMOKE, QUERIES, Queries, Workload, parse_chains,
};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// W1M on InferenceCache: load the workload, time the query sets, check every answer (exit 1
/// when a check fails).
#[derive(Debug, Parser)]
#[command(name = "w1m", version)]
struct Args {
    /// Chains of the workload (default: the full W1M size, or the smoke size with --smoke).
    #[arg(long, value_parser = parse_chains)]
    chains: Option<usize>,
    /// Queries per query set (default: W1M's, or 10,000 with --smoke).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    queries: Option<u64>,
    /// Print one JSON line of results instead of the tables.
    #[arg(long)]
    json: bool,
    /// A short run: the smoke workload, 1,000 warm-up queries, 3 rounds.
    #[arg(long)]
    smoke: bool,
    /// Aggregate the JSON lines of these files (several processes) into Markdown and exit.
    #[arg(long, num_args = 1.., value_name = "FILE", conflicts_with_all = ["chains", "queries", "json", "smoke"])]
    report: Vec<String>,
    /// No progress spinner.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let chains = args.chains.unwrap_or(if args.smoke {
        CHAINS_SMOKE
    } else {
        CHAINS_FULL
    });
    let queries = args
        .queries
        .map_or(if args.smoke { 10_000 } else { QUERIES }, |q| {
            usize::try_from(q).unwrap_or(usize::MAX)
        });
    if !args.report.is_empty() {
        let mut text = String::new();
        for f in &args.report {
            match std::fs::read_to_string(f) {
                Ok(t) => text.push_str(&t),
                Err(e) => {
                    eprintln!("{f}: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        let a = Aggregate::from_lines(text.lines());
        println!("### Side by side (medians)\n\n{}", a.table());
        println!(
            "### Pass bars (same-run ratios of medians; P6 over our core: the median of per-process ratios)\n\n{}",
            a.pass_bars()
        );
        println!("### Spread across processes\n\n{}", a.spread());
        return ExitCode::SUCCESS;
    }

    let plan = if args.smoke {
        Plan {
            warmup: 1_000,
            rounds: 3,
        }
    } else {
        Plan::FULL
    };
    let bar = progress::spinner(
        &format!("W1M: {chains} chains, {queries} queries per set"),
        args.quiet,
    );
    let w = Workload::new(chains);
    let q = Queries::generate(chains, queries);
    let mut rec = Recorder::default();
    let res = ours::run(&w, &q, plan, &mut rec);
    bar.finish_and_clear();
    let extra = format!(
        ",\"allocator\":\"{ALLOCATOR}\",\"chains\":{},\"queries\":{}",
        chains, queries
    );
    if args.json {
        rec.print_json(&extra);
    } else {
        println!(
            "W1M InferenceCache: {} chains, {} entries, {} queries/set, warm-up {}, {} rounds, allocator {ALLOCATOR}",
            chains,
            w.entries(),
            queries,
            plan.warmup,
            plan.rounds
        );
        rec.print_table();
        let g = |r: &str, m: &str| rec.get(r, m).unwrap_or(f64::NAN);
        println!(
            "memory: RSS delta {:.1} MiB ({:.1} B/entry), memory_bytes() {:.1} MiB ({:.1} B/entry)",
            g(ours::ROW_CORE, "rss_delta_mib"),
            g(ours::ROW_CORE, "rss_b_entry"),
            g(ours::ROW_CORE, "mem_mib"),
            g(ours::ROW_CORE, "mem_b_entry"),
        );
        println!(
            "P6 full/core: Q50 mean {:.2}× p99 {:.2}×, Q100 mean {:.2}× p99 {:.2}×",
            g(ours::ROW_ROUTE, "p6_q50_mean_ratio"),
            g(ours::ROW_ROUTE, "p6_q50_p99_ratio"),
            g(ours::ROW_ROUTE, "p6_q100_mean_ratio"),
            g(ours::ROW_ROUTE, "p6_q100_p99_ratio"),
        );
    }
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("W1M CHECK FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
