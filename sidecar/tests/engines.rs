//! The sidecar against the engines' own KV-event publishers: vLLM's
//! `vllm/distributed/kv_events.py` and SGLang's `sglang/srt/disaggregation/kv_events.py` +
//! `sglang/srt/mem_cache/events.py`, taken from their published wheels by
//! `tests/engines/prepare.sh` and driven by `tests/engines/engine_host.py`; the real server and
//! sidecar binaries on loopback.
//!
//! After every step of every scenario the index must equal what the engine holds — no false and
//! no stale entry — within 2 s, checked twice: LookupRoute (matched tokens and tier of each
//! prompt the engine holds or held) and the server's `/snapshot` (the replica's entry count).
//! The sidecar's own `/metrics`, read with prometheus_client's parser, must show the gaps,
//! replays and resyncs the scenario causes.
//!
//! The engine files are looked up in `$INFERENCECACHE_ENGINE_SOURCES`, else
//! `~/.cache/inferencecache-ci/engine-sources`. Without them (or without the Python packages)
//! the tests print a notice and pass, unless `CI` is set: then they fail.

mod common;

use common::free_port;
use common::server_process::{Server, server_binary, start_server};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const SIDECAR: &str = env!("CARGO_BIN_EXE_inferencecache-sidecar");
/// Index block size: the server's `--engine-block-size` and the sidecar's `--block-size`.
const BS: usize = 16;
const TENANT: &str = "team-a";
/// How long the index may take to reflect the engine.
const CONVERGENCE: Duration = Duration::from_secs(2);

const ENGINE_FILES: [&str; 3] = [
    "vllm/distributed/kv_events.py",
    "sglang/srt/disaggregation/kv_events.py",
    "sglang/srt/mem_cache/events.py",
];

