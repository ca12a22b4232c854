//! The harness of the engine tests: the engines' own KV-event publishers run by
//! `tests/engines/engine_host.py`, the real sidecar binary, and the index checks (LookupRoute
//! and `/snapshot`) every engine scenario asserts with. Used by `engines.rs` and the scenario
//! files built on it.

use super::free_port;
use super::server_process::Server;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

pub const SIDECAR: &str = env!("CARGO_BIN_EXE_inferencecache-sidecar");
/// Index block size: the server's `--engine-block-size` and the sidecar's `--block-size`.
pub const BS: usize = 16;
pub const TENANT: &str = "team-a";
/// How long the index may take to reflect the engine.
pub const CONVERGENCE: Duration = Duration::from_secs(2);

pub const ENGINE_FILES: [&str; 3] = [
    "vllm/distributed/kv_events.py",
    "sglang/srt/disaggregation/kv_events.py",
    "sglang/srt/mem_cache/events.py",
];

/// The extracted engine files, or `None` (with a notice) to skip.
pub fn engine_sources() -> Option<PathBuf> {
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
pub enum Engine {
    Vllm,
    Sglang,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }

    pub fn medium(self, tier: Medium) -> &'static str {
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
pub enum Medium {
    Gpu,
    Cpu,
    Disk,
}

/// A run of engine pages: an SGLang radix node, or consecutive vLLM blocks of one chain.
#[derive(Debug, Clone)]
pub struct Seg {
    pub name: String,
    pub chain: String,
    pub parent: Option<String>,
    pub first_page: usize,
    pub page: usize,
    pub own: Vec<u32>,
    /// The prompt from the chain's start through this segment.
    pub full: Vec<u32>,
}

pub fn root(name: &str, tokens: Vec<u32>, page: usize) -> Seg {
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

pub fn child(parent: &Seg, name: &str, tokens: Vec<u32>) -> Seg {
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

pub fn span(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

/// One engine-side change.
#[derive(Debug, Clone)]
pub enum Op {
    Store(Seg, Medium, Value),
    Remove(Seg, Medium),
    Clear,
}

pub fn store(seg: &Seg) -> Op {
    Op::Store(seg.clone(), Medium::Gpu, json!({}))
}

pub fn remove(seg: &Seg) -> Op {
    Op::Remove(seg.clone(), Medium::Gpu)
}

/// The Python process running an engine's publisher.
pub struct Host {
    pub _child: Child,
    pub stdin: ChildStdin,
    pub lines: Lines<BufReader<ChildStdout>>,
}

impl Host {
    pub async fn spawn(sources: &Path) -> Host {
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

    pub async fn read(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line())
            .await
            .expect("engine host answers in time")
            .expect("read engine host")
            .expect("engine host alive");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    pub async fn call(&mut self, cmd: Value) -> Value {
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
pub struct Scrape(pub Vec<(String, serde_json::Map<String, Value>, f64)>);

impl Scrape {
    /// The sum of the samples named `name` whose labels include `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
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
pub struct Want {
    pub tokens: Vec<u32>,
    pub adapter: &'static str,
    pub matched: i32,
    pub tier: Option<pb::CacheTier>,
}

pub fn want(seg: &Seg, matched: usize) -> Want {
    Want {
        tokens: seg.full.clone(),
        adapter: "",
        matched: matched as i32,
        tier: (matched > 0).then_some(pb::CacheTier::T1),
    }
}

/// One scenario's engine, sidecar and expectations.
pub struct Rig<'a> {
    pub engine: Engine,
    pub server: &'a Server,
    pub sources: &'a Path,
    pub dir: PathBuf,
    pub host: Host,
    pub replica: String,
    pub publish_endpoint: String,
    pub replay_endpoint: String,
    /// Where the sidecar subscribes: the engine, or a proxy in front of it.
    pub subscribe_endpoint: String,
    pub sidecar: Option<Child>,
    pub metrics_port: u16,
    pub sidecar_runs: usize,
    /// Flags added to the sidecar's command line (after the harness's own).
    pub sidecar_args: Vec<String>,
}

impl<'a> Rig<'a> {
    pub async fn new(
        engine: Engine,
        server: &'a Server,
        sources: &'a Path,
        scenario: &str,
        engine_args: Value,
    ) -> Rig<'a> {
        let dir = super::temp_dir(&format!("engines-{}-{scenario}", engine.name()));
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
            sidecar_args: Vec::new(),
        }
    }

    pub fn model(&self) -> String {
        format!("model-{}", self.replica)
    }

    pub fn scheme(&self) -> &'static str {
        self.engine.name()
    }

    /// Puts a forwarding proxy dropping `drop` between the engine and the sidecar.
    pub async fn proxy(&mut self, drop: &[u64]) {
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
    pub async fn start_sidecar(&mut self) {
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
            .args(&self.sidecar_args)
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

    pub async fn stop_sidecar(&mut self) {
        if let Some(mut child) = self.sidecar.take() {
            super::sigterm(child.id().expect("sidecar running"));
            let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
                .await
                .expect("sidecar exits after SIGTERM")
                .unwrap();
            assert!(status.success(), "{status}");
        }
    }

    /// Publishes `ops` as one engine batch.
    pub async fn apply(&mut self, ops: &[Op]) {
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

    pub fn vllm_event(&self, op: &Op) -> Value {
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

    pub fn sglang_command(&self, op: &Op) -> Value {
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

    pub async fn restart_engine(&mut self) {
        self.host.call(json!({"op": "restart"})).await;
    }

    pub async fn try_scrape(&mut self) -> Option<Scrape> {
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

    pub async fn metrics(&mut self) -> Scrape {
        self.try_scrape().await.expect("sidecar /metrics")
    }

    /// The replica's entry count in the server's `/snapshot`.
    pub async fn snapshot_count(&mut self) -> u64 {
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

    pub async fn lookup(&self, w: &Want) -> (i32, Option<pb::CacheTier>) {
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
    pub async fn expect(&mut self, step: &str, wants: &[Want], entries: u64) {
        self.expect_by(
            step,
            wants,
            entries,
            tokio::time::Instant::now() + CONVERGENCE,
        )
        .await;
    }

    /// [`Rig::expect`] with the deadline given: every prompt answers as wanted and the replica
    /// holds exactly `entries` entries by `deadline` (checked at least once).
    pub async fn expect_by(
        &mut self,
        step: &str,
        wants: &[Want],
        entries: u64,
        deadline: tokio::time::Instant,
    ) {
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

    pub async fn finish(mut self) {
        self.stop_sidecar().await;
        self.host.call(json!({"op": "stop"})).await;
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = self.sources;
    }
}
