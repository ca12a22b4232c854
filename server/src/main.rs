//! `inferencecache-server`: one process, one index, three listeners.
//!
//! gRPC (`inferencecache.v1alpha1.InferenceCache`, health, reflection) on `:9090`, public HTTP
//! (`/healthz`, `/readyz`) on `:8080`. Every default is embedded, so running the binary with no
//! arguments serves a working (empty) index.

use inferencecache_server::{config::parse_command_line, run};
use std::process::ExitCode;
use std::time::Duration;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Period of the allocator's forced collection.
const ALLOCATOR_COLLECT_INTERVAL: Duration = Duration::from_secs(1);

/// Starts a thread that forces mimalloc's collection once a second: freed pages go back to
/// the OS then, not only when the thread that owns them allocates again. Without it, what the
/// sweep frees after a churn wave (expired tenants, replica ids, models: issue 42) stays
/// resident while the producers' connection threads are quiet (mimalloc purges a freed page
/// after its purge delay, but only from within later allocator calls). A forced collection
/// with nothing to return costs microseconds.
fn start_allocator_collector() {
    let spawned = std::thread::Builder::new()
        .name("inferencecache-alloc-collect".into())
        .spawn(|| {
            loop {
                std::thread::sleep(ALLOCATOR_COLLECT_INTERVAL);
                // SAFETY: `mi_collect` has no preconditions; any thread may call it at any time.
                unsafe { libmimalloc_sys::mi_collect(true) };
            }
        });
    if let Err(err) = spawned {
        eprintln!("inferencecache-server: cannot start the allocator collector: {err}");
    }
}

fn main() -> ExitCode {
    let args = inferencecache_server::config::normalize_args(std::env::args_os());
    // Flags, then the optional --config file beneath them (exit 2 on any error).
    let cli = match parse_command_line(args) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    start_allocator_collector();
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
