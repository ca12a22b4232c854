//! The index stays exact while only the index *server* restarts or goes away (issue 42), with
//! vLLM's and SGLang's own KV-event publisher code (`tests/engines/engine_host.py`), the real
//! sidecar and server binaries on loopback, and one publisher and one sidecar running
//! throughout. The sidecar runs with its default link settings (retry backoff capped at 2 s,
//! instance probe every 5 s, anti-entropy every 30 s).
//!
//! Scenarios, each for both engines:
//! 1. **Deploy**: `--state-dir`, SIGTERM, a removal published while the server is down,
//!    restart on the same ports. The outbox delivers the removal to the restored instance, the
//!    digest then matches: the warm restart is kept, no reconcile.
//! 2. **Crash**: kill -9 after a periodic checkpoint, with a removal applied live after it. The
//!    restore resurrects the removed blocks; the idle sidecar's probe sees the new instance, the
//!    digest differs, the sidecar reconciles.
//! 3. **Outage without a state dir** while the engine stores and removes: the queued changes go
//!    to an empty server, the digest differs, the sidecar reconciles.
//! 4. **Unreachable** (SIGSTOP for 6 s, longer than the 5 s RPC timeout, so calls time out and
//!    may still be applied late) during a burst of stores and removals, then SIGCONT.
//! 5. **Replicated pair** (a real `nats-server`): the sidecar's server is killed; the sidecar
//!    fails over to the other one.
//! 6. **Drift** (anti-entropy, `--anti-entropy-interval 2s`): another client writes a false
//!    entry under the sidecar's replica and removes a true one; the periodic digest comparison
//!    finds it and reconciles.
//!
//! After each, within 10 s of the server reporting ready (`/readyz`; for the pair, of the kill),
//! LookupRoute and `/snapshot` show exactly what the engine holds, and keep showing it; the
//! sidecar's `/metrics` show the retries, instance changes, digest checks, mismatches and
//! reconciles the scenario causes. Prerequisites missing: a notice and a pass, except under
//! `CI`, where they fail.

mod common;

use common::engines::*;
use common::server_process::{Server, Stop, server_binary, start_server};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;

/// The bound the issue sets: exact within this long of the server reporting ready.
const RECOVERY: Duration = Duration::from_secs(10);

/// Server flags every scenario uses: stop without a drain notice (the tests time the stop).
const SERVER_FLAGS: [&str; 2] = ["--drain-notice", "0s"];

/// Reports every match, however short (the default policy prunes matches under 64 tokens).
async fn push_policy(rig: &mut Rig<'_>, server: &Server) {
    let policy = json!({"version": 7, "policies": [{
        "namespace": TENANT, "minimumMatchedTokens": 0, "routingFloorScore": 0,
        "affinityRouting": false,
    }]});
    rig.host
        .call(json!({
            "op": "post",
            "url": format!("http://127.0.0.1:{}/policy", server.snapshot),
            "body": policy.to_string(),
        }))
        .await;
}

/// After converging: the index keeps holding exactly that for a while (no late stale write, no
/// flapping reconcile).
async fn keeps(rig: &mut Rig<'_>, step: &str, wants: &[Want], entries: u64) {
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        rig.expect_by(step, wants, entries, Instant::now()).await;
    }
}

async fn get_json(rig: &mut Rig<'_>, url: String) -> Value {
    let answer = rig.host.call(json!({"op": "fetch", "url": url})).await;
    serde_json::from_str(answer["text"].as_str().unwrap_or_default()).unwrap_or(Value::Null)
}

/// Prints how long after `since` (the server ready, or for the pair the kill) the index was
/// exact: the numbers the docs quote.
fn converged(engine: Engine, scenario: &str, since: Instant) {
    eprintln!(
        "{}: {scenario}: exact {:.2} s after the server was ready (the pair: after the kill)",
        engine.name(),
        since.elapsed().as_secs_f64()
    );
}

fn counter(m: &Scrape, name: &str) -> f64 {
    m.get(&format!("inferencecache_sidecar_{name}"), &[])
}

