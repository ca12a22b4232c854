//! P6 probe: W1M's core match, `lookup_route` and `lookup_route_into`, timed in alternating
//! blocks over the same queries so that host noise hits them alike; `--set` and `--variant`
//! run one path alone (for `perf record` or `valgrind --tool=cachegrind`).
//!
//! ```text
//! route-ab [--chains N] [--blocks N] [--block-queries N] [--set q50|q100|q0] [--variant 0|1|2]
//! ```
//!
//! Prints, per query set, the median and minimum per-query time of each variant over the
//! blocks, and the ratios of the medians to the core match. Blocks should be long (the default
//! is a whole query set): a variant that follows another over the same few thousand queries
//! finds their lines in cache and looks cheaper than it is.

use std::hint::black_box;
use std::time::Instant;

use clap::Parser;
use inferencecache_bench::ours::{self, WireQueries};
use inferencecache_bench::w1m::{CHAINS_FULL, Kind, Queries, Workload, parse_chains};
use inferencecache_engine::{MatchScratch, RouteBuffer};

#[derive(Debug, Parser)]
#[command(name = "route-ab")]
struct Args {
    /// Chains of the workload.
    #[arg(long, value_parser = parse_chains, default_value_t = CHAINS_FULL)]
    chains: usize,
    /// Alternating blocks per variant.
    #[arg(long, default_value_t = 10)]
    blocks: usize,
    /// Queries per block.
    #[arg(long, default_value_t = 100_000)]
    block_queries: usize,
    /// Only this query set (q50, q100, q0).
    #[arg(long)]
    set: Option<String>,
    /// Only this variant (0 core, 1 route, 2 route_into): for profiling one path.
    #[arg(long)]
    variant: Option<usize>,
}

fn main() {
    let args = Args::parse();
    let w = Workload::new(args.chains);
    let q = Queries::generate(args.chains, 100_000);
    let wq = WireQueries::new(&q);
    let ix = ours::new_index();
    ours::insert(&ix, &w.wire_events());
    let Some(part) = ix.partition(ours::TENANT, ours::MODEL, ours::SCHEME, ours::ADAPTER) else {
        eprintln!("W1M partition missing");
        std::process::exit(1);
    };
    let mut scratch = MatchScratch::default();
    let mut buf = RouteBuffer::new();
    for kind in Kind::ALL {
        if args.set.as_deref().is_some_and(|s| s != kind.label()) {
            continue;
        }
        let set = wq.set(kind);
        let mut times: [Vec<f64>; 3] = Default::default();
        let mut start = 0usize;
        for _ in 0..args.blocks {
            for (v, out) in times.iter_mut().enumerate() {
                if args.variant.is_some_and(|only| only != v) {
                    out.push(1.0);
                    continue;
                }
                let t = Instant::now();
                for i in 0..args.block_queries {
                    let query = &set[(start + i) % set.len()];
                    match v {
                        0 => {
                            black_box(ours::core_op(&ix, part, query, &mut scratch));
                        }
                        1 => {
                            black_box(ix.lookup_route(&ours::request(query)));
                        }
                        _ => {
                            black_box(ix.lookup_route_into(&ours::request(query), &mut buf));
                        }
                    }
                }
                out.push(t.elapsed().as_nanos() as f64 / args.block_queries as f64);
            }
            start += args.block_queries;
        }
        let stat = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (v[v.len() / 2], v[0])
        };
        let [core, route, into] = &mut times;
        let (c, cmin) = stat(core);
        let (r, rmin) = stat(route);
        let (i, imin) = stat(into);
        println!(
            "{:5} core {c:7.1} (min {cmin:7.1})  route {r:7.1} (min {rmin:7.1})  into {i:7.1} (min {imin:7.1})  route/core {:.3}  into/core {:.3}",
            kind.label(),
            r / c,
            i / c
        );
    }
}
