//! Index throughput on a Mooncake-format trace (issue #44, part 1), workspace side:
//! InferenceCache beside the reference model (`inferencecache_bench::mooncake::Reference`),
//! every answer checked against the simulator's truth. The peers (kv-index 2.0, Dynamo CRTC and
//! RadixTree) run in the same plan from `bench/peers` (`mooncake-replay-peers`).
//!
//! ```text
//! mooncake-replay [--trace FILE] [--requests N] [--copies N] [--workers N] [--capacity BLOCKS]
//!                 [--threads 1,2] [--out FILE] [--quick]
//! ```
//!
//! The last line printed is the ratio line. Exit 1 when a check fails, 2 on bad arguments.

use std::process::ExitCode;

use inferencecache_bench::mooncake_bench::{self, Args, Subject};
use inferencecache_bench::mooncake_ours::{OursSubject, ReferenceSubject};

fn main() -> ExitCode {
    let args = match Args::parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let (trace, sim) = match args.simulate() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let subjects: Vec<Box<dyn Subject>> = vec![
        Box::new(OursSubject {
            workers: args.workers,
        }),
        Box::new(ReferenceSubject {
            workers: args.workers,
        }),
    ];
    mooncake_bench::main_with(
        &args,
        &trace,
        &sim,
        &subjects,
        " (peer here: the reference model; the real peers run in bench/peers)",
    )
}
