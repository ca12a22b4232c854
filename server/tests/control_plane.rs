//! Control-plane listener (`:8081`): routes, authentication, `/snapshot`, `/policy`, `/probe`
//! (server.md §3, §4, §6.4, §9.1, §12.3, §12.4; SV03–SV10, SV60–SV64).
//!
//! Every HTTP test talks real HTTP/1.1 over loopback to the real router; startup validation and
//! startup logs run the built binary.

use inferencecache_engine::{
    CacheStateUpdate, IndexConfig, LookupRequest, ManualClock, PROBE_TENANT, PrefixRef,
    ReplicaStatsInput,
};
use inferencecache_server::auth::{Auth, AuthConfig, TokenStores};
use inferencecache_server::http::control::{ControlServer, ControlState};
use inferencecache_server::http::probe::T2Prober;
use inferencecache_server::state::{AppState, ServerOptions};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// 2026-01-01T00:00:00Z in µs.
const T0_US: i64 = 1_767_225_600_000_000;

const CTL: &str = "ctl-token-1";
const POL: &str = "pol-token-1";

// ---------------------------------------------------------------------------------------------
// Helpers

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ic-ctl-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        write_file(&p, text);
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_file(p: &Path, text: &str) {
    let mut f = std::fs::File::create(p).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

fn manual_state(index: IndexConfig) -> (AppState, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0_US));
    let options = ServerOptions {
        index,
        ..Default::default()
    };
    (AppState::with_clock(options, clock.clone()), clock)
}

fn open_auth(state: &AppState) -> Arc<Auth> {
    Arc::new(Auth::open(state.metrics().clone()))
}

fn token_auth(state: &AppState, dir: &TempDir) -> (Arc<Auth>, PathBuf, PathBuf) {
    let c = dir.file("controller", &format!("# controller tokens\n{CTL}\n"));
    let p = dir.file("policy", &format!("{POL}\n"));
    let stores = TokenStores::load(&AuthConfig {
        insecure_disable_auth: false,
        controller_token_file: Some(c.clone()),
        policy_token_file: Some(p.clone()),
        producer_token_file: None,
    })
    .unwrap();
    (Arc::new(Auth::new(stores, state.metrics().clone())), c, p)
}

struct Control {
    addr: SocketAddr,
    server: Option<ControlServer>,
}

