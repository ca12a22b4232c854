//! `ic-loadgen`: load generator for a running InferenceCache server (see `bench/README.md`).
//!
//! ```text
//! cargo run --release -p inferencecache-bench --bin ic-loadgen -- --target http://127.0.0.1:9090
//! ```
//!
//! Exit codes: 0 = done, no consumer RPC failed; 1 = at least one LookupRoute returned a gRPC
//! error; 2 = could not run (bad flags, server unreachable, report not writable).

use std::process::ExitCode;

use clap::Parser;
use inferencecache_bench::loadgen::{self, Args};

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ic-loadgen: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let report = match runtime.block_on(loadgen::run(&args, !args.quiet)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ic-loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    print!("{}", report.summary());
    match report.write(&args.out) {
        Ok(svg) => println!(
            "  report    {} (plot {})",
            args.out.display(),
            svg.display()
        ),
        Err(e) => {
            eprintln!("ic-loadgen: cannot write the report: {e}");
            return ExitCode::from(2);
        }
    }
    if report.consumer_error_count() > 0 {
        eprintln!(
            "ic-loadgen: {} LookupRoute calls failed with a gRPC error",
            report.consumer_error_count()
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