/// The extracted engine files, or `None` (with a notice) to skip.
fn engine_sources() -> Option<PathBuf> {
    let dir = std::env::var_os("INFERENCECACHE_ENGINE_SOURCES")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/inferencecache-ci/engine-sources"))
        })?;
    let files_present = ENGINE_FILES.iter().all(|f| dir.join(f).is_file());
    let python_ready = std::process::Command::new("python3")
        .args(["-c", "import zmq, msgspec, prometheus_client"])
        .status()
        .is_ok_and(|s| s.success());
    if files_present && python_ready {
        return Some(dir);
    }
    let why = format!(
        "engine publisher files in {} present: {files_present}; python3 with pyzmq, msgspec and \
         prometheus_client: {python_ready} (run sidecar/tests/engines/prepare.sh)",
        dir.display()
    );
    assert!(std::env::var_os("CI").is_none(), "{why}");
    eprintln!("NOTICE: skipping the engine tests: {why}");
    None
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Vllm,
    Sglang,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    fn medium(self, tier: Medium) -> &'static str {
        match (self, tier) {
            (_, Medium::Gpu) => "GPU",
            (Engine::Vllm, Medium::Cpu) => "CPU",
            (Engine::Sglang, Medium::Cpu) => "CPU_PINNED",
            (Engine::Vllm, Medium::Disk) => "STORAGE",
            (Engine::Sglang, Medium::Disk) => "DISK",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Medium {
    Gpu,
    Cpu,
    Disk,
}

/// A run of engine pages: an SGLang radix node, or consecutive vLLM blocks of one chain.
#[derive(Debug, Clone)]
struct Seg {
    name: String,
    chain: String,
    parent: Option<String>,
    first_page: usize,
    page: usize,
    own: Vec<u32>,
    /// The prompt from the chain's start through this segment.
    full: Vec<u32>,
}

fn root(name: &str, tokens: Vec<u32>, page: usize) -> Seg {
    Seg {
        name: name.into(),
        chain: name.into(),
        parent: None,
        first_page: 0,
        page,
        full: tokens.clone(),
        own: tokens,
    }
}

fn child(parent: &Seg, name: &str, tokens: Vec<u32>) -> Seg {
    let mut full = parent.full.clone();
    full.extend(&tokens);
    Seg {
        name: name.into(),
        chain: parent.chain.clone(),
        parent: Some(parent.name.clone()),
        first_page: parent.first_page + parent.own.len() / parent.page,
        page: parent.page,
        own: tokens,
        full,
    }
}

fn span(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

/// One engine-side change.
#[derive(Debug, Clone)]
enum Op {
    Store(Seg, Medium, Value),
    Remove(Seg, Medium),
    Clear,
}

fn store(seg: &Seg) -> Op {
    Op::Store(seg.clone(), Medium::Gpu, json!({}))
}

fn remove(seg: &Seg) -> Op {
    Op::Remove(seg.clone(), Medium::Gpu)
}

/// The Python process running an engine's publisher.
struct Host {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Host {
    async fn spawn(sources: &Path) -> Host {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/engines/engine_host.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg("--sources")
            .arg(sources)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 engine_host.py");
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut host = Host {
            _child: child,
            stdin,
            lines,
        };
        let ready = host.read().await;
        assert_eq!(ready["ready"], true, "{ready}");
        host
    }

    async fn read(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
            .await
            .expect("engine host answers in time")
            .expect("read engine host")
            .expect("engine host alive");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    async fn call(&mut self, cmd: Value) -> Value {
        let mut line = cmd.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        self.stdin.flush().await.unwrap();
        let answer = self.read().await;
        assert_eq!(answer["ok"], true, "{cmd} → {answer}");
        answer
    }
}

/// A scrape of the sidecar's `/metrics`.
struct Scrape(Vec<(String, serde_json::Map<String, Value>, f64)>);

impl Scrape {
    /// The sum of the samples named `name` whose labels include `labels`.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).and_then(Value::as_str) == Some(*v))
            })
            .map(|(_, _, v)| *v)
            .sum()
    }
}

/// What the index must answer for one prompt.
struct Want {
    tokens: Vec<u32>,
    adapter: &'static str,
    matched: i32,
    tier: Option<pb::CacheTier>,
}

fn want(seg: &Seg, matched: usize) -> Want {
    Want {
        tokens: seg.full.clone(),
        adapter: "",
        matched: matched as i32,
        tier: (matched > 0).then_some(pb::CacheTier::T1),
    }
}

/// One scenario's engine, sidecar and expectations.
struct Rig<'a> {
    engine: Engine,
    server: &'a Server,
    sources: &'a Path,
    dir: PathBuf,
    host: Host,
    replica: String,
    publish_endpoint: String,
    replay_endpoint: String,
    /// Where the sidecar subscribes: the engine, or a proxy in front of it.
    subscribe_endpoint: String,
    sidecar: Option<Child>,
    metrics_port: u16,
    sidecar_runs: usize,
}