impl Control {
    async fn start(state: ControlState) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        Self {
            addr,
            server: Some(ControlServer::spawn(state, listener)),
        }
    }

    async fn with(app: &AppState, auth: Arc<Auth>) -> Self {
        Self::start(ControlState::new(app.clone(), auth)).await
    }

    async fn req(&self, method: &str, path: &str, token: Option<&str>, body: &str) -> Reply {
        let auth = token.map(|t| format!("Bearer {t}"));
        http(self.addr, method, path, auth.as_deref(), body.as_bytes()).await
    }

    async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await.unwrap();
        }
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// One HTTP/1.1 request (Connection: close); `authorization` is the raw header value.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    body: &[u8],
) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    if let Some(a) = authorization {
        req.push_str(&format!("Authorization: {a}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    stream.write_all(req.as_bytes()).await.unwrap();
    // The server may answer (400) before reading a large body: ignore write errors.
    let _ = stream.write_all(body).await;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Reply {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

fn metrics_text(state: &AppState) -> String {
    inferencecache_server::metrics::render_text(&state.metrics().gather(state.index()))
}

fn counter(state: &AppState, family: &str, result: &str) -> u64 {
    let needle = format!("{family}{{result=\"{result}\"}} ");
    metrics_text(state)
        .lines()
        .find_map(|l| l.strip_prefix(&needle)?.parse().ok())
        .unwrap_or(0)
}

/// A log sink for `tracing` (JSON lines), installed for the current thread.
#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogBuf {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).to_string()
    }
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let w = self.clone();
        let sub = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::set_default(sub)
    }
}

fn ingest(
    state: &AppState,
    tenant: &str,
    replica: &str,
    model: &str,
    keys: &[&[u8]],
    ts_us: i64,
    stats: Option<ReplicaStatsInput>,
) {
    state.index().ingest(CacheStateUpdate {
        replica_id: replica,
        model_id: model,
        tenant_id: tenant,
        hash_scheme: "vllm",
        timestamp_us: ts_us,
        adapter_id: "",
        prefixes: keys.iter().map(|k| PrefixRef {
            prefix_hash: k,
            token_count: 64,
            block_hashes: &[] as &[Vec<u8>],
            block_token_counts: &[],
            tier: 1,
            adapter_id: "",
        }),
        stats,
    });
}

const PROBE_BODY: &str = r#"{"backend":"b1","model":"m","hashScheme":"vllm"}"#;

// ---------------------------------------------------------------------------------------------
// SV03, SV04: routes and methods

#[tokio::test]
async fn sv03_open_control_routes_and_404_on_public_listener() {
    let (state, _) = manual_state(IndexConfig::default());
    // Public listener: the control routes do not exist there.
    let public = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let public_addr = public.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let public_task = tokio::spawn(inferencecache_server::http::serve_public(
        state.clone(),
        public,
        async move {
            let _ = stop_rx.await;
        },
    ));
    for (method, path, body) in [
        ("GET", "/snapshot", ""),
        ("POST", "/policy", r#"{"version":7}"#),
        ("POST", "/probe", PROBE_BODY),
    ] {
        let r = http(public_addr, method, path, None, body.as_bytes()).await;
        assert_eq!(r.status, 404, "{method} {path} on the public listener");
    }
    let _ = stop_tx.send(());
    public_task.await.unwrap().unwrap();

    // Control listener without tokens: served without auth, counters untouched.
    let ctl = Control::with(&state, open_auth(&state)).await;
    let r = ctl.req("GET", "/snapshot", None, "").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(
        r.body,
        "{\"replicas\":[],\"tenants\":[],\"totalPrefixes\":0,\"hotPrefixes\":0}\n"
    );
    let r = ctl.req("POST", "/policy", None, r#"{"version":7}"#).await;
    assert_eq!(r.status, 204);
    assert_eq!(r.body, "");
    let r = ctl.req("POST", "/probe", None, PROBE_BODY).await;
    assert_eq!(r.status, 200, "{r:?}");
    for path in ["/", "/snapshot/", "/metrics", "/healthz", "/snapshotx"] {
        assert_eq!(ctl.req("GET", path, None, "").await.status, 404, "{path}");
    }
    let text = metrics_text(&state);
    assert!(
        !text.contains("inferencecache_snapshot_auth_total{"),
        "{text}"
    );
    assert!(
        !text.contains("inferencecache_policy_auth_total{"),
        "{text}"
    );
    assert!(!text.contains("inferencecache_probe_auth_total{"), "{text}");
    ctl.stop().await;
}

#[tokio::test]
async fn sv04_wrong_methods_get_405_with_allow() {
    let (state, _) = manual_state(IndexConfig::default());
    let ctl = Control::with(&state, open_auth(&state)).await;
    for method in ["POST", "PUT", "DELETE", "PATCH", "HEAD"] {
        let r = ctl.req(method, "/snapshot", None, "").await;
        assert_eq!(r.status, 405, "{method} /snapshot");
        assert_eq!(r.header("allow").as_deref(), Some("GET"));
        if method != "HEAD" {
            assert_eq!(r.body, "method not allowed\n");
        }
    }
    for method in ["GET", "PUT", "DELETE", "PATCH"] {
        let r = ctl.req(method, "/probe", None, "").await;
        assert_eq!(r.status, 405, "{method} /probe");
        assert_eq!(r.header("allow").as_deref(), Some("POST"));
        assert_eq!(r.body, "method not allowed\n");
    }
    for method in ["GET", "DELETE", "PATCH"] {
        let r = ctl.req(method, "/policy", None, "").await;
        assert_eq!(r.status, 405, "{method} /policy");
        assert_eq!(r.header("allow").as_deref(), Some("POST, PUT"));
        assert_eq!(r.body, "method not allowed\n");
    }
    let r = ctl.req("PUT", "/policy", None, r#"{"version":7}"#).await;
    assert_eq!(r.status, 204);
    ctl.stop().await;

    // Auth on: authentication runs before the method check.
    let dir = TempDir::new("sv04");
    let (auth, _, _) = token_auth(&state, &dir);
    let ctl = Control::with(&state, auth).await;
    let r = ctl.req("GET", "/policy", None, "").await;
    assert_eq!(r.status, 401);
    assert_eq!(r.body, "unauthorized\n");
    let r = ctl.req("GET", "/policy", Some(POL), "").await;
    assert_eq!(r.status, 405);
    let r = ctl.req("POST", "/snapshot", Some(POL), "").await;
    assert_eq!(r.status, 403);
    ctl.stop().await;
}

// ---------------------------------------------------------------------------------------------
// SV05–SV08: tokens

#[tokio::test]
async fn sv05_tokens_required_and_counted() {
    let (state, _) = manual_state(IndexConfig::default());
    let dir = TempDir::new("sv05");
    let (auth, _, _) = token_auth(&state, &dir);
    let ctl = Control::with(&state, auth).await;
    for (method, path, body) in [
        ("GET", "/snapshot", ""),
        ("POST", "/policy", r#"{"version":7}"#),
        ("POST", "/probe", PROBE_BODY),
    ] {
        let r = ctl.req(method, path, None, body).await;
        assert_eq!(r.status, 401, "{path}");
        assert_eq!(r.body, "unauthorized\n");
    }
    let r = ctl.req("GET", "/snapshot", Some(CTL), "").await;
    assert_eq!(r.status, 200);
    let r = ctl.req("POST", "/probe", Some(CTL), PROBE_BODY).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body,
        "{\"backend\":\"b1\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}\n"
    );
    let r = ctl
        .req("POST", "/policy", Some(POL), r#"{"version":7}"#)
        .await;
    assert_eq!(r.status, 204);
    for family in [
        "inferencecache_snapshot_auth_total",
        "inferencecache_policy_auth_total",
        "inferencecache_probe_auth_total",
    ] {
        assert_eq!(counter(&state, family, "unauth"), 1, "{family}");
        assert_eq!(counter(&state, family, "ok"), 1, "{family}");
        assert_eq!(counter(&state, family, "forbidden"), 0, "{family}");
        assert_eq!(counter(&state, family, "error"), 0, "{family}");
    }
    ctl.stop().await;
}

#[tokio::test]
async fn sv06_token_of_the_other_audience_is_forbidden() {
    let (state, _) = manual_state(IndexConfig::default());
    let dir = TempDir::new("sv06");
    let (auth, _, _) = token_auth(&state, &dir);
    let ctl = Control::with(&state, auth).await;
    let r = ctl
        .req("POST", "/policy", Some(CTL), r#"{"version":7}"#)
        .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.body, "forbidden\n");
    let r = ctl.req("GET", "/snapshot", Some(POL), "").await;
    assert_eq!(r.status, 403);
    let r = ctl.req("POST", "/probe", Some(POL), PROBE_BODY).await;
    assert_eq!(r.status, 403);
    assert_eq!(
        counter(&state, "inferencecache_policy_auth_total", "forbidden"),
        1
    );
    assert_eq!(
        counter(&state, "inferencecache_snapshot_auth_total", "forbidden"),
        1
    );
    assert_eq!(
        counter(&state, "inferencecache_probe_auth_total", "forbidden"),
        1
    );
    // An unknown token is 401, not 403.
    let r = ctl.req("GET", "/snapshot", Some("nope"), "").await;
    assert_eq!(r.status, 401);
    ctl.stop().await;
}

#[tokio::test]
async fn sv06_only_a_policy_file_forbids_the_controller_routes() {
    let (state, _) = manual_state(IndexConfig::default());
    let dir = TempDir::new("sv06b");
    let p = dir.file("policy", &format!("{POL}\n"));
    let stores = TokenStores::load(&AuthConfig {
        policy_token_file: Some(p),
        ..Default::default()
    })
    .unwrap();
    let ctl = Control::with(&state, Arc::new(Auth::new(stores, state.metrics().clone()))).await;
    assert_eq!(
        ctl.req("GET", "/snapshot", Some("any"), "").await.status,
        403
    );
    assert_eq!(ctl.req("GET", "/snapshot", None, "").await.status, 401);
    assert_eq!(
        ctl.req("POST", "/policy", Some(POL), r#"{"version":7}"#)
            .await
            .status,
        204
    );
    ctl.stop().await;
}

/// Polls `f` until it returns true or `limit` passes; returns the elapsed time on success.
async fn eventually<F, Fut>(limit: Duration, mut f: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test]
async fn sv07_schemes_empty_and_deleted_files() {
    let logs = LogBuf::default();
    let _guard = logs.install(); // current-thread runtime: the server logs on this thread
    let (state, _) = manual_state(IndexConfig::default());
    let dir = TempDir::new("sv07");
    let (auth, controller_file, _) = token_auth(&state, &dir);
    let ctl = Control::with(&state, auth).await;
    let get = |authz: Option<&'static str>| {
        let addr = ctl.addr;
        async move { http(addr, "GET", "/snapshot", authz, b"").await }
    };
    for bad in [
        None,
        Some("Basic Y3RsOnRva2Vu"),
        Some("Bearer "),
        Some("Bearer"),
        Some("Token ctl-token-1"),
    ] {
        let r = get(bad).await;
        assert_eq!(r.status, 401, "{bad:?}");
        assert_eq!(r.body, "unauthorized\n");
    }
    for good in [
        "bearer ctl-token-1",
        "BEARER ctl-token-1",
        "Bearer   ctl-token-1  ",
    ] {
        assert_eq!(get(Some(good)).await.status, 200, "{good}");
    }

    // Emptied at runtime: 503 `error` within the reload interval.
    write_file(&controller_file, "# rotated out\n\n");
    let took = eventually(Duration::from_secs(3), || async {
        get(Some("Bearer ctl-token-1")).await.status == 503
    })
    .await;
    assert!(took.is_some(), "an emptied file never gave 503");
    let r = get(Some("Bearer ctl-token-1")).await;
    assert_eq!(r.body, "token store unavailable\n");
    assert!(counter(&state, "inferencecache_snapshot_auth_total", "error") >= 2);
    // Row 1 still wins over row 2.
    assert_eq!(get(None).await.status, 401);
    assert!(logs.text().contains("\"auth_tokens_reloaded\""));

    // Refilled, then deleted: the last good set keeps working and the failure is logged once.
    write_file(&controller_file, "ctl-token-2\n");
    assert!(
        eventually(Duration::from_secs(3), || async {
            get(Some("Bearer ctl-token-2")).await.status == 200
        })
        .await
        .is_some()
    );
    std::fs::remove_file(&controller_file).unwrap();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(get(Some("Bearer ctl-token-2")).await.status, 200);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(get(Some("Bearer ctl-token-2")).await.status, 200);
    let text = logs.text();
    let failures: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"auth_tokens_reload_failed\""))
        .collect();
    assert_eq!(failures.len(), 1, "{text}");
    assert!(failures[0].contains("\"level\":\"ERROR\""));
    assert!(failures[0].contains("\"audience\":\"controller\""));
    assert!(failures[0].contains("\"file\":"));
    assert!(failures[0].contains("\"err\":"));
    // Tokens never reach the logs.
    assert!(!text.contains("ctl-token"), "{text}");
    assert!(!text.contains(POL), "{text}");
    ctl.stop().await;
}

#[tokio::test]
async fn sv08_rotation_old_token_refused_within_2s() {
    let (state, _) = manual_state(IndexConfig::default());
    let dir = TempDir::new("sv08");
    let file = dir.file("controller", "old-token\nnew-token\n");
    let stores = TokenStores::load(&AuthConfig {
        controller_token_file: Some(file.clone()),
        ..Default::default()
    })
    .unwrap();
    let ctl = Control::with(&state, Arc::new(Auth::new(stores, state.metrics().clone()))).await;
    assert_eq!(
        ctl.req("GET", "/snapshot", Some("old-token"), "")
            .await
            .status,
        200
    );
    assert_eq!(
        ctl.req("GET", "/snapshot", Some("new-token"), "")
            .await
            .status,
        200
    );
    // Make sure the next check is due, then rotate.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    write_file(&file, "new-token\n");
    let rotated = Instant::now();
    let took = eventually(Duration::from_secs(2), || async {
        ctl.req("GET", "/snapshot", Some("old-token"), "")
            .await
            .status
            == 401
    })
    .await;
    assert!(
        took.is_some(),
        "old token still accepted {:?} after the rewrite",
        rotated.elapsed()
    );
    assert_eq!(
        ctl.req("GET", "/snapshot", Some("new-token"), "")
            .await
            .status,
        200
    );
    ctl.stop().await;
}

// ---------------------------------------------------------------------------------------------
// SV09, SV10 and the startup logs: the built binary

const BIN: &str = env!("CARGO_BIN_EXE_inferencecache-server");

/// Runs the binary with `args` (loopback ephemeral listeners unless overridden); returns the exit
/// code and stderr. A process still running after 20 s is killed and reported as `None`.
async fn run_bin(args: &[&str]) -> (Option<i32>, String) {
    let mut all: Vec<&str> = vec![
        "--grpc-bind-address",
        "127.0.0.1:0",
        "--http-bind-address",
        "127.0.0.1:0",
    ];
    if !args.contains(&"--snapshot-bind-address") {
        all.extend(["--snapshot-bind-address", "127.0.0.1:0"]);
    }
    all.extend_from_slice(args);
    let mut child = tokio::process::Command::new(BIN)
        .args(&all)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the server binary");
    let mut stderr = child.stderr.take().unwrap();
    let mut err = String::new();
    let status = tokio::time::timeout(Duration::from_secs(20), async {
        let _ = stderr.read_to_string(&mut err).await;
        child.wait().await
    })
    .await;
    match status {
        Ok(Ok(s)) => (s.code(), err),
        _ => {
            let _ = child.kill().await;
            (None, err)
        }
    }
}

#[tokio::test]
async fn sv09_auth_matrix_exits_2() {
    let dir = TempDir::new("sv09");
    let good = dir.file("good", "t1\n");
    let empty = dir.file("empty", "# none\n   \n");
    let missing = dir.0.join("missing");
    let (good, empty, missing) = (
        good.to_str().unwrap().to_string(),
        empty.to_str().unwrap().to_string(),
        missing.to_str().unwrap().to_string(),
    );
    let cases: Vec<Vec<&str>> = vec![
        vec!["--insecure-disable-auth", "--controller-token-file", &good],
        vec!["--insecure-disable-auth", "--policy-token-file", &good],
        vec!["-insecure-disable-auth", "-policy-token-file", &good],
        vec!["--controller-token-file", &missing],
        vec!["--policy-token-file", &empty],
        vec!["--producer-token-file", &empty],
        vec!["--producer-token-file", &missing],
        vec!["--snapshot-bind-address", "0.0.0.0:8081"],
        vec!["--snapshot-bind-address", "10.0.0.5:8081"],
        vec!["--snapshot-bind-address", "[::]:8081"],
        vec!["--tls-client-ca-file", &good],
        vec!["--log-format", "yaml"],
        vec!["--log-level", "trace"],
        vec!["--no-such-flag", "x"],
    ];
    for args in cases {
        let (code, stderr) = run_bin(&args).await;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("t1"), "token leaked: {stderr}");
    }
    for args in [
        vec!["--allowed-controller-sa", "x"],
        vec!["--controller-audience=x"],
        vec!["-policy-audience", "y"],
    ] {
        let (code, stderr) = run_bin(&args).await;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("--controller-token-file"), "{stderr}");
        assert!(stderr.contains("--policy-token-file"), "{stderr}");
    }
}

/// Starts the binary, reads stderr until the `startup` record, then kills it.
async fn startup_logs(args: &[&str]) -> String {
    let mut all: Vec<&str> = vec![
        "--grpc-bind-address",
        "127.0.0.1:0",
        "--http-bind-address",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let mut child = tokio::process::Command::new(BIN)
        .args(&all)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the server binary");
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut out = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(line)) = lines.next_line().await {
            out.push_str(&line);
            out.push('\n');
            if line.contains("\"startup\"") {
                break;
            }
        }
    })
    .await;
    // Give a failing bind a moment to show up, then stop the process we started.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "the server exited early: {out}"
    );
    let _ = child.kill().await;
    out
}

