//! Identity churn in waves against the real server binary (issue #42): what a churned tenant,
//! replica id or model costs in resident memory while it is live, and whether the server gives
//! that memory back once the identity's entries expired.
//!
//! ```text
//! churn-waves --server target/release/inferencecache-server --kind tenant|replica|model
//!     [--count 20000] [--waves 4] [--blocks 2] [--ttl-ms 5000] [--sweep-ms 1000] [--streams 4]
//!     [--peak-bar-bytes 2048] [--expiry-bar-mib 50]
//! ```
//!
//! The binary starts the server on loopback (free ports), with `--ttl` and `--sweep-interval`
//! from the flags, and drives it over gRPC:
//!
//! 1. **Warm-up**: 200 identities of the kind, then waits until they expired. The server's
//!    fixed costs that the first traffic brings (connection buffers, runtime workers, lazily
//!    created metric families) are in the baseline, not charged to the churned identities.
//!    Baseline = VmRSS after the warm-up.
//! 2. **Each wave**: `--count` fresh identities (never seen before, not reused across waves),
//!    one `CacheStateUpdate` each holding a chain of `--blocks` blocks, over `--streams`
//!    concurrent `ReportCacheState` streams. The wave's peak RSS is the process's `VmHWM`,
//!    reset before the wave (`/proc/PID/clear_refs` ← 5), or the highest `VmRSS` sampled every
//!    20 ms when the reset is not permitted. Then it waits until `/metrics` reports 0 entries
//!    and 0 engine memory (every entry expired and swept), plus two sweep intervals and
//!    `--settle-ms`, and reads `VmRSS`. Where the peak is: `VmHWM` is also read right after
//!    the ingest and after the `/metrics` scrape that reads the live gauges, and printed per
//!    identity beside the wave's peak ("peak by phase: ingest / scrape / expiry"): what rises
//!    after the ingest is the scrape's and the expiring sweep's transient memory.
//!
//! Bars (exit 1 when one is missed): for every wave, (peak − baseline) / count ≤
//! `--peak-bar-bytes`, and RSS after expiry ≤ baseline + `--expiry-bar-mib`. Loopback only.

use clap::{Parser, ValueEnum};
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Endpoint;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Kind {
    /// A new tenant per update (one model, one replica id).
    Tenant,
    /// A new replica id per update (one tenant, one model).
    Replica,
    /// A new model per update (one tenant, one replica id).
    Model,
}

