//! The real binary: configuration file precedence and reload (SV13), TLS flag validation (SV14),
//! producer auth (SV18), JSON logs and graceful shutdown (SV11, §13).

mod common;

use common::{SERVER_BIN, ServerProcess, exact_lookup, free_port, legacy_update, lookup, temp_dir};
use inferencecache_proto::v1alpha1 as pb;
use std::process::Command;
use std::time::{Duration, Instant};

/// SIGTERM, then the exit code (-1 for a signal) and the logs.
async fn terminate(server: ServerProcess) -> (i32, String) {
    server.sigterm();
    let (code, logs) = server.wait().await;
    (code.unwrap_or(-1), logs)
}

fn exit_code(args: &[&str]) -> (i32, String) {
    let out = Command::new(SERVER_BIN).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A 128-token legacy prefix on replica `r1`.
fn legacy(tenant: &str, hash: &[u8]) -> pb::CacheStateUpdate {
    legacy_update("r1", tenant, hash, 128)
}

/// A 128-token exact lookup.
fn exact(tenant: &str, hash: &[u8]) -> pb::LookupRouteRequest {
    exact_lookup(tenant, hash, 128)
}

#[test]
fn sv14_tls_flag_validation() {
    let dir = temp_dir("process-sv14");
    let cert = dir.join("missing-cert.pem");
    let key = dir.join("missing-key.pem");
    let (code, err) = exit_code(&["--tls-cert-file", cert.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    let (code, _) = exit_code(&["--tls-client-ca-file", cert.to_str().unwrap()]);
    assert_eq!(code, 2);
    let grpc = format!("127.0.0.1:{}", free_port());
    let (code, err) = exit_code(&[
        "--tls-cert-file",
        cert.to_str().unwrap(),
        "--tls-key-file",
        key.to_str().unwrap(),
        "--grpc-bind-address",
        &grpc,
    ]);
    assert_eq!(code, 1, "unloadable files are exit 1: {err}");
    assert!(err.contains("grpc_tls_load"), "{err}");
}

#[test]
fn config_file_errors_exit_2() {
    let dir = temp_dir("process-badcfg");
    let cfg = dir.join("bad.toml");
    std::fs::write(&cfg, "bogus_key = 1\n").unwrap();
    assert_eq!(exit_code(&["--config", cfg.to_str().unwrap()]).0, 2);
    assert_eq!(
        exit_code(&["--config", dir.join("missing.toml").to_str().unwrap()]).0,
        2
    );
}

#[tokio::test]
async fn sv13_config_file_precedence_and_reload() {
    let dir = temp_dir("process-sv13");
    let cfg = dir.join("config.toml");
    let write = |body: &str| std::fs::write(&cfg, body).unwrap();
    // The file asks for another gRPC address; the flag wins.
    write(
        r#"grpc_bind_address = "127.0.0.1:1"
[[policy.namespaces]]
namespace = "team-a"
strategy = { requireChain = true }
[[tenants]]
tenantID = "team-q"
maxIndexEntries = 0
"#,
    );
    let server = ServerProcess::start(
        &dir,
        &["--config", cfg.to_str().unwrap(), "--log-level", "debug"],
    );
    server.wait_ready().await;
    let mut c = server.client().await;
    c.report_cache_state(tokio_stream::iter(vec![legacy("team-a", b"p")]))
        .await
        .unwrap();
    let r = lookup(&mut c, exact("team-a", b"p")).await;
    assert_eq!(
        r.reason_code, "POLICY_REQUIRES_CHAIN",
        "the file's namespace policy applies"
    );
    // Edit: drop requireChain, and change a restart-only key.
    write(
        r#"grpc_bind_address = "127.0.0.1:2"
[[policy.namespaces]]
namespace = "team-a"
minimumMatchedTokens = 0
"#,
    );
    let deadline = Instant::now() + Duration::from_secs(6);
    loop {
        let r = lookup(&mut c, exact("team-a", b"p")).await;
        if r.reason_code == "PREFIX_MATCH" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the edit took effect within 5 s (got {})",
            r.reason_code
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // An invalid edit keeps the previous layer.
    write("[[policy.namespaces]]\nnamespace = \"team-a\"\nnot_a_key = 1\n");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = lookup(&mut c, exact("team-a", b"p")).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    let (code, logs) = terminate(server).await;
    assert_eq!(code, 0, "{logs}");
    assert!(logs.contains("\"msg\":\"config_reloaded\""), "{logs}");
    assert!(logs.contains("\"msg\":\"config_reload_failed\""), "{logs}");
    assert!(
        logs.contains("\"msg\":\"config_change_requires_restart\""),
        "{logs}"
    );
}

#[tokio::test]
async fn sv18_producer_token_guards_producer_rpcs_only() {
    let dir = temp_dir("process-sv18");
    let tokens = dir.join("producer.tokens");
    std::fs::write(&tokens, "# producers\nsecret-1\n").unwrap();
    let server = ServerProcess::start(&dir, &["--producer-token-file", tokens.to_str().unwrap()]);
    server.wait_ready().await;
    let mut c = server.client().await;
    let err = c
        .report_cache_state(tokio_stream::iter(vec![legacy("t", b"p")]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut wrong = tonic::Request::new(pb::CacheEvent {
        r#type: 4,
        tenant_id: "t".into(),
        ..Default::default()
    });
    wrong
        .metadata_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    assert_eq!(
        c.publish_event(wrong).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );
    assert_eq!(
        lookup(&mut c, exact("t", b"p")).await.reason_code,
        "NO_HINT",
        "nothing applied"
    );
    let mut good = tonic::Request::new(tokio_stream::iter(vec![legacy("t", b"p")]));
    good.metadata_mut()
        .insert("authorization", "bearer secret-1".parse().unwrap());
    c.report_cache_state(good)
        .await
        .expect("a valid token is accepted");
    let r = lookup(&mut c, exact("t", b"p")).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH", "consumer RPCs need no token");
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await;
    assert!(state.is_ok());
    let (code, logs) = terminate(server).await;
    assert_eq!(code, 0);
    assert!(!logs.contains("secret-1"), "tokens are never logged");
}

#[tokio::test]
async fn sv11_json_logs_and_graceful_shutdown() {
    let dir = temp_dir("process-sv11");
    let server = ServerProcess::start(&dir, &[]);
    server.wait_ready().await;
    let mut c = server.client().await;
    let _ = c.lookup_route(exact("t", b"secret-prefix")).await.unwrap();
    let (code, logs) = terminate(server).await;
    assert_eq!(code, 0, "{logs}");
    let records: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for r in &records {
        let obj = r.as_object().unwrap();
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        assert!(
            keys.contains(&"time") && keys.contains(&"level") && keys.contains(&"msg"),
            "{r}"
        );
    }
    let msgs: Vec<&str> = records.iter().map(|r| r["msg"].as_str().unwrap()).collect();
    let started = msgs
        .iter()
        .position(|m| *m == "graceful_shutdown_started")
        .expect("started logged");
    let done = msgs
        .iter()
        .position(|m| *m == "graceful_shutdown_done")
        .expect("done logged");
    assert!(started < done);
    assert!(msgs.contains(&"startup"));
    assert!(
        !logs.contains("secret-prefix") && !logs.contains("prefix_hash"),
        "no payload in logs"
    );
}