fn reconciles(m: &Scrape, reason: &str) -> f64 {
    m.get(
        "inferencecache_sidecar_reconciles_total",
        &[("reason", reason)],
    )
}

fn chain(page: usize) -> (Seg, Seg, Seg) {
    let a01 = root("a01", span(1000, 32), page);
    let a23 = child(&a01, "a23", span(1032, 32));
    let b = root("b", span(2000, 32), page);
    (a01, a23, b)
}

async fn single_server(bin: &Path, dir: &Path, name: &str, extra: &[&str]) -> Server {
    let mut flags: Vec<&str> = SERVER_FLAGS.to_vec();
    flags.extend_from_slice(extra);
    start_server(bin, BS, &flags, &dir.join(format!("{name}.log")))
        .await
        .expect("server starts")
}

/// 1. Deploy: SIGTERM (final checkpoint), a removal while down, restart from the checkpoint.
async fn deploy(engine: Engine, bin: &Path, sources: &Path, dir: &Path) {
    let state = dir.join("deploy-state");
    let state_arg = state.to_string_lossy().into_owned();
    let server = single_server(bin, dir, "deploy", &["--state-dir", &state_arg]).await;
    let mut rig = Rig::new(engine, &server, sources, "deploy", json!({})).await;
    push_policy(&mut rig, &server).await;
    rig.start_sidecar().await;
    let (a01, a23, b) = chain(16);
    rig.apply(&[store(&a01), store(&a23), store(&b)]).await;
    rig.expect("store", &[want(&a23, 64), want(&b, 32)], 6)
        .await;

    server.stop(Stop::Term).await;
    rig.apply(&[remove(&a23)]).await;
    // The sidecar keeps the removal and retries it while the server is down.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let m = rig.metrics().await;
    assert_eq!(counter(&m, "outbox_messages"), 2.0, "two evictions queued");
    let ready = server.restart().await;
    let restore = get_json(
        &mut rig,
        format!("http://127.0.0.1:{}/checkpoint", server.snapshot),
    )
    .await;
    assert_eq!(
        restore["restore"]["loaded"], 6,
        "the restore held the removed blocks: {restore}"
    );
    rig.expect_by(
        "deploy: removal while down",
        &[want(&a23, 32), want(&b, 32)],
        4,
        ready + RECOVERY,
    )
    .await;
    converged(engine, "deploy", ready);
    keeps(
        &mut rig,
        "deploy: keeps",
        &[want(&a23, 32), want(&b, 32)],
        4,
    )
    .await;
    let m = rig.metrics().await;
    assert!(counter(&m, "send_retries_total") >= 1.0);
    assert_eq!(counter(&m, "outbox_messages"), 0.0);
    assert_eq!(counter(&m, "server_instance_changes_total"), 1.0);
    assert!(counter(&m, "digest_checks_total") >= 1.0);
    // The restored entries plus the delivered removal are exactly the engine's: the warm
    // restart is kept, nothing is cleared.
    assert_eq!(counter(&m, "digest_mismatches_total"), 0.0);
    assert_eq!(
        m.get("inferencecache_sidecar_reconciles_total", &[]),
        0.0,
        "no reconcile needed"
    );
    rig.finish().await;
    server.stop(Stop::Term).await;
}

