//! `ic-loadgen`: drives a running InferenceCache server over gRPC with a simulated fleet.
//!
//! - **Producers**: `--replicas` replicas, each with its own long-lived `ReportCacheState`
//!   stream (own connection), report the full block chain of every turn they serve, paced to an
//!   aggregate `--ingest-blocks-per-sec`; `PublishEvent` carries `PREFIX_EVICTED` of finished
//!   conversations' blocks at `--events-per-sec` and an `ALL_CLEARED` every `--clear-interval`.
//! - **Gateways**: `LookupRoute` for the next turn of a random live conversation, open loop on a
//!   fixed timetable (`--lookup-rate`); latency is measured from the *intended* send time, so a
//!   stall shows up in the histogram instead of silently lowering the offered rate
//!   (coordinated omission). `--max-inflight` caps concurrency; a request waiting for a slot is
//!   still timed from its intended time.
//! - **Ground truth**: the [`workload::Fleet`] knows what each replica was sent minus what was
//!   evicted or cleared, and judges every answer.
//!
//! The binary is a thin wrapper around [`run`]; the test in `bench/tests/loadgen.rs` calls the
//! same function against an in-process server.

pub mod report;
pub mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use inferencecache_engine::fingerprint::to_wire;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{CacheEvent, CacheStateUpdate, cache_event};
use tokio::sync::{Semaphore, mpsc};
use tonic::transport::{Channel, Endpoint};

use self::report::{
    ConfigEcho, EventSection, HitSection, IngestSection, LookupSection, Percentiles, Report,
    WindowStat,
};
use self::workload::{ConversationShape, Fleet, InputForm, LookupPlan, WorkloadParams};

/// Boxed error of the runner.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Parses `30`, `30s`, `1.5s`, `500ms`, `2m` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(v) = s.strip_suffix("ms") {
        (v, 1e-3)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (use e.g. 30s, 500ms, 2m)"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("invalid duration {s:?}"));
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// Command line of `ic-loadgen`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "ic-loadgen",
    about = "Load generator for an InferenceCache server: a simulated fleet reports cache state \
             while gateways issue open-loop LookupRoute calls; reports CO-corrected latency and \
             the realized hit rate against ground truth."
)]
pub struct Args {
    /// gRPC endpoint of the server.
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub target: String,
    /// Measured run time (after the warm-up).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Load runs but nothing is recorded (fills the index, warms connections).
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub warmup: Duration,

    /// Simulated engine replicas, each with its own ReportCacheState stream.
    #[arg(long, default_value_t = 8)]
    pub replicas: usize,
    /// Target aggregate ingest rate in blocks/s over all replica streams (0 = no ingest).
    #[arg(long, default_value_t = 200_000.0)]
    pub ingest_blocks_per_sec: f64,
    /// Target PublishEvent rate (PREFIX_EVICTED of finished conversations' blocks).
    #[arg(long, default_value_t = 1_000.0)]
    pub events_per_sec: f64,
    /// One ALL_CLEARED of a random replica this often (0 = never).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub clear_interval: Duration,

    /// Open-loop LookupRoute rate (requests/s, fixed timetable).
    #[arg(long, default_value_t = 2_000.0)]
    pub lookup_rate: f64,
    /// Most lookups in flight; a request over the cap waits, still timed from its intended time.
    #[arg(long, default_value_t = 256)]
    pub max_inflight: usize,
    /// Gateway connections the lookups are spread over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Lookup input form.
    #[arg(long, value_enum, default_value_t = InputForm::Chain)]
    pub input: InputForm,
    /// Client-side deadline of one lookup (a timeout counts as an error).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub request_timeout: Duration,

