//! Replicated mode against a real `nats-server` (JetStream, loopback): N server processes that
//! end with equal digests — the same entries everywhere — through mixed ingest, the cap, LFU
//! credits counted on different servers, TTL expiry, a policy push, kill -9 and restart, a new
//! server joining from the object-store checkpoint, a trimmed stream, duplicates, and NATS
//! itself going away. Skipped (with a note) when `nats-server` is not installed, except in CI
//! (`CI` set), where `.ci/run` installs it.

mod common;

use common::*;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_test_nats::NatsServer;
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// The bar: every server ends with the same digest within 2 s after the producers stop (or
/// after a restarted server reports ready).
const AFTER_PRODUCERS: Duration = Duration::from_secs(2);

/// Everything a digest answer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Digest {
    seq: u64,
    entries: u64,
    hash: String,
    leader: bool,
    /// Records accepted and not yet in the stream, and the stream's head as last seen.
    buffered: u64,
    stream_last: u64,
}

fn server(dir: &Path, nats: &NatsServer, id: &str, extra: &[&str]) -> ServerProcess {
    let dir = dir.join(id);
    std::fs::create_dir_all(&dir).unwrap();
    let url = nats.url();
    let mut args: Vec<&str> = vec![
        "--nats-url",
        &url,
        "--nats-server-id",
        id,
        "--checkpoint-interval",
        "1s",
        "--nats-max-age",
        "1m",
        "--sweep-interval",
        "250ms",
        "--drain-notice",
        "0s",
    ];
    args.extend_from_slice(extra);
    ServerProcess::start(&dir, &args)
}

async fn digest(s: &ServerProcess) -> Option<Digest> {
    let addr = format!("127.0.0.1:{}", s.control).parse().unwrap();
    let (status, _, body) = http_request(addr, "GET", "/digest", "").await;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    Some(Digest {
        seq: v["stream_seq"].as_u64()?,
        entries: v["entries"].as_u64()?,
        hash: v["digest"].as_str()?.to_owned(),
        leader: v["leader"].as_bool()?,
        buffered: v["buffered_records"].as_u64()?,
        stream_last: v["stream_last_seq"].as_u64()?,
    })
}

/// Waits until every server answers `/readyz` 200, within 30 s for all of them.
async fn wait_ready(servers: &[&ServerProcess]) {
    let limit = Duration::from_secs(30);
    let start = Instant::now();
    for s in servers {
        s.wait_ready_within(limit.saturating_sub(start.elapsed()))
            .await;
    }
}

