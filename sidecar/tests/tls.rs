//! TLS and mutual TLS towards the server (`--server-tls-ca-file`, `--server-tls-cert-file`,
//! `--server-tls-key-file`), against an in-process recording server with certificates made in
//! the test (the TLS half of SC15).

mod common;

use common::{Mode, start_fake_server_with, temp_dir};
use inferencecache_sidecar::client::{GrpcSink, TlsFiles, build_channel};
use inferencecache_sidecar::reporter::{Identity, Reporter, ReporterConfig};
use inferencecache_sidecar::wire::{BlockStored, Event, EventBatch};
use inferencecache_test_ca::Ca;
use std::path::PathBuf;
use tonic::transport::{Certificate, Identity as TlsIdentity, ServerTlsConfig};

fn one_store() -> EventBatch {
    EventBatch {
        ts: 1.0,
        events: vec![Event::BlockStored(BlockStored {
            block_hashes: vec![vec![1]],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            ..BlockStored::default()
        })],
        data_parallel_rank: None,
    }
}

async fn send_one(addr: std::net::SocketAddr, tls: &TlsFiles) -> (u64, u64) {
    let sink = GrpcSink::new(build_channel(&addr.to_string(), tls).unwrap(), None);
    let mut cfg = ReporterConfig::new(Identity::default());
    cfg.block_size = 4;
    let mut r = Reporter::new(cfg, sink);
    r.handle_batch(&one_store()).await;
    r.flush().await;
    (r.counters().updates_sent, r.counters().updates_failed)
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn server_verified_with_ca_file_and_mutual_tls() {
    let dir = temp_dir("tls");
    let server_ca = Ca::new("server-ca");
    let client_ca = Ca::new("client-ca");
    let (srv_cert, srv_key) = server_ca.leaf();
    let (cli_cert, cli_key) = client_ca.leaf();
    let ca_file = write(&dir, "ca.pem", &server_ca.pem());
    let cert_file = write(&dir, "client.pem", &cli_cert);
    let key_file = write(&dir, "client.key", &cli_key);

    // TLS only.
    let (rec, addr) = start_fake_server_with(
        Mode::Ok,
        Some(ServerTlsConfig::new().identity(TlsIdentity::from_pem(&srv_cert, &srv_key))),
    )
    .await;
    let tls = TlsFiles {
        ca_file: Some(ca_file.clone()),
        ..Default::default()
    };
    assert_eq!(send_one(addr, &tls).await, (1, 0));
    assert_eq!(rec.updates().len(), 1);
    // Plaintext against a TLS server fails (logged, not fatal).
    assert_eq!(send_one(addr, &TlsFiles::default()).await, (0, 1));
    // A CA that did not sign the server's certificate fails verification.
    let wrong = write(&dir, "wrong.pem", &client_ca.pem());
    let bad = TlsFiles {
        ca_file: Some(wrong),
        ..Default::default()
    };
    assert_eq!(send_one(addr, &bad).await, (0, 1));

    // Mutual TLS: the server requires a client certificate from client_ca.
    let (rec, addr) = start_fake_server_with(
        Mode::Ok,
        Some(
            ServerTlsConfig::new()
                .identity(TlsIdentity::from_pem(&srv_cert, &srv_key))
                .client_ca_root(Certificate::from_pem(client_ca.pem())),
        ),
    )
    .await;
    let mtls = TlsFiles {
        ca_file: Some(ca_file.clone()),
        cert_file: Some(cert_file),
        key_file: Some(key_file),
    };
    assert_eq!(send_one(addr, &mtls).await, (1, 0));
    assert_eq!(rec.updates().len(), 1);
    assert_eq!(send_one(addr, &tls).await, (0, 1), "no client certificate");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn half_an_identity_is_rejected() {
    let tls = TlsFiles {
        ca_file: None,
        cert_file: Some("c.pem".into()),
        key_file: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(build_channel("127.0.0.1:1", &tls).is_err());
    });
}
