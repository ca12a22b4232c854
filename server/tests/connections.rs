//! Connections against the real binary (`docs/robustness.md`, Fault injection): the cap on
//! concurrent gRPC connections, the 10 s HTTP/2 preface deadline, and the order of a graceful
//! stop (health NOT_SERVING and `/readyz` 503 while both still answer, then the drain).

mod common;

use common::{ServerProcess, temp_dir};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Waits until the server closes `stream` (EOF or reset); returns when that happened.
async fn closed_at(mut stream: TcpStream, limit: Duration) -> Option<Instant> {
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(Instant::now()),
            Ok(Ok(_)) => continue, // SETTINGS, GOAWAY: keep reading until the close
            Err(_) => return None,
        }
    }
}

async fn health(addr: u16) -> Result<i32, tonic::Status> {
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let reply = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    Ok(reply.into_inner().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cap_preface_deadline_and_drain_order() {
    let dir = temp_dir("connections");
    let server = ServerProcess::start(
        &dir,
        &["--max-connections", "4", "--drain-notice", "1500ms"],
    );
    let grpc = SocketAddr::from(([127, 0, 0, 1], server.grpc));
    let http = SocketAddr::from(([127, 0, 0, 1], server.http));
    // The start-up probe's connection must be gone first (it held a permit too).
    let open_is = |n: f64| async move {
        let started = Instant::now();
        loop {
            let (_, _, text) = common::http_request(http, "GET", "/metrics", "").await;
            if metric(&text, "inferencecache_grpc_connections_open") == Some(n) {
                return text;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "{text}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // The start-up probe's socket may still wait in the listen backlog: a served health check
    // on a later connection proves the accept loop took it, so the gauge then counts it.
    let started = Instant::now();
    while health(server.grpc).await.ok() != Some(ServingStatus::Serving as i32) {
        assert!(started.elapsed() < Duration::from_secs(10), "never SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = open_is(0.0).await;
    let refused_before = metric(&text, "inferencecache_grpc_connections_refused_total").unwrap();

    // Four connections take the four permits: one speaks HTTP/2, two are silent, one stops
    // halfway through the preface.
    let speaking = TcpStream::connect(grpc).await.unwrap();
    let (h2_client, h2_connection) = h2::client::handshake(speaking).await.unwrap();
    let h2_connection = tokio::spawn(h2_connection);
    let opened = Instant::now();
    let silent: Vec<TcpStream> = vec![
        TcpStream::connect(grpc).await.unwrap(),
        TcpStream::connect(grpc).await.unwrap(),
    ];
    let mut half = TcpStream::connect(grpc).await.unwrap();
    half.write_all(&PREFACE[..10]).await.unwrap();
    // Let the server accept all four before the fifth arrives.
    open_is(4.0).await;
    // The fifth is over the cap: closed at once and counted.
    let refused = TcpStream::connect(grpc).await.unwrap();
    assert!(
        closed_at(refused, Duration::from_secs(2)).await.is_some(),
        "a connection over --max-connections is closed at accept"
    );
    let (_, _, text) = common::http_request(http, "GET", "/metrics", "").await;
    assert_eq!(
        metric(&text, "inferencecache_grpc_connections_refused_total"),
        Some(refused_before + 1.0),
        "{text}"
    );

    // The silent and the half-preface connections are closed 10 s after their accept; the one
    // that completed the preface stays.
    let mut waits: Vec<_> = silent
        .into_iter()
        .chain(std::iter::once(half))
        .map(|s| tokio::spawn(closed_at(s, Duration::from_secs(15))))
        .collect();
    for wait in waits.drain(..) {
        let at = wait.await.unwrap().expect("closed within 15 s");
        let after = at.duration_since(opened);
        assert!(
            after >= Duration::from_millis(9_500) && after <= Duration::from_secs(12),
            "closed {after:?} after the accept, expected at 10 s"
        );
    }
    assert!(
        !h2_connection.is_finished(),
        "a speaking connection is not touched"
    );
    drop(h2_client);

    // Their permits came back: a new client is served.
    assert_eq!(
        health(server.grpc).await.unwrap(),
        ServingStatus::Serving as i32
    );

    // SIGTERM: first the notice, with both listeners answering.
    let channel = server.channel().await;
    let mut checker = HealthClient::new(channel);
    let request = || HealthCheckRequest {
        service: String::new(),
    };
    assert_eq!(
        checker.check(request()).await.unwrap().into_inner().status,
        ServingStatus::Serving as i32
    );
    server.sigterm();
    let signalled = Instant::now();
    let (mut saw_not_serving, mut saw_readyz_503) = (false, false);
    while !(saw_not_serving && saw_readyz_503) {
        assert!(
            signalled.elapsed() < Duration::from_millis(1_500),
            "within the notice: NOT_SERVING {saw_not_serving}, /readyz 503 {saw_readyz_503}\n{}",
            server.logs()
        );
        let status = checker
            .check(request())
            .await
            .expect("gRPC health answers during the notice")
            .into_inner()
            .status;
        saw_not_serving |= status == ServingStatus::NotServing as i32;
        let (code, _, _) = common::http_request(http, "GET", "/readyz", "").await;
        assert!(code == 200 || code == 503, "/readyz answers: {code}");
        saw_readyz_503 |= code == 503;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new connection is still accepted and told NOT_SERVING during the notice.
    assert_eq!(
        health(server.grpc).await.unwrap(),
        ServingStatus::NotServing as i32
    );
    drop(checker);
    let (code, logs) = server.wait().await;
    assert_eq!(code, Some(0), "{logs}");
    assert!(
        signalled.elapsed() >= Duration::from_millis(1_500),
        "the drain starts after the notice"
    );
    let started = logs.find("graceful_shutdown_started").expect("started");
    let done = logs.find("graceful_shutdown_done").expect("done");
    assert!(started < done, "{logs}");
}
