//! `e2e-lookup`: LookupRoute end to end over loopback gRPC (issues #5 and #6).
//!
//! ```text
//! cargo build --release -p inferencecache-bench --features e2e --bin e2e-lookup
//! e2e-lookup lookup                                   # issue #5 (W1M loaded vs empty handler)
//! e2e-lookup prompt-text --tokenizer-models-dir DIR   # issue #6 (prompt_text vs token_ids)
//! ```
//!
//! Both modes run the real server in process (`inferencecache_server::serve`, the production
//! gRPC stack of `serve_grpc`) on a loopback port, on its own Tokio runtime, and drive it with
//! tonic clients on a second runtime. By default client and server share the machine's cores and
//! nothing is pinned, so the ratio to the baseline measured in the same run is the fair figure;
//! `--server-cores` / `--client-cores` pin each runtime to its own cores (core_affinity) so the
//! client never preempts the handler whose clock `lookup_latency_us` reports.
//!
//! `lookup` also serves, on another port, the same tonic `Server` stack (same services, message
//! limit and TCP_NODELAY) whose `LookupRoute` answers an empty `LookupRouteResponse` at once,
//! and measures both stacks with identical clients and requests.
//!
//! The report (Markdown) goes to stdout and, with `--out`, to a file.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use hdrhistogram::Histogram;
use inferencecache_bench::host::{cpu_model, loadavg, utc_now};
use inferencecache_bench::ours::{self, COUNTS, REPLICAS};
use inferencecache_bench::w1m::{
    BLOCK_TOKENS, CHAINS_FULL, Kind, LEN, Queries, WORKERS, Workload, expected_blocks, worker,
};
use inferencecache_engine::{CacheStateUpdate, IndexConfig, PrefixRef, fingerprint, tier};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use inferencecache_server::grpc::MAX_MESSAGE_BYTES;
use inferencecache_server::state::{AppState, ServerOptions};
use inferencecache_tokenize::{PromptTokenizer, Tokenizers};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

// The production server binary uses mimalloc; so does the in-process server here.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Error = Box<dyn std::error::Error + Send + Sync>;
type Client = InferenceCacheClient<Channel>;

const TENANT: &str = "t";
const W1M_MODEL: &str = "m";
const SCHEME: &str = "vllm";

#[derive(Parser)]
#[command(about = "End-to-end LookupRoute benchmarks over loopback gRPC (issues #5 and #6)")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Issue #5: 1 M W1M entries loaded; our LookupRoute vs an empty handler on the same stack.
    Lookup(LookupArgs),
    /// Issue #6: prompt_text lookups through a real tokenizer vs token_ids of the same prompts.
    PromptText(PromptArgs),
}