impl<'a> Rig<'a> {
    async fn new(
        engine: Engine,
        server: &'a Server,
        sources: &'a Path,
        scenario: &str,
        engine_args: Value,
    ) -> Rig<'a> {
        let dir = common::temp_dir(&format!("engines-{}-{scenario}", engine.name()));
        let mut host = Host::spawn(sources).await;
        let publish_endpoint = format!("tcp://127.0.0.1:{}", free_port());
        let replay_endpoint = format!("tcp://127.0.0.1:{}", free_port());
        let mut cmd = json!({
            "op": "start",
            "engine": engine.name(),
            "endpoint": publish_endpoint,
            "replay": replay_endpoint,
        });
        for (k, v) in engine_args.as_object().into_iter().flatten() {
            cmd[k] = v.clone();
        }
        host.call(cmd).await;
        Rig {
            engine,
            server,
            sources,
            dir,
            host,
            replica: format!("{}-{scenario}", engine.name()),
            subscribe_endpoint: publish_endpoint.clone(),
            publish_endpoint,
            replay_endpoint,
            sidecar: None,
            metrics_port: 0,
            sidecar_runs: 0,
        }
    }

    fn model(&self) -> String {
        format!("model-{}", self.replica)
    }

    fn scheme(&self) -> &'static str {
        self.engine.name()
    }

    /// Puts a forwarding proxy dropping `drop` between the engine and the sidecar.
    async fn proxy(&mut self, drop: &[u64]) {
        let listen = format!("tcp://127.0.0.1:{}", free_port());
        self.host
            .call(json!({
                "op": "proxy",
                "upstream": self.publish_endpoint,
                "listen": listen,
                "drop": drop,
            }))
            .await;
        self.subscribe_endpoint = listen;
    }

    /// Starts the sidecar and waits until its startup resync reached the server.
    async fn start_sidecar(&mut self) {
        self.metrics_port = free_port();
        self.sidecar_runs += 1;
        let log = self.dir.join(format!("sidecar-{}.log", self.sidecar_runs));
        let child = Command::new(SIDECAR)
            .args([
                "--engine-endpoint",
                &self.subscribe_endpoint,
                "--engine-replay-endpoint",
                &self.replay_endpoint,
                "--server",
                &format!("127.0.0.1:{}", self.server.grpc),
                "--replica-id",
                &self.replica,
                "--model-id",
                &self.model(),
                "--tenant-id",
                TENANT,
                "--hash-scheme",
                self.scheme(),
                "--block-size",
                &BS.to_string(),
                "--window",
                "20ms",
                "--metrics-bind-address",
                &format!("127.0.0.1:{}", self.metrics_port),
                "--engine-metrics-url",
                "http://127.0.0.1:1/metrics",
                "--stats-interval",
                "1h",
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn sidecar");
        self.sidecar = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(m) = self.try_scrape().await
                && m.get(
                    "inferencecache_sidecar_events_sent_total",
                    &[("type", "ALL_CLEARED")],
                ) >= 1.0
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "sidecar did not resync at startup: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The subscription reaches the publisher shortly after the dial.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    async fn stop_sidecar(&mut self) {
        if let Some(mut child) = self.sidecar.take() {
            common::sigterm(child.id().expect("sidecar running"));
            let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
                .await
                .expect("sidecar exits after SIGTERM")
                .unwrap();
            assert!(status.success(), "{status}");
        }
    }

    /// Publishes `ops` as one engine batch.
    async fn apply(&mut self, ops: &[Op]) {
        match self.engine {
            Engine::Vllm => {
                let events: Vec<Value> = ops.iter().map(|op| self.vllm_event(op)).collect();
                self.host
                    .call(json!({"op": "publish", "events": events}))
                    .await;
            }
            Engine::Sglang => {
                for (i, op) in ops.iter().enumerate() {
                    let mut cmd = self.sglang_command(op);
                    cmd["flush"] = json!(i + 1 == ops.len());
                    self.host.call(cmd).await;
                }
            }
        }
    }

    fn vllm_event(&self, op: &Op) -> Value {
        match op {
            Op::Store(seg, medium, extra) => {
                let mut ev = json!({
                    "kind": "stored",
                    "chain": seg.chain,
                    "first": seg.first_page,
                    "tokens": seg.own,
                    "block_size": seg.page,
                    "medium": self.engine.medium(*medium),
                });
                for (k, v) in extra.as_object().into_iter().flatten() {
                    ev[k] = v.clone();
                }
                ev
            }
            Op::Remove(seg, medium) => {
                let pages = seg.first_page..seg.first_page + seg.own.len() / seg.page;
                json!({
                    "kind": "removed",
                    "chain": seg.chain,
                    "blocks": pages.collect::<Vec<_>>(),
                    "medium": self.engine.medium(*medium),
                })
            }
            Op::Clear => json!({"kind": "cleared"}),
        }
    }

    fn sglang_command(&self, op: &Op) -> Value {
        match op {
            Op::Store(seg, medium, extra) => {
                let mut cmd = json!({
                    "op": "store",
                    "node": seg.name,
                    "parent": seg.parent.clone().unwrap_or_else(|| "root".into()),
                    "tokens": seg.own,
                    "medium": self.engine.medium(*medium),
                });
                for (k, v) in extra.as_object().into_iter().flatten() {
                    cmd[k] = v.clone();
                }
                cmd
            }
            Op::Remove(seg, medium) => json!({
                "op": "remove",
                "node": seg.name,
                "medium": self.engine.medium(*medium),
            }),
            Op::Clear => json!({"op": "clear"}),
        }
    }

    async fn restart_engine(&mut self) {
        self.host.call(json!({"op": "restart"})).await;
    }

    async fn try_scrape(&mut self) -> Option<Scrape> {
        let url = format!("http://127.0.0.1:{}/metrics", self.metrics_port);
        let mut line = json!({"op": "scrape", "url": url}).to_string();
        line.push('\n');
        self.host.stdin.write_all(line.as_bytes()).await.ok()?;
        let answer = self.host.read().await;
        if answer["ok"] != true {
            return None;
        }
        let samples = answer["samples"].as_array()?;
        Some(Scrape(
            samples
                .iter()
                .map(|s| {
                    (
                        s[0].as_str().unwrap_or_default().to_string(),
                        s[1].as_object().cloned().unwrap_or_default(),
                        s[2].as_f64().unwrap_or(f64::NAN),
                    )
                })
                .collect(),
        ))
    }

    async fn metrics(&mut self) -> Scrape {
        self.try_scrape().await.expect("sidecar /metrics")
    }

    /// The replica's entry count in the server's `/snapshot`.
    async fn snapshot_count(&mut self) -> u64 {
        let url = format!("http://127.0.0.1:{}/snapshot", self.server.snapshot);
        let answer = self.host.call(json!({"op": "fetch", "url": url})).await;
        let body: Value = serde_json::from_str(answer["text"].as_str().unwrap()).unwrap();
        body["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["replicaId"] == self.replica.as_str())
            .and_then(|r| r["prefixCount"].as_u64())
            .unwrap_or(0)
    }

    async fn lookup(&self, w: &Want) -> (i32, Option<pb::CacheTier>) {
        let mut c = InferenceCacheClient::connect(format!("http://127.0.0.1:{}", self.server.grpc))
            .await
            .unwrap();
        let r = c
            .lookup_route(pb::LookupRouteRequest {
                model_id: self.model(),
                tenant_id: TENANT.into(),
                hash_scheme: self.scheme().into(),
                token_ids: w.tokens.clone(),
                adapter_id: w.adapter.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        match r
            .replica_scores
            .iter()
            .find(|s| s.replica_id == self.replica)
        {
            Some(s) if s.matched_tokens > 0 => {
                (s.matched_tokens, pb::CacheTier::try_from(s.tier).ok())
            }
            _ => (0, None),
        }
    }

    /// Asserts that within [`CONVERGENCE`] every prompt answers as wanted and the replica holds
    /// exactly `entries` index entries.
    async fn expect(&mut self, step: &str, wants: &[Want], entries: u64) {
        let deadline = tokio::time::Instant::now() + CONVERGENCE;
        loop {
            let mut got = Vec::new();
            for w in wants {
                got.push(self.lookup(w).await);
            }
            let count = self.snapshot_count().await;
            let ok = count == entries
                && wants
                    .iter()
                    .zip(&got)
                    .all(|(w, g)| g.0 == w.matched && (w.tier.is_none() || g.1 == w.tier));
            if ok {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                let wanted: Vec<(i32, Option<pb::CacheTier>)> =
                    wants.iter().map(|w| (w.matched, w.tier)).collect();
                let logs: Vec<String> = (1..=self.sidecar_runs)
                    .map(|i| {
                        std::fs::read_to_string(self.dir.join(format!("sidecar-{i}.log")))
                            .unwrap_or_default()
                    })
                    .collect();
                panic!(
                    "{} {}: {step}: index {got:?} / {count} entries, engine holds {wanted:?} / \
                     {entries} entries\nsidecar logs:\n{}",
                    self.engine.name(),
                    self.replica,
                    logs.join("\n---\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn finish(mut self) {
        self.stop_sidecar().await;
        self.host.call(json!({"op": "stop"})).await;
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = self.sources;
    }
}

fn chain_a(page: usize) -> (Seg, Seg) {
    let a01 = root("a01", span(1000, 32), page);
    let a23 = child(&a01, "a23", span(1032, 32));
    (a01, a23)
}

async fn happy_path(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "happy", json!({})).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01), store(&a23), store(&b)]).await;
    rig.expect("store", &[want(&a23, 64), want(&b, 32)], 6)
        .await;
    rig.apply(&[remove(&a23)]).await;
    rig.expect("remove", &[want(&a23, 32), want(&b, 32)], 4)
        .await;
    rig.apply(&[Op::Clear]).await;
    rig.expect("clear", &[want(&a23, 0), want(&b, 0)], 0).await;
    let m = rig.metrics().await;
    let resyncs = "inferencecache_sidecar_resyncs_total";
    assert_eq!(m.get(resyncs, &[("reason", "startup")]), 1.0);
    assert_eq!(m.get(resyncs, &[]), 1.0);
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_total", &[]),
        0.0
    );
    let received = "inferencecache_sidecar_batches_received_total";
    assert_eq!(m.get(received, &[("source", "live")]), 3.0);
    let events = "inferencecache_sidecar_events_received_total";
    assert_eq!(m.get(events, &[("type", "AllBlocksCleared")]), 1.0);
    assert!(m.get(events, &[("type", "BlockStored")]) >= 1.0);
    assert_eq!(m.get(events, &[("type", "BlockRemoved")]), 1.0);
    assert!(m.get("inferencecache_sidecar_updates_sent_total", &[]) >= 1.0);
    assert_eq!(
        m.get(
            "inferencecache_sidecar_events_sent_total",
            &[("type", "PREFIX_EVICTED")]
        ),
        2.0
    );
    assert_eq!(m.get("inferencecache_sidecar_send_errors_total", &[]), 0.0);
    assert_eq!(
        m.get("inferencecache_sidecar_decode_failures_total", &[]),
        0.0
    );
    assert!(m.get("inferencecache_sidecar_seconds_since_last_event", &[]) >= 0.0);
    rig.finish().await;
}

async fn sidecar_starts_after_the_engine_published(
    engine: Engine,
    server: &Server,
    sources: &Path,
) {
    let mut rig = Rig::new(engine, server, sources, "late", json!({})).await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01), store(&a23)]).await;
    rig.apply(&[store(&b)]).await;
    rig.apply(&[remove(&a23)]).await;
    rig.start_sidecar().await;
    rig.expect("after replay", &[want(&a23, 32), want(&b, 32)], 4)
        .await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        3.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_resyncs_total",
            &[("reason", "startup")]
        ),
        1.0
    );
    rig.finish().await;
}