/// 2. Crash: kill -9 after a periodic checkpoint; a removal applied live after it.
async fn crash(engine: Engine, bin: &Path, sources: &Path, dir: &Path) {
    let state = dir.join("crash-state");
    let state_arg = state.to_string_lossy().into_owned();
    let server = single_server(
        bin,
        dir,
        "crash",
        &["--state-dir", &state_arg, "--checkpoint-interval", "3s"],
    )
    .await;
    let mut rig = Rig::new(engine, &server, sources, "crash", json!({})).await;
    push_policy(&mut rig, &server).await;
    rig.start_sidecar().await;
    let (a01, a23, b) = chain(16);
    rig.apply(&[store(&a01), store(&a23), store(&b)]).await;
    rig.expect("store", &[want(&a23, 64), want(&b, 32)], 6)
        .await;
    // Wait for a periodic checkpoint holding the six entries, then remove live and crash
    // before the next one.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = get_json(
            &mut rig,
            format!("http://127.0.0.1:{}/checkpoint", server.snapshot),
        )
        .await;
        if status["last_checkpoint"]["entries"] == 6 {
            break;
        }
        assert!(Instant::now() < deadline, "no checkpoint: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rig.apply(&[remove(&a23)]).await;
    rig.expect("removed live", &[want(&a23, 32), want(&b, 32)], 4)
        .await;
    server.stop(Stop::Kill).await;
    let ready = server.restart().await;
    let status = get_json(
        &mut rig,
        format!("http://127.0.0.1:{}/checkpoint", server.snapshot),
    )
    .await;
    assert_eq!(
        status["restore"]["loaded"], 6,
        "the restore resurrected the removed blocks: {status}"
    );
    push_policy(&mut rig, &server).await;
    rig.expect_by(
        "crash: resurrected blocks corrected",
        &[want(&a23, 32), want(&b, 32)],
        4,
        ready + RECOVERY,
    )
    .await;
    converged(engine, "crash", ready);
    keeps(&mut rig, "crash: keeps", &[want(&a23, 32), want(&b, 32)], 4).await;
    let m = rig.metrics().await;
    assert_eq!(counter(&m, "server_instance_changes_total"), 1.0);
    assert!(counter(&m, "digest_mismatches_total") >= 1.0);
    assert!(reconciles(&m, "digest_mismatch") >= 1.0);
    rig.finish().await;
    server.stop(Stop::Term).await;
}

/// 3. Outage without a state dir while the engine stores and removes.
async fn outage(engine: Engine, bin: &Path, sources: &Path, dir: &Path) {
    let server = single_server(bin, dir, "outage", &[]).await;
    let mut rig = Rig::new(engine, &server, sources, "outage", json!({})).await;
    push_policy(&mut rig, &server).await;
    rig.start_sidecar().await;
    let (a01, a23, b) = chain(16);
    rig.apply(&[store(&a01), store(&a23)]).await;
    rig.expect("store", &[want(&a23, 64)], 4).await;
    server.stop(Stop::Kill).await;
    rig.apply(&[store(&b)]).await;
    rig.apply(&[remove(&a23)]).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // The sidecar's health follows its calls: refused ones mark the server unreachable.
    let reachable = "inferencecache_sidecar_server_reachable";
    assert_eq!(rig.metrics().await.get(reachable, &[]), 0.0, "server down");
    let ready = server.restart().await;
    push_policy(&mut rig, &server).await;
    rig.expect_by(
        "outage: engine's blocks back",
        &[want(&a23, 32), want(&b, 32)],
        4,
        ready + RECOVERY,
    )
    .await;
    converged(engine, "outage", ready);
    keeps(
        &mut rig,
        "outage: keeps",
        &[want(&a23, 32), want(&b, 32)],
        4,
    )
    .await;
    let m = rig.metrics().await;
    assert!(counter(&m, "send_retries_total") >= 1.0);
    assert_eq!(counter(&m, "server_instance_changes_total"), 1.0);
    assert!(counter(&m, "digest_mismatches_total") >= 1.0);
    assert!(reconciles(&m, "digest_mismatch") >= 1.0);
    assert_eq!(m.get(reachable, &[]), 1.0, "server back");
    rig.finish().await;
    server.stop(Stop::Term).await;
}

