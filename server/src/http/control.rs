//! Control-plane HTTP listener (`:8081`, spec `server.md` §4, §6.4, §9.1, §12.3, §12.4):
//! `GET /snapshot`, `POST|PUT /policy`, `POST /probe`.
//!
//! Exact-path routing; anything else is 404. Each route authenticates first (§9.1), then checks
//! the method, then reads the body.

use crate::auth::Auth;
use crate::metrics::AuthRoute;
use crate::policy::{MAX_PUSH_BYTES, decode_push};
use crate::state::AppState;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use inferencecache_engine::{
    CacheEventInput, CacheStateUpdate, Index, LookupRequest, PROBE_TENANT, PrefixRef,
    ReplicaStatsInput, SnapshotData, Strategy, event_type,
};
use inferencecache_tokenize::civil_from_days;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Largest accepted `/probe` body.
pub const MAX_PROBE_BYTES: usize = 4 * 1024;

/// Tokens in the probe's single block.
pub const PROBE_BLOCK_TOKENS: i32 = 16;

/// Backend type assumed when the probe request has none.
pub const DEFAULT_BACKEND_TYPE: &str = "LMCache";

/// Optional offload-tier (T2) prober used by the probe's `t2` stage. None ships with the product;
/// tests inject doubles.
pub trait T2Prober: Send + Sync {
    /// Stores `payload` under `key` on the backend.
    fn put(&self, backend: &str, model: &str, key: &[u8], payload: &[u8]) -> Result<(), String>;
    /// Reads back the payload stored under `key`.
    fn get(&self, backend: &str, model: &str, key: &[u8]) -> Result<Vec<u8>, String>;
}

/// Shared state of the control-plane router.
#[derive(Clone)]
pub struct ControlState {
    app: AppState,
    auth: Arc<Auth>,
    probes: Arc<ProbeLocks>,
    t2: Option<Arc<dyn T2Prober>>,
}

impl ControlState {
    pub fn new(app: AppState, auth: Arc<Auth>) -> Self {
        Self {
            app,
            auth,
            probes: Arc::default(),
            t2: None,
        }
    }

    /// Installs a T2 prober for the probe's `t2` stage.
    pub fn with_t2_prober(mut self, prober: Arc<dyn T2Prober>) -> Self {
        self.t2 = Some(prober);
        self
    }
}

/// Router of the control-plane listener.
pub fn control_router(state: ControlState) -> Router {
    Router::new()
        .route("/snapshot", any(snapshot))
        .route("/policy", any(policy))
        .route("/probe", any(probe))
        .route("/checkpoint", any(checkpoint))
        .route("/digest", any(digest))
        .fallback(not_found)
        .with_state(state)
}

/// Serves the control-plane router until `stop` resolves.
pub async fn serve_control(
    state: ControlState,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_http(control_router(state), listener, stop).await
}

/// Time allowed for a request's header to arrive (§4).
pub const READ_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long in-flight requests may run after `stop` (§14).
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// Plaintext HTTP/1.1 for `router` on `listener` with the 5 s read-header timeout (§4). When
/// `stop` resolves, stops accepting and waits up to [`SHUTDOWN_DEADLINE`] for open connections.
pub async fn serve_http(
    router: Router,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(READ_HEADER_TIMEOUT);
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Per-connection failures are retried at once; others (e.g. out of file
                // descriptors) after a pause, as net/http does.
                if !matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                ) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(SHUTDOWN_DEADLINE, graceful.shutdown()).await;
    Ok(())
}