async fn sidecar_restarted_while_a_removal_is_published(
    engine: Engine,
    server: &Server,
    sources: &Path,
) {
    let mut rig = Rig::new(engine, server, sources, "restarted", json!({})).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    rig.apply(&[store(&a01), store(&a23)]).await;
    rig.expect("store", &[want(&a23, 64)], 4).await;
    rig.stop_sidecar().await;
    rig.apply(&[remove(&a23)]).await;
    rig.start_sidecar().await;
    rig.expect("removal while down", &[want(&a23, 32)], 2).await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        2.0
    );
    rig.finish().await;
}

async fn one_message_lost(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "lost", json!({})).await;
    rig.proxy(&[1]).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01)]).await; // seq 0
    rig.expect("first", &[want(&a23, 32)], 2).await;
    rig.apply(&[store(&b)]).await; // seq 1: dropped by the proxy
    rig.apply(&[store(&a23)]).await; // seq 2: reveals the gap
    rig.expect("gap filled", &[want(&a23, 64), want(&b, 32)], 6)
        .await;
    let dropped = rig.host.call(json!({"op": "dropped"})).await;
    assert_eq!(dropped["dropped"], json!([1]));
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_filled_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_resyncs_total", &[]),
        1.0,
        "startup only"
    );
    rig.finish().await;
}

