//! Backpressure that never drops (`docs/robustness.md`, Limits): a producer over its rate, or
//! faster than ingest, is slowed by HTTP/2 flow control and keeps its connection. Every update
//! it sent is applied, every Ack is `accepted: true`, and the server never sends GOAWAY.
//!
//! The client is a raw HTTP/2 client (the `h2` crate) that writes every gRPC message as its own
//! DATA frame, as grpcio and a paced tonic client do: small frames are what h2's framing budget
//! counts, so a client that batched messages into large frames would not exercise it.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::manual_state;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_server::limits::Limits;
use inferencecache_server::state::{AppState, ServerOptions};
use prost::Message as _;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

const REPORT_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/ReportCacheState";

/// A server with the given producer rate on loopback; returns the state and the gRPC address.
async fn start(blocks_per_sec: u64) -> (AppState, std::net::SocketAddr) {
    let (state, _) = manual_state(ServerOptions {
        limits: Limits {
            producer_max_blocks_per_sec: blocks_per_sec,
            ..Limits::default()
        },
        ..Default::default()
    });
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    tokio::spawn(inferencecache_server::serve(
        state.clone(),
        grpc,
        http,
        std::future::pending(),
    ));
    (state, addr)
}

/// A gRPC length-prefixed message.
fn frame(update: &pb::CacheStateUpdate) -> Bytes {
    let body = update.encode_to_vec();
    let mut out = BytesMut::with_capacity(5 + body.len());
    out.put_u8(0);
    out.put_u32(u32::try_from(body.len()).unwrap());
    out.put_slice(&body);
    out.freeze()
}

/// A small update: one legacy key, unique per `(stream, i)`: 30 bytes, a 35-byte DATA frame.
fn small(stream: usize, i: usize) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            prefix_hash: ((stream as u64) << 32 | i as u64).to_be_bytes().to_vec(),
            token_count: 16,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A large update: one chain of `blocks` 8-byte blocks, unique per `(stream, i)`.
fn large(stream: usize, i: usize, blocks: usize) -> pb::CacheStateUpdate {
    let base = ((stream as u64) << 48) | ((i as u64) << 24);
    pb::CacheStateUpdate {
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: (0..blocks as u64)
                .map(|b| (base | b).to_be_bytes().to_vec())
                .collect(),
            block_token_counts: (1..=blocks as i32).map(|b| b * 16).collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// What one stream ended with.
#[derive(Debug)]
struct StreamEnd {
    grpc_status: Option<String>,
    ack: Option<pb::Ack>,
}

/// Sends `streams` concurrent ReportCacheState streams on ONE HTTP/2 connection, each message
/// in its own DATA frame, and waits for every answer. Panics if the connection fails (a
/// GOAWAY with an error code ends it with an error).
async fn report_raw(
    addr: std::net::SocketAddr,
    streams: Vec<Vec<pb::CacheStateUpdate>>,
) -> Vec<StreamEnd> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut tasks = Vec::new();
    for updates in streams {
        let mut client = client.clone().ready().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let request = http::Request::builder()
                .method("POST")
                .uri(format!("http://test{REPORT_PATH}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
            let (response, mut send) = client
                .send_request(request, false)
                .map_err(|e| e.to_string())?;
            for update in &updates {
                // h2 queues what the window does not allow yet and sends it as the server
                // releases capacity: each call stays one DATA frame (split only if larger than
                // the frame size), never merged with the next.
                send.send_data(frame(update), false)
                    .map_err(|e| format!("send: {e}"))?;
                // Let the connection task write between messages, as a real producer that
                // produces messages one by one does.
                tokio::task::yield_now().await;
            }
            send.send_data(Bytes::new(), true)
                .map_err(|e| format!("end: {e}"))?;
            let response = response.await.map_err(|e| format!("headers: {e}"))?;
            let mut body = response.into_body();
            let mut data = BytesMut::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.map_err(|e| format!("body: {e}"))?;
                let _ = body.flow_control().release_capacity(chunk.len());
                data.extend_from_slice(&chunk);
            }
            let trailers = body
                .trailers()
                .await
                .map_err(|e| format!("trailers: {e}"))?;
            let grpc_status = trailers
                .as_ref()
                .and_then(|t| t.get("grpc-status"))
                .map(|v| v.to_str().unwrap().to_string());
            let ack = (data.len() >= 5).then(|| pb::Ack::decode(&data[5..]).unwrap());
            Ok::<_, String>(StreamEnd { grpc_status, ack })
        }));
    }
    let mut ends = Vec::new();
    for t in tasks {
        ends.push(t.await.expect("stream task"));
    }
    drop(client);
    // The connection ends cleanly once the client lets go: no GOAWAY with an error code. A
    // GOAWAY ends it with the server's reason, reported before the streams' own errors.
    connection
        .await
        .unwrap()
        .expect("the connection ends without an error (no GOAWAY)");
    ends.into_iter()
        .map(|end| end.expect("the stream completes"))
        .collect()
}