#[derive(Args, Clone)]
struct Common {
    /// Gateway connections (one HTTP/2 connection each; requests are spread round robin).
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Worker threads of the server runtime (the binary's default is one per core).
    #[arg(long, default_value_t = 2)]
    server_threads: usize,
    /// Worker threads of the client runtime.
    #[arg(long, default_value_t = 2)]
    client_threads: usize,
    /// Pin every thread of the server runtime to these cores (comma list; empty = unpinned).
    /// With `--client-cores` on other cores, client work never preempts the handler.
    #[arg(long, value_delimiter = ',')]
    server_cores: Vec<usize>,
    /// Pin every thread of the client runtime to these cores (comma list; empty = unpinned).
    #[arg(long, value_delimiter = ',')]
    client_cores: Vec<usize>,
    /// Warm-up before each measured closed-loop point.
    #[arg(long, default_value = "1s", value_parser = inferencecache_bench::loadgen::parse_duration)]
    warmup: Duration,
    /// Measured time of each closed-loop point.
    #[arg(long, default_value = "5s", value_parser = inferencecache_bench::loadgen::parse_duration)]
    closed: Duration,
    /// Write the Markdown report here too.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct LookupArgs {
    #[command(flatten)]
    common: Common,
    /// W1M chains loaded (16,384 × 64 blocks = 1,048,576 storage entries).
    #[arg(long, default_value_t = CHAINS_FULL)]
    chains: usize,
    /// W1M query iterations; each gives one Q50 and one Q100 request (sent alternately).
    #[arg(long, default_value_t = 4096)]
    queries: usize,
    /// Closed-loop concurrencies (requests in flight), each run on both stacks.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
    /// Closed-loop rounds (stacks interleaved; medians reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Open-loop rate as a fraction of our maximum closed-loop throughput.
    #[arg(long, default_value_t = 0.7)]
    open_fraction: f64,
    /// Measured open-loop time per stack.
    #[arg(long, default_value = "20s", value_parser = inferencecache_bench::loadgen::parse_duration)]
    open: Duration,
    /// Open-loop in-flight cap (a request waiting for a slot keeps its intended send time).
    #[arg(long, default_value_t = 256)]
    max_inflight: usize,
}

#[derive(Args, Clone)]
struct PromptArgs {
    #[command(flatten)]
    common: Common,
    /// Tokenizer tree (`<dir>/<org>/<name>/tokenizer.json` + `tokenizer_config.json`).
    #[arg(long)]
    tokenizer_models_dir: PathBuf,
    /// Model id (its path below the models dir).
    #[arg(long, default_value = "Qwen/Qwen3")]
    model: String,
    /// Prompt sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "1024,16384")]
    sizes: Vec<usize>,
    /// Distinct prompts per size (cycled).
    #[arg(long, default_value_t = 64)]
    prompts: usize,
    /// Closed-loop concurrencies.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    concurrency: Vec<usize>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let res = match cli.mode {
        Mode::Lookup(a) => run_lookup(&a),
        Mode::PromptText(a) => run_prompt(&a),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("e2e-lookup: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Runtimes, servers, clients

/// A multi-thread runtime; with `cores`, each of its threads (workers and blocking pool) is
/// pinned to one of them, round robin in start order.
fn runtime(threads: usize, name: &str, cores: &[usize]) -> Result<tokio::runtime::Runtime, Error> {
    let available = core_affinity::get_core_ids().unwrap_or_default();
    let mut pins = Vec::with_capacity(cores.len());
    for &c in cores {
        match available.iter().find(|id| id.id == c) {
            Some(id) => pins.push(*id),
            None => return Err(format!("{name}: core {c} is not available to this process").into()),
        }
    }
    let next = AtomicU64::new(0);
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(threads.max(1))
        .thread_name(name)
        .enable_all();
    if !pins.is_empty() {
        let pins = Arc::new(pins);
        let label = name.to_string();
        b.on_thread_start(move || {
            let i = next.fetch_add(1, Ordering::Relaxed) as usize % pins.len();
            if !core_affinity::set_for_current(pins[i]) {
                eprintln!("{label}: could not pin a thread to core {}", pins[i].id);
            }
        });
    }
    Ok(b.build()?)
}

/// How the runtimes are placed, for the report.
fn placement(c: &Common) -> String {
    let list = |v: &[usize]| {
        v.iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    match (c.server_cores.is_empty(), c.client_cores.is_empty()) {
        (true, true) => "nothing pinned".to_string(),
        _ => format!(
            "server pinned to core(s) {}, client to core(s) {}",
            if c.server_cores.is_empty() {
                "-".into()
            } else {
                list(&c.server_cores)
            },
            if c.client_cores.is_empty() {
                "-".into()
            } else {
                list(&c.client_cores)
            },
        ),
    }
}

/// A server running on the server runtime; dropping the sender stops it.
struct Running {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

/// Our server: the production `serve` (gRPC via `serve_grpc`, plus the public HTTP listener).
fn start_ours(rt: &tokio::runtime::Runtime, state: AppState) -> Result<Running, Error> {
    let (grpc, http) = rt.block_on(async {
        Ok::<_, std::io::Error>((
            TcpListener::bind("127.0.0.1:0").await?,
            TcpListener::bind("127.0.0.1:0").await?,
        ))
    })?;
    let addr = grpc.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    rt.spawn(inferencecache_server::serve(
        state,
        grpc,
        http,
        async move {
            let _ = rx.await;
        },
    ));
    Ok(Running { addr, _stop: tx })
}

/// The baseline: `InferenceCache` whose LookupRoute returns an empty response immediately.
#[derive(Clone, Copy)]
struct EmptyHandler;

fn baseline_unimplemented() -> Status {
    Status::unimplemented("baseline serves LookupRoute only")
}

#[tonic::async_trait]
impl InferenceCache for EmptyHandler {
    async fn render_template(
        &self,
        _r: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Err(baseline_unimplemented())
    }

    async fn lookup_route(
        &self,
        _r: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        Ok(Response::new(pb::LookupRouteResponse::default()))
    }

    async fn lookup_pd_route(
        &self,
        _r: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        Err(baseline_unimplemented())
    }

    async fn get_cache_state(
        &self,
        _r: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        Err(baseline_unimplemented())
    }

    async fn report_cache_state(
        &self,
        _r: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        Err(baseline_unimplemented())
    }

    async fn publish_event(
        &self,
        _r: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        Err(baseline_unimplemented())
    }

    type StreamCacheEventsStream = tokio_stream::Empty<Result<pb::CacheEvent, Status>>;

    async fn stream_cache_events(
        &self,
        _r: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Err(baseline_unimplemented())
    }

    type StreamMetricsStream = tokio_stream::Empty<Result<pb::Metric, Status>>;

    async fn stream_metrics(
        &self,
        _r: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Err(baseline_unimplemented())
    }
}

/// The same tonic stack as `serve_grpc` (health, reflection v1 + v1alpha, the service with the
/// 4 MiB decode limit, TCP_NODELAY incoming, plaintext), with the empty handler.
fn start_baseline(rt: &tokio::runtime::Runtime) -> Result<Running, Error> {
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    rt.spawn(async move {
        let (health_reporter, health_service) = tonic_health::server::health_reporter();
        health_reporter
            .set_serving::<InferenceCacheServer<EmptyHandler>>()
            .await;
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(inferencecache_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let (Ok(r1), Ok(r2)) = (reflection().build_v1(), reflection().build_v1alpha()) else {
            eprintln!("e2e-lookup: baseline reflection service failed to build");
            return;
        };
        let service =
            InferenceCacheServer::new(EmptyHandler).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let res = tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(r1)
            .add_service(r2)
            .add_service(service)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                async move {
                    let _ = rx.await;
                },
            )
            .await;
        if let Err(e) = res {
            eprintln!("e2e-lookup: baseline server: {e}");
        }
    });
    Ok(Running { addr, _stop: tx })
}

/// `n` gateway connections to `addr` (retried while the listener comes up).
async fn connect(addr: SocketAddr, n: usize) -> Result<Vec<Client>, Error> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let ep = Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(10))
            .tcp_nodelay(true);
        let mut last = None;
        let mut ch = None;
        for _ in 0..100 {
            match ep.connect().await {
                Ok(c) => {
                    ch = Some(c);
                    break;
                }
                Err(e) => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        let Some(ch) = ch else {
            return Err(format!("cannot connect to {addr}: {last:?}").into());
        };
        out.push(InferenceCacheClient::new(ch));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Measurement

fn hist() -> Histogram<u64> {
    // 1 ns .. 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static histogram bounds are valid")
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// What a response must look like to count as right (checked on every timed response).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Any OK response (the baseline).
    Any,
    /// `reason_code == PREFIX_MATCH`.
    PrefixMatch,
}

/// Results of one measured phase.
struct Phase {
    /// Completed requests per second in the measured window.
    throughput: f64,
    /// Client latency (ns): service time for closed loop, from the intended send time for open.
    latency: Histogram<u64>,
    /// Server-reported `lookup_latency_us`.
    server_us: Histogram<u64>,
    ok: u64,
    errors: u64,
    wrong: u64,
}

impl Phase {
    fn new() -> Self {
        Self {
            throughput: 0.0,
            latency: hist(),
            server_us: hist(),
            ok: 0,
            errors: 0,
            wrong: 0,
        }
    }

    fn merge(&mut self, o: &Phase) {
        let _ = self.latency.add(&o.latency);
        let _ = self.server_us.add(&o.server_us);
        self.ok += o.ok;
        self.errors += o.errors;
        self.wrong += o.wrong;
    }

    fn record(&mut self, res: Result<pb::LookupRouteResponse, Status>, lat: u64, expect: Expect) {
        match res {
            Ok(r) => {
                self.ok += 1;
                let _ = self.latency.record(lat);
                let _ = self
                    .server_us
                    .record(u64::try_from(r.lookup_latency_us).unwrap_or(0).max(1));
                if expect == Expect::PrefixMatch && r.reason_code != "PREFIX_MATCH" {
                    self.wrong += 1;
                }
            }
            Err(_) => self.errors += 1,
        }
    }

    fn us(&self, q: f64) -> f64 {
        self.latency.value_at_quantile(q) as f64 / 1e3
    }
}

/// Closed loop: `conc` workers, each sending its next request as soon as the previous answer
/// arrives. Requests are taken round robin from `reqs`, connections round robin.
async fn closed_loop(
    clients: &[Client],
    reqs: Arc<Vec<pb::LookupRouteRequest>>,
    conc: usize,
    warmup: Duration,
    measure: Duration,
    expect: Expect,
) -> Phase {
    let start = Instant::now();
    let from = start + warmup;
    let end = from + measure;
    let mut tasks = Vec::with_capacity(conc);
    for w in 0..conc.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let reqs = reqs.clone();
        tasks.push(tokio::spawn(async move {
            let mut ph = Phase::new();
            let mut i = w;
            loop {
                let t = Instant::now();
                if t >= end {
                    break;
                }
                let req = reqs[i % reqs.len()].clone();
                i += conc;
                let res = client.lookup_route(req).await.map(Response::into_inner);
                if t >= from {
                    ph.record(res, ns(t.elapsed()), expect);
                }
            }
            ph
        }));
    }
    let mut total = Phase::new();
    for t in tasks {
        if let Ok(ph) = t.await {
            total.merge(&ph);
        }
    }
    total.throughput = total.ok as f64 / measure.as_secs_f64();
    total
}

/// One closed-loop phase with `c`'s warm-up and measured window, run on `rt`: the one way every
/// closed-loop row of both issues is measured.
fn closed_phase(
    rt: &tokio::runtime::Runtime,
    c: &Common,
    clients: &[Client],
    reqs: &Arc<Vec<pb::LookupRouteRequest>>,
    conc: usize,
    expect: Expect,
) -> Phase {
    rt.block_on(closed_loop(
        clients,
        reqs.clone(),
        conc,
        c.warmup,
        c.closed,
        expect,
    ))
}

/// Open loop: request `i` is due at `start + i / rate`; latency runs from that intended time
/// (coordinated omission corrected). A nanosleep thread keeps the timetable; at most
/// `max_inflight` requests are outstanding and a request waiting for a slot keeps its time.
#[allow(clippy::too_many_arguments)]
fn open_loop(
    handle: &tokio::runtime::Handle,
    clients: &[Client],
    reqs: Arc<Vec<pb::LookupRouteRequest>>,
    rate: f64,
    warmup: Duration,
    measure: Duration,
    max_inflight: usize,
    expect: Expect,
) -> Phase {
    let start = Instant::now() + Duration::from_millis(10);
    let from = start + warmup;
    let end = from + measure;
    let period = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let slots = Arc::new(Semaphore::new(max_inflight.max(1)));
    let shared = Arc::new(std::sync::Mutex::new(Phase::new()));
    let issued = Arc::new(AtomicU64::new(0));
    let mut i: u64 = 0;
    while let Some(intended) = u32::try_from(i)
        .ok()
        .and_then(|k| period.checked_mul(k))
        .and_then(|d| start.checked_add(d))
        .filter(|t| *t < end)
    {
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        let Ok(permit) = handle.block_on(slots.clone().acquire_owned()) else {
            break;
        };
        let mut client = clients[(i as usize) % clients.len()].clone();
        let req = reqs[(i as usize) % reqs.len()].clone();
        let shared = shared.clone();
        let measured = intended >= from;
        if measured {
            issued.fetch_add(1, Ordering::Relaxed);
        }
        handle.spawn(async move {
            let res = client.lookup_route(req).await.map(Response::into_inner);
            let lat = ns(intended.elapsed());
            if measured && let Ok(mut ph) = shared.lock() {
                ph.record(res, lat, expect);
            }
            // Released only after recording, so the final drain sees every answer counted.
            drop(permit);
        });
        i += 1;
    }
    // Wait for the stragglers.
    let _ = handle.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(15),
            slots.acquire_many(u32::try_from(max_inflight.max(1)).unwrap_or(u32::MAX)),
        )
        .await
    });
    let mut out = Phase::new();
    if let Ok(ph) = shared.lock() {
        out.merge(&ph);
    }
    out.throughput = out.ok as f64 / measure.as_secs_f64();
    let lost = issued
        .load(Ordering::Relaxed)
        .saturating_sub(out.ok + out.errors);
    out.errors += lost;
    out
}

/// One closed-loop concurrency: (in flight, our rounds, the baseline's rounds).
type ClosedRow = (usize, Vec<Phase>, Vec<Phase>);

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn fmt_us(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.2} ms", v / 1000.0)
    } else {
        format!("{v:.1} µs")
    }
}