async fn engine_restart(engine: Engine, server: &Server, sources: &Path, via_proxy: bool) {
    let scenario = if via_proxy {
        "restart-proxied"
    } else {
        "restart"
    };
    let mut rig = Rig::new(engine, server, sources, scenario, json!({})).await;
    if via_proxy {
        // The proxy stays connected: the sidecar sees only the sequence going back to 0.
        rig.proxy(&[]).await;
    }
    rig.start_sidecar().await;
    let (a01, _) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01)]).await;
    rig.apply(&[store(&b)]).await;
    rig.expect("before", &[want(&a01, 32), want(&b, 32)], 4)
        .await;
    // A new engine process: empty cache, sequence from 0, same block hashes for the same
    // content.
    rig.restart_engine().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = root("c", span(3000, 32), 16);
    let d = root("d", span(4000, 16), 16);
    rig.apply(&[store(&c)]).await;
    rig.apply(&[store(&d)]).await;
    rig.expect(
        "after restart",
        &[want(&a01, 0), want(&b, 0), want(&c, 32), want(&d, 16)],
        3,
    )
    .await;
    let m = rig.metrics().await;
    let resyncs = "inferencecache_sidecar_resyncs_total";
    if via_proxy {
        assert_eq!(m.get(resyncs, &[("reason", "engine_restart")]), 1.0);
    } else {
        assert!(
            m.get(resyncs, &[("reason", "reconnect")])
                + m.get(resyncs, &[("reason", "engine_restart")])
                >= 1.0
        );
    }
    rig.finish().await;
}

