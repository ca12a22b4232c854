//! Warm-restart checkpoint bench (issue "Warm restart"): W1M's generator with `--chains`
//! chains (163,840 → 10,485,760 entries), then
//!
//! 1. one checkpoint written into `--dir` (time, bytes, bytes per entry),
//! 2. lookup latency idle and while checkpoints are written back to back on a pool of
//!    `--checkpoint-threads` workers (p50/p99 and their ratio),
//! 3. the restore in a fresh child process (`--restore-only`): time, and its peak RSS
//!    (`VmHWM`) against the restored index's RSS (`VmRSS` after the load).
//!
//! `cargo run --release -p inferencecache-bench --bin checkpoint -- --chains 163840`

use clap::Parser;
use inferencecache_bench::measure::{percentile, vm_rss_bytes};
use inferencecache_bench::ours::{self, COUNTS};
use inferencecache_bench::w1m::{Workload, wire};
use inferencecache_engine::checkpoint::{files, write::WriteOptions};
use inferencecache_engine::{Index, LookupRequest, RouteBuffer};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(about = "Checkpoint write, restore and lookup-during-checkpoint figures on W1M data")]
struct Args {
    /// W1M chains (64 entries each).
    #[arg(long, default_value_t = 163_840)]
    chains: usize,
    /// State directory for the checkpoint files (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Workers of the checkpoint pool while lookups are measured (the server's setting).
    #[arg(long, default_value_t = 1)]
    checkpoint_threads: usize,
    /// Seconds of lookups per phase (idle, during checkpoints).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Only restore `--dir` in this process and print its figures (used by the parent).
    #[arg(long)]
    restore_only: bool,
}

fn vm_hwm_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn restore_only(dir: &std::path::Path) {
    let ix = ours::new_index();
    let before = vm_rss_bytes();
    let t = Instant::now();
    let r = files::restore_newest(&ix, dir);
    let el = t.elapsed();
    let (_, report) = r.restored.expect("a checkpoint to restore");
    let rss = vm_rss_bytes();
    let hwm = vm_hwm_bytes();
    println!(
        "restore entries={} loaded={} seconds={:.3} rss_before={} rss_after={} peak={} peak_over_rss={:.3} storage_entries={}",
        report.entries,
        report.outcome.loaded,
        el.as_secs_f64(),
        before,
        rss,
        hwm,
        hwm as f64 / rss as f64,
        ix.storage_entries()
    );
}

/// Lookups (half-chain prefixes of random chains) for `seconds`: per-call latencies (ns).
fn lookups(ix: &Index, w: &Workload, seconds: u64, stop: &AtomicBool) -> Vec<u64> {
    let mut buf = RouteBuffer::new();
    let mut out = Vec::with_capacity(4_000_000);
    let mut rng = inferencecache_bench::w1m::Xorshift64(42);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let keys: Vec<_> = (0..w.chains.min(4096))
        .map(|c| wire(&w.seq[c * (w.chains / 4096).max(1) % w.chains]))
        .collect();
    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        for _ in 0..256 {
            let k = &keys[(rng.next() % keys.len() as u64) as usize];
            let req = LookupRequest {
                block_hashes: &k[..32],
                block_token_counts: &COUNTS[..32],
                ..LookupRequest::new(ours::TENANT, ours::MODEL, ours::SCHEME)
            };
            let t = Instant::now();
            let s = ix.lookup_route_into(&req, &mut buf);
            out.push(t.elapsed().as_nanos() as u64);
            std::hint::black_box(s);
        }
    }
    out
}

fn main() {
    let args = Args::parse();
    let dir = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("ic-ckpt-bench-{}", std::process::id()))
    });
    if args.restore_only {
        restore_only(&dir);
        return;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let w = Workload::new(args.chains);
    let ix = Arc::new(ours::new_index());
    let t = Instant::now();
    for (c, keys) in w.wire_events().iter().enumerate() {
        ours::ingest_chain(&ix, c, keys);
    }
    println!(
        "ingest chains={} storage_entries={} seconds={:.3} rss={}",
        args.chains,
        ix.storage_entries(),
        t.elapsed().as_secs_f64(),
        vm_rss_bytes()
    );
    let entries = ix.storage_entries() as f64;

    // 1. One checkpoint on the default pool (every core), as a shutdown write runs.
    let r = files::write_to_dir(&ix, &dir, &WriteOptions::default()).expect("write checkpoint");
    println!(
        "write entries={} bytes={} bytes_per_entry={:.2} seconds={:.3} threads={}",
        r.entries,
        r.bytes,
        r.bytes as f64 / entries,
        r.duration.as_secs_f64(),
        rayon::current_num_threads()
    );

    // 2. Lookup latency idle, then while checkpoints are written back to back.
    let stop = AtomicBool::new(false);
    let idle = {
        let mut v = lookups(&ix, &w, args.seconds, &stop);
        v.sort_unstable();
        v
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.checkpoint_threads)
        .build()
        .expect("a rayon pool");
    let writing = AtomicBool::new(true);
    let written = std::sync::atomic::AtomicU64::new(0);
    let during = std::thread::scope(|s| {
        s.spawn(|| {
            while writing.load(Ordering::Relaxed) {
                pool.install(|| {
                    files::write_to_dir(&ix, &dir, &WriteOptions::default()).expect("write")
                });
                written.fetch_add(1, Ordering::Relaxed);
            }
        });
        let mut v = lookups(&ix, &w, args.seconds, &stop);
        writing.store(false, Ordering::Relaxed);
        v.sort_unstable();
        v
    });
    let (i50, i99) = (percentile(&idle, 0.5), percentile(&idle, 0.99));
    let (d50, d99) = (percentile(&during, 0.5), percentile(&during, 0.99));
    println!(
        "lookup idle_p50_ns={i50:.0} idle_p99_ns={i99:.0} during_p50_ns={d50:.0} during_p99_ns={d99:.0} p99_ratio={:.3} checkpoints_during={} checkpoint_threads={} samples_idle={} samples_during={}",
        d99 / i99,
        written.load(Ordering::Relaxed),
        args.checkpoint_threads,
        idle.len(),
        during.len()
    );
    drop(ix);

    // 3. The restore in a fresh process.
    let exe = std::env::current_exe().expect("this binary");
    let out = std::process::Command::new(exe)
        .args(["--restore-only", "--dir"])
        .arg(&dir)
        .output()
        .expect("run the restore");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