/// A control-plane server running in its own task, stopped with [`ControlServer::stop`].
pub struct ControlServer {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    failed: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl ControlServer {
    /// Starts serving `listener`.
    pub fn spawn(state: ControlState, listener: TcpListener) -> Self {
        let (stop, mut stop_rx) = tokio::sync::watch::channel(false);
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let result = serve_control(state, listener, async move {
                let _ = stop_rx.wait_for(|stopped| *stopped).await;
            })
            .await;
            if result.is_err() {
                let _ = failed_tx.send(());
            }
            result
        });
        Self {
            stop,
            task,
            failed: Some(failed_rx),
        }
    }

    /// Resolves when the listener fails; pending forever otherwise (even after a clean stop).
    pub fn failure(&mut self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let rx = self.failed.take();
        async move {
            let failed = match rx {
                Some(rx) => rx.await.is_ok(),
                None => false,
            };
            if !failed {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Stops accepting, drains in-flight requests and returns the listener's result.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.task.await?
    }
}

fn text(status: StatusCode, body: &'static str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn text_owned(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

fn json(body: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn not_found() -> Response {
    text(StatusCode::NOT_FOUND, "404 page not found\n")
}

async fn snapshot(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Snapshot, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    json(snapshot_json(&s.app.index().snapshot()))
}

/// `GET /checkpoint`: the last checkpoint written and the startup restore (controller audience).
async fn checkpoint(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Snapshot, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    json(s.app.core().checkpoint_status().to_json())
}

/// `GET /digest`: the stream sequence applied, the entry count and the order-independent
/// digest of the index at that sequence (replicated mode computes it on the apply thread).
async fn digest(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Snapshot, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    let (replicated, at) = match s.app.replication() {
        Some(r) => match r.digest().await {
            Some(at) => (true, at),
            None => {
                return text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "replication has not started yet\n",
                );
            }
        },
        None => (
            false,
            crate::replication::apply::DigestAt {
                stream_seq: 0,
                digest: s.app.index().digest(),
            },
        ),
    };
    let (leader, buffered, stream_last_seq) = s.app.replication().map_or((false, 0, 0), |r| {
        let c = r.counters();
        (
            c.leader.load(std::sync::atomic::Ordering::Relaxed),
            r.buffered(),
            c.stream_last_seq.load(std::sync::atomic::Ordering::Relaxed),
        )
    });
    json(
        serde_json::json!({
            "replicated": replicated,
            "stream_seq": at.stream_seq,
            "entries": at.digest.entries,
            "digest": format!("{:032x}", at.digest.hash),
            "leader": leader,
            "buffered_records": buffered,
            "stream_last_seq": stream_last_seq,
        })
        .to_string()
            + "\n",
    )
}

async fn policy(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Policy, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::POST && req.method() != Method::PUT {
        return method_not_allowed("POST, PUT");
    }
    let body = match read_body(req.into_body(), MAX_PUSH_BYTES).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return text(
                StatusCode::BAD_REQUEST,
                "decode policy snapshot: body exceeds 1 MiB\n",
            );
        }
        Err(BodyError::Read(e)) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("decode policy snapshot: {e}\n"),
            );
        }
    };
    match decode_push(&body) {
        Ok(_) if s.app.replication().is_some() => {
            // Replicated mode: every server applies the push at its stream position.
            if let Some(replication) = s.app.replication() {
                replication.submit_policy(&body).await;
            }
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(layer) => {
            // A push during a warm restart wins over the checkpoint's layer.
            s.app.core().wait_restored().await;
            s.app.core().push_policy(&body, layer);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
    }
}

enum BodyError {
    TooLarge,
    Read(String),
}

/// Reads at most `limit` bytes; a longer body is `TooLarge`.
async fn read_body(body: Body, limit: usize) -> Result<axum::body::Bytes, BodyError> {
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = source {
                if err.is::<http_body_util::LengthLimitError>() {
                    return Err(BodyError::TooLarge);
                }
                source = err.source();
            }
            Err(BodyError::Read(e.to_string()))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /snapshot (§12.3)

/// Serializes snapshot data exactly as §12.3 (key order, omission rules, `[]` for empty lists,
/// RFC 3339 times, shortest f32 floats), followed by `\n`.
pub fn snapshot_json(data: &SnapshotData) -> String {
    let mut out = String::with_capacity(128 + data.replicas.len() * 256 + data.tenants.len() * 96);
    out.push_str("{\"replicas\":[");
    for (i, r) in data.replicas.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"replicaId\":");
        write_json_str(&mut out, &r.replica_id);
        if !r.tenant_id.is_empty() {
            out.push_str(",\"tenant\":");
            write_json_str(&mut out, &r.tenant_id);
        }
        let _ = write!(out, ",\"cacheMemoryBytes\":{}", r.cache_memory_bytes);
        out.push_str(",\"hitRate\":");
        write_f32(&mut out, r.hit_rate);
        out.push_str(",\"pressure\":");
        write_f32(&mut out, r.pressure);
        out.push_str(",\"lastUpdate\":\"");
        write_time(&mut out, r.last_update_us);
        let _ = write!(out, "\",\"prefixCount\":{}", r.prefix_count);
        out.push_str(",\"lastEventAt\":\"");
        write_time(&mut out, r.last_event_at_us);
        out.push('"');
        if r.stats_reported {
            out.push_str(",\"statsReported\":true");
        }
        if r.t2_hit_tokens != 0 {
            let _ = write!(out, ",\"t2HitTokens\":{}", r.t2_hit_tokens);
        }
        if r.t2_query_tokens != 0 {
            let _ = write!(out, ",\"t2QueryTokens\":{}", r.t2_query_tokens);
        }
        out.push('}');
    }
    out.push_str("],\"tenants\":[");
    for (i, t) in data.tenants.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"tenantId\":");
        write_json_str(&mut out, &t.tenant_id);
        let _ = write!(out, ",\"indexEntries\":{}", t.index_entries);
        out.push_str(",\"hitRate\":");
        write_f32(&mut out, t.hit_rate as f32);
        if t.hit_rate_reported {
            out.push_str(",\"hitRateReported\":true");
        }
        out.push_str(",\"memoryUsed\":0}");
    }
    let _ = writeln!(
        out,
        "],\"totalPrefixes\":{},\"hotPrefixes\":{}}}",
        data.total_prefixes, data.hot_prefixes
    );
    out
}

