//! `replication`: replicated mode's throughput and lag on one machine (issue 25).
//!
//! ```text
//! cargo build --release -p inferencecache-server -p inferencecache-bench --bin replication
//! target/release/replication --rates 100000,300000,1000000 --seconds 10 --out bench/results/replication.md
//! ```
//!
//! Starts `nats-server -js` and `--servers` release server binaries on loopback, all in
//! replicated mode. For each offered rate, one producer per server streams chain updates
//! (`--chain-blocks` blocks each) at its share of the rate for `--seconds`, while a probe sends
//! a one-block marker every 100 ms through the servers in turn and polls every server until all
//! of them answer it: the time from the marker's Ack to the last server answering is the
//! replication lag. Reported per rate: blocks/s offered and applied (every server's
//! `inferencecache_ingest_blocks_total`, which counts blocks applied from the stream), lag
//! p50/p99/max, stream bytes per million blocks (`nats-server`'s `/jsz`). Then LookupRoute
//! p50/p99 from a client on the same machine, against a replicated server and against a
//! standalone server holding the same chains, alternated in rounds.

use clap::Parser;
use hdrhistogram::Histogram;
use inferencecache_bench::host::{cpu_model, loadavg, utc_now};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

type Error = Box<dyn std::error::Error + Send + Sync>;
type Client = InferenceCacheClient<Channel>;

#[derive(Parser)]
#[command(about = "Replicated mode: ingest throughput, replication lag, LookupRoute on vs off")]
struct Cli {
    /// The server binary (a release build).
    #[arg(long, default_value = "target/release/inferencecache-server")]
    server_bin: PathBuf,
    /// The NATS server binary.
    #[arg(long, default_value = "nats-server")]
    nats_bin: PathBuf,
    /// Servers in the replicated deployment.
    #[arg(long, default_value_t = 3)]
    servers: usize,
    /// Offered rates, blocks per second (all producers together).
    #[arg(long, value_delimiter = ',', default_values_t = [100_000u64, 300_000, 1_000_000])]
    rates: Vec<u64>,
    /// Seconds per rate.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Blocks per chain update.
    #[arg(long, default_value_t = 64)]
    chain_blocks: u64,
    /// Chains loaded before the LookupRoute comparison.
    #[arg(long, default_value_t = 20_000)]
    lookup_chains: u64,
    /// Lookups per round and server in the comparison.
    #[arg(long, default_value_t = 20_000)]
    lookups: u64,
    /// Print each second's stream position, outbox and applied blocks of the first server.
    #[arg(long)]
    verbose: bool,
    /// Write the Markdown report here too.
    #[arg(long)]
    out: Option<PathBuf>,
}

struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_port(port: u16, what: &str) -> Result<(), Error> {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("{what} did not listen on {port}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// One HTTP/1.1 GET on loopback; the body.
fn http_get(port: u16, path: &str) -> Result<String, Error> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    Ok(raw
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned()))
}