fn assert_all_accepted(ends: &[StreamEnd]) {
    for end in ends {
        assert_eq!(end.grpc_status.as_deref(), Some("0"), "{end:?}");
        let ack = end.ack.as_ref().expect("an Ack");
        assert!(ack.accepted, "{end:?}");
        assert_eq!(ack.reason_code, "", "{end:?}");
        assert_eq!(ack.server_instance_id.len(), 32, "{end:?}");
    }
}

/// The repro: `--producer-max-blocks-per-sec 2000`, 20,000 small updates on one stream.
/// The bucket holds one second, so the last update is applied after ~9 s, and the producer must
/// have been slowed (not cut off) all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_messages_on_one_stream_are_all_applied_at_the_producer_rate() {
    let (state, addr) = start(2_000).await;
    let updates: Vec<_> = (0..20_000).map(|i| small(0, i)).collect();
    // Under h2's 256-byte small-frame threshold, above the 32 bytes the windows are sized for.
    assert_eq!(frame(&updates[0]).len(), 35);
    let started = Instant::now();
    let ends = report_raw(addr, vec![updates]).await;
    let took = started.elapsed();
    assert_all_accepted(&ends);
    assert_eq!(state.index().storage_entries(), 20_000);
    assert_eq!(state.index().ingest_blocks_total(), 20_000);
    assert!(
        took >= Duration::from_secs(8),
        "20,000 blocks at 2,000/s with a one-second bucket take ≥ 9 s, took {took:?}"
    );
    assert!(state.metrics().limits.throttled() > 0);
    eprintln!("backpressure: 20,000 small updates at 2,000 blocks/s applied in {took:?}");
}

/// Many streams of small messages on one connection, all over the rate: every one applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_messages_on_many_streams_are_all_applied() {
    let (state, addr) = start(4_000).await;
    let streams: Vec<Vec<_>> = (0..8)
        .map(|s| (0..2_500).map(|i| small(s, i)).collect())
        .collect();
    let ends = report_raw(addr, streams).await;
    assert_eq!(ends.len(), 8);
    assert_all_accepted(&ends);
    assert_eq!(state.index().storage_entries(), 20_000);
    assert!(state.metrics().limits.throttled() > 0);
}

/// Large messages (a 1,000-block chain, ~12 KB each, several DATA frames) over the rate, one
/// stream and many: 110,000 blocks at 20,000/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_on_one_and_many_streams_are_all_applied() {
    let (state, addr) = start(20_000).await;
    let one: Vec<_> = (0..50).map(|i| large(0, i, 1_000)).collect();
    let ends = report_raw(addr, vec![one]).await;
    assert_all_accepted(&ends);
    assert_eq!(state.index().storage_entries(), 50_000);

    let many: Vec<Vec<_>> = (1..=4)
        .map(|s| (0..15).map(|i| large(s, i, 1_000)).collect())
        .collect();
    let ends = report_raw(addr, many).await;
    assert_eq!(ends.len(), 4);
    assert_all_accepted(&ends);
    assert_eq!(state.index().storage_entries(), 110_000);
    assert!(state.metrics().limits.throttled() > 0);
}

/// No rate limit, but a producer far faster than ingest: the same flow control holds it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_faster_than_ingest_keeps_its_connection() {
    let (state, addr) = start(0).await;
    let streams: Vec<Vec<_>> = (0..4)
        .map(|s| (0..25_000).map(|i| small(s, i)).collect())
        .collect();
    let ends = report_raw(addr, streams).await;
    assert_all_accepted(&ends);
    assert_eq!(state.index().storage_entries(), 100_000);
}
