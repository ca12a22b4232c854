//! End to end (spec `sidecar.md` SC13–SC15): the real server binary, the sidecar binary and the
//! fake engine binary on free loopback ports.
//!
//! The server binary comes from [`common::server_process`].

mod common;

use common::server_process::{server_binary, start_server};
use common::temp_dir;
use inferencecache_engine::fingerprint::{chain, to_wire};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_sidecar::fake_engine::{Plan, hex};
use inferencecache_sidecar::wire::encode;
use rmpv::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::Channel;

const BS: usize = 128;
const SIDECAR: &str = env!("CARGO_BIN_EXE_inferencecache-sidecar");
const FAKE_ENGINE: &str = env!("CARGO_BIN_EXE_inferencecache-fake-engine");

/// Starts the fake engine; returns the child, its bound endpoint and its EXPECT lines.
async fn start_fake_engine(args: &[&str]) -> (Child, String, Vec<String>) {
    let mut child = Command::new(FAKE_ENGINE)
        .args(["--bind", "tcp://127.0.0.1:0", "--interval", "200ms"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn fake engine");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut endpoint = String::new();
    let mut expect = Vec::new();
    let want = expected_lines(args);
    let read = async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(ep) = l.strip_prefix("LISTENING ") {
                endpoint = ep.trim().to_string();
            } else if l.starts_with("EXPECT") {
                expect.push(l);
            }
            if !endpoint.is_empty() && expect.len() >= want {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("fake engine output");
    // Keep draining stdout so the child never blocks.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, endpoint, expect)
}

fn expected_lines(args: &[&str]) -> usize {
    if args.contains(&"--omit-token-ids") {
        return 1;
    }
    args.iter()
        .position(|a| *a == "--num-blocks")
        .map(|i| args[i + 1].parse().unwrap())
        .unwrap_or(1)
}

fn start_sidecar(endpoint: &str, grpc: u16, model: &str, extra: &[&str], log: &Path) -> Child {
    Command::new(SIDECAR)
        .args([
            "--engine-endpoint",
            endpoint,
            "--server",
            &format!("127.0.0.1:{grpc}"),
            "--replica-id",
            "fake-engine-0",
            "--model-id",
            model,
            "--tenant-id",
            "team-a",
            "--window",
            "50ms",
            "--engine-metrics-url",
            "http://127.0.0.1:1/metrics",
            "--stats-interval",
            "1h",
            "--block-size",
            &BS.to_string(),
            "--metrics-bind-address",
            "127.0.0.1:0",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn sidecar")
}

async fn client(grpc: u16) -> InferenceCacheClient<Channel> {
    InferenceCacheClient::connect(format!("http://127.0.0.1:{grpc}"))
        .await
        .unwrap()
}

fn lookup(model: &str) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        tenant_id: "team-a".into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    }
}

async fn route(
    c: &mut InferenceCacheClient<Channel>,
    req: pb::LookupRouteRequest,
) -> pb::LookupRouteResponse {
    c.lookup_route(req).await.unwrap().into_inner()
}

async fn wait_for_match(
    c: &mut InferenceCacheClient<Channel>,
    req: pb::LookupRouteRequest,
) -> pb::LookupRouteResponse {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = route(c, req.clone()).await;
        if r.reason_code == "PREFIX_MATCH" || tokio::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn assert_no_match(r: &pb::LookupRouteResponse, what: &str) {
    assert!(
        r.reason_code == "AFFINITY_HINT" || r.reason_code == "NO_HINT",
        "{what}: {r:?}"
    );
    assert!(
        r.replica_scores.iter().all(|s| s.matched_tokens == 0),
        "{what}: {r:?}"
    );
}

/// The SC13 checks against a server that has the fake engine's two blocks.
async fn check_sc13(mut c: InferenceCacheClient<Channel>, model: &str, expect: &[String]) {
    let tokens: Vec<u32> = (0..2 * BS as u32).collect();
    // The fake engine's EXPECT lines are the gateway fingerprint.
    let (wire, counts) = chain(&tokens, BS);
    assert_eq!(counts, vec![128, 128]);
    assert_eq!(
        expect,
        &[
            format!("EXPECT prefix_hash[0]={} token_count=128", hex(&wire[0])),
            format!("EXPECT prefix_hash[1]={} token_count=256", hex(&wire[1])),
        ]
    );
    // token_ids lookup of the fake engine's tokens.
    let r = wait_for_match(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: tokens.clone(),
            ..lookup(model)
        },
    )
    .await;
    assert_eq!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    assert_eq!(r.replica_scores[0].replica_id, "fake-engine-0");
    assert_eq!(r.replica_scores[0].matched_tokens, 256);
    // Gateway-computed chain.
    let r = route(
        &mut c,
        pb::LookupRouteRequest {
            block_hashes: wire.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: counts.clone(),
            ..lookup(model)
        },
    )
    .await;
    assert_eq!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    assert_eq!(r.replica_scores[0].matched_tokens, 256);
    // The one-block prefix.
    let r = route(
        &mut c,
        pb::LookupRouteRequest {
            block_hashes: vec![wire[0].to_vec()],
            block_token_counts: vec![128],
            ..lookup(model)
        },
    )
    .await;
    assert_eq!(r.reason_code, "PREFIX_MATCH", "{r:?}");
    assert_eq!(r.replica_scores[0].matched_tokens, 128);
    let r = route(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: tokens[..BS].to_vec(),
            ..lookup(model)
        },
    )
    .await;
    assert_eq!(r.replica_scores[0].matched_tokens, 128, "{r:?}");
    // Novel content.
    let novel: Vec<u32> = (50_000..50_000 + 2 * BS as u32).collect();
    let r = route(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: novel,
            ..lookup(model)
        },
    )
    .await;
    assert_no_match(&r, "novel tokens");
    // Raw engine hashes are not index keys.
    let r = route(
        &mut c,
        pb::LookupRouteRequest {
            block_hashes: vec![
                0xE000u64.to_be_bytes().to_vec(),
                0xE001u64.to_be_bytes().to_vec(),
            ],
            block_token_counts: vec![128, 128],
            ..lookup(model)
        },
    )
    .await;
    assert_no_match(&r, "raw engine hashes");
    // And the sidecar's own wire form is the BE u64.
    assert_eq!(wire[0], to_wire(u64::from_be_bytes(wire[0])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sc13_fake_engine_sidecar_server_prefix_match() {
    let Some(bin) = server_binary() else { return };
    let dir = temp_dir("sc13");
    let server = start_server(&bin, BS, &[], &dir.join("server.log"))
        .await
        .expect("server starts");
    let (_engine, endpoint, expect) =
        start_fake_engine(&["--block-size", "128", "--num-blocks", "2", "--events", "2"]).await;
    let mut sidecar = start_sidecar(&endpoint, server.grpc, "m13", &[], &dir.join("sidecar.log"));
    check_sc13(client(server.grpc).await, "m13", &expect).await;

    // Graceful drain on SIGTERM: exit 0 and a stop line.
    common::sigterm(sidecar.id().expect("sidecar still running"));
    let status = tokio::time::timeout(Duration::from_secs(15), sidecar.wait())
        .await
        .expect("sidecar exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
    let log = std::fs::read_to_string(dir.join("sidecar.log")).unwrap();
    assert!(log.contains("\"msg\":\"engine_subscribed\""), "{log}");
    assert!(log.contains("\"graceful_shutdown_done\""), "{log}");
    // The sidecar's JSON lines pass the schema check the server's pass (issue 46).
    assert_log_schema(&log);
    let server_log = std::fs::read_to_string(dir.join("server.log")).unwrap();
    assert_log_schema(&server_log);
    let _ = std::fs::remove_dir_all(dir);
}

/// Every line passes `inferencecache_logging::check_json_line`.
fn assert_log_schema(log: &str) {
    let mut lines = 0;
    for line in log.lines() {
        lines += 1;
        if let Err(problem) = inferencecache_sidecar::logging::check_json_line(line) {
            panic!("{problem}: {line}");
        }
    }
    assert!(lines >= 2, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sc14_omitted_token_ids_and_truncated_event_index_nothing() {
    use bytes::Bytes;
    use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};
    let Some(bin) = server_binary() else { return };
    let dir = temp_dir("sc14");
    let server = start_server(&bin, BS, &[], &dir.join("server.log"))
        .await
        .expect("server starts");
    // The fake engine binary's own --omit-token-ids output.
    let (_engine, _ep, expect) =
        start_fake_engine(&["--num-blocks", "2", "--omit-token-ids"]).await;
    assert!(
        expect[0].starts_with("EXPECT no index entries"),
        "{expect:?}"
    );
    // An in-test publisher sends the same omitted-token batch plus a truncated BlockStored.
    let mut publ = PubSocket::new();
    let ep = publ.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let omitted = Plan::new(128, 2, 1, 0, true).unwrap().payload();
    let truncated = encode(&Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(vec![Value::from(0xE000u64)]),
            Value::Nil,
        ])]),
    ]));
    let mut sidecar = start_sidecar(&ep, server.grpc, "m14", &[], &dir.join("sidecar.log"));
    let log_path = dir.join("sidecar.log");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut seq = 0u64;
    loop {
        for payload in [&omitted, &truncated] {
            let msg = ZmqMessage::try_from(vec![
                Bytes::from_static(b"kv-events"),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload.clone()),
            ])
            .unwrap();
            seq += 1;
            publ.send(msg).await.unwrap();
        }
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        // The truncated BlockStored is dropped on its own (its batch holds nothing else).
        if log.contains("no_index_entries") && log.contains("malformed_event") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "log lines missing: {log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        sidecar.try_wait().unwrap().is_none(),
        "sidecar keeps running"
    );
    let mut c = client(server.grpc).await;
    let st = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m14".into(),
            tenant_id: "team-a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.summary.unwrap().total_prefixes, 0);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sc15_producer_token_required() {
    let Some(bin) = server_binary() else { return };
    let dir = temp_dir("sc15");
    let token_file = dir.join("producer.tokens");
    std::fs::write(&token_file, "# producers\nsidecar-token-1\n").unwrap();
    let Some(server) = start_server(
        &bin,
        BS,
        &["--producer-token-file", token_file.to_str().unwrap()],
        &dir.join("server.log"),
    )
    .await
    else {
        eprintln!("NOTICE: this server build does not accept --producer-token-file; SC15 skipped");
        return;
    };
    let (_engine, endpoint, expect) =
        start_fake_engine(&["--block-size", "128", "--num-blocks", "2", "--events", "2"]).await;

    // Without a token: UNAUTHENTICATED is logged, the process keeps running, nothing indexed.
    let log_a = dir.join("sidecar-a.log");
    let mut a = start_sidecar(&endpoint, server.grpc, "m15a", &[], &log_a);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let log = std::fs::read_to_string(&log_a).unwrap_or_default();
        if log.contains("Unauthenticated") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no UNAUTHENTICATED in {log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(a.try_wait().unwrap().is_none(), "sidecar keeps running");
    let mut c = client(server.grpc).await;
    let st = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m15a".into(),
            tenant_id: "team-a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.summary.unwrap().total_prefixes, 0);

    // With the token (the reference flag name and the server-side alias both work).
    let sidecar_token = dir.join("sidecar.token");
    std::fs::write(&sidecar_token, "sidecar-token-1\n").unwrap();
    let _b = start_sidecar(
        &endpoint,
        server.grpc,
        "m15b",
        &["--server-token-file", sidecar_token.to_str().unwrap()],
        &dir.join("sidecar-b.log"),
    );
    check_sc13(client(server.grpc).await, "m15b", &expect).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sc15_mutual_tls_end_to_end() {
    use inferencecache_test_ca::Ca;
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let Some(bin) = server_binary() else { return };
    let dir = temp_dir("sc15tls");
    let server_ca = Ca::new("server-ca");
    let client_ca = Ca::new("client-ca");
    let (srv_cert, srv_key) = server_ca.leaf();
    let (cli_cert, cli_key) = client_ca.leaf();
    let w = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let (sc, sk, cca) = (
        w("server.pem", &srv_cert),
        w("server.key", &srv_key),
        w("client-ca.pem", &client_ca.pem()),
    );
    let (ca, cc, ck) = (
        w("server-ca.pem", &server_ca.pem()),
        w("client.pem", &cli_cert),
        w("client.key", &cli_key),
    );
    let Some(server) = start_server(
        &bin,
        BS,
        &[
            "--tls-cert-file",
            &sc,
            "--tls-key-file",
            &sk,
            "--tls-client-ca-file",
            &cca,
        ],
        &dir.join("server.log"),
    )
    .await
    else {
        eprintln!("NOTICE: this server build does not serve gRPC TLS yet; SC15 (mTLS) skipped");
        return;
    };
    let (_engine, endpoint, expect) =
        start_fake_engine(&["--block-size", "128", "--num-blocks", "2", "--events", "2"]).await;
    let _sidecar = start_sidecar(
        &endpoint,
        server.grpc,
        "m15tls",
        &[
            "--server-tls-ca-file",
            &ca,
            "--server-tls-cert-file",
            &cc,
            "--server-tls-key-file",
            &ck,
        ],
        &dir.join("sidecar.log"),
    );
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server_ca.pem()))
        .identity(Identity::from_pem(cli_cert, cli_key));
    let channel = Channel::from_shared(format!("https://127.0.0.1:{}", server.grpc))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    check_sc13(InferenceCacheClient::new(channel), "m15tls", &expect).await;
    let _ = std::fs::remove_dir_all(dir);
}