fn metric(port: u16, name: &str) -> f64 {
    http_get(port, "/metrics")
        .ok()
        .and_then(|body| {
            body.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// Stream storage bytes and messages as `nats-server` reports them.
fn jsz(port: u16) -> (u64, u64) {
    let v: serde_json::Value = http_get(port, "/jsz")
        .ok()
        .and_then(|b| serde_json::from_str(&b).ok())
        .unwrap_or_default();
    (
        v["bytes"].as_u64().unwrap_or(0),
        v["messages"].as_u64().unwrap_or(0),
    )
}

struct Server {
    _proc: Proc,
    grpc: u16,
    http: u16,
}

fn start_server(
    bin: &PathBuf,
    nats: Option<u16>,
    id: &str,
    dir: &std::path::Path,
) -> Result<Server, Error> {
    let (grpc, http, control) = (free_port()?, free_port()?, free_port()?);
    let mut cmd = Command::new(bin);
    cmd.args([
        "--grpc-bind-address".to_string(),
        format!("127.0.0.1:{grpc}"),
        "--http-bind-address".into(),
        format!("127.0.0.1:{http}"),
        "--snapshot-bind-address".into(),
        format!("127.0.0.1:{control}"),
        "--max-entries".into(),
        "0".into(),
        "--producer-max-blocks-per-sec".into(),
        "0".into(),
        "--log-level".into(),
        "warn".into(),
    ]);
    if let Some(port) = nats {
        cmd.args([
            "--nats-url".to_string(),
            format!("nats://127.0.0.1:{port}"),
            "--nats-server-id".into(),
            id.into(),
            // No checkpoint upload inside a measured phase.
            "--checkpoint-interval".into(),
            "30m".into(),
            "--nats-max-age".into(),
            "1h".into(),
        ]);
    }
    let log = std::fs::File::create(dir.join(format!("{id}.log")))?;
    let child = cmd.stdout(Stdio::null()).stderr(log).spawn()?;
    let proc = Proc { child };
    wait_port(grpc, id)?;
    let start = Instant::now();
    while http_get(http, "/readyz").is_err()
        || !http_get(http, "/readyz").unwrap_or_default().contains("ok")
    {
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!("{id} not ready").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Server {
        _proc: proc,
        grpc,
        http,
    })
}

async fn client(port: u16) -> Result<Client, Error> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
        .tcp_nodelay(true)
        .connect()
        .await?;
    Ok(InferenceCacheClient::new(ch).max_decoding_message_size(64 << 20))
}

fn block(chain: u64, i: u64) -> Vec<u8> {
    (chain << 16 | i).to_be_bytes().to_vec()
}

fn update(tenant: &str, replica: &str, chain: u64, blocks: u64) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: (0..blocks).map(|i| block(chain, i)).collect(),
            block_token_counts: vec![16; blocks as usize],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn lookup_req(tenant: &str, chain: u64, blocks: u64) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        block_hashes: (0..blocks).map(|i| block(chain, i)).collect(),
        block_token_counts: vec![16; blocks as usize],
        ..Default::default()
    }
}

