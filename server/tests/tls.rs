//! gRPC TLS, hot reload and mutual TLS with certificates generated in the test (SV15–SV17).

mod common;

use common::{TestServer, manual_state};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_server::state::ServerOptions;
use inferencecache_server::tls::{TlsFiles, server_config};
use inferencecache_test_ca::Ca;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// A fresh directory for one TLS test.
fn temp_dir(name: &str) -> PathBuf {
    common::temp_dir(&format!("tls-{name}"))
}

/// Writes a serving pair into `dir` as `cert.pem` / `key.pem` and names the files, with
/// `client_ca` set for mutual TLS.
fn write_pair(dir: &Path, (cert, key): &(String, String), client_ca: Option<PathBuf>) -> TlsFiles {
    let files = TlsFiles {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
        client_ca,
    };
    std::fs::write(&files.cert, cert).unwrap();
    std::fs::write(&files.key, key).unwrap();
    files
}

fn write_newer(path: &Path, contents: &str) {
    std::fs::write(path, contents).unwrap();
    // Make the change visible to an mtime check even on coarse-grained file systems.
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() + Duration::from_secs(5))
        .unwrap();
}

async fn tls_client(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    identity: Option<(&str, &str)>,
) -> Result<InferenceCacheClient<Channel>, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(InferenceCacheClient::new(channel))
}

async fn works(client: Result<InferenceCacheClient<Channel>, String>) -> bool {
    let Ok(mut client) = client else { return false };
    client
        .lookup_route(pb::LookupRouteRequest {
            model_id: "m".into(),
            ..Default::default()
        })
        .await
        .is_ok_and(|r| r.into_inner().reason_code == "NO_HINT")
}

async fn start(files: &TlsFiles) -> TestServer {
    let options = ServerOptions {
        tls: Some(server_config(files).expect("tls config")),
        ..Default::default()
    };
    TestServer::start_with(manual_state(options).0).await
}

#[tokio::test]
async fn sv15_tls_serves_verifying_clients_and_refuses_plaintext() {
    let dir = temp_dir("sv15");
    let ca = Ca::new("ca-1");
    let files = write_pair(&dir, &ca.leaf(), None);
    let server = start(&files).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(works(tls_client(server.grpc, &ca.pem(), None).await).await);
    let plaintext = Channel::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await;
    let plaintext_ok = match plaintext {
        Ok(ch) => InferenceCacheClient::new(ch)
            .lookup_route(pb::LookupRouteRequest::default())
            .await
            .is_ok(),
        Err(_) => false,
    };
    assert!(
        !plaintext_ok,
        "a plaintext client must fail against the TLS port"
    );
    let (_, _, metrics) = common::http_request(server.http, "GET", "/metrics", "").await;
    assert!(metrics.contains("inferencecache_server_grpc_tls_enabled 1\n"));
    server.shutdown().await;
}

#[tokio::test]
async fn sv16_certificate_hot_reload_and_corrupt_rewrite() {
    let dir = temp_dir("sv16");
    let (ca1, ca2) = (Ca::new("ca-1"), Ca::new("ca-2"));
    let files = write_pair(&dir, &ca1.leaf(), None);
    let server = start(&files).await;
    assert!(works(tls_client(server.grpc, &ca1.pem(), None).await).await);
    let (cert2, key2) = ca2.leaf();
    std::fs::write(&files.key, &key2).unwrap();
    write_newer(&files.cert, &cert2);
    assert!(
        works(tls_client(server.grpc, &ca2.pem(), None).await).await,
        "next handshake serves the new pair"
    );
    assert!(!works(tls_client(server.grpc, &ca1.pem(), None).await).await);
    // A corrupt rewrite keeps the last good pair.
    let f = std::fs::File::options()
        .write(true)
        .truncate(true)
        .open(&files.cert)
        .unwrap();
    f.set_modified(SystemTime::now() + Duration::from_secs(60))
        .unwrap();
    drop(f);
    assert!(works(tls_client(server.grpc, &ca2.pem(), None).await).await);
    server.shutdown().await;
}

#[tokio::test]
async fn sv17_mutual_tls() {
    let dir = temp_dir("sv17");
    let (ca, other) = (Ca::new("ca"), Ca::new("other"));
    let ca_file = dir.join("clients.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let files = write_pair(&dir, &ca.leaf(), Some(ca_file));
    let server = start(&files).await;
    assert!(
        !works(tls_client(server.grpc, &ca.pem(), None).await).await,
        "no client certificate"
    );
    let (bad_cert, bad_key) = other.leaf();
    assert!(
        !works(tls_client(server.grpc, &ca.pem(), Some((&bad_cert, &bad_key))).await).await,
        "foreign CA"
    );
    let (good_cert, good_key) = ca.leaf();
    assert!(works(tls_client(server.grpc, &ca.pem(), Some((&good_cert, &good_key))).await).await);
    server.shutdown().await;
}

#[test]
fn unloadable_files_are_errors() {
    let dir = temp_dir("bad");
    let files = TlsFiles {
        cert: dir.join("missing.pem"),
        key: dir.join("missing-key.pem"),
        client_ca: None,
    };
    assert!(server_config(&files).is_err());
    std::fs::write(dir.join("garbage.pem"), "not a certificate").unwrap();
    let files = TlsFiles {
        cert: dir.join("garbage.pem"),
        key: dir.join("garbage.pem"),
        client_ca: None,
    };
    assert!(server_config(&files).is_err());
}
