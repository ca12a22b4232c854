//! Warm restart against the real binary: a SIGTERM or kill -9 restart with the same
//! `--state-dir` answers exactly as before, and every damaged, missing or unwritable state
//! gives its logged reason and a server that answers.

mod common;

use common::{SERVER_BIN, free_port, http_request, lookup, report, temp_dir, try_http_request};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tonic::transport::Channel;

struct Server {
    child: Option<Child>,
    grpc: u16,
    http: u16,
    control: u16,
    log: PathBuf,
}

impl Server {
    fn start(dir: &Path, state_dir: &Path, extra: &[&str]) -> Self {
        let (grpc, http, control) = (free_port(), free_port(), free_port());
        let log = dir.join(format!("stderr-{grpc}.log"));
        let child = Command::new(SERVER_BIN)
            .args([
                "--grpc-bind-address".to_string(),
                format!("127.0.0.1:{grpc}"),
                "--http-bind-address".into(),
                format!("127.0.0.1:{http}"),
                "--snapshot-bind-address".into(),
                format!("127.0.0.1:{control}"),
                "--state-dir".into(),
                state_dir.display().to_string(),
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start server");
        Self {
            child: Some(child),
            grpc,
            http,
            control,
            log,
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn http_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.http))
    }

    fn control_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.control))
    }

    /// Waits for `/readyz` 200 (the restore is done).
    async fn ready(&self) {
        let start = Instant::now();
        loop {
            // A server still starting may accept a connection and drop it: not ready yet.
            let answer = try_http_request(self.http_addr(), "GET", "/readyz", "").await;
            if answer.is_ok_and(|(status, _, _)| status == 200) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "server never became ready: {}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn client(&self) -> InferenceCacheClient<Channel> {
        let ch = Channel::from_shared(format!("http://127.0.0.1:{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        InferenceCacheClient::new(ch)
    }

    fn signal(&self, sig: i32) {
        let pid = i32::try_from(self.child.as_ref().unwrap().id()).unwrap();
        // SAFETY: kill(2) on a child this test spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }

    /// Sends `sig` and waits for the exit: the exit code (None if killed) and the logs.
    async fn stop(mut self, sig: i32) -> (Option<i32>, String) {
        self.signal(sig);
        let mut child = self.child.take().unwrap();
        let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
        (status.code(), self.logs())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

fn block(i: u64) -> Vec<u8> {
    (0xB10C_0000_0000_0000u64 + i).to_be_bytes().to_vec()
}

/// Everything the round trip ingests. Timestamps lie 20 minutes ahead, so freshness stays
/// exactly 1 on both sides of the restart and scores can be compared exactly.
fn updates(ts: i64) -> Vec<pb::CacheStateUpdate> {
    let mut out = Vec::new();
    for (tenant, replicas) in [("t", 6), ("lfu-t", 3)] {
        for r in 0..replicas {
            let blocks = 8 + 6 * r as u64;
            out.push(pb::CacheStateUpdate {
                replica_id: format!("{tenant}-replica-{r}"),
                model_id: "m".into(),
                tenant_id: tenant.into(),
                hash_scheme: "vllm".into(),
                timestamp_us: ts + r as i64 * 1000,
                prefixes: vec![
                    pb::PrefixEntry {
                        block_hashes: (0..blocks).map(block).collect(),
                        block_token_counts: vec![16; blocks as usize],
                        tier: (r % 3) + 1,
                        ..Default::default()
                    },
                    pb::PrefixEntry {
                        prefix_hash: format!("legacy-{tenant}-{r}").into_bytes(),
                        token_count: 100 + r,
                        adapter_id: if r % 2 == 0 {
                            "sql-lora".into()
                        } else {
                            String::new()
                        },
                        ..Default::default()
                    },
                ],
                stats: Some(pb::ReplicaStats {
                    cache_memory_bytes: 1 << (20 + r),
                    hit_rate: 0.1 * r as f32,
                    pressure: 0.05 * r as f32,
                    t2_hit_tokens: r as i64,
                    t2_query_tokens: 10 * r as i64,
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    out
}

fn lookups() -> Vec<pb::LookupRouteRequest> {
    let mut out = Vec::new();
    for i in 0..1000u64 {
        let tenant = ["t", "lfu-t", "unknown-tenant"][(i % 3) as usize];
        let n = (i % 45) + 1;
        let start = if i % 7 == 0 { 3 } else { 0 };
        let mut req = pb::LookupRouteRequest {
            tenant_id: tenant.into(),
            model_id: if i % 11 == 0 {
                "other-model".into()
            } else {
                "m".into()
            },
            hash_scheme: "vllm".into(),
            block_hashes: (start..start + n).map(block).collect(),
            block_token_counts: vec![16; n as usize],
            ..Default::default()
        };
        if i % 5 == 0 {
            req.block_hashes.clear();
            req.block_token_counts.clear();
            req.prefix_hash = format!("legacy-{tenant}-{}", i % 7).into_bytes();
            req.adapter_id = if i % 2 == 0 {
                "sql-lora".into()
            } else {
                String::new()
            };
        }
        out.push(req);
    }
    out
}

async fn answers(client: &mut InferenceCacheClient<Channel>) -> Vec<pb::LookupRouteResponse> {
    let mut out = Vec::new();
    for req in lookups() {
        let mut a = lookup(client, req).await;
        a.lookup_latency_us = 0;
        out.push(a);
    }
    out
}

/// The instance identity of a running server (a new one at every start).
async fn instance_of(s: &Server) -> String {
    let mut c = s.client().await;
    c.get_cache_state(pb::GetCacheStateRequest::default())
        .await
        .unwrap()
        .into_inner()
        .server_instance_id
}

/// What a restore must give back exactly: GetCacheState (without the instance identity, which
/// every start renews) and `/snapshot`.
async fn observable(s: &Server) -> (Vec<pb::GetCacheStateResponse>, String) {
    let mut c = s.client().await;
    let mut states = Vec::new();
    for tenant in ["t", "lfu-t"] {
        let mut state = c
            .get_cache_state(pb::GetCacheStateRequest {
                tenant_id: tenant.into(),
                model_id: "m".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(state.server_instance_id.len(), 32);
        state.server_instance_id.clear();
        states.push(state);
    }
    let (status, _, snapshot) = http_request(s.control_addr(), "GET", "/snapshot", "").await;
    assert_eq!(status, 200);
    (states, snapshot)
}

const POLICY: &str = r#"{"version":7,"policies":[{"namespace":"lfu-t","eviction":"lfu"},{"namespace":"t","minimumMatchedTokens":32}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_restart_answers_exactly_as_before() {
    let dir = temp_dir("warm-restart-sigterm");
    let state = dir.join("state");
    let first = Server::start(&dir, &state, &["--checkpoint-interval", "1h"]);
    first.ready().await;
    let (status, _, _) = http_request(first.control_addr(), "POST", "/policy", POLICY).await;
    assert_eq!(status, 204);
    let mut c = first.client().await;
    report(&mut c, updates(now_us() + 20 * 60 * 1_000_000)).await;
    // Events: one key evicted, one replica cleared.
    for (ty, replica, key) in [
        (
            pb::cache_event::Type::PrefixEvicted,
            "t-replica-4",
            block(2),
        ),
        (pb::cache_event::Type::AllCleared, "t-replica-5", Vec::new()),
    ] {
        c.publish_event(pb::CacheEvent {
            r#type: ty as i32,
            replica_id: replica.into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            prefix_hash: key,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let before = answers(&mut c).await;
    assert!(before.iter().any(|a| a.reason_code == "PREFIX_MATCH"));
    let state_before = observable(&first).await;
    let first_instance = instance_of(&first).await;
    assert!(
        state_before.0[1].summary.as_ref().unwrap().hot_prefixes > 0,
        "LFU credits made prefixes hot"
    );
    let (code, logs) = first.stop(libc::SIGTERM).await;
    assert_eq!(code, Some(0), "{logs}");
    assert!(logs.contains("checkpoint_written"), "{logs}");

    let second = Server::start(&dir, &state, &["--checkpoint-interval", "1h"]);
    second.ready().await;
    assert_eq!(
        observable(&second).await,
        state_before,
        "GetCacheState and /snapshot"
    );
    // A restore from a checkpoint is a new instance: producers must not assume it holds what
    // they sent to the previous one.
    assert_ne!(instance_of(&second).await, first_instance);
    let mut c2 = second.client().await;
    assert_eq!(answers(&mut c2).await, before, "1,000 LookupRoute answers");
    let (status, _, body) = http_request(second.control_addr(), "GET", "/checkpoint", "").await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["restore"]["file"],
        state.join("checkpoint.current").display().to_string()
    );
    assert!(v["restore"]["loaded"].as_u64().unwrap() > 100, "{body}");
    assert_eq!(v["restore"]["loaded"], v["restore"]["entries"], "{body}");
    let metrics = http_request(second.http_addr(), "GET", "/metrics", "")
        .await
        .2;
    assert!(
        metrics.contains("inferencecache_checkpoint_restore_entries "),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_after_a_periodic_checkpoint_restores_it() {
    let dir = temp_dir("warm-restart-kill9");
    let state = dir.join("state");
    let first = Server::start(&dir, &state, &["--checkpoint-interval", "300ms"]);
    first.ready().await;
    let mut c = first.client().await;
    report(&mut c, updates(now_us() + 20 * 60 * 1_000_000)).await;
    // Wait for a periodic checkpoint holding every entry.
    let expected: u64 = updates(0)
        .iter()
        .map(|u| {
            u.prefixes
                .iter()
                .map(|p| p.block_hashes.len().max(1) as u64)
                .sum::<u64>()
        })
        .sum();
    let start = Instant::now();
    loop {
        let body = http_request(first.control_addr(), "GET", "/checkpoint", "")
            .await
            .2;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["last_checkpoint"]["entries"].as_u64() == Some(expected) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = answers(&mut c).await;
    assert!(before.iter().any(|a| a.reason_code == "PREFIX_MATCH"));
    let (code, _) = first.stop(libc::SIGKILL).await;
    assert_eq!(code, None, "killed");
    let second = Server::start(&dir, &state, &[]);
    second.ready().await;
    let mut c2 = second.client().await;
    assert_eq!(answers(&mut c2).await, before);
}

/// Offsets where each section of a checkpoint file starts, and the end of the file.
fn section_starts(bytes: &[u8]) -> Vec<usize> {
    let mut at = 40;
    let mut out = Vec::new();
    while at + 8 <= bytes.len() {
        out.push(at);
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        at += 8 + len + 8;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_missing_and_unwritable_state_is_logged_and_the_server_answers() {
    let dir = temp_dir("warm-restart-corrupt");
    let state = dir.join("state");
    let first = Server::start(&dir, &state, &["--checkpoint-interval", "1h"]);
    first.ready().await;
    let mut c = first.client().await;
    report(&mut c, updates(0)).await;
    http_request(first.control_addr(), "POST", "/policy", POLICY).await;
    let (code, logs) = first.stop(libc::SIGTERM).await;
    assert_eq!(code, Some(0), "{logs}");
    let good = std::fs::read(state.join("checkpoint.current")).unwrap();
    let starts = section_starts(&good);
    assert!(starts.len() >= 5, "blob, partitions, entries, stats, end");

    let mut cases: Vec<(String, Vec<u8>, &str)> = vec![
        (
            "empty file".into(),
            Vec::new(),
            "shorter than a checkpoint header",
        ),
        (
            "header only".into(),
            good[..40].to_vec(),
            "truncated after 0",
        ),
    ];
    for (i, &s) in starts.iter().enumerate() {
        cases.push((
            format!("cut at section {i}"),
            good[..s].to_vec(),
            "truncated",
        ));
        let mut flipped = good.clone();
        flipped[s + 9] ^= 0x40;
        cases.push((format!("flip in section {i}"), flipped, "section"));
    }
    let mut v2 = good.clone();
    v2[8] = 9;
    let sum = xxhash_rust::xxh3::xxh3_64(&v2[..32]);
    v2[32..40].copy_from_slice(&sum.to_le_bytes());
    cases.push(("wrong version".into(), v2, "unknown checkpoint version 9"));

    for (name, bytes, reason) in cases {
        let case_dir = dir.join(name.replace(' ', "-"));
        std::fs::create_dir_all(&case_dir).unwrap();
        std::fs::write(case_dir.join("checkpoint.current"), &bytes).unwrap();
        let s = Server::start(&dir, &case_dir, &["--checkpoint-interval", "1h"]);
        s.ready().await;
        let mut c = s.client().await;
        let a = lookup(&mut c, lookups().swap_remove(1)).await;
        assert_eq!(a.reason_code, "NO_HINT", "{name}: starts empty");
        let logs = s.logs();
        assert!(
            logs.contains("checkpoint_refused") && logs.contains(reason),
            "{name}: expected a refusal naming {reason:?}: {logs}"
        );
        // The refusal is recorded in /checkpoint too.
        let body = http_request(s.control_addr(), "GET", "/checkpoint", "")
            .await
            .2;
        assert!(body.contains("\"refused\": ["), "{name}: {body}");
    }

    // A previous checkpoint still good behind a damaged current one is restored.
    let fallback = dir.join("fallback");
    std::fs::create_dir_all(&fallback).unwrap();
    std::fs::write(fallback.join("checkpoint.current"), &good[..good.len() - 1]).unwrap();
    std::fs::write(fallback.join("checkpoint.previous"), &good).unwrap();
    let s = Server::start(&dir, &fallback, &["--checkpoint-interval", "1h"]);
    s.ready().await;
    let mut c = s.client().await;
    let hit = lookup(&mut c, lookups().swap_remove(1)).await;
    assert_eq!(hit.reason_code, "PREFIX_MATCH", "{}", s.logs());
    drop(s);

    // A state "directory" that is a file: refused with its reason, the server answers, and the
    // shutdown checkpoint fails without crashing.
    let not_dir = dir.join("not-a-directory");
    std::fs::write(&not_dir, b"x").unwrap();
    let s = Server::start(&dir, &not_dir, &["--checkpoint-interval", "1h"]);
    s.ready().await;
    let mut c = s.client().await;
    assert_eq!(
        lookup(&mut c, lookups().swap_remove(1)).await.reason_code,
        "NO_HINT"
    );
    let (code, logs) = s.stop(libc::SIGTERM).await;
    assert_eq!(code, Some(0), "{logs}");
    assert!(logs.contains("checkpoint_write_failed"), "{logs}");

    // Disk full (the temporary file is /dev/full): the write fails, is logged and counted, and
    // the complete checkpoint stays and is restored next time.
    let full = dir.join("disk-full");
    std::fs::create_dir_all(&full).unwrap();
    std::fs::write(full.join("checkpoint.current"), &good).unwrap();
    std::os::unix::fs::symlink("/dev/full", full.join("checkpoint.tmp")).unwrap();
    let s = Server::start(&dir, &full, &["--checkpoint-interval", "1h"]);
    s.ready().await;
    let (code, logs) = s.stop(libc::SIGTERM).await;
    assert_eq!(code, Some(0), "{logs}");
    assert!(
        logs.contains("checkpoint_write_failed") && logs.contains("No space left on device"),
        "{logs}"
    );
    assert_eq!(
        std::fs::read(full.join("checkpoint.current")).unwrap(),
        good
    );
    let s = Server::start(&dir, &full, &["--checkpoint-interval", "1h"]);
    s.ready().await;
    let mut c = s.client().await;
    assert_eq!(
        lookup(&mut c, lookups().swap_remove(1)).await.reason_code,
        "PREFIX_MATCH"
    );
}

/// While a warm restart loads: gRPC health NOT_SERVING, `/readyz` 503, LookupRoute NO_HINT
/// even for a key the index holds, producer RPCs wait; after it: SERVING, 200, the hit, and
/// the waiting update applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_restoring_health_is_not_serving_lookups_fail_open_and_producers_wait() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let server = common::TestServer::start().await;
    let mut c = server.client().await;
    report(&mut c, vec![common::legacy_update("r", "t", b"key", 128)]).await;
    let hit = common::exact_lookup("t", b"key", 128);
    assert_eq!(
        lookup(&mut c, hit.clone()).await.reason_code,
        "PREFIX_MATCH"
    );
    let mut health = HealthClient::new(server.channel().await);
    let status = |h: &mut HealthClient<Channel>| {
        let mut h = h.clone();
        async move {
            h.check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
        }
    };
    assert_eq!(status(&mut health).await, ServingStatus::Serving as i32);

    server.state.core().begin_restore();
    let deadline = Instant::now() + Duration::from_secs(5);
    while status(&mut health).await != ServingStatus::NotServing as i32 {
        assert!(Instant::now() < deadline, "health never turned NOT_SERVING");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(http_request(server.http, "GET", "/readyz", "").await.0, 503);
    assert_eq!(lookup(&mut c, hit.clone()).await.reason_code, "NO_HINT");
    let mut producer = c.clone();
    let waiting = tokio::spawn(async move {
        report(
            &mut producer,
            vec![common::legacy_update("r", "t", b"later", 16)],
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "a producer RPC waits for the restore"
    );
    assert!(
        server
            .state
            .index()
            .entry("t", "m", "vllm", "", b"later", "r")
            .is_none()
    );

    server.state.core().end_restore();
    waiting.await.unwrap();
    assert!(
        server
            .state
            .index()
            .entry("t", "m", "vllm", "", b"later", "r")
            .is_some()
    );
    assert_eq!(lookup(&mut c, hit).await.reason_code, "PREFIX_MATCH");
    assert_eq!(http_request(server.http, "GET", "/readyz", "").await.0, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    while status(&mut health).await != ServingStatus::Serving as i32 {
        assert!(
            Instant::now() < deadline,
            "health never turned SERVING again"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown().await;
}