/// Streams `updates_per_sec` chain updates into `c` until `stop`, chains from `first` on.
async fn produce(
    mut c: Client,
    tenant: String,
    first: u64,
    blocks: u64,
    updates_per_sec: f64,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) -> Result<(), Error> {
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::CacheStateUpdate>(1024);
    let call = tokio::spawn(async move {
        c.report_cache_state(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    let start = Instant::now();
    let mut chain = first;
    let mut done = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let due = (start.elapsed().as_secs_f64() * updates_per_sec) as u64;
        while done < due {
            if tx.send(update(&tenant, "r", chain, blocks)).await.is_err() {
                return Err("producer stream closed".into());
            }
            chain += 1;
            done += 1;
            sent.fetch_add(blocks, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(tx);
    call.await??;
    Ok(())
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).unwrap_or_else(|_| unreachable!())
}

/// Marker every 100 ms through the servers in turn; µs from its Ack to all servers answering.
async fn probe_lag(
    servers: Vec<(Client, Vec<Client>)>,
    stop: Arc<AtomicBool>,
) -> Result<Histogram<u64>, Error> {
    let mut h = hist();
    let mut servers = servers;
    let mut marker = 1u64 << 40;
    let mut turn = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let n = servers.len();
        let (producer, _) = &mut servers[turn % n];
        marker += 1;
        producer
            .report_cache_state(tokio_stream::iter(vec![update("probe", "p", marker, 4)]))
            .await?;
        let acked = Instant::now();
        for (_, lookups) in servers.iter_mut() {
            for c in lookups.iter_mut() {
                loop {
                    let r = c
                        .lookup_route(lookup_req("probe", marker, 4))
                        .await?
                        .into_inner();
                    if r.reason_code == "PREFIX_MATCH" {
                        break;
                    }
                    if acked.elapsed() > Duration::from_secs(60) {
                        return Err("a marker never arrived".into());
                    }
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
            }
        }
        h.record(acked.elapsed().as_micros().max(1) as u64)?;
        turn += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(h)
}

async fn lookup_latency(
    c: &mut Client,
    chains: u64,
    n: u64,
    blocks: u64,
) -> Result<Histogram<u64>, Error> {
    let mut h = hist();
    for i in 0..n {
        let req = lookup_req("load", (i * 7919) % chains, blocks);
        let t = Instant::now();
        let r = c.lookup_route(req).await?.into_inner();
        h.record(t.elapsed().as_nanos().max(1) as u64 / 1000 + 1)?;
        if r.reason_code != "PREFIX_MATCH" {
            return Err(format!("lookup answered {}", r.reason_code).into());
        }
    }
    Ok(h)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let cli = Cli::parse();
    let dir = std::env::temp_dir().join(format!("ic-replication-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (nats_port, monitor) = (free_port()?, free_port()?);
    let nats = Proc {
        child: Command::new(&cli.nats_bin)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &nats_port.to_string(),
                "-m",
                &monitor.to_string(),
                "-sd",
            ])
            .arg(dir.join("nats"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    };
    wait_port(nats_port, "nats-server")?;
    let mut servers = Vec::new();
    for i in 0..cli.servers {
        servers.push(start_server(
            &cli.server_bin,
            Some(nats_port),
            &format!("s{i}"),
            &dir,
        )?);
    }
    let mut report = String::new();
    writeln!(
        report,
        "Machine: {} ({} logical CPUs), load {} at start; {}. {} servers + `nats-server` {} (JetStream, file store) on loopback, server binary `{}`, `--max-entries 0`.\n",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        loadavg(),
        utc_now(),
        cli.servers,
        Command::new(&cli.nats_bin)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default(),
        cli.server_bin.display(),
    )?;
    writeln!(
        report,
        "```text\ntarget/release/replication --rates {} --seconds {} --chain-blocks {}\n```\n",
        cli.rates
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        cli.seconds,
        cli.chain_blocks
    )?;
    // LookupRoute: replicated server 0 vs a standalone server, the same chains.
    let alone = start_server(&cli.server_bin, None, "standalone", &dir)?;
    let mut rc = client(servers[0].grpc).await?;
    let mut ac = client(alone.grpc).await?;
    for batch in 0..(cli.lookup_chains / 100) {
        let ups: Vec<_> = (0..100)
            .map(|i| update("load", "r", batch * 100 + i, 16))
            .collect();
        rc.report_cache_state(tokio_stream::iter(ups.clone()))
            .await?;
        ac.report_cache_state(tokio_stream::iter(ups)).await?;
    }
    // Wait until the replicated servers hold them.
    let start = Instant::now();
    while rc
        .lookup_route(lookup_req("load", cli.lookup_chains - 1, 16))
        .await?
        .into_inner()
        .reason_code
        != "PREFIX_MATCH"
    {
        if start.elapsed() > Duration::from_secs(60) {
            return Err("lookup chains never arrived".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut on, mut off) = (hist(), hist());
    for _ in 0..3 {
        on.add(lookup_latency(&mut rc, cli.lookup_chains, cli.lookups, 16).await?)?;
        off.add(lookup_latency(&mut ac, cli.lookup_chains, cli.lookups, 16).await?)?;
    }
    writeln!(
        report,
        "LookupRoute, client-side latency over loopback, before the ingest phases (one client, sequential, {} chains of 16 blocks held by both, 3 alternated rounds of {} lookups each):\n",
        cli.lookup_chains, cli.lookups
    )?;
    writeln!(report, "| | p50 | p99 |\n|---|---|---|")?;
    writeln!(
        report,
        "| replication on (server s0 of {}) | {} µs | {} µs |",
        cli.servers,
        on.value_at_quantile(0.5),
        on.value_at_quantile(0.99)
    )?;
    writeln!(
        report,
        "| replication off (standalone server) | {} µs | {} µs |",
        off.value_at_quantile(0.5),
        off.value_at_quantile(0.99)
    )?;
    writeln!(
        report,
        "| ratio on / off | {:.2}× | {:.2}× |",
        on.value_at_quantile(0.5) as f64 / off.value_at_quantile(0.5).max(1) as f64,
        on.value_at_quantile(0.99) as f64 / off.value_at_quantile(0.99).max(1) as f64
    )?;
    drop(alone);
    writeln!(
        report,
        "\n| offered blocks/s | sent blocks/s (producers, after backpressure) | applied blocks/s (per server, min, over the phase and its drain) | marker lag p50 | marker lag p99 | marker lag max | backlog left at the stop (s to drain) | dropped records | stream bytes / 1M blocks | messages / 1M blocks |\n|---|---|---|---|---|---|---|---|---|---|"
    )?;
    let mut next_chain = 0u64;
    for &rate in &cli.rates {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let before: Vec<f64> = servers
            .iter()
            .map(|s| metric(s.http, "inferencecache_ingest_blocks_total"))
            .collect();
        let (bytes0, msgs0) = jsz(monitor);
        let per_producer = rate as f64 / cli.chain_blocks as f64 / servers.len() as f64;
        let mut tasks = Vec::new();
        for (i, s) in servers.iter().enumerate() {
            let c = client(s.grpc).await?;
            tasks.push(tokio::spawn(produce(
                c,
                "load".into(),
                next_chain + (i as u64) * 100_000_000,
                cli.chain_blocks,
                per_producer,
                stop.clone(),
                sent.clone(),
            )));
        }
        let mut probes = Vec::new();
        for s in &servers {
            let mut lookups = Vec::new();
            for t in &servers {
                lookups.push(client(t.grpc).await?);
            }
            probes.push((client(s.grpc).await?, lookups));
        }
        let probe = tokio::spawn(probe_lag(probes, stop.clone()));
        let started = Instant::now();
        for second in 0..cli.seconds {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if cli.verbose {
                let s = &servers[0];
                eprintln!(
                    "  t={}s s0: applied seq {} of {}, outbox {}, blocks applied {}",
                    second + 1,
                    metric(s.http, "inferencecache_replication_applied_sequence"),
                    metric(s.http, "inferencecache_replication_applied_sequence")
                        + metric(s.http, "inferencecache_replication_lag_messages"),
                    metric(s.http, "inferencecache_replication_buffered_records"),
                    metric(s.http, "inferencecache_ingest_blocks_total"),
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await??;
        }
        let offered_s = started.elapsed().as_secs_f64();
        let lag = probe.await??;
        // Applied: wait until every server has applied what was sent (or 60 s).
        let target = sent.load(Ordering::Relaxed) as f64;
        let drain = Instant::now();
        let mut applied_s = Vec::new();
        for (s, b) in servers.iter().zip(&before) {
            loop {
                let n = metric(s.http, "inferencecache_ingest_blocks_total") - b;
                if n >= target || drain.elapsed() > Duration::from_secs(60) {
                    applied_s.push(n / (offered_s + drain.elapsed().as_secs_f64()));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let drained_s = drain.elapsed().as_secs_f64();
        let (bytes1, msgs1) = jsz(monitor);
        let per_m = |d: u64| d as f64 / (target / 1e6).max(1e-9);
        let min_applied = applied_s.iter().copied().fold(f64::INFINITY, f64::min);
        writeln!(
            report,
            "| {} | {:.0} | {:.0} | {:.1} ms | {:.1} ms | {:.1} ms | {:.2} s | {} | {:.1} MB | {:.0} |",
            rate,
            target / offered_s,
            min_applied,
            lag.value_at_quantile(0.5) as f64 / 1e3,
            lag.value_at_quantile(0.99) as f64 / 1e3,
            lag.max() as f64 / 1e3,
            drained_s,
            servers
                .iter()
                .map(|s| metric(s.http, "inferencecache_replication_dropped_records_total"))
                .sum::<f64>(),
            per_m(bytes1.saturating_sub(bytes0)) / 1e6,
            per_m(msgs1.saturating_sub(msgs0)),
        )?;
        eprintln!(
            "rate {rate}: sent {target} blocks in {offered_s:.1}s, applied/s {applied_s:?}, lag p50 {} µs p99 {} µs",
            lag.value_at_quantile(0.5),
            lag.value_at_quantile(0.99)
        );
        next_chain += 1_000_000_000;
    }
    print!("{report}");
    if let Some(out) = &cli.out {
        std::fs::write(out, &report)?;
    }
    drop(nats);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