/// A float32 as Go's `encoding/json` prints it: the shortest decimal that round-trips, plain
/// notation unless the magnitude is below 1e-6 or at least 1e21 (then `1e-7`, `1e+21`).
/// Non-finite values (not representable in JSON) are written as `0`.
pub fn write_f32(out: &mut String, x: f32) {
    if !x.is_finite() {
        out.push('0');
        return;
    }
    let abs = x.abs();
    if abs != 0.0 && !(1e-6..1e21).contains(&abs) {
        let s = format!("{x:e}");
        match s.split_once('e') {
            Some((mantissa, exp)) if !exp.starts_with('-') => {
                let _ = write!(out, "{mantissa}e+{exp:0>2}");
            }
            _ => out.push_str(&s),
        }
    } else {
        let _ = write!(out, "{x}");
    }
}

/// RFC 3339 UTC with a trimmed fractional second; 0 is Go's zero time.
pub fn write_time(out: &mut String, us: i64) {
    if us == 0 {
        out.push_str("0001-01-01T00:00:00Z");
        return;
    }
    let secs = us.div_euclid(1_000_000);
    let frac_us = us.rem_euclid(1_000_000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60
    );
    if frac_us != 0 {
        let frac = format!("{frac_us:06}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
}

/// A JSON string as Go's `encoding/json` writes it (HTML-safe escaping of `<`, `>`, `&`, and of
/// U+2028/U+2029).
pub fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// /probe (§12.4)

/// A `/probe` request body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    pub backend: String,
    pub model: String,
    #[serde(rename = "hashScheme")]
    pub hash_scheme: String,
    #[serde(rename = "backendType", default)]
    pub backend_type: Option<String>,
}

/// Strict decode: one JSON object, known keys only, the three required strings non-empty.
pub fn decode_probe(body: &[u8]) -> Result<ProbeRequest, String> {
    if body.len() > MAX_PROBE_BYTES {
        return Err("request body exceeds 4 KiB".into());
    }
    // A JSON array would decode positionally into the struct; strict decode wants an object.
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    if !value.is_object() {
        return Err("the body must be a JSON object".into());
    }
    let req: ProbeRequest = serde_json::from_value(value).map_err(|e| e.to_string())?;
    for (name, value) in [
        ("backend", &req.backend),
        ("model", &req.model),
        ("hashScheme", &req.hash_scheme),
    ] {
        if value.is_empty() {
            return Err(format!("{name} must be non-empty"));
        }
    }
    Ok(req)
}

/// `SHA-256("inferencecache.io/probe/v1\n" ‖ f(hashScheme) ‖ f(model) ‖ f(backend))` with
/// `f(s) = u32_be(len(s)) ‖ s`.
pub fn probe_hash(hash_scheme: &str, model: &str, backend: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"inferencecache.io/probe/v1\n");
    for s in [hash_scheme, model, backend] {
        h.update((s.len() as u32).to_be_bytes());
        h.update(s.as_bytes());
    }
    h.finalize().into()
}

/// The probe's replica id for `backend`.
pub fn probe_replica(backend: &str) -> String {
    format!("__probe-{backend}")
}

/// Result of one probe stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageResult {
    Ok,
    Failed,
    Skipped,
}

impl StageResult {
    pub fn as_str(self) -> &'static str {
        match self {
            StageResult::Ok => "ok",
            StageResult::Failed => "failed",
            StageResult::Skipped => "skipped",
        }
    }
}

