//! ZMQ subscriber (spec `sidecar.md` §3): dial retry before the publisher exists, multipart
//! frames, topic filtering, the resync after every (re)connect, sequence gaps and restarts
//! without a replay endpoint, cancellation. The replay paths run against the engines' own
//! publishers in `engines.rs`.

mod common;

use bytes::Bytes;
use common::free_port;
use inferencecache_sidecar::fake_engine::Plan;
use inferencecache_sidecar::reporter::Input;
use inferencecache_sidecar::subscriber::{SubscriberConfig, run};
use inferencecache_sidecar::telemetry::{ResyncReason, Telemetry};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::mpsc::Receiver;
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

/// Waits for the next input.
async fn next(rx: &mut Receiver<Input>) -> Input {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("an input in time")
        .expect("channel open")
}

/// Publishes sequence `seq` until the subscriber forwards something (slow-joiner safe); returns
/// what it forwarded first and the next unused sequence.
async fn publish_until_forwarded(
    publ: &mut PubSocket,
    rx: &mut Receiver<Input>,
    payload: &[u8],
    mut seq: u64,
) -> (Input, u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        // A message on another topic is filtered out by the subscription.
        publ.send(msg("other-topic", seq, &[0xc1])).await.unwrap();
        publ.send(msg("kv-events", seq, payload)).await.unwrap();
        seq += 1;
        if let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(100), rx.recv()).await {
            return (b, seq);
        }
        assert!(tokio::time::Instant::now() < deadline, "nothing forwarded");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dial_retry_resync_on_every_connect_sequence_checks_and_cancel() {
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    let telemetry = Arc::new(Telemetry::default());
    let mut cfg = SubscriberConfig::new(endpoint.clone(), "kv-events");
    cfg.telemetry = Arc::clone(&telemetry);
    let cancel = CancellationToken::new();
    // Start the subscriber before anything listens.
    let task = tokio::spawn(run(cfg, tx, cancel.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let payload = Plan::new(4, 2, 2, 0, false).unwrap().payload();

    let mut publ = PubSocket::new();
    publ.bind(&endpoint).await.unwrap();
    // The first dial resyncs before anything else is forwarded.
    assert_eq!(next(&mut rx).await, Input::Resync(ResyncReason::Startup));
    let (first, mut seq) = publish_until_forwarded(&mut publ, &mut rx, &payload, 0).await;
    let Input::Batch(b) = first else {
        panic!("{first:?}")
    };
    assert_eq!(b.events.len(), 2);
    assert_eq!(
        telemetry.decode_failures.load(Ordering::Relaxed),
        0,
        "other topic filtered"
    );
    // Late copies of the slow-joiner loop are in order too; drop them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    while let Ok(input) = rx.try_recv() {
        assert!(matches!(input, Input::Batch(_)), "{input:?}");
    }
    // In order: forwarded as is.
    publ.send(msg("kv-events", seq, &payload)).await.unwrap();
    assert!(matches!(next(&mut rx).await, Input::Batch(_)));
    // A gap without a replay endpoint cannot be filled: resync, then the batch.
    seq += 5;
    publ.send(msg("kv-events", seq, &payload)).await.unwrap();
    assert_eq!(
        next(&mut rx).await,
        Input::Resync(ResyncReason::GapUnfillable)
    );
    assert!(matches!(next(&mut rx).await, Input::Batch(_)));
    // The sequence goes backwards: an engine restart.
    publ.send(msg("kv-events", 0, &payload)).await.unwrap();
    assert_eq!(
        next(&mut rx).await,
        Input::Resync(ResyncReason::EngineRestart)
    );
    assert!(matches!(next(&mut rx).await, Input::Batch(_)));
    assert_eq!(telemetry.gaps.load(Ordering::Relaxed), 1);

    // The publisher goes away and comes back on the same port: a reconnect resync.
    drop(publ.close().await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut publ = PubSocket::new();
    publ.bind(&endpoint).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match next(&mut rx).await {
            Input::Resync(ResyncReason::Reconnect) => break,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "no reconnect resync: {other:?}"
            ),
        }
    }
    let (again, _) = publish_until_forwarded(&mut publ, &mut rx, &payload, 0).await;
    assert!(matches!(again, Input::Batch(_)), "{again:?}");

    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("subscriber stops on cancel")
        .unwrap();
    // The sender was dropped: the reporter's input is closed.
    while rx.try_recv().is_ok() {}
    assert!(rx.recv().await.is_none());
}

/// Log lines captured from every thread of this test binary.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silence_after_subscribing_is_warned_with_endpoint_and_topic() {
    let captured = Captured::default();
    let writer = captured.clone();
    let _ = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::WARN)
        .try_init();
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let mut publ = PubSocket::new();
    publ.bind(&endpoint).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    let mut cfg = SubscriberConfig::new(endpoint.clone(), "quiet-topic");
    cfg.silence_warning = Duration::from_millis(200);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run(cfg, tx, cancel.clone()));
    assert_eq!(next(&mut rx).await, Input::Resync(ResyncReason::Startup));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = String::from_utf8_lossy(&captured.0.lock().unwrap()).to_string();
        if text.contains("no_events") {
            break text;
        }
        assert!(tokio::time::Instant::now() < deadline, "no warning: {text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let line = text.lines().find(|l| l.contains("no_events")).unwrap();
    assert!(
        line.contains(&endpoint) && line.contains("quiet-topic"),
        "{line}"
    );
    // Once per subscription.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let text = String::from_utf8_lossy(&captured.0.lock().unwrap()).to_string();
    assert_eq!(text.matches("no_events").count(), 1, "{text}");
    cancel.cancel();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_batches_are_counted_and_skipped() {
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    let mut cfg = SubscriberConfig::new(endpoint.clone(), "");
    let telemetry = Arc::clone(&cfg.telemetry);
    cfg.silence_warning = Duration::from_millis(50);
    let cancel = CancellationToken::new();
    let mut publ = PubSocket::new();
    publ.bind(&endpoint).await.unwrap();
    let task = tokio::spawn(run(cfg, tx, cancel.clone()));
    assert_eq!(next(&mut rx).await, Input::Resync(ResyncReason::Startup));
    let payload = Plan::new(4, 1, 1, 0, false).unwrap().payload();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut seq = 0;
    loop {
        publ.send(msg("t", seq, &[0xc1])).await.unwrap();
        publ.send(msg("t", seq + 1, &payload)).await.unwrap();
        seq += 2;
        if let Ok(Some(Input::Batch(_))) =
            tokio::time::timeout(Duration::from_millis(100), rx.recv()).await
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "nothing forwarded");
    }
    // The subscription may have joined between the two sends of a pair (PUB drops what it
    // sends before a subscriber joins), so the pair that got through may have lost its
    // undecodable half. Now that the subscriber is joined, one more pair arrives whole and in
    // order: its undecodable batch is counted and skipped, the valid one after it forwarded.
    publ.send(msg("t", seq, &[0xc1])).await.unwrap();
    publ.send(msg("t", seq + 1, &payload)).await.unwrap();
    loop {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Input::Batch(_))) => break,
            Ok(Some(_)) => continue,
            other => panic!("the valid batch after the undecodable one: {other:?}"),
        }
    }
    assert!(telemetry.decode_failures.load(Ordering::Relaxed) >= 1);
    cancel.cancel();
    task.await.unwrap();
}