    /// Distinct shared system prompts (popularity is Zipf).
    #[arg(long, default_value_t = 64)]
    pub system_prompts: usize,
    /// Zipf exponent of system prompt popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf_s: f64,
    /// Mean system prompt length in tokens (uniform in [mean/2, 3·mean/2]).
    #[arg(long, default_value_t = 2048)]
    pub system_prompt_tokens: usize,
    /// Live conversations (a finished one is replaced by a new one).
    #[arg(long, default_value_t = 2_000)]
    pub conversations: usize,
    /// Turns per conversation are uniform in 1..=max-turns.
    #[arg(long, default_value_t = 8)]
    pub max_turns: u32,
    /// Mean user message length in tokens.
    #[arg(long, default_value_t = 128)]
    pub user_tokens: usize,
    /// Mean assistant reply length in tokens.
    #[arg(long, default_value_t = 256)]
    pub assistant_tokens: usize,
    /// Probability that a conversation's turn stays on its current replica.
    #[arg(long, default_value_t = 0.9)]
    pub sticky: f64,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,

    /// Tenant of every request.
    #[arg(long, default_value = "loadgen")]
    pub tenant: String,
    /// Model of every request.
    #[arg(long, default_value = "loadgen-model")]
    pub model: String,
    /// Hash scheme of reports and lookups.
    #[arg(long, default_value = "vllm")]
    pub hash_scheme: String,
    /// Producer bearer token, when the server requires one.
    #[arg(long)]
    pub producer_token: Option<String>,
    /// Do not ALL_CLEAR the replicas of (tenant, model) before starting.
    #[arg(long)]
    pub no_reset: bool,
    /// Workload RNG seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// JSON report path; the SVG latency plot is written next to it (same name, `.svg`).
    #[arg(long, default_value = "target/loadgen/report.json")]
    pub out: PathBuf,
    /// Tokio worker threads of the binary (the server usually shares the machine).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl Args {
    fn conversation_shape(&self) -> ConversationShape {
        ConversationShape {
            system_prompts: self.system_prompts,
            zipf_s: self.zipf_s,
            system_prompt_tokens: self.system_prompt_tokens,
            conversations: self.conversations,
            max_turns: self.max_turns,
            user_tokens: self.user_tokens,
            assistant_tokens: self.assistant_tokens,
            sticky: self.sticky,
            block_size: self.block_size,
        }
    }