/// 4. The server frozen (SIGSTOP) for 6 s during a burst of stores and removals.
async fn unreachable(engine: Engine, bin: &Path, sources: &Path, dir: &Path) {
    let server = single_server(bin, dir, "frozen", &[]).await;
    let mut rig = Rig::new(engine, &server, sources, "frozen", json!({})).await;
    push_policy(&mut rig, &server).await;
    rig.start_sidecar().await;
    let (a01, a23, b) = chain(16);
    let c = root("c", span(3000, 48), 16);
    let d = child(&c, "d", span(3048, 16));
    rig.apply(&[store(&a01)]).await;
    rig.expect("store", &[want(&a01, 32)], 2).await;
    let pid = server.pid().expect("server running") as i32;
    // SAFETY: signals the server process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let frozen = Instant::now();
    let burst = [
        vec![store(&a23), store(&b)],
        vec![store(&c)],
        vec![remove(&a23)],
        vec![store(&d)],
        vec![remove(&b)],
        vec![store(&a23)],
        vec![remove(&c)],
    ];
    for ops in &burst {
        rig.apply(ops).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep_until(frozen + Duration::from_secs(6)).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let ready = server.wait_ready().await;
    // Engine: a01, a23 (stored again); b removed; c removed with d after it.
    let wants = [want(&a23, 64), want(&b, 0), want(&d, 0), want(&c, 0)];
    rig.expect_by("unreachable: burst applied", &wants, 4, ready + RECOVERY)
        .await;
    converged(engine, "unreachable", ready);
    keeps(&mut rig, "unreachable: keeps", &wants, 4).await;
    let m = rig.metrics().await;
    assert!(counter(&m, "send_retries_total") >= 1.0);
    assert!(
        m.get("inferencecache_sidecar_send_errors_total", &[]) >= 1.0,
        "calls timed out"
    );
    assert_eq!(counter(&m, "server_instance_changes_total"), 0.0);
    assert!(
        counter(&m, "digest_checks_total") >= 1.0,
        "delivery verified"
    );
    assert_eq!(counter(&m, "outbox_messages"), 0.0);
    rig.finish().await;
    server.stop(Stop::Term).await;
}

/// 5. A replicated pair; the sidecar's server is killed and it fails over to the other.
async fn replicated_pair(engine: Engine, bin: &Path, sources: &Path, dir: &Path) {
    let Some(nats_bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let nats = inferencecache_test_nats::NatsServer::start(&nats_bin, dir);
    let url = nats.url();
    let replicated = |id: &'static str| {
        let url = url.clone();
        async move {
            let flags = [
                "--nats-url",
                &url,
                "--nats-server-id",
                id,
                "--checkpoint-interval",
                "1s",
                "--nats-max-age",
                "1m",
            ];
            single_server(bin, dir, id, &flags).await
        }
    };
    let first = replicated("pair-a").await;
    let second = replicated("pair-b").await;
    let mut rig = Rig::new(engine, &first, sources, "pair", json!({})).await;
    push_policy(&mut rig, &first).await;
    push_policy(&mut rig, &second).await;
    rig.sidecar_args = vec!["--server".into(), format!("127.0.0.1:{}", second.grpc)];
    rig.start_sidecar().await;
    let (a01, a23, b) = chain(16);
    rig.apply(&[store(&a01), store(&a23), store(&b)]).await;
    rig.expect("store (first)", &[want(&a23, 64), want(&b, 32)], 6)
        .await;
    rig.server = &second;
    rig.expect("store (second)", &[want(&a23, 64), want(&b, 32)], 6)
        .await;

    first.stop(Stop::Kill).await;
    let killed = Instant::now();
    rig.apply(&[remove(&a23)]).await;
    let c = root("c", span(3000, 32), 16);
    rig.apply(&[store(&c)]).await;
    let wants = [want(&a23, 32), want(&b, 32), want(&c, 32)];
    rig.expect_by("pair: after failover", &wants, 6, killed + RECOVERY)
        .await;
    converged(engine, "pair", killed);
    keeps(&mut rig, "pair: keeps", &wants, 6).await;
    let m = rig.metrics().await;
    assert!(counter(&m, "send_retries_total") >= 1.0);
    assert_eq!(counter(&m, "server_instance_changes_total"), 1.0);
    assert!(counter(&m, "digest_checks_total") >= 1.0);
    assert_eq!(counter(&m, "outbox_messages"), 0.0);
    rig.finish().await;
    second.stop(Stop::Term).await;
    drop(nats);
}

/// Scenario 6, drift nobody announced: a foreign client adds an entry the engine does not hold
/// under the sidecar's replica and evicts one it does hold; the periodic digest comparison
/// repairs both.
async fn drift(engine: Engine, bin: &Path, sources: &Path, dir: &Path) {
    use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
    use inferencecache_proto::v1alpha1 as pb;
    use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
    let server = single_server(bin, dir, "drift", &[]).await;
    let mut rig = Rig::new(engine, &server, sources, "drift", json!({})).await;
    push_policy(&mut rig, &server).await;
    rig.sidecar_args = vec!["--anti-entropy-interval".into(), "2s".into()];
    rig.start_sidecar().await;
    let (a01, a23, b) = chain(16);
    let z = root("z", span(9000, 32), 16);
    rig.apply(&[store(&a01), store(&a23), store(&b)]).await;
    let wants = [want(&a23, 64), want(&b, 32), want(&z, 0)];
    rig.expect("store", &wants, 6).await;
    let mut client = InferenceCacheClient::connect(format!("http://127.0.0.1:{}", server.grpc))
        .await
        .unwrap();
    let z_keys = prefix_hashes(&z.full, BS);
    client
        .report_cache_state(tokio_stream::iter(vec![pb::CacheStateUpdate {
            replica_id: rig.replica.clone(),
            model_id: rig.model(),
            tenant_id: TENANT.into(),
            hash_scheme: rig.scheme().into(),
            prefixes: z_keys
                .iter()
                .enumerate()
                .map(|(i, &key)| pb::PrefixEntry {
                    prefix_hash: to_wire(key).to_vec(),
                    token_count: (BS * (i + 1)) as i32,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }]))
        .await
        .unwrap();
    client
        .publish_event(pb::CacheEvent {
            r#type: pb::cache_event::Type::PrefixEvicted as i32,
            replica_id: rig.replica.clone(),
            model_id: rig.model(),
            tenant_id: TENANT.into(),
            prefix_hash: to_wire(prefix_hashes(&b.full, BS)[0]).to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
    let drifted = Instant::now();
    // The drift is real: a false entry answers, a true one does not.
    rig.expect_by(
        "drifted",
        &[want(&a23, 64), want(&b, 0), want(&z, 32)],
        7,
        Instant::now(),
    )
    .await;
    rig.expect_by("drift: repaired", &wants, 6, drifted + RECOVERY)
        .await;
    eprintln!(
        "{}: drift: exact {:.2} s after the foreign writes",
        engine.name(),
        drifted.elapsed().as_secs_f64()
    );
    keeps(&mut rig, "drift: keeps", &wants, 6).await;
    let m = rig.metrics().await;
    assert!(counter(&m, "digest_mismatches_total") >= 1.0);
    assert!(reconciles(&m, "digest_mismatch") >= 1.0);
    assert_eq!(counter(&m, "server_instance_changes_total"), 0.0);
    assert_eq!(counter(&m, "send_retries_total"), 0.0);
    rig.finish().await;
    server.stop(Stop::Term).await;
}

async fn all_scenarios(engine: Engine) {
    let Some(sources) = engine_sources() else {
        return;
    };
    let Some(bin) = server_binary() else { return };
    let dir = common::temp_dir(&format!("server-restarts-{}", engine.name()));
    let started = Instant::now();
    deploy(engine, &bin, &sources, &dir).await;
    crash(engine, &bin, &sources, &dir).await;
    outage(engine, &bin, &sources, &dir).await;
    unreachable(engine, &bin, &sources, &dir).await;
    replicated_pair(engine, &bin, &sources, &dir).await;
    drift(engine, &bin, &sources, &dir).await;
    eprintln!(
        "{}: every server-restart scenario in {:.1} s",
        engine.name(),
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_publisher_index_exact_through_server_restarts() {
    all_scenarios(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_publisher_index_exact_through_server_restarts() {
    all_scenarios(Engine::Sglang).await;
}