// ---------------------------------------------------------------------------------------------
// Issue #5: lookup

/// Loads W1M through the engine API: one chain-form ingest per chain, timestamp "now".
fn load_w1m(state: &AppState, w: &Workload) {
    for (c, keys) in w.wire_events().iter().enumerate() {
        // Timestamp 0 = the server's clock (K-rules), so entries are fresh under the real clock.
        ours::ingest_chain_as(state.index(), REPLICAS[worker(c)], keys, tier::T1, 0);
    }
}

fn chain_request(keys: &[[u8; 8]; LEN]) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: TENANT.into(),
        model_id: W1M_MODEL.into(),
        hash_scheme: SCHEME.into(),
        block_hashes: keys.iter().map(|k| k.to_vec()).collect(),
        block_token_counts: COUNTS.to_vec(),
        ..Default::default()
    }
}

/// Checks one answer against benchmarks.md §2.4: PREFIX_MATCH, 8 scores, per-replica matched
/// tokens = expected blocks × 16, and the expected top replica(s).
fn check_w1m(kind: Kind, c: usize, r: &pb::LookupRouteResponse) -> Result<(), String> {
    let ctx = || format!("{} chain {c}: {r:?}", kind.label());
    if r.reason_code != "PREFIX_MATCH" || r.replica_scores.len() != WORKERS {
        return Err(format!("unexpected reason/score count: {}", ctx()));
    }
    for s in &r.replica_scores {
        let w = REPLICAS
            .iter()
            .position(|x| *x == s.replica_id)
            .ok_or_else(|| format!("unknown replica: {}", ctx()))?;
        let want = expected_blocks(kind, c, w) as i32 * BLOCK_TOKENS;
        if s.matched_tokens != want {
            return Err(format!(
                "{} matched {} tokens, expected {want}: {}",
                s.replica_id,
                s.matched_tokens,
                ctx()
            ));
        }
    }
    let owner = REPLICAS[worker(c)];
    let partner = REPLICAS[worker(c) ^ 1];
    let top: Vec<&str> = r.replica_scores[..2]
        .iter()
        .map(|s| s.replica_id.as_str())
        .collect();
    let ok = match kind {
        Kind::Q100 => top == [owner, partner],
        _ => top.contains(&owner) && top.contains(&partner),
    };
    if !ok {
        return Err(format!("wrong top replicas: {}", ctx()));
    }
    Ok(())
}