    fn workload(&self) -> WorkloadParams {
        WorkloadParams {
            replicas: self.replicas,
            shape: self.conversation_shape(),
            seed: self.seed,
            tenant: self.tenant.clone(),
            model: self.model.clone(),
            hash_scheme: self.hash_scheme.clone(),
            input: self.input,
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if self.replicas == 0 || self.block_size == 0 || self.conversations == 0 {
            return Err("--replicas, --block-size and --conversations must be positive".into());
        }
        if self.max_inflight == 0 || self.connections == 0 {
            return Err("--max-inflight and --connections must be positive".into());
        }
        for (name, v) in [
            ("--lookup-rate", self.lookup_rate),
            ("--ingest-blocks-per-sec", self.ingest_blocks_per_sec),
            ("--events-per-sec", self.events_per_sec),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} must be a non-negative number").into());
            }
        }
        if self.duration.is_zero() {
            return Err("--duration must be positive".into());
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn hist() -> Histogram<u64> {
    // 1 ns .. 1 h, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// Lookup-side measurements (behind one mutex; a few thousand updates per second).
struct LookupStats {
    /// Intended send → response, ns (coordinated-omission-correct).
    latency: Histogram<u64>,
    /// Actual send → response, ns.
    service: Histogram<u64>,
    /// Server-reported `lookup_latency_us`.
    server_us: Histogram<u64>,
    /// Current one-second window of `latency` for the timeline.
    window: Histogram<u64>,
    /// Scheduled with an intended time inside the measured window.
    issued: u64,
    ok: u64,
    reasons: BTreeMap<String, u64>,
    with_prefix: u64,
    hits: u64,
    matched_exact: u64,
    matched_over_truth: u64,
    contested: u64,
    contested_hits: u64,
    prefix_match: u64,
    prefix_match_exact: u64,
}

impl LookupStats {
    fn new() -> Self {
        LookupStats {
            latency: hist(),
            service: hist(),
            server_us: hist(),
            window: hist(),
            issued: 0,
            ok: 0,
            reasons: BTreeMap::new(),
            with_prefix: 0,
            hits: 0,
            matched_exact: 0,
            matched_over_truth: 0,
            contested: 0,
            contested_hits: 0,
            prefix_match: 0,
            prefix_match_exact: 0,
        }
    }
}

#[derive(Default)]
struct Counters {
    blocks: AtomicU64,
    updates: AtomicU64,
    evicted: AtomicU64,
    cleared: AtomicU64,
    lookups_done: AtomicU64,
}

struct Shared {
    fleet: Mutex<Fleet>,
    stats: Mutex<LookupStats>,
    counters: Counters,
    /// Consumer (LookupRoute) errors by gRPC code, any phase.
    consumer_errors: Mutex<BTreeMap<String, u64>>,
    /// Producer (ReportCacheState, PublishEvent) errors by gRPC code, any phase.
    producer_errors: Mutex<BTreeMap<String, u64>>,
    stop: AtomicBool,
    measure_from: Instant,
}

fn count(map: &Mutex<BTreeMap<String, u64>>, key: &str) {
    *lock(map).entry(key.to_string()).or_default() += 1;
}

fn code_name(status: &tonic::Status) -> String {
    format!("{:?}", status.code())
}

async fn connect(target: &str, timeout: Option<Duration>) -> Result<Channel, Error> {
    let mut ep = Endpoint::from_shared(target.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    if let Some(t) = timeout {
        ep = ep.timeout(t);
    }
    Ok(ep
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {target}: {e}"))?)
}

fn authorize<T>(req: &mut tonic::Request<T>, token: Option<&str>) {
    if let Some(t) = token
        && let Ok(v) = format!("Bearer {t}").parse()
    {
        req.metadata_mut().insert("authorization", v);
    }
}

fn event(args: &Args, kind: cache_event::Type, replica: &str, hash: Option<u64>) -> CacheEvent {
    CacheEvent {
        r#type: kind as i32,
        replica_id: replica.to_string(),
        model_id: args.model.clone(),
        tenant_id: args.tenant.clone(),
        prefix_hash: hash.map(|h| to_wire(h).to_vec()).unwrap_or_default(),
        timestamp_us: 0,
        adapter_id: String::new(),
    }
}

/// Runs the load and returns the report. `progress` shows the indicatif bar on stderr.
pub async fn run(args: &Args, progress: bool) -> Result<Report, Error> {
    args.validate()?;
    let token = args.producer_token.as_deref();
    let fleet = Fleet::new(args.workload());
    let replica_ids = fleet.replica_ids().to_vec();

    // Gateways and producers each get their own connections.
    let mut gateways = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        gateways.push(InferenceCacheClient::new(
            connect(&args.target, Some(args.request_timeout)).await?,
        ));
    }
    let events_client = InferenceCacheClient::new(connect(&args.target, None).await?);
    if !args.no_reset {
        for id in &replica_ids {
            let mut req = tonic::Request::new(event(args, cache_event::Type::AllCleared, id, None));
            authorize(&mut req, token);
            events_client
                .clone()
                .publish_event(req)
                .await
                .map_err(|s| format!("reset (ALL_CLEARED of {id}) failed: {s}"))?;
        }
    }

    // One long-lived ReportCacheState stream per replica.
    let mut senders = Vec::with_capacity(args.replicas);
    let mut streams = Vec::with_capacity(args.replicas);
    for _ in 0..args.replicas {
        let mut client = InferenceCacheClient::new(connect(&args.target, None).await?);
        let (tx, rx) = mpsc::channel::<CacheStateUpdate>(64);
        let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        authorize(&mut req, token);
        senders.push(tx);
        streams.push(tokio::spawn(
            async move { client.report_cache_state(req).await },
        ));
    }

    let start = Instant::now();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    let shared = Arc::new(Shared {
        fleet: Mutex::new(fleet),
        stats: Mutex::new(LookupStats::new()),
        counters: Counters::default(),
        consumer_errors: Mutex::new(BTreeMap::new()),
        producer_errors: Mutex::new(BTreeMap::new()),
        stop: AtomicBool::new(false),
        measure_from,
    });

    let ingest = tokio::spawn(ingest_loop(
        shared.clone(),
        senders,
        args.ingest_blocks_per_sec,
        end,
    ));
    let events = tokio::spawn(event_loop(
        shared.clone(),
        args.clone(),
        events_client,
        replica_ids.clone(),
        end,
    ));
    let inflight = Arc::new(Semaphore::new(args.max_inflight));
    let scheduler = {
        let shared = shared.clone();
        let inflight = inflight.clone();
        let handle = tokio::runtime::Handle::current();
        let rate = args.lookup_rate;
        std::thread::Builder::new()
            .name("ic-loadgen-gateway".into())
            .spawn(move || schedule_lookups(handle, shared, gateways, inflight, rate, start, end))?
    };

    // Progress and the per-second timeline.
    let bar = if progress {
        ProgressBar::with_draw_target(
            Some(u64::try_from((end - start).as_millis()).unwrap_or(u64::MAX)),
            ProgressDrawTarget::stderr_with_hz(4),
        )
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{bar:24}] {percent:>3}% {msg}",
        )
        .map_err(|e| format!("progress template: {e}"))?
        .progress_chars("=> "),
    );
    let mut timeline = Vec::new();
    let c0 = snapshot(&shared.counters);
    let mut base = c0;
    let mut at_measure = None;
    let mut last = (start, c0);
    let mut tick = start + Duration::from_millis(500);
    while Instant::now() < end {
        let now = Instant::now();
        if tick > now {
            tokio::time::sleep_until(tokio::time::Instant::from_std(tick.min(end))).await;
        }
        tick += Duration::from_millis(500);
        let now = Instant::now();
        let cur = snapshot(&shared.counters);
        if at_measure.is_none() && now >= measure_from {
            at_measure = Some(cur);
            base = cur;
        }
        let dt = (now - last.0).as_secs_f64().max(1e-9);
        let rates = cur.minus(&last.1).per_sec(dt);
        last = (now, cur);
        // One timeline point per measured second.
        let (p99, hit) = {
            let mut st = lock(&shared.stats);
            let since = now.saturating_duration_since(measure_from).as_secs_f64();
            if now >= measure_from && since >= (timeline.len() + 1) as f64 {
                let w = std::mem::replace(&mut st.window, hist());
                timeline.push(WindowStat::from_hist(timeline.len() as f64 + 1.0, &w));
            }
            let hit = if st.with_prefix > 0 {
                st.hits as f64 / st.with_prefix as f64
            } else {
                0.0
            };
            (st.latency.value_at_quantile(0.99), hit)
        };
        let errs: u64 = lock(&shared.consumer_errors).values().sum();
        let phase = if now < measure_from {
            "warmup"
        } else {
            "measure"
        };
        bar.set_position(u64::try_from((now - start).as_millis()).unwrap_or(u64::MAX));
        bar.set_message(format!(
            "{phase} | lookups {:.0}/s p99 {} | ingest {:.1}k blk/s | events {:.0}/s | hit {:.1}% | errors {errs}",
            rates.lookups,
            report::fmt_ns(p99),
            rates.blocks / 1e3,
            rates.events,
            hit * 100.0,
        ));
    }
    let at_end = snapshot(&shared.counters);
    let measured = (Instant::now() - measure_from).as_secs_f64().max(1e-9);
    let ingest_measured = at_end.minus(&at_measure.unwrap_or(base));

    // Drain: no new lookups, wait for the ones in flight, then close the producer side.
    shared.stop.store(true, Ordering::Relaxed);
    let scheduler = tokio::task::spawn_blocking(move || scheduler.join());
    let _ = scheduler.await;
    let drain = tokio::time::timeout(
        args.request_timeout * 2 + Duration::from_secs(1),
        inflight.acquire_many(u32::try_from(args.max_inflight).unwrap_or(u32::MAX)),
    )
    .await;
    if drain.is_err() {
        count(&shared.consumer_errors, "DrainTimeout");
    }
    let _ = events.await;
    let _ = ingest.await; // drops the senders: each stream half-closes and gets its Ack
    for s in streams {
        match tokio::time::timeout(Duration::from_secs(10), s).await {
            Ok(Ok(Ok(_ack))) => {}
            Ok(Ok(Err(status))) => count(&shared.producer_errors, &code_name(&status)),
            Ok(Err(_join)) => count(&shared.producer_errors, "TaskPanicked"),
            Err(_) => count(&shared.producer_errors, "AckTimeout"),
        }
    }
    bar.finish_and_clear();

    let st = lock(&shared.stats);
    let fleet = lock(&shared.fleet);
    let consumer_errors = lock(&shared.consumer_errors).clone();
    let producer_errors = lock(&shared.producer_errors).clone();
    let frac = |a: u64, b: u64| if b > 0 { a as f64 / b as f64 } else { 0.0 };
    let completed = st.latency.len();
    let mut report = Report {
        tool: "ic-loadgen".into(),
        started_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(0))
            .unwrap_or(0)
            .saturating_sub(u64::try_from((Instant::now() - start).as_millis()).unwrap_or(0)),
        config: ConfigEcho::from_args(args),
        measured_seconds: measured,
        lookups: LookupSection {
            offered_per_sec: args.lookup_rate,
            achieved_per_sec: completed as f64 / measured,
            issued: st.issued,
            completed,
            ok: st.ok,
            errors: consumer_errors.values().sum(),
            latency_us: Percentiles::from_ns(&st.latency),
            service_time_us: Percentiles::from_ns(&st.service),
            server_lookup_latency_us: Percentiles::from_us(&st.server_us),
            reason_codes: st.reasons.clone(),
            hit: HitSection {
                realized_hit_rate: frac(st.hits, st.with_prefix),
                lookups_with_prefix: st.with_prefix,
                hits: st.hits,
                matched_tokens_exact_rate: frac(st.matched_exact, st.ok),
                matched_tokens_exact: st.matched_exact,
                matched_over_truth: st.matched_over_truth,
                contested_hit_rate: frac(st.contested_hits, st.contested),
                contested_lookups: st.contested,
                prefix_match_exact_rate: frac(st.prefix_match_exact, st.prefix_match),
            },
        },
        ingest: IngestSection {
            offered_blocks_per_sec: args.ingest_blocks_per_sec,
            achieved_blocks_per_sec: ingest_measured.blocks as f64 / measured,
            updates_per_sec: ingest_measured.updates as f64 / measured,
            blocks_total: at_end.blocks,
            updates_total: at_end.updates,
        },
        events: EventSection {
            offered_per_sec: args.events_per_sec,
            achieved_per_sec: (ingest_measured.evicted + ingest_measured.cleared) as f64 / measured,
            prefix_evicted_total: at_end.evicted,
            all_cleared_total: at_end.cleared,
            eviction_backlog: fleet.eviction_backlog() as u64,
            truth_entries_held: fleet.held_entries() as u64,
        },
        consumer_errors,
        producer_errors,
        warnings: Vec::new(),
        timeline,
    };
    report.add_warnings();
    Ok(report)
}

#[derive(Clone, Copy)]
struct Snap {
    blocks: u64,
    updates: u64,
    evicted: u64,
    cleared: u64,
    lookups: u64,
}

struct Rates {
    blocks: f64,
    events: f64,
    lookups: f64,
}

impl Snap {
    fn minus(&self, o: &Snap) -> Snap {
        Snap {
            blocks: self.blocks - o.blocks,
            updates: self.updates - o.updates,
            evicted: self.evicted - o.evicted,
            cleared: self.cleared - o.cleared,
            lookups: self.lookups - o.lookups,
        }
    }
    fn per_sec(&self, dt: f64) -> Rates {
        Rates {
            blocks: self.blocks as f64 / dt,
            events: (self.evicted + self.cleared) as f64 / dt,
            lookups: self.lookups as f64 / dt,
        }
    }
}

fn snapshot(c: &Counters) -> Snap {
    Snap {
        blocks: c.blocks.load(Ordering::Relaxed),
        updates: c.updates.load(Ordering::Relaxed),
        evicted: c.evicted.load(Ordering::Relaxed),
        cleared: c.cleared.load(Ordering::Relaxed),
        lookups: c.lookups_done.load(Ordering::Relaxed),
    }
}

/// Producer side: serves turns and hands each replica's report to its stream, paced to
/// `rate` blocks/s with a token bucket (5 ms ticks). A full stream buffer blocks the loop, so a
/// server that cannot keep up shows as an achieved rate below the offered one.
async fn ingest_loop(
    shared: Arc<Shared>,
    senders: Vec<mpsc::Sender<CacheStateUpdate>>,
    rate: f64,
    end: Instant,
) {
    if rate <= 0.0 {
        return;
    }
    let mut alive = vec![true; senders.len()];
    let tick = Duration::from_millis(5);
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut budget = 0.0f64;
    let mut last = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) && Instant::now() < end {
        interval.tick().await;
        let now = Instant::now();
        // Cap the carried-over budget so a stall is not followed by a burst.
        budget = (budget + rate * (now - last).as_secs_f64()).min(rate * 0.05);
        last = now;
        while budget > 0.0 && Instant::now() < end {
            let turn = lock(&shared.fleet).next_turn();
            budget -= turn.blocks as f64;
            if !alive[turn.replica] {
                continue;
            }
            if senders[turn.replica].send(turn.update).await.is_err() {
                // The stream ended early (its status is collected at the end).
                alive[turn.replica] = false;
                lock(&shared.fleet).mark_dead(turn.replica);
                continue;
            }
            shared
                .counters
                .blocks
                .fetch_add(turn.blocks as u64, Ordering::Relaxed);
            shared.counters.updates.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Concurrent PublishEvent calls.
const EVENT_SLOTS: u32 = 64;

/// Producer side: PREFIX_EVICTED of finished conversations' blocks at `events_per_sec`
/// (10 ms ticks, up to [`EVENT_SLOTS`] in flight) and an ALL_CLEARED every `clear_interval`.
async fn event_loop(
    shared: Arc<Shared>,
    args: Args,
    client: InferenceCacheClient<Channel>,
    replica_ids: Vec<String>,
    end: Instant,
) {
    let rate = args.events_per_sec;
    let slots = Arc::new(Semaphore::new(EVENT_SLOTS as usize));
    let mut interval = tokio::time::interval(Duration::from_millis(10));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut budget = 0.0f64;
    let mut last = Instant::now();
    let mut next_clear = (!args.clear_interval.is_zero()).then(|| last + args.clear_interval);
    let token = args.producer_token.clone();
    while !shared.stop.load(Ordering::Relaxed) && Instant::now() < end {
        interval.tick().await;
        let now = Instant::now();
        budget = (budget + rate * (now - last).as_secs_f64()).min(rate * 0.1 + 1.0);
        last = now;
        let mut batch = Vec::new();
        if next_clear.is_some_and(|t| now >= t) {
            next_clear = Some(now + args.clear_interval);
            let r = lock(&shared.fleet).clear_random_replica();
            batch.push(event(
                &args,
                cache_event::Type::AllCleared,
                &replica_ids[r],
                None,
            ));
            shared.counters.cleared.fetch_add(1, Ordering::Relaxed);
        }
        {
            let mut fleet = lock(&shared.fleet);
            while budget >= 1.0 {
                let Some((r, h)) = fleet.pop_eviction() else {
                    // Nothing to evict: the budget does not accumulate.
                    budget = 0.0;
                    break;
                };
                budget -= 1.0;
                batch.push(event(
                    &args,
                    cache_event::Type::PrefixEvicted,
                    &replica_ids[r],
                    Some(h),
                ));
                shared.counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        for ev in batch {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let mut client = client.clone();
            let shared = shared.clone();
            let mut req = tonic::Request::new(ev);
            authorize(&mut req, token.as_deref());
            tokio::spawn(async move {
                if let Err(status) = client.publish_event(req).await {
                    count(&shared.producer_errors, &code_name(&status));
                }
                drop(permit);
            });
        }
    }
    // Let the last events finish.
    let _ = slots.acquire_many(EVENT_SLOTS).await;
}

/// Gateway timetable, on its own OS thread: request `i` is due at `start + i / rate`. The
/// thread sleeps until a request is due (nanosleep, far finer than the runtime's 1 ms timer),
/// takes an in-flight slot (waiting if all are taken) and spawns the call on the runtime with
/// its intended time. Falling behind never drops or re-times requests.
fn schedule_lookups(
    handle: tokio::runtime::Handle,
    shared: Arc<Shared>,
    gateways: Vec<InferenceCacheClient<Channel>>,
    inflight: Arc<Semaphore>,
    rate: f64,
    start: Instant,
    end: Instant,
) {
    if rate <= 0.0 {
        return;
    }
    let period = Duration::from_secs_f64(1.0 / rate);
    let mut i: u64 = 0;
    loop {
        let Some(intended) = period
            .checked_mul(u32::try_from(i).unwrap_or(u32::MAX))
            .and_then(|d| start.checked_add(d))
        else {
            return;
        };
        if intended >= end || shared.stop.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        let Ok(permit) = handle.block_on(inflight.clone().acquire_owned()) else {
            return;
        };
        let plan = lock(&shared.fleet).random_lookup();
        let measured = intended >= shared.measure_from;
        if measured {
            lock(&shared.stats).issued += 1;
        }
        let client = gateways[(i as usize) % gateways.len()].clone();
        handle.spawn(lookup_once(
            client,
            plan,
            intended,
            measured,
            shared.clone(),
            permit,
        ));
        i += 1;
    }
}

async fn lookup_once(
    mut client: InferenceCacheClient<Channel>,
    plan: Arc<LookupPlan>,
    intended: Instant,
    measured: bool,
    shared: Arc<Shared>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let req = plan.request.clone();
    let sent = Instant::now();
    let res = client.lookup_route(req).await;
    let done = Instant::now();
    drop(permit);
    shared.counters.lookups_done.fetch_add(1, Ordering::Relaxed);
    let resp = match res {
        Ok(r) => r.into_inner(),
        Err(status) => {
            count(&shared.consumer_errors, &code_name(&status));
            return;
        }
    };
    if !measured {
        return;
    }
    let top = resp
        .replica_scores
        .first()
        .map(|s| (s.replica_id.as_str(), s.matched_tokens));
    let verdict = lock(&shared.fleet).judge(&plan.chain, top);
    let latency = u64::try_from((done - intended).as_nanos())
        .unwrap_or(u64::MAX)
        .max(1);
    let service = u64::try_from((done - sent).as_nanos())
        .unwrap_or(u64::MAX)
        .max(1);
    let mut st = lock(&shared.stats);
    st.latency.saturating_record(latency);
    st.window.saturating_record(latency);
    st.service.saturating_record(service);
    st.server_us
        .saturating_record(u64::try_from(resp.lookup_latency_us).unwrap_or(0));
    st.ok += 1;
    if resp.reason_code == "PREFIX_MATCH" {
        st.prefix_match += 1;
        st.prefix_match_exact += u64::from(verdict.matched_exact);
    }
    if verdict.best_blocks > 0 && !verdict.all_tied {
        st.contested += 1;
        st.contested_hits += u64::from(verdict.hit);
    }
    if let Some(n) = st.reasons.get_mut(resp.reason_code.as_str()) {
        *n += 1;
    } else {
        st.reasons.insert(resp.reason_code, 1);
    }
    if verdict.best_blocks > 0 {
        st.with_prefix += 1;
        st.hits += u64::from(verdict.hit);
    }
    st.matched_exact += u64::from(verdict.matched_exact);
    st.matched_over_truth += u64::from(verdict.overclaim);
}
