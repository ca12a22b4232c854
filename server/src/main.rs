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

/// Turns transparent huge pages off for this process (Linux), unless the operator chose
/// mimalloc's own setting (`MIMALLOC_ALLOW_THP` set). mimalloc asks for huge pages on its
/// arenas (`madvise`), so a few records on a fresh 2 MiB range made the whole range resident:
/// with them, a churned tenant cost 3.0-4.0 KiB of peak RSS and the pre-churn baseline was
/// 29-34 MiB; without them, 2.7-2.9 KiB and ~23 MiB (issue 42, bench/results/churn-waves.md).
/// The index's own key tables do not ask for huge pages (`engine/src/raw/pages.rs`). Called
/// first in `main`, before the runtime's threads allocate: pages already huge stay so, later
/// faults map small pages.
fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and sets a flag of this
        // process; it touches no memory of ours.
        let status = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        if status != 0 {
            eprintln!(
                "inferencecache-server: cannot turn transparent huge pages off: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

fn main() -> ExitCode {
    disable_transparent_huge_pages();
    inferencecache_server::allocator::set_purge_delay();
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
