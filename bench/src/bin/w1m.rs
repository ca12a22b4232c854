//! W1M on InferenceCache (`benchmarks.md` §2–§3).
//!
//! ```text
//! w1m [--chains N] [--queries N] [--json] [--smoke]
//! w1m --report FILE...      # aggregate JSON lines of several processes into markdown
//! ```
//!
//! Exits non-zero when any check fails (sums, scores, entry counts).

use std::process::ExitCode;

use inferencecache_bench::host::ALLOCATOR;
use inferencecache_bench::measure::{Plan, Recorder};
use inferencecache_bench::ours;
use inferencecache_bench::report::Aggregate;
use inferencecache_bench::w1m::{CHAINS_FULL, CHAINS_SMOKE, QUERIES, Queries, Workload};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Args {
    chains: usize,
    queries: usize,
    json: bool,
    smoke: bool,
    report: Vec<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        chains: CHAINS_FULL,
        queries: QUERIES,
        json: false,
        smoke: false,
        report: Vec::new(),
    };
    let mut chains_set = false;
    let mut queries_set = false;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--chains" => {
                a.chains = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n: &usize| n >= 8)
                    .ok_or("--chains needs a number ≥ 8")?;
                chains_set = true;
            }
            "--queries" => {
                a.queries = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n: &usize| n > 0)
                    .ok_or("--queries needs a positive number")?;
                queries_set = true;
            }
            "--json" => a.json = true,
            "--smoke" => a.smoke = true,
            "--report" => {
                a.report.extend(it.by_ref());
            }
            "-h" | "--help" => {
                return Err(
                    "usage: w1m [--chains N] [--queries N] [--json] [--smoke] | --report FILE..."
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.smoke {
        if !chains_set {
            a.chains = CHAINS_SMOKE;
        }
        if !queries_set {
            a.queries = 10_000;
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
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
            "### Pass bars (same-run ratios of medians)\n\n{}",
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
    let w = Workload::new(args.chains);
    let q = Queries::generate(args.chains, args.queries);
    let mut rec = Recorder::default();
    let res = ours::run(&w, &q, plan, &mut rec);
    let extra = format!(
        ",\"allocator\":\"{ALLOCATOR}\",\"chains\":{},\"queries\":{}",
        args.chains, args.queries
    );
    if args.json {
        rec.print_json(&extra);
    } else {
        println!(
            "W1M InferenceCache: {} chains, {} entries, {} queries/set, warm-up {}, {} rounds, allocator {ALLOCATOR}",
            args.chains,
            w.entries(),
            args.queries,
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