/// Outcome of a probe run (the `/probe` response).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    pub backend: String,
    pub ingest: StageResult,
    pub routing: StageResult,
    pub t2: StageResult,
    /// `(stage, message)` in stage order.
    pub errors: Vec<(&'static str, String)>,
}

impl ProbeReport {
    /// Every stage `ok` or `skipped`.
    pub fn passed(&self) -> bool {
        [self.ingest, self.routing, self.t2]
            .iter()
            .all(|s| *s != StageResult::Failed)
    }

    /// `{"backend":…,"ingest":…,"routing":…,"t2":…,"errors":[…]}` + `\n`; `errors` omitted when
    /// empty.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(128);
        out.push_str("{\"backend\":");
        write_json_str(&mut out, &self.backend);
        let _ = write!(
            out,
            ",\"ingest\":\"{}\",\"routing\":\"{}\",\"t2\":\"{}\"",
            self.ingest.as_str(),
            self.routing.as_str(),
            self.t2.as_str()
        );
        if !self.errors.is_empty() {
            out.push_str(",\"errors\":[");
            for (i, (stage, message)) in self.errors.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str("{\"stage\":");
                write_json_str(&mut out, stage);
                out.push_str(",\"message\":");
                write_json_str(&mut out, message);
                out.push('}');
            }
            out.push(']');
        }
        out.push_str("}\n");
        out
    }
}

type ModelLock = Arc<tokio::sync::Mutex<()>>;

/// Serializes probe runs per model, across backends (§12.4 asks for per-(backend, model)
/// serialization; this is stricter on purpose).
///
/// Runs for different backends of one model write the same reserved-tenant partition, and the
/// index publishes a new partition in its directory before adding it to the model's partition
/// list, which is what a run's cleanup (ALL_CLEARED) walks. Two such runs in parallel on a new
/// partition could leave the second one's entry behind: it found the partition, ingested, and
/// cleared before the partition was listed
/// (`control_plane.rs::unserialized_probe_runs_of_one_model_race_on_partition_creation`).
/// Within one model the runs are now sequential, so each run's partition is listed before its
/// own cleanup; runs of different models never share a partition, and nothing else writes the
/// reserved tenant (ingest and events drop it). A run is a few microseconds without a T2
/// prober, so the serialization costs nothing noticeable.
#[derive(Default)]
pub struct ProbeLocks {
    locks: parking_lot::Mutex<HashMap<String, ModelLock>>,
}

/// A model's lock taken from [`ProbeLocks`]; its map entry goes when the last user drops it
/// (also when a waiting request is cancelled).
struct ModelLockRef<'l> {
    locks: &'l ProbeLocks,
    model: &'l str,
    lock: ModelLock,
}

impl Drop for ModelLockRef<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.locks.lock();
        // One reference in the map, this one: no other run of the model is pending (others
        // clone under the map's lock, which is held here).
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(self.model);
        }
    }
}

impl ProbeLocks {
    /// Runs the probe of `req` once no other run of the same model is in progress.
    pub async fn run(
        &self,
        index: &Index,
        req: &ProbeRequest,
        t2: Option<&dyn T2Prober>,
    ) -> ProbeReport {
        let entry = ModelLockRef {
            locks: self,
            model: &req.model,
            lock: self
                .locks
                .lock()
                .entry(req.model.clone())
                .or_default()
                .clone(),
        };
        // Declared after `entry`, so released before it.
        let _guard = entry.lock.lock().await;
        run_probe(index, req, t2)
    }
}