async fn replay_buffer_exceeded(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(
        engine,
        server,
        sources,
        "exceeded",
        json!({"buffer_steps": 3}),
    )
    .await;
    rig.proxy(&[1, 2, 3, 4]).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    let c = root("c", span(3000, 32), 16);
    let d = root("d", span(4000, 16), 16);
    rig.apply(&[store(&a01), store(&a23)]).await; // 0: delivered
    rig.expect("first", &[want(&a23, 64)], 4).await;
    // Chain e starts before the buffer window and continues inside it.
    let e01 = root("e01", span(10_000, 32), 16);
    let e23 = child(&e01, "e23", span(10_032, 32));
    rig.apply(&[store(&b), store(&e01)]).await; // 1: dropped, aged out of the buffer
    rig.apply(&[remove(&a23), remove(&a01)]).await; // 2: dropped, aged out
    rig.apply(&[remove(&b)]).await; // 3: dropped, still buffered
    rig.apply(&[store(&c), store(&e23)]).await; // 4: dropped, still buffered
    rig.apply(&[store(&d)]).await; // 5: delivered, reveals the gap
    // The engine holds c, d and e01+e23. After the resync the sidecar knows c and d; e23's
    // parent is older than the buffer, so chain e is a miss — and e23's tokens alone must not
    // match as if they started a prompt.
    let e23_alone = Want {
        tokens: e23.own.clone(),
        adapter: "",
        matched: 0,
        tier: None,
    };
    rig.expect(
        "after resync",
        &[
            want(&a23, 0),
            want(&b, 0),
            want(&c, 32),
            want(&d, 16),
            want(&e23, 0),
            e23_alone,
        ],
        3,
    )
    .await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_filled_total", &[]),
        0.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_resyncs_total",
            &[("reason", "gap_unfillable")]
        ),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        3.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_duplicate_batches_total", &[]),
        1.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_skipped_blocks_total",
            &[("reason", "unknown_parent")]
        ),
        2.0
    );
    rig.finish().await;
}

async fn media_copies(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "media", json!({})).await;
    rig.start_sidecar().await;
    let (a01, _) = chain_a(16);
    let x = root("x", span(5000, 16), 16);
    let tiered = |seg: &Seg, tier| Want {
        tier: Some(tier),
        ..want(seg, seg.full.len())
    };
    rig.apply(&[store(&a01)]).await;
    rig.apply(&[Op::Store(a01.clone(), Medium::Cpu, json!({}))])
        .await;
    rig.apply(&[Op::Store(x.clone(), Medium::Disk, json!({}))])
        .await;
    rig.expect(
        "GPU and CPU copies",
        &[
            tiered(&a01, pb::CacheTier::T1),
            tiered(&x, pb::CacheTier::T3),
        ],
        3,
    )
    .await;
    rig.apply(&[remove(&a01)]).await;
    rig.expect("GPU copy removed", &[tiered(&a01, pb::CacheTier::T2)], 3)
        .await;
    rig.apply(&[Op::Remove(a01.clone(), Medium::Cpu)]).await;
    rig.expect("CPU copy removed", &[want(&a01, 0)], 1).await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_unknown_medium_total", &[]),
        0.0
    );
    rig.finish().await;
}

