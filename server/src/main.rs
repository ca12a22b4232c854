//! `inferencecache-server`: one process, one index, three listeners.
//!
//! gRPC (`inferencecache.v1alpha1.InferenceCache`, health, reflection) on `:9090`, public HTTP
//! (`/healthz`, `/readyz`) on `:8080`. Every default is embedded, so running the binary with no
//! arguments serves a working (empty) index.

use inferencecache_server::{config::parse_command_line, run};
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = inferencecache_server::config::normalize_args(std::env::args_os());
    // Flags, then the optional --config file beneath them (exit 2 on any error).
    let cli = match parse_command_line(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("inferencecache-server: cannot start the async runtime: {err}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(run(cli))
}