/// Runs the probe stages against `index` (§12.4). Callers serialize runs per model
/// ([`ProbeLocks::run`]).
pub fn run_probe(index: &Index, req: &ProbeRequest, t2: Option<&dyn T2Prober>) -> ProbeReport {
    let model = req.model.as_str();
    let scheme = req.hash_scheme.as_str();
    let replica = probe_replica(&req.backend);
    let hash = probe_hash(scheme, model, &req.backend);
    let hashes = [hash];
    let counts = [PROBE_BLOCK_TOKENS];
    let mut report = ProbeReport {
        backend: req.backend.clone(),
        ingest: StageResult::Ok,
        routing: StageResult::Skipped,
        t2: StageResult::Skipped,
        errors: Vec::new(),
    };

    // ingest: directly into the index under the reserved tenant, timestamp now (0).
    index.ingest(CacheStateUpdate {
        replica_id: &replica,
        model_id: model,
        tenant_id: PROBE_TENANT,
        hash_scheme: scheme,
        timestamp_us: 0,
        adapter_id: "",
        prefixes: std::iter::once(PrefixRef {
            prefix_hash: &[],
            token_count: PROBE_BLOCK_TOKENS,
            block_hashes: &hashes[..],
            block_token_counts: &counts[..],
            tier: 0,
            adapter_id: "",
        }),
        stats: Some(ReplicaStatsInput {
            hit_rate: 1.0,
            ..Default::default()
        }),
    });
    let request = LookupRequest {
        block_hashes: &hashes[..],
        block_token_counts: &counts[..],
        ..LookupRequest::new(PROBE_TENANT, model, scheme)
    };
    let held = index
        .lookup(&request)
        .iter()
        .any(|s| *s.replica_id == *replica);
    if !held {
        report.ingest = StageResult::Failed;
        report.errors.push((
            "ingest",
            format!("probe prefix not found on replica {replica} after ingest"),
        ));
    } else {
        // routing: the index's LookupRoute (no floors, no timeouts, nothing credited).
        let route = index.lookup_route(&request);
        if route.strategy != Strategy::PrefixMatch {
            report.routing = StageResult::Failed;
            report.errors.push((
                "routing",
                format!(
                    "LookupRoute returned {}, expected PREFIX_MATCH",
                    route.strategy.reason_code()
                ),
            ));
        } else if !route.scores.iter().any(|s| *s.replica_id == *replica) {
            report.routing = StageResult::Failed;
            report.errors.push((
                "routing",
                format!("LookupRoute returned PREFIX_MATCH without the expected replica {replica}"),
            ));
        } else {
            report.routing = StageResult::Ok;
            let backend_type = req.backend_type.as_deref().unwrap_or("");
            let lmcache = backend_type.is_empty() || backend_type == DEFAULT_BACKEND_TYPE;
            if let (true, Some(prober)) = (lmcache, t2) {
                match t2_cycle(prober, &req.backend, model, &hash) {
                    Ok(()) => report.t2 = StageResult::Ok,
                    Err(e) => {
                        report.t2 = StageResult::Failed;
                        report
                            .errors
                            .push(("t2", format!("T2 put/get cycle failed: {e}")));
                    }
                }
            }
        }
    }

    // cleanup (always): no probe state remains.
    index.apply_event(CacheEventInput {
        event_type: event_type::ALL_CLEARED,
        replica_id: &replica,
        model_id: model,
        tenant_id: PROBE_TENANT,
        prefix_hash: &[],
        timestamp_us: 0,
        adapter_id: "",
    });
    report
}

fn t2_cycle(prober: &dyn T2Prober, backend: &str, model: &str, hash: &[u8]) -> Result<(), String> {
    let mut payload = b"probe-payload-v1\n".to_vec();
    payload.extend_from_slice(hash);
    prober
        .put(backend, model, hash, &payload)
        .map_err(|e| format!("put failed: {e}"))?;
    let got = prober
        .get(backend, model, hash)
        .map_err(|e| format!("get failed: {e}"))?;
    if got != payload {
        return Err("get failed: payload mismatch".into());
    }
    Ok(())
}