fn run_lookup(a: &LookupArgs) -> Result<(), Error> {
    let c = &a.common;
    let started = utc_now();
    let load_start = loadavg();
    let srv_rt = runtime(c.server_threads, "srv", &c.server_cores)?;
    let cli_rt = runtime(c.client_threads, "cli", &c.client_cores)?;

    eprintln!("generating W1M ({} chains) and queries ...", a.chains);
    let w = Workload::new(a.chains);
    let q = Queries::generate(a.chains, a.queries.max(1));
    let entries = w.entries();
    let state = AppState::new(ServerOptions {
        index: IndexConfig {
            // Above the 1,048,576 W1M entries: the cap must not evict during the bench.
            max_entries: i64::try_from(entries * 2).unwrap_or(i64::MAX),
            ..IndexConfig::default()
        },
        ..ServerOptions::default()
    });
    let t = Instant::now();
    load_w1m(&state, &w);
    let stored = state.index().storage_entries();
    if stored != entries as i64 {
        return Err(format!("loaded {stored} storage entries, expected {entries}").into());
    }
    eprintln!("loaded {stored} entries in {:.2?}", t.elapsed());
    drop(w);

    // Requests: Q50 and Q100 alternately, as a gateway sends them (rolling hashes, 8-byte BE).
    let (q50, q100) = (q.q50.wire_rolling(), q.q100.wire_rolling());
    let mut reqs = Vec::with_capacity(q50.len() * 2);
    let mut meta = Vec::with_capacity(q50.len() * 2);
    for (i, keys) in q50.iter().enumerate() {
        reqs.push(chain_request(keys));
        meta.push((Kind::Q50, q.q50.chain[i]));
        reqs.push(chain_request(&q100[i]));
        meta.push((Kind::Q100, q.q100.chain[i]));
    }
    let reqs = Arc::new(reqs);

    let ours = start_ours(&srv_rt, state.clone())?;
    let base = start_baseline(&srv_rt)?;
    let (ours_cl, base_cl) = cli_rt.block_on(async {
        Ok::<_, Error>((
            connect(ours.addr, c.connections).await?,
            connect(base.addr, c.connections).await?,
        ))
    })?;

    // Sanity check on a sample before timing.
    let sample = reqs.len().min(512);
    cli_rt.block_on(async {
        let mut cl = ours_cl[0].clone();
        for (req, &(kind, chain)) in reqs.iter().zip(&meta).take(sample) {
            let r = cl.lookup_route(req.clone()).await?.into_inner();
            check_w1m(kind, chain, &r)?;
        }
        let r = base_cl[0].clone().lookup_route(reqs[0].clone()).await?;
        if r.get_ref().reason_code.is_empty() && r.get_ref().replica_scores.is_empty() {
            Ok::<_, Error>(())
        } else {
            Err("baseline answered a non-empty response".into())
        }
    })?;
    eprintln!("sanity check: {sample} answers match benchmarks.md §2.4");

    // Closed loop, stacks interleaved per round.
    let mut closed: Vec<ClosedRow> = Vec::new();
    for &conc in &a.concurrency {
        let (mut o, mut b) = (Vec::new(), Vec::new());
        for round in 0..a.rounds.max(1) {
            let po = closed_phase(&cli_rt, c, &ours_cl, &reqs, conc, Expect::PrefixMatch);
            let pb_ = closed_phase(&cli_rt, c, &base_cl, &reqs, conc, Expect::Any);
            eprintln!(
                "closed c={conc} round {round}: ours {:.0}/s p50 {} | baseline {:.0}/s p50 {} | load {}",
                po.throughput,
                fmt_us(po.us(0.5)),
                pb_.throughput,
                fmt_us(pb_.us(0.5)),
                loadavg()
            );
            o.push(po);
            b.push(pb_);
        }
        closed.push((conc, o, b));
    }
    let best = |pick: fn(&ClosedRow) -> &Vec<Phase>| {
        closed
            .iter()
            .map(|row| {
                (
                    row.0,
                    median(pick(row).iter().map(|p| p.throughput).collect()),
                )
            })
            .fold((0usize, 0.0f64), |acc, x| if x.1 > acc.1 { x } else { acc })
    };
    let (ours_best_c, ours_max) = best(|r| &r.1);
    let (base_best_c, base_max) = best(|r| &r.2);
    let load_closed = loadavg();

    // Open loop at a fraction of our maximum, both stacks at the same rate.
    let rate = ours_max * a.open_fraction;
    eprintln!("open loop at {rate:.0}/s for {:?} per stack ...", a.open);
    let open_warm = Duration::from_secs(2);
    let ours_open = open_loop(
        cli_rt.handle(),
        &ours_cl,
        reqs.clone(),
        rate,
        open_warm,
        a.open,
        a.max_inflight,
        Expect::PrefixMatch,
    );
    let load_open_ours = loadavg();
    let base_open = open_loop(
        cli_rt.handle(),
        &base_cl,
        reqs.clone(),
        rate,
        open_warm,
        a.open,
        a.max_inflight,
        Expect::Any,
    );
    let load_end = loadavg();
    let still = state.index().storage_entries();

    // Report.
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### Issue #5: LookupRoute end to end vs an empty handler (W1M, 1 M entries)\n"
    );
    let _ = writeln!(
        s,
        "- Date: {started}; machine: {}; load averages (1/5/15 min, \
         other jobs included): start {load_start}, after closed loop {load_closed}, after open loop (ours) \
         {load_open_ours}, end {load_end}).",
        cpu_model()
    );
    let _ = writeln!(
        s,
        "- Server: `inferencecache_server::serve` in process (production gRPC stack, mimalloc), \
         {} runtime workers; {} storage entries loaded via the engine API (W1M, {} chains × 64 × \
         8 replicas), cap {}, {} entries still held at the end. Baseline: the same tonic stack \
         (health, reflection, 4 MiB limit, TCP_NODELAY) with an `InferenceCache` whose \
         LookupRoute returns an empty response.",
        c.server_threads,
        entries,
        a.chains,
        entries * 2,
        still
    );
    let _ = writeln!(
        s,
        "- Clients: tonic, {} connections, {} runtime workers, same process; requests = W1M Q50 \
         and Q100 alternately ({} distinct), 64 × 8-byte BE rolling hashes, counts 16; {}. \
         {sample} answers checked against benchmarks.md §2.4 before timing (PREFIX_MATCH, \
         per-replica matched tokens, top replicas); every timed answer of ours is checked for \
         PREFIX_MATCH.",
        c.connections,
        c.client_threads,
        reqs.len(),
        placement(c)
    );
    let _ = writeln!(
        s,
        "\nClosed loop ({} rounds × {:?} measured after {:?} warm-up, stacks interleaved; \
         medians of rounds; latency = service time):\n",
        a.rounds, c.closed, c.warmup
    );
    let _ = writeln!(
        s,
        "| in flight | ours req/s | baseline req/s | ratio | ours p50 / p99 | baseline p50 / p99 | ours server `lookup_latency_us` p50 / p99 | errors / wrong |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for (conc, o, b) in &closed {
        let ot = median(o.iter().map(|p| p.throughput).collect());
        let bt = median(b.iter().map(|p| p.throughput).collect());
        let m = |v: &Vec<Phase>, q: f64| median(v.iter().map(|p| p.us(q)).collect());
        let srv = |q: f64| {
            median(
                o.iter()
                    .map(|p| p.server_us.value_at_quantile(q) as f64)
                    .collect(),
            )
        };
        let errs: u64 = o.iter().chain(b.iter()).map(|p| p.errors).sum();
        let wrong: u64 = o.iter().map(|p| p.wrong).sum();
        let _ = writeln!(
            s,
            "| {conc} | {ot:.0} | {bt:.0} | {:.3} | {} / {} | {} / {} | {} / {} µs | {errs} / {wrong} |",
            if bt > 0.0 { ot / bt } else { 0.0 },
            fmt_us(m(o, 0.5)),
            fmt_us(m(o, 0.99)),
            fmt_us(m(b, 0.5)),
            fmt_us(m(b, 0.99)),
            srv(0.5),
            srv(0.99),
        );
    }
    let ratio = if base_max > 0.0 {
        ours_max / base_max
    } else {
        0.0
    };
    let _ = writeln!(
        s,
        "\nMaximum throughput: ours {ours_max:.0} req/s (at {ours_best_c} in flight), baseline \
         {base_max:.0} req/s (at {base_best_c} in flight): **ratio {ratio:.3}** (target ≥ 0.8: \
         {}).",
        if ratio >= 0.8 { "met" } else { "NOT met" }
    );
    let _ = writeln!(
        s,
        "\nOpen loop at {rate:.0} req/s = {:.0} % of our maximum, both stacks, {:?} measured after \
         {open_warm:?} warm-up, ≤ {} in flight, latency from the intended send time (CO-corrected):\n",
        a.open_fraction * 100.0,
        a.open,
        a.max_inflight
    );
    let _ = writeln!(
        s,
        "| stack | achieved req/s | p50 | p90 | p99 | p99.9 | max | errors / wrong |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for (name, p) in [("ours", &ours_open), ("baseline", &base_open)] {
        let _ = writeln!(
            s,
            "| {name} | {:.0} | {} | {} | {} | {} | {} | {} / {} |",
            p.throughput,
            fmt_us(p.us(0.5)),
            fmt_us(p.us(0.9)),
            fmt_us(p.us(0.99)),
            fmt_us(p.us(0.999)),
            fmt_us(p.latency.max() as f64 / 1e3),
            p.errors,
            p.wrong
        );
    }
    let sp = |q: f64| ours_open.server_us.value_at_quantile(q);
    let p99 = sp(0.99);
    let _ = writeln!(
        s,
        "\nServer-side `lookup_latency_us` over the {} open-loop responses of ours: p50 {} µs, \
         p90 {} µs, **p99 {p99} µs** (target ≤ 20 µs: {}), p99.9 {} µs, max {} µs.",
        ours_open.server_us.len(),
        sp(0.5),
        sp(0.9),
        if p99 <= 20 { "met" } else { "NOT met" },
        sp(0.999),
        ours_open.server_us.max()
    );
    print!("{s}");
    if let Some(path) = &c.out {
        std::fs::write(path, &s)?;
    }
    let failures = closed
        .iter()
        .flat_map(|r| r.1.iter().chain(r.2.iter()))
        .chain([&ours_open, &base_open])
        .map(|p| p.errors + p.wrong)
        .sum::<u64>();
    drop((ours, base));
    srv_rt.shutdown_timeout(Duration::from_secs(2));
    if failures > 0 {
        return Err(format!("{failures} errors or wrong answers during timing").into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Issue #6: prompt_text

/// Deterministic English-like prose of about `bytes` bytes (xorshift over a word list, with
/// punctuation), so the tokenizer sees realistic word lengths and a realistic word cache.
fn prose(bytes: usize, seed: u64) -> String {
    const WORDS: &[&str] = &[
        "the",
        "cache",
        "router",
        "request",
        "model",
        "token",
        "prefix",
        "replica",
        "latency",
        "memory",
        "block",
        "engine",
        "server",
        "gateway",
        "tenant",
        "index",
        "lookup",
        "answer",
        "question",
        "system",
        "prompt",
        "assistant",
        "user",
        "history",
        "context",
        "window",
        "attention",
        "layer",
        "decode",
        "prefill",
        "batch",
        "schedule",
        "throughput",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "with",
        "as",
        "on",
        "by",
        "this",
        "be",
        "are",
        "from",
        "at",
        "or",
        "an",
        "which",
        "it",
        "not",
        "can",
        "will",
        "should",
        "would",
        "because",
        "between",
        "during",
        "without",
        "within",
        "across",
        "through",
        "about",
        "please",
        "explain",
        "summarize",
        "translate",
        "following",
        "document",
        "paragraph",
        "section",
        "function",
        "variable",
        "compile",
        "benchmark",
        "distributed",
        "consistent",
        "hashing",
        "eviction",
        "policy",
        "freshness",
        "deadline",
        "timeout",
        "streaming",
        "protocol",
        "buffer",
        "message",
        "response",
        "error",
        "status",
        "configuration",
        "Kubernetes",
        "GPU",
        "HTTP/2",
        "gRPC",
        "JSON",
        "2026",
        "42",
        "3.14",
        "v1alpha1",
        "naïve",
        "café",
        "résumé",
        "東京",
        "数据",
        "模型",
        "缓存",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut s = String::with_capacity(bytes + 32);
    let mut sentence = 0;
    while s.len() < bytes {
        let w = WORDS[(next() % WORDS.len() as u64) as usize];
        if sentence == 0 {
            let mut cs = w.chars();
            if let Some(f) = cs.next() {
                s.extend(f.to_uppercase());
                s.push_str(cs.as_str());
            }
        } else {
            s.push_str(w);
        }
        sentence += 1;
        if sentence > 6 && next() % 9 == 0 {
            s.push_str(if next() % 4 == 0 { ".\n" } else { ". " });
            sentence = 0;
        } else if next() % 11 == 0 {
            s.push_str(", ");
        } else {
            s.push(' ');
        }
    }
    // Cut at a char boundary at or below `bytes`.
    let mut cut = bytes.min(s.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s
}

fn run_prompt(a: &PromptArgs) -> Result<(), Error> {
    let c = &a.common;
    let started = utc_now();
    let load_start = loadavg();
    let t = Instant::now();
    let tok = Arc::new(Tokenizers::load(&a.tokenizer_models_dir));
    if !tok.contains(&a.model) {
        return Err(format!(
            "model {} not found below {} (loaded: {:?})",
            a.model,
            a.tokenizer_models_dir.display(),
            tok.model_ids().collect::<Vec<_>>()
        )
        .into());
    }
    let load_time = t.elapsed();
    let has_template = tok.has_chat_template(&a.model);
    let srv_rt = runtime(c.server_threads, "srv", &c.server_cores)?;
    let cli_rt = runtime(c.client_threads, "cli", &c.client_cores)?;
    let block = 16usize;
    let state = AppState::new(ServerOptions {
        block_size: block,
        tokenizer: Some(tok.clone() as Arc<dyn PromptTokenizer>),
        ..ServerOptions::default()
    });

    // Prompts, their tokens (rendered chat template, as the server does), and a stored chain for
    // each: replica p0 holds the whole prompt, p1 its first half, so answers are PREFIX_MATCH.
    struct Set {
        size: usize,
        text: Arc<Vec<pb::LookupRouteRequest>>,
        ids: Arc<Vec<pb::LookupRouteRequest>>,
        tokens: Vec<Vec<u32>>,
        mean_tokens: f64,
    }
    let mut sets = Vec::new();
    for &size in &a.sizes {
        let mut text = Vec::new();
        let mut ids = Vec::new();
        let mut tokens = Vec::new();
        for p in 0..a.prompts.max(1) {
            let prompt = prose(size, ((size as u64) << 20) | p as u64);
            let toks = tok
                .encode_chat(&a.model, &prompt)
                .map_err(|e| format!("encode_chat: {e}"))?;
            let (keys, counts) = fingerprint::chain(&toks, block);
            for (replica, n) in [("p0", keys.len()), ("p1", keys.len() / 2)] {
                state.index().ingest(CacheStateUpdate {
                    replica_id: replica,
                    model_id: &a.model,
                    tenant_id: TENANT,
                    hash_scheme: SCHEME,
                    timestamp_us: 0,
                    prefixes: std::iter::once(PrefixRef {
                        prefix_hash: &[],
                        token_count: 0,
                        block_hashes: &keys[..n],
                        block_token_counts: &counts[..n],
                        tier: tier::T1,
                        adapter_id: "",
                    }),
                    stats: None,
                    adapter_id: "",
                });
            }
            let base = pb::LookupRouteRequest {
                tenant_id: TENANT.into(),
                model_id: a.model.clone(),
                hash_scheme: SCHEME.into(),
                ..Default::default()
            };
            text.push(pb::LookupRouteRequest {
                prompt_text: prompt,
                ..base.clone()
            });
            ids.push(pb::LookupRouteRequest {
                token_ids: toks.clone(),
                ..base
            });
            tokens.push(toks);
        }
        let mean_tokens =
            tokens.iter().map(Vec::len).sum::<usize>() as f64 / tokens.len().max(1) as f64;
        sets.push(Set {
            size,
            text: Arc::new(text),
            ids: Arc::new(ids),
            tokens,
            mean_tokens,
        });
    }

    let ours = start_ours(&srv_rt, state.clone())?;
    let clients = cli_rt.block_on(connect(ours.addr, c.connections))?;

    // Sanity: the prompt_text answer echoes exactly our tokens and ranks p0 first with the whole
    // chain matched; the token_ids answer ranks the same without an echo.
    cli_rt.block_on(async {
        let mut cl = clients[0].clone();
        for set in &sets {
            for (i, ((text, ids), toks)) in set
                .text
                .iter()
                .zip(set.ids.iter())
                .zip(&set.tokens)
                .enumerate()
            {
                let full = fingerprint::chain(toks, block).1.iter().sum::<i32>();
                let r = cl.lookup_route(text.clone()).await?.into_inner();
                let top = r.replica_scores.first();
                if r.reason_code != "PREFIX_MATCH"
                    || r.token_ids != *toks
                    || top.map(|s| (s.replica_id.as_str(), s.matched_tokens)) != Some(("p0", full))
                {
                    return Err::<(), Error>(
                        format!(
                            "prompt_text answer for {} B prompt {i}: reason {} echo {} tokens \
                             (expected {}), top {:?} (expected p0 with {full})",
                            set.size,
                            r.reason_code,
                            r.token_ids.len(),
                            toks.len(),
                            top
                        )
                        .into(),
                    );
                }
                let r2 = cl.lookup_route(ids.clone()).await?.into_inner();
                if r2.reason_code != "PREFIX_MATCH"
                    || !r2.token_ids.is_empty()
                    || r2.replica_scores.first().map(|s| s.matched_tokens) != Some(full)
                {
                    return Err(format!("token_ids answer differs: {r2:?}").into());
                }
            }
        }
        Ok(())
    })?;
    eprintln!("sanity check passed for every prompt");

    let mut rows = Vec::new();
    for set in &sets {
        for &conc in &a.concurrency {
            for (form, reqs) in [("prompt_text", &set.text), ("token_ids", &set.ids)] {
                let p = closed_phase(&cli_rt, c, &clients, reqs, conc, Expect::PrefixMatch);
                eprintln!(
                    "{} B {form} c={conc}: {:.0}/s p50 {} p99 {} | load {}",
                    set.size,
                    p.throughput,
                    fmt_us(p.us(0.5)),
                    fmt_us(p.us(0.99)),
                    loadavg()
                );
                rows.push((set.size, set.mean_tokens, conc, form, p));
            }
        }
    }
    let load_end = loadavg();

    let mut s = String::new();
    let _ = writeln!(
        s,
        "### Issue #6: prompt_text LookupRoute latency (real tokenizer)\n"
    );
    let _ = writeln!(
        s,
        "- Date: {started}; machine: {}; load averages (1/5/15 min, \
         other jobs included): start {load_start}, end {load_end}).",
        cpu_model()
    );
    let _ = writeln!(
        s,
        "- Tokenizer: model `{}` loaded from `{}` in {load_time:.2?} (chat template: {}); the \
         server renders the template for one user turn and encodes it on the blocking pool \
         (server.md §7.3). Block size {block}.",
        a.model,
        a.tokenizer_models_dir.display(),
        if has_template { "yes" } else { "no" }
    );
    let _ = writeln!(
        s,
        "- Server in process (`inferencecache_server::serve`, {} runtime workers); clients: tonic, \
         {} connections, {} runtime workers, same process, {}. {} distinct English-like \
         prompts per size (cycled); each prompt's chain is stored for replica p0 (whole) and p1 \
         (first half) so every answer is PREFIX_MATCH with p0 first; before timing every prompt \
         was checked (echoed tokens equal the tokenizer's, matched tokens = whole chain, token_ids \
         form gives the same top match). Closed loop, {:?} measured after {:?} warm-up per row; \
         latency = service time.",
        c.server_threads,
        c.connections,
        c.client_threads,
        placement(c),
        a.prompts,
        c.closed,
        c.warmup
    );
    let _ = writeln!(
        s,
        "\n| prompt | tokens (mean) | in flight | input | req/s | p50 | p99 | server `lookup_latency_us` p50 / p99 | errors / wrong |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for (size, toks, conc, form, p) in &rows {
        let _ = writeln!(
            s,
            "| {} KiB | {toks:.0} | {conc} | {form} | {:.0} | {} | {} | {} / {} µs | {} / {} |",
            size / 1024,
            p.throughput,
            fmt_us(p.us(0.5)),
            fmt_us(p.us(0.99)),
            p.server_us.value_at_quantile(0.5),
            p.server_us.value_at_quantile(0.99),
            p.errors,
            p.wrong
        );
    }
    let _ = writeln!(
        s,
        "\nTokenization cost ≈ prompt_text p50 − token_ids p50 of the same row pair (the \
         token_ids request is larger on the wire, so this slightly understates it)."
    );
    print!("{s}");
    if let Some(path) = &c.out {
        std::fs::write(path, &s)?;
    }
    let failures: u64 = rows.iter().map(|r| r.4.errors + r.4.wrong).sum();
    drop(ours);
    srv_rt.shutdown_timeout(Duration::from_secs(2));
    if failures > 0 {
        return Err(format!("{failures} errors or wrong answers during timing").into());
    }
    Ok(())
}