#[derive(Parser, Clone)]
#[command(
    about = "Identity churn in waves against the server binary: RSS per identity and after expiry"
)]
struct Args {
    /// The inferencecache-server binary to start.
    #[arg(long)]
    server: PathBuf,
    /// Which identity is new in every update.
    #[arg(long, value_enum)]
    kind: Kind,
    /// Fresh identities per wave.
    #[arg(long, default_value_t = 20_000)]
    count: usize,
    /// Waves in a row, each expired before the next.
    #[arg(long, default_value_t = 4)]
    waves: usize,
    /// Blocks of the one chain each identity's update holds.
    #[arg(long, default_value_t = 2)]
    blocks: usize,
    /// Server `--ttl`, in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    ttl_ms: u64,
    /// Server `--sweep-interval`, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    sweep_ms: u64,
    /// Concurrent ReportCacheState streams (one connection each).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Bar: peak RSS above the baseline per live identity, in bytes.
    #[arg(long, default_value_t = 2_048)]
    peak_bar_bytes: u64,
    /// Bar: RSS after each wave expired, above the baseline, in MiB.
    #[arg(long, default_value_t = 50)]
    expiry_bar_mib: u64,
    /// Wait after the wave's entries expired and two more sweeps ran, before RSS is read, in
    /// milliseconds (the allocator returns freed pages after a delay: mimalloc's purge delay).
    #[arg(long, default_value_t = 2_000)]
    settle_ms: u64,
    /// Longest wait for a wave's entries to expire, in seconds.
    #[arg(long, default_value_t = 120)]
    expiry_timeout_s: u64,
    /// Extra arguments passed to the server (repeatable).
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Kills the server when the run ends, however it ends.
struct ServerProcess(Child);

impl Drop for ServerProcess {
    /// SIGTERM first (a graceful stop, so that allocator statistics asked for with
    /// `MIMALLOC_SHOW_STATS=1` are printed at exit), SIGKILL after 10 s.
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16, Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One field of `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(pid: u32, field: &str) -> Result<u64, Error> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
        .ok_or_else(|| format!("no {field} in /proc/{pid}/status"))?;
    let kib: u64 = line[field.len() + 1..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib * 1024)
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS; false when not permitted.
fn reset_peak(pid: u32) -> bool {
    std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/clear_refs"))
        .and_then(|mut f| f.write_all(b"5"))
        .is_ok()
}

fn http_get(port: u16, path: &str) -> Result<(u16, String), Error> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no end of headers")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or("no status code")?;
    Ok((code, body.to_string()))
}

/// The sum of every sample of one unlabeled-or-labeled gauge family in a `/metrics` body.
fn gauge_sum(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// (entries, engine memory bytes) from `/metrics`.
fn index_state(http: u16) -> Result<(f64, f64), Error> {
    let (code, body) = http_get(http, "/metrics")?;
    if code != 200 {
        return Err(format!("/metrics answered {code}").into());
    }
    Ok((
        gauge_sum(&body, "inferencecache_index_entries"),
        gauge_sum(&body, "inferencecache_index_memory_bytes"),
    ))
}

/// The update that makes identity `serial` of `kind` live, with a chain of `blocks` blocks.
fn update(kind: Kind, serial: u64, blocks: usize) -> CacheStateUpdate {
    let id = format!("churn-{serial:010}");
    let (tenant, model, replica) = match kind {
        Kind::Tenant => (id, "m".to_string(), "r0".to_string()),
        Kind::Replica => ("t".to_string(), "m".to_string(), id),
        Kind::Model => ("t".to_string(), id, "r0".to_string()),
    };
    let block_hashes: Vec<Vec<u8>> = (0..blocks as u64)
        .map(|b| {
            let mut hash = serial.to_be_bytes().to_vec();
            hash.extend_from_slice(&b.to_be_bytes());
            hash
        })
        .collect();
    CacheStateUpdate {
        replica_id: replica,
        model_id: model,
        tenant_id: tenant,
        hash_scheme: "vllm".into(),
        prefixes: vec![PrefixEntry {
            prefix_hash: block_hashes.last().cloned().unwrap_or_default(),
            token_count: 16 * blocks as i32,
            block_token_counts: vec![16; blocks],
            block_hashes,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Ingests identities `first..first + count` over `streams` concurrent streams.
async fn ingest(
    target: &str,
    kind: Kind,
    first: u64,
    count: usize,
    blocks: usize,
    streams: usize,
) -> Result<(), Error> {
    let streams = streams.max(1);
    let per = count.div_ceil(streams) as u64;
    let end = first + count as u64;
    let mut tasks = Vec::new();
    for s in 0..streams as u64 {
        let (from, to) = ((first + s * per).min(end), (first + (s + 1) * per).min(end));
        let channel = Endpoint::from_shared(target.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await?;
        tasks.push(tokio::spawn(async move {
            let mut client = InferenceCacheClient::new(channel);
            let updates = (from..to).map(move |serial| update(kind, serial, blocks));
            let ack = client
                .report_cache_state(tokio_stream::iter(updates))
                .await?
                .into_inner();
            if !ack.accepted {
                return Err::<(), Error>(format!("Ack not accepted: {}", ack.reason_code).into());
            }
            Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// Waits until every entry expired and was swept (0 entries, 0 engine bytes), then two more
/// sweep intervals (the sweep that reclaims the emptied records runs after the one that
/// removed their last entry).
async fn await_expiry(
    http: u16,
    sweep: Duration,
    settle: Duration,
    timeout: Duration,
) -> Result<Duration, Error> {
    let started = Instant::now();
    loop {
        let (entries, bytes) = index_state(http)?;
        if entries == 0.0 && bytes == 0.0 {
            break;
        }
        if started.elapsed() > timeout {
            return Err(format!(
                "entries did not expire in {timeout:?}: {entries} entries, {bytes} bytes"
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expired_after = started.elapsed();
    tokio::time::sleep(sweep * 2 + Duration::from_millis(200) + settle).await;
    Ok(expired_after)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

async fn run(args: Args) -> Result<bool, Error> {
    let (grpc, http, control) = (free_port()?, free_port()?, free_port()?);
    let mut command = Command::new(&args.server);
    command
        .args([
            "--grpc-bind-address",
            &format!("127.0.0.1:{grpc}"),
            "--http-bind-address",
            &format!("127.0.0.1:{http}"),
            "--snapshot-bind-address",
            &format!("127.0.0.1:{control}"),
            "--ttl",
            &format!("{}ms", args.ttl_ms),
            "--sweep-interval",
            &format!("{}ms", args.sweep_ms),
            "--log-level",
            "warn",
        ])
        .args(&args.server_args)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let server = ServerProcess(
        command
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", args.server.display()))?,
    );
    let pid = server.0.id();
    let ready_by = Instant::now() + Duration::from_secs(30);
    while !matches!(http_get(http, "/readyz"), Ok((200, _))) {
        if Instant::now() > ready_by {
            return Err("server not ready in 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let target = format!("http://127.0.0.1:{grpc}");
    let sweep = Duration::from_millis(args.sweep_ms);
    let expiry_timeout = Duration::from_secs(args.expiry_timeout_s);
    let settle = Duration::from_millis(args.settle_ms);

    // Warm-up: identities above every wave's range.
    let warm_first = u64::MAX / 2;
    ingest(
        &target,
        args.kind,
        warm_first,
        200,
        args.blocks,
        args.streams,
    )
    .await?;
    await_expiry(http, sweep, settle, expiry_timeout).await?;
    let baseline = status_bytes(pid, "VmRSS")?;
    println!(
        "churn-waves: kind {:?}, {} per wave, {} waves, {} blocks each, TTL {} ms, sweep {} ms, {} streams; \
         server {} (pid {pid}); baseline RSS {:.1} MiB after a 200-identity warm-up",
        args.kind,
        args.count,
        args.waves,
        args.blocks,
        args.ttl_ms,
        args.sweep_ms,
        args.streams,
        args.server.display(),
        mib(baseline)
    );
    let mut ok = true;
    for wave in 0..args.waves {
        let hwm_reset = reset_peak(pid);
        // Sampled peak, used when the kernel peak cannot be reset (and as a cross-check).
        let sampled = Arc::new(AtomicU64::new(status_bytes(pid, "VmRSS")?));
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (sampled, stop) = (sampled.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(rss) = status_bytes(pid, "VmRSS") {
                        sampled.fetch_max(rss, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let started = Instant::now();
        ingest(
            &target,
            args.kind,
            (wave * args.count) as u64,
            args.count,
            args.blocks,
            args.streams,
        )
        .await?;
        let ingest_took = started.elapsed();
        // Where the wave's peak is: the kernel's peak read after the ingest, after the scrape
        // that reads the live gauges, and at the end (the sweeps that expire the wave).
        let peak_ingest = status_bytes(pid, "VmHWM")?;
        let (live_entries, live_bytes) = index_state(http)?;
        let peak_scrape = status_bytes(pid, "VmHWM")?;
        let expired_after = await_expiry(http, sweep, settle, expiry_timeout).await?;
        stop.store(true, Ordering::Relaxed);
        sampler.await?;
        let peak = if hwm_reset {
            status_bytes(pid, "VmHWM")?.max(sampled.load(Ordering::Relaxed))
        } else {
            sampled.load(Ordering::Relaxed)
        };
        let after = status_bytes(pid, "VmRSS")?;
        let per = |bytes: u64| bytes.saturating_sub(baseline) / args.count.max(1) as u64;
        let per_identity = per(peak);
        let peak_ok = per_identity <= args.peak_bar_bytes;
        let after_ok = after <= baseline + args.expiry_bar_mib * 1024 * 1024;
        ok &= peak_ok && after_ok;
        println!(
            "wave {}: ingest {:.2} s; after ingest {} entries, engine {:.1} MiB ({:.0} B/identity); \
             peak RSS {:.1} MiB ({} B/identity above baseline, bar {}: {}); expired after {:.1} s; \
             RSS after expiry {:.1} MiB ({:+.1} MiB vs baseline, bar +{}: {}); \
             peak by phase{}: ingest {} / scrape {} / expiry {} B/identity",
            wave + 1,
            ingest_took.as_secs_f64(),
            live_entries,
            mib(live_bytes as u64),
            live_bytes / args.count.max(1) as f64,
            mib(peak),
            per_identity,
            args.peak_bar_bytes,
            if peak_ok { "met" } else { "MISSED" },
            expired_after.as_secs_f64(),
            mib(after),
            mib(after) - mib(baseline),
            args.expiry_bar_mib,
            if after_ok { "met" } else { "MISSED" },
            if hwm_reset {
                ""
            } else {
                " (no peak reset: process peaks)"
            },
            per(peak_ingest),
            per(peak_scrape),
            per(peak),
        );
    }
    drop(server);
    Ok(ok)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("churn-waves: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            println!("FAIL: a bar was missed (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("churn-waves: {e}");
            ExitCode::FAILURE
        }
    }
}