#[tokio::test]
async fn sv03_startup_logs_for_each_auth_mode() {
    // No token, empty host: loopback only.
    let out = startup_logs(&["--snapshot-bind-address", ":0"]).await;
    assert!(out.contains("\"controller_auth_disabled\""), "{out}");
    assert!(
        out.contains("\"reason\":\"no_tokens_loopback_only\""),
        "{out}"
    );
    assert!(out.contains("\"snapshot_listener_loopback_only\""), "{out}");
    assert!(out.contains("\"addr\":\"127.0.0.1:0\""), "{out}");
    assert!(out.contains("\"snapshot_addr\":\"127.0.0.1:0\""), "{out}");
    assert!(out.contains("\"level\":\"WARN\""), "{out}");

    // Explicit loopback host: allowed, no loopback rewrite message.
    let out = startup_logs(&["--snapshot-bind-address", "127.0.0.1:0"]).await;
    assert!(
        out.contains("\"reason\":\"no_tokens_loopback_only\""),
        "{out}"
    );
    assert!(!out.contains("snapshot_listener_loopback_only"), "{out}");

    // Insecure: any address.
    let out = startup_logs(&["--insecure-disable-auth", "--snapshot-bind-address", ":0"]).await;
    assert!(out.contains("\"reason\":\"insecure_flag\""), "{out}");
    assert!(out.contains("\"snapshot_addr\":\"0.0.0.0:0\""), "{out}");
    assert!(!out.contains("snapshot_listener_loopback_only"), "{out}");

    // Tokens: enabled with counts, every interface.
    let dir = TempDir::new("startup");
    let c = dir.file("c", "a\nb\n# c\n");
    let p = dir.file("p", "z\n");
    let out = startup_logs(&[
        "--snapshot-bind-address",
        ":0",
        "--controller-token-file",
        c.to_str().unwrap(),
        "--policy-token-file",
        p.to_str().unwrap(),
    ])
    .await;
    assert!(out.contains("\"controller_auth_enabled\""), "{out}");
    assert!(out.contains("\"controller_tokens\":2"), "{out}");
    assert!(out.contains("\"policy_tokens\":1"), "{out}");
    assert!(out.contains("\"snapshot_addr\":\"0.0.0.0:0\""), "{out}");
    assert!(!out.contains("controller_auth_disabled"), "{out}");
}

