//! ZMQ subscriber (spec `sidecar.md` §3): dial retry before the publisher exists, multipart
//! frames, topic filtering, reconnect after the publisher restarts, cancellation.

mod common;

use bytes::Bytes;
use common::free_port;
use inferencecache_sidecar::fake_engine::Plan;
use inferencecache_sidecar::subscriber::{SubscriberStats, run};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

fn msg(topic: &str, seq: u64, payload: &[u8]) -> ZmqMessage {
    ZmqMessage::try_from(vec![
        Bytes::from(topic.to_string()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::copy_from_slice(payload),
    ])
    .unwrap()
}

/// Publishes until a batch arrives on `rx` (slow-joiner safe).
async fn publish_until_received(
    publ: &mut PubSocket,
    rx: &mut tokio::sync::mpsc::Receiver<inferencecache_sidecar::wire::EventBatch>,
    payload: &[u8],
) -> inferencecache_sidecar::wire::EventBatch {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut seq = 0;
    loop {
        // A message on another topic is filtered out by the subscription.
        publ.send(msg("other-topic", seq, &[0xc1])).await.unwrap();
        publ.send(msg("kv-events", seq, payload)).await.unwrap();
        seq += 1;
        if let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
            return b;
        }
        assert!(tokio::time::Instant::now() < deadline, "no batch received");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dial_retry_receive_reconnect_and_cancel() {
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    let stats = Arc::new(SubscriberStats::default());
    let cancel = CancellationToken::new();
    // Start the subscriber before anything listens.
    let task = tokio::spawn(run(
        endpoint.clone(),
        "kv-events".into(),
        tx,
        stats.clone(),
        cancel.clone(),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let payload = Plan::new(4, 2, 2, 0, false).unwrap().payload();

    let mut publ = PubSocket::new();
    publ.bind(&endpoint).await.unwrap();
    let b = publish_until_received(&mut publ, &mut rx, &payload).await;
    assert_eq!(b.events.len(), 2);
    assert_eq!(
        stats.undecodable.load(Ordering::Relaxed),
        0,
        "other topic filtered"
    );

    // The publisher goes away and comes back on the same port.
    drop(publ.close().await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut publ = PubSocket::new();
    publ.bind(&endpoint).await.unwrap();
    while rx.try_recv().is_ok() {}
    let b = publish_until_received(&mut publ, &mut rx, &payload).await;
    assert_eq!(b.events.len(), 2);

    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("subscriber stops on cancel")
        .unwrap();
    // The sender was dropped: the reporter's input is closed.
    while rx.try_recv().is_ok() {}
    assert!(rx.recv().await.is_none());
}