async fn probe(State(s): State<ControlState>, req: Request) -> Response {
    if let Err((status, body)) = s.auth.check_control(AuthRoute::Probe, req.headers()) {
        return text(status, body);
    }
    if req.method() != Method::POST {
        return method_not_allowed("POST");
    }
    let body = match read_body(req.into_body(), MAX_PROBE_BYTES).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return text(
                StatusCode::BAD_REQUEST,
                "invalid probe request: body exceeds 4 KiB\n",
            );
        }
        Err(BodyError::Read(e)) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("invalid probe request: {e}\n"),
            );
        }
    };
    let request = match decode_probe(&body) {
        Ok(r) => r,
        Err(e) => {
            return text_owned(
                StatusCode::BAD_REQUEST,
                format!("invalid probe request: {e}\n"),
            );
        }
    };
    let report = s.probes.run(s.app.index(), &request, s.t2.as_deref()).await;
    json(report.to_json())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(x: f32) -> String {
        let mut s = String::new();
        write_f32(&mut s, x);
        s
    }

    fn t(us: i64) -> String {
        let mut s = String::new();
        write_time(&mut s, us);
        s
    }

    #[test]
    fn floats_match_go_float32_encoding() {
        assert_eq!(f(1.0), "1");
        assert_eq!(f(0.0), "0");
        assert_eq!(f(0.8), "0.8");
        assert_eq!(f(0.6), "0.6");
        assert_eq!(f(0.1), "0.1");
        assert_eq!(f(0.7), "0.7");
        assert_eq!(f(1.5), "1.5");
        assert_eq!(f(-0.25), "-0.25");
        assert_eq!(f(123456.79), "123456.79");
        assert_eq!(f(1e-6), "0.000001");
        assert_eq!(f(1e-7), "1e-7");
        assert_eq!(f(1.5e-10), "1.5e-10");
        assert_eq!(f(1e21), "1e+21");
        assert_eq!(f(1e20), "100000000000000000000");
        assert_eq!(f(f32::NAN), "0");
        // The f64 mean of two f32 values, narrowed back: (0.8 + 0.6) / 2 is not 0.7 in f32.
        assert_eq!(
            f(((0.8f32 as f64 + 0.6f32 as f64) / 2.0) as f32),
            "0.70000005"
        );
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(t(0), "0001-01-01T00:00:00Z");
        assert_eq!(t(1_767_225_600_000_000), "2026-01-01T00:00:00Z");
        assert_eq!(t(1_772_366_400_500_000), "2026-03-01T12:00:00.5Z");
        assert_eq!(t(1_772_366_400_123_000), "2026-03-01T12:00:00.123Z");
        assert_eq!(t(1_000), "1970-01-01T00:00:00.001Z");
        assert_eq!(t(951_782_400_000_000), "2000-02-29T00:00:00Z");
        assert_eq!(t(-1_000_000), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn strings_are_escaped_like_go() {
        let mut s = String::new();
        write_json_str(&mut s, "a\"b\\c\n<&>\u{1}\u{2028}é");
        assert_eq!(s, r#""a\"b\\c\n\u003c\u0026\u003e\u0001\u2028é""#);
    }

    #[test]
    fn empty_snapshot() {
        assert_eq!(
            snapshot_json(&SnapshotData::default()),
            "{\"replicas\":[],\"tenants\":[],\"totalPrefixes\":0,\"hotPrefixes\":0}\n"
        );
    }

    #[test]
    fn probe_hash_layout() {
        let mut manual = Vec::new();
        manual.extend_from_slice(b"inferencecache.io/probe/v1\n");
        for s in ["vllm", "m", "b1"] {
            manual.extend_from_slice(&(s.len() as u32).to_be_bytes());
            manual.extend_from_slice(s.as_bytes());
        }
        let expected: [u8; 32] = Sha256::digest(&manual).into();
        assert_eq!(probe_hash("vllm", "m", "b1"), expected);
        assert_ne!(probe_hash("vllm", "m", "b1"), probe_hash("vllm", "mb", "1"));
    }

    #[test]
    fn probe_bodies_are_strict() {
        let ok = br#"{"backend":"b","model":"m","hashScheme":"vllm"}"#;
        assert!(decode_probe(ok).is_ok());
        assert!(
            decode_probe(b" {\"backend\":\"b\",\"model\":\"m\",\"hashScheme\":\"v\"}\n").is_ok()
        );
        for bad in [
            &b"{"[..],
            br#"{"backend":"b","model":"m"}"#,
            br#"{"backend":"","model":"m","hashScheme":"v"}"#,
            br#"{"backend":"b","model":"m","hashScheme":"v","tenant":"t"}"#,
            br#"{"backend":"b","model":"m","hashScheme":"v"}{}"#,
            br#"{"backend":"b","model":"m","hashScheme":"v"}]"#,
            br#"{"backend":"b","model":"m","hashScheme":"v"}xyz"#,
            br#"{"backend":null,"model":"m","hashScheme":"v"}"#,
            br#"[]"#,
        ] {
            assert!(
                decode_probe(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let big = format!(
            r#"{{"backend":"{}","model":"m","hashScheme":"v"}}"#,
            "x".repeat(MAX_PROBE_BYTES)
        );
        assert!(decode_probe(big.as_bytes()).is_err());
    }

    #[test]
    fn probe_report_json() {
        let mut r = ProbeReport {
            backend: "b".into(),
            ingest: StageResult::Ok,
            routing: StageResult::Ok,
            t2: StageResult::Skipped,
            errors: Vec::new(),
        };
        assert!(r.passed());
        assert_eq!(
            r.to_json(),
            "{\"backend\":\"b\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}\n"
        );
        r.routing = StageResult::Failed;
        r.errors.push(("routing", "x".into()));
        assert!(!r.passed());
        assert!(
            r.to_json()
                .ends_with(",\"errors\":[{\"stage\":\"routing\",\"message\":\"x\"}]}\n")
        );
    }
}