#[tokio::test]
async fn sv10_log_settings_accepted_by_the_binary() {
    for args in [
        ["--log-format", " Text "],
        ["--log-format", "JSON"],
        ["--log-level", "warning"],
        ["--log-level", "DEBUG"],
    ] {
        let mut all = vec!["--snapshot-bind-address", "127.0.0.1:0"];
        all.extend_from_slice(&args);
        let out = startup_logs(&all).await;
        if args[1] == " Text " {
            assert!(out.contains("startup"), "{out}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /policy (§6.4, SV64)

#[tokio::test]
async fn policy_push_changes_resolution() {
    let (state, _) = manual_state(IndexConfig::default());
    let ctl = Control::with(&state, open_auth(&state)).await;
    assert!((state.policies().resolve("team-a").routing_floor_score - 0.1).abs() < 1e-6);
    let body = r#"{"version":7,"policies":[{"namespace":"team-a","routingFloorScore":0,"minimumMatchedTokens":32}],"tenants":[{"tenantID":"tenant-a","maxIndexEntries":10}]}"#;
    let r = ctl.req("POST", "/policy", None, body).await;
    assert_eq!(r.status, 204, "{r:?}");
    let p = state.policies().resolve("team-a");
    assert_eq!(p.routing_floor_score, 0.0);
    assert_eq!(p.minimum_matched_tokens, 32);
    assert_eq!(state.policies().quota("tenant-a"), Some(10));

    // Errors keep the pushed layer.
    for (body, expect) in [
        (
            r#"{"version":99}"#.to_string(),
            "unsupported policy snapshot version\n",
        ),
        (
            r#"{"version":2}"#.to_string(),
            "unsupported policy snapshot version\n",
        ),
        ("not json".to_string(), "decode policy snapshot: "),
        (
            r#"{"version":7,"bogus":1}"#.to_string(),
            "decode policy snapshot: ",
        ),
        (
            format!(
                r#"{{"version":7,"policies":[{{"namespace":"{}"}}]}}"#,
                "x".repeat(1 << 20)
            ),
            "decode policy snapshot: ",
        ),
    ] {
        let r = ctl.req("PUT", "/policy", None, &body).await;
        assert_eq!(r.status, 400, "{}", &body[..body.len().min(60)]);
        assert!(r.body.starts_with(expect), "{:?}", r.body);
        assert!(r.body.ends_with('\n'));
    }
    assert_eq!(
        state.policies().resolve("team-a").minimum_matched_tokens,
        32
    );

    // A later push replaces the layer.
    let r = ctl
        .req(
            "PUT",
            "/policy",
            None,
            r#"{"version":3,"policies":[{"namespace":"team-a"}]}"#,
        )
        .await;
    assert_eq!(r.status, 204);
    let p = state.policies().resolve("team-a");
    assert_eq!(p.minimum_matched_tokens, 64);
    assert!((p.routing_floor_score - 0.1).abs() < 1e-6);
    assert_eq!(state.policies().quota("tenant-a"), None);
    ctl.stop().await;
}

// ---------------------------------------------------------------------------------------------
// /probe (§12.4, SV61–SV63)

fn no_probe_state(state: &AppState, model: &str, backend: &str) {
    assert_eq!(state.index().reserved_storage_entries(), 0);
    let hash = inferencecache_server::http::probe::probe_hash("vllm", model, backend);
    let hashes = [hash];
    let counts = [16];
    let req = LookupRequest {
        block_hashes: &hashes[..],
        block_token_counts: &counts[..],
        ..LookupRequest::new(PROBE_TENANT, model, "vllm")
    };
    assert!(state.index().lookup(&req).is_empty());
    assert!(
        state
            .index()
            .cache_state(PROBE_TENANT, model)
            .replicas
            .is_empty()
    );
}

#[tokio::test]
async fn sv61_probe_passes_and_leaves_no_state() {
    // A full cap-1 index: the probe must not evict the real entry.
    let (state, _) = manual_state(IndexConfig {
        max_entries: 1,
        ..Default::default()
    });
    ingest(
        &state,
        "tenant-a",
        "replica-a",
        "m",
        &[b"p1"],
        0,
        Some(ReplicaStatsInput {
            hit_rate: 0.5,
            ..Default::default()
        }),
    );
    let ctl = Control::with(&state, open_auth(&state)).await;
    let before = ctl.req("GET", "/snapshot", None, "").await.body;
    let entries = state.index().storage_entries();
    assert_eq!(entries, 1);

    let r = ctl.req("POST", "/probe", None, PROBE_BODY).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(
        r.body,
        "{\"backend\":\"b1\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}\n"
    );
    // backendType other than LMCache: t2 skipped as well.
    let r = ctl
        .req(
            "POST",
            "/probe",
            None,
            r#"{"backend":"b2","model":"m","hashScheme":"vllm","backendType":"Mooncake"}"#,
        )
        .await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains("\"t2\":\"skipped\""));

    assert_eq!(state.index().storage_entries(), entries);
    assert_eq!(ctl.req("GET", "/snapshot", None, "").await.body, before);
    assert!(!before.contains("probe"));
    no_probe_state(&state, "m", "b1");
    no_probe_state(&state, "m", "b2");
    let mut req = LookupRequest::<Vec<u8>>::new("tenant-a", "m", "vllm");
    req.prefix_hash = b"p1";
    assert_eq!(
        state.index().lookup(&req).len(),
        1,
        "the real entry survives"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sv61_concurrent_probes_pass() {
    let (state, _) = manual_state(IndexConfig::default());
    let ctl = Control::with(&state, open_auth(&state)).await;
    let mut tasks = Vec::new();
    for i in 0..16 {
        let addr = ctl.addr;
        // 8 for one backend, 8 spread over other (backend, model) pairs.
        let body = if i < 8 {
            PROBE_BODY.to_string()
        } else {
            format!(
                r#"{{"backend":"b{}","model":"m{}","hashScheme":"vllm"}}"#,
                i % 3,
                i % 2
            )
        };
        tasks.push(tokio::spawn(async move {
            http(addr, "POST", "/probe", None, body.as_bytes()).await
        }));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        assert!(
            r.body
                .contains("\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}"),
            "{}",
            r.body
        );
    }
    assert_eq!(state.index().reserved_storage_entries(), 0);
    assert_eq!(
        ctl.req("GET", "/snapshot", None, "").await.body,
        "{\"replicas\":[],\"tenants\":[],\"totalPrefixes\":0,\"hotPrefixes\":0}\n"
    );
    ctl.stop().await;
}

/// Probes of different backends for one model share the reserved tenant's partition, and a
/// probe's cleanup (ALL_CLEARED) walks the model's partition list. An index that published a new
/// partition in its directory before adding it to that list would let a second probe find the
/// partition in that window, ingest, clean up, see no partition to clear and leave its entry
/// (the race behind a one-time `sv61_concurrent_probes_pass` failure; 4 threads × 3,000 rounds
/// left 9 entries). The engine lists a partition before linking it (`Index::enter_part`; the deterministic reproducer is the
/// engine test `a_partition_is_listed_before_other_writers_can_reach_it`). Here threads run
/// `run_probe` for distinct backends of a fresh model each round (so every round creates the
/// partition concurrently) without the handler's per-model lock, and nothing may be left.
#[test]
fn unserialized_probe_runs_of_one_model_race_on_partition_creation() {
    use inferencecache_server::http::probe::{decode_probe, run_probe};
    const THREADS: usize = 4;
    const ROUNDS: usize = 1_500;
    let (state, _) = manual_state(IndexConfig::default());
    let index = state.index().clone();
    let barrier = Arc::new(std::sync::Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (index, barrier) = (index.clone(), barrier.clone());
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let body =
                        format!(r#"{{"backend":"b{t}","model":"m{round}","hashScheme":"vllm"}}"#);
                    let request = decode_probe(body.as_bytes()).unwrap();
                    barrier.wait();
                    let _ = run_probe(&index, &request, None);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(index.reserved_storage_entries(), 0);
}

/// The handler's path: `/probe` runs go through `ProbeLocks::run`, which serializes runs of one
/// model across backends (a probe's ingest, lookups and cleanup then never interleave with
/// another probe's of that model, whatever the engine allows). The same concurrent pattern (four backends on a fresh model each round,
/// several models in flight) leaves nothing, under any interleaving the scheduler produces.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serialized_probe_runs_never_leave_reserved_entries() {
    use inferencecache_server::http::probe::{ProbeLocks, decode_probe};
    let (state, _) = manual_state(IndexConfig::default());
    let locks = Arc::new(ProbeLocks::default());
    for round in 0..400 {
        let mut runs = Vec::new();
        for t in 0..8 {
            let (index, locks) = (state.index().clone(), locks.clone());
            // Two fresh models per round, four backends each.
            let body = format!(
                r#"{{"backend":"b{}","model":"m{round}-{}","hashScheme":"vllm"}}"#,
                t / 2,
                t % 2
            );
            runs.push(tokio::spawn(async move {
                let request = decode_probe(body.as_bytes()).unwrap();
                locks.run(&index, &request, None).await
            }));
        }
        for run in runs {
            let report = run.await.unwrap();
            assert!(report.passed(), "{}", report.to_json());
        }
        assert_eq!(
            state.index().reserved_storage_entries(),
            0,
            "round {round}: the reserved tenant kept entries"
        );
    }
}

struct FailingGet;

impl T2Prober for FailingGet {
    fn put(&self, _: &str, _: &str, _: &[u8], _: &[u8]) -> Result<(), String> {
        Ok(())
    }
    fn get(&self, _: &str, _: &str, _: &[u8]) -> Result<Vec<u8>, String> {
        Err("connection refused".into())
    }
}

#[derive(Default)]
struct MemoryT2(Mutex<Vec<(Vec<u8>, Vec<u8>)>>);

impl T2Prober for MemoryT2 {
    fn put(&self, _: &str, _: &str, key: &[u8], payload: &[u8]) -> Result<(), String> {
        self.0
            .lock()
            .unwrap()
            .push((key.to_vec(), payload.to_vec()));
        Ok(())
    }
    fn get(&self, _: &str, _: &str, key: &[u8]) -> Result<Vec<u8>, String> {
        let v = self.0.lock().unwrap();
        v.iter()
            .find(|(k, _)| k == key)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| "not found".into())
    }
}

#[tokio::test]
async fn sv62_t2_prober_outcomes() {
    let (state, _) = manual_state(IndexConfig::default());
    let ctl = Control::start(
        ControlState::new(state.clone(), open_auth(&state)).with_t2_prober(Arc::new(FailingGet)),
    )
    .await;
    let r = ctl.req("POST", "/probe", None, PROBE_BODY).await;
    assert_eq!(r.status, 200);
    assert!(
        r.body.starts_with(
            "{\"backend\":\"b1\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"failed\",\"errors\":[{\"stage\":\"t2\",\"message\":\"T2 put/get cycle failed: get failed: "
        ),
        "{}",
        r.body
    );
    // Not an LMCache backend: the prober is not used.
    let r = ctl
        .req(
            "POST",
            "/probe",
            None,
            r#"{"backend":"b1","model":"m","hashScheme":"vllm","backendType":"other"}"#,
        )
        .await;
    assert!(r.body.contains("\"t2\":\"skipped\""), "{}", r.body);
    ctl.stop().await;
    no_probe_state(&state, "m", "b1");

    let memory = Arc::new(MemoryT2::default());
    let ctl = Control::start(
        ControlState::new(state.clone(), open_auth(&state)).with_t2_prober(memory.clone()),
    )
    .await;
    let r = ctl
        .req(
            "POST",
            "/probe",
            None,
            r#"{"backend":"b1","model":"m","hashScheme":"vllm","backendType":"LMCache"}"#,
        )
        .await;
    assert_eq!(
        r.body,
        "{\"backend\":\"b1\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"ok\"}\n"
    );
    let stored = memory.0.lock().unwrap()[0].clone();
    let hash = inferencecache_server::http::probe::probe_hash("vllm", "m", "b1");
    let mut payload = b"probe-payload-v1\n".to_vec();
    payload.extend_from_slice(&hash);
    assert_eq!(stored, (hash.to_vec(), payload));
    ctl.stop().await;
}

#[tokio::test]
async fn sv63_bad_probe_bodies_are_400() {
    let (state, _) = manual_state(IndexConfig::default());
    let ctl = Control::with(&state, open_auth(&state)).await;
    let long = format!(
        r#"{{"backend":"{}","model":"m","hashScheme":"vllm"}}"#,
        "b".repeat(5000)
    );
    for body in [
        "",
        "{",
        "not json",
        r#"{"backend":"b","model":"m"}"#,
        r#"{"backend":"","model":"m","hashScheme":"vllm"}"#,
        r#"{"backend":"b","model":"m","hashScheme":"vllm","tenant":"t"}"#,
        r#"{"backend":"b","model":"m","hashScheme":"vllm"}{"backend":"b"}"#,
        r#"{"backend":"b","model":"m","hashScheme":"vllm"}]"#,
        r#"{"backend":"b","model":"m","hashScheme":"vllm"} garbage"#,
        r#"{"backend":1,"model":"m","hashScheme":"vllm"}"#,
        // The struct in array form (serde would read it positionally; strict decode refuses).
        r#"["b","m","vllm"]"#,
        long.as_str(),
    ] {
        let r = ctl.req("POST", "/probe", None, body).await;
        assert_eq!(r.status, 400, "{}", &body[..body.len().min(80)]);
        assert!(r.body.ends_with('\n'));
    }
    assert_eq!(state.index().reserved_storage_entries(), 0);
    ctl.stop().await;
}

// ---------------------------------------------------------------------------------------------
// /snapshot (§12.3, G2; SV60, T76, T77)

#[tokio::test]
async fn sv60_snapshot_exact_json() {
    let (state, _clock) = manual_state(IndexConfig::default());
    // T76: replica-a holds p1 (m1) and p2 (m2), hit 0.8; replica-b holds p3, hit 0.6.
    ingest(
        &state,
        "tenant-a",
        "replica-a",
        "m1",
        &[b"p1"],
        T0_US + 500_000,
        Some(ReplicaStatsInput {
            cache_memory_bytes: 1024,
            hit_rate: 0.8,
            pressure: 0.25,
            ..Default::default()
        }),
    );
    ingest(
        &state,
        "tenant-a",
        "replica-a",
        "m2",
        &[b"p2"],
        T0_US + 1_123_000,
        None,
    );
    ingest(
        &state,
        "tenant-b",
        "replica-b",
        "m1",
        &[b"p3"],
        T0_US,
        Some(ReplicaStatsInput {
            cache_memory_bytes: 2048,
            hit_rate: 0.6,
            pressure: 1.0,
            t2_hit_tokens: 7,
            t2_query_tokens: 9,
        }),
    );
    // T77: a prefix-only replica with 2 keys, under the "" tenant.
    ingest(
        &state,
        "",
        "replica-c",
        "m1",
        &[b"p4", b"p5"],
        T0_US + 2_000,
        None,
    );
    // A stats-only replica.
    ingest(
        &state,
        "tenant-c",
        "replica-d",
        "m1",
        &[],
        T0_US + 60_000_000,
        Some(ReplicaStatsInput {
            hit_rate: 1.0,
            ..Default::default()
        }),
    );
    // Probe state never shows.
    ingest(
        &state,
        PROBE_TENANT,
        "__probe-x",
        "m1",
        &[b"px"],
        T0_US,
        None,
    );

    let ctl = Control::with(&state, open_auth(&state)).await;
    let r = ctl.req("GET", "/snapshot", None, "").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    let expected = concat!(
        "{\"replicas\":[",
        "{\"replicaId\":\"replica-c\",\"cacheMemoryBytes\":0,\"hitRate\":0,\"pressure\":0,",
        "\"lastUpdate\":\"0001-01-01T00:00:00Z\",\"prefixCount\":2,",
        "\"lastEventAt\":\"2026-01-01T00:00:00.002Z\"},",
        "{\"replicaId\":\"replica-a\",\"tenant\":\"tenant-a\",\"cacheMemoryBytes\":1024,",
        "\"hitRate\":0.8,\"pressure\":0.25,\"lastUpdate\":\"2026-01-01T00:00:00.5Z\",",
        "\"prefixCount\":2,\"lastEventAt\":\"2026-01-01T00:00:01.123Z\",\"statsReported\":true},",
        "{\"replicaId\":\"replica-b\",\"tenant\":\"tenant-b\",\"cacheMemoryBytes\":2048,",
        "\"hitRate\":0.6,\"pressure\":1,\"lastUpdate\":\"2026-01-01T00:00:00Z\",",
        "\"prefixCount\":1,\"lastEventAt\":\"2026-01-01T00:00:00Z\",\"statsReported\":true,",
        "\"t2HitTokens\":7,\"t2QueryTokens\":9},",
        "{\"replicaId\":\"replica-d\",\"tenant\":\"tenant-c\",\"cacheMemoryBytes\":0,",
        "\"hitRate\":1,\"pressure\":0,\"lastUpdate\":\"2026-01-01T00:01:00Z\",",
        "\"prefixCount\":0,\"lastEventAt\":\"0001-01-01T00:00:00Z\",\"statsReported\":true}",
        "],\"tenants\":[",
        "{\"tenantId\":\"\",\"indexEntries\":2,\"hitRate\":0,\"memoryUsed\":0},",
        "{\"tenantId\":\"tenant-a\",\"indexEntries\":2,\"hitRate\":0.8,",
        "\"hitRateReported\":true,\"memoryUsed\":0},",
        "{\"tenantId\":\"tenant-b\",\"indexEntries\":1,\"hitRate\":0.6,",
        "\"hitRateReported\":true,\"memoryUsed\":0},",
        "{\"tenantId\":\"tenant-c\",\"indexEntries\":0,\"hitRate\":1,",
        "\"hitRateReported\":true,\"memoryUsed\":0}",
        "],\"totalPrefixes\":5,\"hotPrefixes\":0}\n"
    );
    assert_eq!(r.body, expected);
    ctl.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Listener behavior (§4)

#[tokio::test]
async fn read_header_timeout_closes_slow_clients() {
    let (state, _) = manual_state(IndexConfig::default());
    let ctl = Control::with(&state, open_auth(&state)).await;
    let mut stream = TcpStream::connect(ctl.addr).await.unwrap();
    stream
        .write_all(b"GET /snapshot HTTP/1.1\r\nHost: test\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(9), stream.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "connection still open after 9 s");
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(4), "closed too early: {took:?}");
    assert!(!String::from_utf8_lossy(&raw).contains(" 200 "));
    // A complete request on a new connection is still served.
    assert_eq!(ctl.req("GET", "/snapshot", None, "").await.status, 200);
    ctl.stop().await;
}
