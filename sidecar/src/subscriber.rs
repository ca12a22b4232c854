//! ZMQ subscriber (spec `sidecar.md` §3): SUB socket → decoded batches on a bounded channel.

use crate::wire::{EventBatch, decode_batch};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use zeromq::{Socket, SocketRecv, SubSocket, ZmqMessage};

/// Capacity of the subscriber → reporter channel (batches).
pub const CHANNEL_CAPACITY: usize = 256;
/// Pause before redialing after a failure.
pub const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Bound on one dial attempt.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// Subscriber counters (shared with the caller).
#[derive(Debug, Default)]
pub struct SubscriberStats {
    pub messages: AtomicU64,
    pub batches: AtomicU64,
    pub undecodable: AtomicU64,
    pub empty: AtomicU64,
}

/// What to do with one received multipart message.
pub enum Handled {
    Batch(EventBatch),
    Skip,
}

/// Decodes the last frame of a message; counts and logs failures.
pub fn handle_message(msg: &ZmqMessage, stats: &SubscriberStats) -> Handled {
    stats.messages.fetch_add(1, Ordering::Relaxed);
    let Some(last) = msg.iter().last() else {
        stats.empty.fetch_add(1, Ordering::Relaxed);
        return Handled::Skip;
    };
    if last.is_empty() {
        stats.empty.fetch_add(1, Ordering::Relaxed);
        return Handled::Skip;
    }
    match decode_batch(last) {
        Ok(b) => {
            stats.batches.fetch_add(1, Ordering::Relaxed);
            Handled::Batch(b)
        }
        Err(e) => {
            stats.undecodable.fetch_add(1, Ordering::Relaxed);
            warn!(event = "undecodable_batch", err = %e, "skipping undecodable event batch");
            Handled::Skip
        }
    }
}

async fn dial(endpoint: &str, topic: &str) -> Result<SubSocket, String> {
    let mut sock = SubSocket::new();
    match tokio::time::timeout(DIAL_TIMEOUT, sock.connect(endpoint)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("dial timed out".into()),
    }
    sock.subscribe(topic).await.map_err(|e| e.to_string())?;
    Ok(sock)
}

/// Runs until cancelled: dial, subscribe, receive, decode, forward (blocking send). Failures
/// are logged and retried after [`RETRY_DELAY`]. Dropping the sender on return closes the
/// reporter's input.
pub async fn run(
    endpoint: String,
    topic: String,
    tx: mpsc::Sender<EventBatch>,
    stats: Arc<SubscriberStats>,
    cancel: CancellationToken,
) {
    'outer: loop {
        let dialed = tokio::select! {
            _ = cancel.cancelled() => break,
            r = dial(&endpoint, &topic) => r,
        };
        let mut sock = match dialed {
            Ok(s) => s,
            Err(e) => {
                warn!(endpoint = %endpoint, err = %e, "ZMQ dial failed; retrying in 1s");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(RETRY_DELAY) => continue,
                }
            }
        };
        info!(endpoint = %endpoint, topic = %topic, "subscribed to engine KV events");
        loop {
            let msg = tokio::select! {
                _ = cancel.cancelled() => break 'outer,
                m = sock.recv() => m,
            };
            match msg {
                Ok(m) => {
                    if let Handled::Batch(b) = handle_message(&m, &stats) {
                        tokio::select! {
                            _ = cancel.cancelled() => break 'outer,
                            r = tx.send(b) => if r.is_err() { break 'outer },
                        }
                    }
                }
                Err(e) => {
                    warn!(endpoint = %endpoint, err = %e, "ZMQ receive failed; reconnecting in 1s");
                    drop(sock.close().await);
                    tokio::select! {
                        _ = cancel.cancelled() => break 'outer,
                        _ = tokio::time::sleep(RETRY_DELAY) => continue 'outer,
                    }
                }
            }
        }
    }
    info!(endpoint = %endpoint, "subscriber stopped");
}