async fn pages_other_than_the_block_size(engine: Engine, server: &Server, sources: &Path) {
    // SGLang's default page_size = 1; vLLM with 32-token blocks.
    let (page, first_len) = match engine {
        Engine::Sglang => (1, 40),
        Engine::Vllm => (32, 32),
    };
    let mut rig = Rig::new(engine, server, sources, "pages", json!({"page_size": page})).await;
    rig.start_sidecar().await;
    let p = root("p", span(6000, first_len), page);
    let q = child(&p, "q", span(6000 + first_len, 64 - first_len));
    rig.apply(&[store(&p)]).await;
    rig.apply(&[store(&q)]).await;
    rig.expect(
        "stored",
        &[want(&q, 64), want(&p, first_len as usize / BS * BS)],
        4,
    )
    .await;
    rig.apply(&[remove(&q)]).await;
    rig.expect("second run removed", &[want(&q, 32)], 2).await;
    rig.finish().await;
}

async fn extra_keys(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "extra", json!({})).await;
    rig.start_sidecar().await;
    let plain = root("plain", span(7000, 32), 16);
    let keyed = root("keyed", span(8000, 64), 16);
    match engine {
        Engine::Vllm => {
            let lora = root("lora", span(9000, 32), 16);
            rig.apply(&[
                store(&plain),
                // An image in block 1: its hash (and every later block's) depends on it.
                Op::Store(
                    keyed.clone(),
                    Medium::Gpu,
                    json!({"extra_keys": [null, [["img-sha", 0]], null, null]}),
                ),
                // LoRA name only: a token-only block of adapter "sql-lora" (id 7 unmapped).
                Op::Store(
                    lora.clone(),
                    Medium::Gpu,
                    json!({"lora_id": 7, "lora_name": "sql-lora",
                           "extra_keys": [["sql-lora"], ["sql-lora"]]}),
                ),
            ])
            .await;
            let base_lora = want(&lora, 0);
            let adapter_lora = Want {
                adapter: "sql-lora",
                ..want(&lora, 32)
            };
            rig.expect(
                "extra keys",
                &[want(&plain, 32), want(&keyed, 16), base_lora, adapter_lora],
                5,
            )
            .await;
        }
        Engine::Sglang => {
            rig.apply(&[
                store(&plain),
                Op::Store(keyed.clone(), Medium::Gpu, json!({"cache_salt": "salt-1"})),
            ])
            .await;
            rig.expect("cache salt", &[want(&plain, 32), want(&keyed, 0)], 2)
                .await;
        }
    }
    let m = rig.metrics().await;
    assert_eq!(
        m.get(
            "inferencecache_sidecar_skipped_blocks_total",
            &[("reason", "extra_keys")]
        ),
        match engine {
            Engine::Vllm => 3.0,
            Engine::Sglang => 4.0,
        }
    );
    rig.finish().await;
}

async fn all_scenarios(engine: Engine) {
    let Some(sources) = engine_sources() else {
        return;
    };
    let Some(bin) = server_binary() else { return };
    let dir = common::temp_dir(&format!("engines-server-{}", engine.name()));
    let server = start_server(&bin, BS, &[], &dir.join("server.log"))
        .await
        .expect("server starts");
    // Report every match, however short: the default policy prunes matches under 64 tokens
    // (H10) and the scenarios check 16-token granularity.
    let mut host = Host::spawn(&sources).await;
    let policy = json!({"version": 7, "policies": [{
        "namespace": TENANT, "minimumMatchedTokens": 0, "routingFloorScore": 0,
        "affinityRouting": false,
    }]});
    host.call(json!({
        "op": "post",
        "url": format!("http://127.0.0.1:{}/policy", server.snapshot),
        "body": policy.to_string(),
    }))
    .await;
    host.call(json!({"op": "stop"})).await;
    happy_path(engine, &server, &sources).await;
    sidecar_starts_after_the_engine_published(engine, &server, &sources).await;
    sidecar_restarted_while_a_removal_is_published(engine, &server, &sources).await;
    one_message_lost(engine, &server, &sources).await;
    engine_restart(engine, &server, &sources, false).await;
    engine_restart(engine, &server, &sources, true).await;
    replay_buffer_exceeded(engine, &server, &sources).await;
    media_copies(engine, &server, &sources).await;
    pages_other_than_the_block_size(engine, &server, &sources).await;
    extra_keys(engine, &server, &sources).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_publisher_keeps_the_index_exact() {
    all_scenarios(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_publisher_keeps_the_index_exact() {
    all_scenarios(Engine::Sglang).await;
}