/// Waits until every server reports the same digest at the same sequence (and no sequence
/// moves for a moment); returns it.
async fn converged(nats: &NatsServer, servers: &[&ServerProcess], within: Duration) -> Digest {
    let start = Instant::now();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let mut last: Vec<Option<Digest>> = Vec::new();
    loop {
        let mut now = Vec::new();
        for s in servers {
            now.push(digest(s).await);
        }
        let first = now[0].clone();
        // The stream's head now (the servers' own view may be 500 ms old).
        let head = match js.get_stream("inferencecache").await {
            Ok(stream) => stream
                .get_info()
                .await
                .map_or(u64::MAX, |i| i.state.last_sequence),
            Err(_) => u64::MAX,
        };
        // Equal digests at the stream's head, nothing waiting to be published.
        let equal = first.is_some()
            && now.iter().all(|d| {
                d.as_ref()
                    .is_some_and(|d| d.buffered == 0 && d.stream_last <= d.seq && d.seq == head)
                    && d.as_ref().map(|d| (d.seq, &d.hash))
                        == first.as_ref().map(|f| (f.seq, &f.hash))
            });
        let same = |a: &[Option<Digest>], b: &[Option<Digest>]| {
            a.len() == b.len()
                && a.iter().zip(b).all(|(x, y)| {
                    x.as_ref().map(|d| (d.seq, &d.hash)) == y.as_ref().map(|d| (d.seq, &d.hash))
                })
        };
        if equal && same(&now, &last) {
            return first.unwrap_or_else(|| unreachable!());
        }
        if start.elapsed() > within {
            let logs: Vec<String> = servers.iter().map(|s| s.logs()).collect();
            panic!(
                "no convergence within {within:?}: {now:?}\n{}",
                logs.join("\n-----\n")
            );
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn block(chain: u64, i: u64) -> Vec<u8> {
    (chain << 20 | i).to_be_bytes().to_vec()
}

fn chain_update(tenant: &str, replica: &str, chain: u64, blocks: u64) -> pb::CacheStateUpdate {
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

fn chain_lookup(tenant: &str, chain: u64, blocks: u64) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        block_hashes: (0..blocks).map(|i| block(chain, i)).collect(),
        block_token_counts: vec![16; blocks as usize],
        ..Default::default()
    }
}

fn event(ty: pb::cache_event::Type, tenant: &str, replica: &str, hash: Vec<u8>) -> pb::CacheEvent {
    pb::CacheEvent {
        r#type: ty as i32,
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: tenant.into(),
        prefix_hash: hash,
        ..Default::default()
    }
}

/// The answer of every server for `chain`: (reason, [(replica, matched tokens)]).
async fn answers(
    clients: &mut [InferenceCacheClient<Channel>],
    tenant: &str,
    chain: u64,
    blocks: u64,
) -> Vec<(String, Vec<(String, i32)>)> {
    let mut out = Vec::new();
    for c in clients.iter_mut() {
        let r = lookup(c, chain_lookup(tenant, chain, blocks)).await;
        let mut picks: Vec<(String, i32)> = r
            .replica_scores
            .iter()
            .map(|c| (c.replica_id.clone(), c.matched_tokens))
            .collect();
        picks.sort();
        out.push((r.reason_code, picks));
    }
    out
}

async fn clients(servers: &[&ServerProcess]) -> Vec<InferenceCacheClient<Channel>> {
    let mut out = Vec::new();
    for s in servers {
        out.push(s.client().await);
    }
    out
}

async fn metric(s: &ServerProcess, name: &str) -> f64 {
    let addr = format!("127.0.0.1:{}", s.http).parse().unwrap();
    let (_, _, body) = http_request(addr, "GET", "/metrics", "").await;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// Checkpoint uploads of all `servers` (only leaders upload).
async fn uploads(servers: &[&ServerProcess]) -> f64 {
    let mut n = 0.0;
    for s in servers {
        let v = metric(s, "inferencecache_replication_checkpoint_uploads_total").await;
        if v.is_finite() {
            n += v;
        }
    }
    n
}

/// Waits until the shared checkpoint covers `seq` (read from the meta bucket, as a server does).
async fn wait_checkpoint(nats: &NatsServer, seq: u64, servers: &[&ServerProcess]) {
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let meta = js.get_key_value("inferencecache-meta").await.unwrap();
    let start = Instant::now();
    loop {
        let covered = meta
            .get("checkpoint")
            .await
            .ok()
            .flatten()
            .and_then(|v| String::from_utf8(v.to_vec()).ok())
            .and_then(|n| n.strip_prefix("checkpoint-")?.parse::<u64>().ok())
            .is_some_and(|at| at >= seq);
        if covered {
            return;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let logs: Vec<String> = servers.iter().map(|s| s.logs()).collect();
            panic!("no checkpoint at {seq}:\n{}", logs.join("\n-----\n"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn push_policy(s: &ServerProcess, body: &str) {
    let addr = format!("127.0.0.1:{}", s.control).parse().unwrap();
    let (status, _, text) = http_request(addr, "POST", "/policy", body).await;
    assert_eq!(status, 204, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_servers_converge_under_mixed_ingest_a_policy_push_and_duplicates() {
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-mixed");
    let nats = NatsServer::start(&bin, &dir);
    let a = server(&dir, &nats, "a", &[]);
    let b = server(&dir, &nats, "b", &[]);
    let c = server(&dir, &nats, "c", &[]);
    let all = [&a, &b, &c];
    wait_ready(&all).await;
    let mut cl = clients(&all).await;
    // Producers spread over the servers: 60 chains of 8 blocks, 3 replicas.
    for chain in 0..60u64 {
        let s = (chain % 3) as usize;
        let replica = ["r0", "r1", "r2"][(chain % 3) as usize];
        report(&mut cl[s], vec![chain_update("t", replica, chain, 8)]).await;
        if chain % 10 == 9 {
            // PREFIX_EVICTED of the chain's last block, through another server.
            let ev = event(
                pb::cache_event::Type::PrefixEvicted,
                "t",
                replica,
                block(chain, 7),
            );
            // (A producer talks to one server: its records keep their order in the stream.)
            cl[s].publish_event(ev).await.unwrap();
        }
    }
    // ALL_CLEARED of r2 (whose producer uses server c), then r2 reports one chain again.
    let clear = event(pb::cache_event::Type::AllCleared, "t", "r2", Vec::new());
    cl[2].publish_event(clear).await.unwrap();
    report(&mut cl[2], vec![chain_update("t", "r2", 1000, 4)]).await;
    let d = converged(&nats, &all, AFTER_PRODUCERS).await;
    // r0 and r1 hold 20 chains each (8 blocks, minus 2 evicted last blocks); r2 only chain 1000.
    assert_eq!(d.entries, 2 * (20 * 8 - 2) + 4, "{d:?}");
    assert_eq!(all.iter().len(), 3);
    let start = Instant::now();
    let leaders = loop {
        let mut n = 0;
        for s in all {
            n += usize::from(digest(s).await.is_some_and(|d| d.leader));
        }
        if n == 1 || start.elapsed() > Duration::from_secs(5) {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(leaders, 1, "one leader");
    // Every server answers every chain alike.
    for chain in [0u64, 1, 2, 9, 1000] {
        let got = answers(&mut cl, "t", chain, 8).await;
        assert!(got.iter().all(|g| g == &got[0]), "chain {chain}: {got:?}");
    }
    let got = answers(&mut cl, "t", 0, 8).await;
    assert_eq!(got[0].0, "PREFIX_MATCH");
    assert_eq!(got[0].1, vec![("r0".to_string(), 128)]);
    let got = answers(&mut cl, "t", 2, 8).await;
    assert!(
        got[0].0 != "PREFIX_MATCH" && got[0].1.iter().all(|(r, _)| r != "r2"),
        "r2 was cleared everywhere: {got:?}"
    );

    // A policy push on one server reaches all: tenant t now needs 256 matched tokens.
    push_policy(
        &b,
        r#"{"version":7,"policies":[{"namespace":"t","minimumMatchedTokens":256}]}"#,
    )
    .await;
    converged(&nats, &all, AFTER_PRODUCERS).await;
    let got = answers(&mut cl, "t", 0, 8).await;
    assert!(
        got.iter().all(|g| g.0 != "PREFIX_MATCH" && g == &got[0]),
        "the pushed floor applies on every server: {got:?}"
    );

    // A record published twice: the same message id is deduplicated by the stream; the same
    // records again under a new id (nothing changed them since) change nothing.
    use inferencecache_server::replication::record::{Batch, Body, Record};
    use prost::Message;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let batch = Batch {
        origin: "harness".into(),
        epoch: 7,
        seq: 1,
        records: vec![Record {
            body: Some(Body::Update(pb::CacheStateUpdate {
                timestamp_us: 1_900_000_000_000_000,
                ..chain_update("t", "r5", 5000, 8)
            })),
        }],
    };
    let payload: bytes::Bytes = batch.encode_to_vec().into();
    let publish = |id: String| {
        let js = js.clone();
        let payload = payload.clone();
        async move {
            js.send_publish(
                "inferencecache.records",
                async_nats::jetstream::message::PublishMessage::build()
                    .payload(payload)
                    .message_id(id),
            )
            .await
            .unwrap()
            .await
            .unwrap()
        }
    };
    assert!(!publish(batch.message_id()).await.duplicate);
    let before = converged(&nats, &all, AFTER_PRODUCERS).await;
    assert_eq!(before.entries, d.entries + 8);
    assert!(
        publish(batch.message_id()).await.duplicate,
        "the stream deduplicates a retried id"
    );
    assert!(
        !publish(format!("{}-replayed", batch.message_id()))
            .await
            .duplicate
    );
    let after = converged(&nats, &all, AFTER_PRODUCERS).await;
    assert_eq!(after.seq, before.seq + 1, "{before:?} {after:?}");
    assert_eq!((after.entries, &after.hash), (before.entries, &before.hash));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_lfu_credits_and_ttl_decide_the_same_entries_everywhere() {
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-cap");
    let nats = NatsServer::start(&bin, &dir);
    let flags = ["--max-entries", "200", "--ttl", "4s"];
    let a = server(&dir, &nats, "a", &flags);
    let b = server(&dir, &nats, "b", &flags);
    let c = server(&dir, &nats, "c", &flags);
    let all = [&a, &b, &c];
    wait_ready(&all).await;
    let mut cl = clients(&all).await;
    push_policy(
        &a,
        r#"{"version":7,"policies":[{"namespace":"lfu","eviction":"LFU"}]}"#,
    )
    .await;
    converged(&nats, &all, Duration::from_secs(5)).await;
    // LRU tenant: 40 chains of 5 blocks; LFU tenant: 20 chains of 5 blocks, chains 0..5 looked up
    // many times, on different servers, before the cap bites.
    for chain in 0..20u64 {
        report(
            &mut cl[(chain % 3) as usize],
            vec![chain_update("lfu", "r", chain, 5)],
        )
        .await;
    }
    converged(&nats, &all, Duration::from_secs(5)).await;
    for round in 0..6usize {
        for chain in 0..5u64 {
            lookup(
                &mut cl[(round + chain as usize) % 3],
                chain_lookup("lfu", chain, 5),
            )
            .await;
        }
    }
    // Credits are published once a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for chain in 0..40u64 {
        report(
            &mut cl[(chain % 3) as usize],
            vec![chain_update("lru", "r", chain, 5)],
        )
        .await;
    }
    let d = converged(&nats, &all, AFTER_PRODUCERS).await;
    assert_eq!(d.entries, 200, "the cap holds everywhere: {d:?}");
    // The credited LFU chains survived on every server, alike.
    for chain in 0..5u64 {
        let got = answers(&mut cl, "lfu", chain, 5).await;
        assert!(got.iter().all(|g| g == &got[0]), "{got:?}");
        assert_eq!(got[0].0, "PREFIX_MATCH", "credited chain {chain}: {got:?}");
    }
    // The newest LRU chain survived everywhere too.
    let got = answers(&mut cl, "lru", 39, 5).await;
    assert!(got.iter().all(|g| g.0 == "PREFIX_MATCH"), "{got:?}");
    // TTL: with no more ingest everything expires, by the leader's decisions, everywhere.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let start = Instant::now();
    loop {
        let d = converged(&nats, &all, Duration::from_secs(10)).await;
        if d.entries == 0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{d:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_restart_a_new_server_and_a_trimmed_stream_bootstrap_from_the_checkpoint() {
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-restart");
    let nats = NatsServer::start(&bin, &dir);
    let a = server(&dir, &nats, "a", &[]);
    let b = server(&dir, &nats, "b", &[]);
    let c = server(&dir, &nats, "c", &[]);
    wait_ready(&[&a, &b, &c]).await;
    let mut ca = a.client().await;
    let mut cb = b.client().await;
    for chain in 0..30u64 {
        report(&mut ca, vec![chain_update("t", "r0", chain, 6)]).await;
        if chain == 15 {
            // kill -9 mid-stream.
            // SAFETY: kill(2) on the pid of a child this test started and still owns.
            unsafe { libc::kill(c.pid(), libc::SIGKILL) };
        }
    }
    drop(c);
    let c = server(&dir, &nats, "c", &[]);
    for chain in 30..40u64 {
        report(&mut cb, vec![chain_update("t", "r1", chain, 6)]).await;
    }
    // A brand-new server joins: it loads the object-store checkpoint, then the stream.
    let now = converged(&nats, &[&a, &b], AFTER_PRODUCERS).await;
    wait_checkpoint(&nats, now.seq, &[&a, &b, &c]).await;
    let d = server(&dir, &nats, "d", &[]);
    wait_ready(&[&c, &d]).await;
    let digest4 = converged(&nats, &[&a, &b, &c, &d], AFTER_PRODUCERS).await;
    assert_eq!(digest4.entries, 40 * 6);
    assert!(
        d.logs().contains("replication_checkpoint_loaded"),
        "the new server started from the object-store checkpoint"
    );

    // A server that was away while the stream moved on and was trimmed past what it had
    // applied: it must come back from the checkpoint, not from the (partial) stream.
    drop(d);
    for chain in 40..50u64 {
        report(&mut ca, vec![chain_update("t", "r2", chain, 6)]).await;
    }
    let remove = event(pb::cache_event::Type::AllCleared, "t", "r0", Vec::new());
    ca.publish_event(remove).await.unwrap();
    let live = converged(&nats, &[&a, &b, &c], AFTER_PRODUCERS).await;
    // One more record, then wait for a checkpoint upload (which covers it: a leader uploads
    // only when the stream moved), and trim everything up to `live`.
    let before = uploads(&[&a, &b, &c]).await;
    report(&mut ca, vec![chain_update("t", "r2", 50, 6)]).await;
    let start = Instant::now();
    while uploads(&[&a, &b, &c]).await < before + 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no checkpoint upload:\n{}\n----\n{}\n----\n{}",
            a.logs(),
            b.logs(),
            c.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream("inferencecache").await.unwrap();
    stream.purge().sequence(live.seq + 1).await.unwrap();
    let first = stream.get_info().await.unwrap().state.first_sequence;
    assert_eq!(first, live.seq + 1, "trimmed");
    let d = server(&dir, &nats, "d", &[]);
    wait_ready(&[&d]).await;
    let d4 = converged(&nats, &[&a, &b, &c, &d], AFTER_PRODUCERS).await;
    assert_eq!(
        d4.entries,
        10 * 6 + 11 * 6,
        "r0 cleared; r1 and r2 remain: {d4:?}"
    );
    assert_eq!(
        metric(&d, "inferencecache_replication_bootstraps_total").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_for_ten_seconds_under_load_then_restarted() {
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-outage");
    let mut nats = NatsServer::start(&bin, &dir);
    let a = server(&dir, &nats, "a", &[]);
    let b = server(&dir, &nats, "b", &[]);
    let c = server(&dir, &nats, "c", &[]);
    let all = [&a, &b, &c];
    wait_ready(&all).await;
    let mut cl = clients(&all).await;
    for chain in 0..10u64 {
        report(
            &mut cl[(chain % 3) as usize],
            vec![chain_update("t", "r", chain, 4)],
        )
        .await;
    }
    converged(&nats, &all, Duration::from_secs(5)).await;
    nats.kill();
    // Ten seconds without NATS: producers are acked, lookups answer (the state before the
    // outage), no gRPC error anywhere.
    let start = Instant::now();
    let mut chain = 10u64;
    let mut lookups = 0u32;
    while start.elapsed() < Duration::from_secs(10) {
        report(
            &mut cl[(chain % 3) as usize],
            vec![chain_update("t", "r", chain, 4)],
        )
        .await;
        chain += 1;
        for client in cl.iter_mut() {
            let r = lookup(client, chain_lookup("t", 1, 4)).await;
            assert_eq!(r.reason_code, "PREFIX_MATCH");
            lookups += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(lookups > 50);
    nats.resume();
    let d = converged(&nats, &all, Duration::from_secs(20)).await;
    assert_eq!(
        d.entries,
        chain * 4,
        "every record sent during the outage arrived: {d:?}\n{}",
        a.logs()
    );
    for s in &all {
        assert_eq!(
            metric(s, "inferencecache_replication_dropped_records_total").await,
            0.0
        );
    }
    let got = answers(&mut cl, "t", chain - 1, 4).await;
    assert!(got.iter().all(|g| g.0 == "PREFIX_MATCH"), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_server_whose_next_record_was_trimmed_rebootstraps() {
    use inferencecache_server::replication::record::{Batch, Body, Record};
    use prost::Message;
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-lagging");
    let nats = NatsServer::start(&bin, &dir);
    let a = server(&dir, &nats, "a", &[]);
    let b = server(&dir, &nats, "b", &[]);
    wait_ready(&[&a, &b]).await;
    let mut ca = a.client().await;
    for chain in 0..10u64 {
        report(&mut ca, vec![chain_update("t", "r0", chain, 4)]).await;
    }
    converged(&nats, &[&a, &b], Duration::from_secs(5)).await;
    // b stops reading; more messages than its consumer has asked for (500) arrive meanwhile,
    // published here as another server would.
    // SAFETY: kill(2) on the pid of a child this test started and still owns.
    unsafe { libc::kill(b.pid(), libc::SIGSTOP) };
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut acks = Vec::new();
    for i in 0..1200u64 {
        let batch = Batch {
            origin: "harness".into(),
            epoch: 1,
            seq: i + 1,
            records: vec![Record {
                body: Some(Body::Update(chain_update("t", "r9", 1000 + i, 2))),
            }],
        };
        let publish = async_nats::jetstream::message::PublishMessage::build()
            .payload(batch.encode_to_vec().into())
            .message_id(batch.message_id());
        acks.push(
            js.send_publish("inferencecache.records", publish)
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
    let stream = js.get_stream("inferencecache").await.unwrap();
    let last = stream.get_info().await.unwrap().state.last_sequence;
    // a applies everything, leads (b's lease expired while it was stopped) and uploads a
    // checkpoint covering `last`; then the stream is trimmed to its last message.
    wait_checkpoint(&nats, last, &[&a]).await;
    stream.purge().sequence(last).await.unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(b.pid(), libc::SIGCONT) };
    let d = converged(&nats, &[&a, &b], AFTER_PRODUCERS).await;
    assert_eq!(d.entries, 10 * 4 + 1200 * 2);
    assert!(metric(&b, "inferencecache_replication_gaps_total").await >= 1.0);
    assert!(metric(&b, "inferencecache_replication_bootstraps_total").await >= 2.0);
    assert!(b.logs().contains("replication_history_lost_rebootstrap"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_beyond_the_buffer_during_an_outage_are_dropped_counted_and_missing_everywhere() {
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-buffer");
    let mut nats = NatsServer::start(&bin, &dir);
    let a = server(&dir, &nats, "a", &["--nats-buffer", "5"]);
    let b = server(&dir, &nats, "b", &[]);
    wait_ready(&[&a, &b]).await;
    let mut ca = a.client().await;
    report(&mut ca, vec![chain_update("t", "r", 0, 4)]).await;
    converged(&nats, &[&a, &b], Duration::from_secs(5)).await;
    nats.kill();
    for chain in 1..=20u64 {
        // Every RPC is still acked.
        report(&mut ca, vec![chain_update("t", "r", chain, 4)]).await;
    }
    let dropped = metric(&a, "inferencecache_replication_dropped_records_total").await;
    nats.resume();
    let d = converged(&nats, &[&a, &b], Duration::from_secs(20)).await;
    let arrived = d.entries / 4 - 1;
    assert_eq!(arrived as f64 + dropped, 20.0, "{d:?}, dropped {dropped}");
    assert!(
        (5..=6).contains(&arrived),
        "the buffer bounds records not yet acked by the stream (5): {arrived}"
    );
    // Dropped records are missing on every server alike: the same chains answer everywhere.
    let mut cl = clients(&[&a, &b]).await;
    for chain in 1..=20u64 {
        let got = answers(&mut cl, "t", chain, 4).await;
        assert_eq!(got[0], got[1], "chain {chain}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_faster_than_the_stream_waits_for_room_and_nothing_is_dropped() {
    let Some(bin) = inferencecache_test_nats::binary() else {
        return;
    };
    let dir = temp_dir("replication-backpressure");
    let nats = NatsServer::start(&bin, &dir);
    let a = server(&dir, &nats, "a", &["--nats-buffer", "2"]);
    let b = server(&dir, &nats, "b", &[]);
    wait_ready(&[&a, &b]).await;
    let mut ca = a.client().await;
    // 2,000 updates on one stream into a two-record outbox, and 4 streams of 250 at once.
    report(
        &mut ca,
        (0..2000u64).map(|c| chain_update("t", "r", c, 2)).collect(),
    )
    .await;
    let mut streams = Vec::new();
    for s in 0..4u64 {
        let mut c = a.client().await;
        streams.push(tokio::spawn(async move {
            let updates = (0..250u64).map(|i| chain_update("t", "q", 10_000 + s * 250 + i, 2));
            report(&mut c, updates.collect()).await;
        }));
    }
    for s in streams {
        s.await.unwrap();
    }
    let d = converged(&nats, &[&a, &b], AFTER_PRODUCERS).await;
    assert_eq!(d.entries, (2000 + 1000) * 2);
    assert_eq!(
        metric(&a, "inferencecache_replication_dropped_records_total").await,
        0.0
    );
}
