//! The outbox: records this server accepted, waiting to be published to the stream.
//!
//! Producer RPCs never wait on NATS: a record goes into a bounded queue and the RPC is acked.
//! One publisher task drains the queue into batches of at most [`MAX_BATCH_BYTES`], publishes
//! them with a message id (`origin:epoch:seq`) and keeps a window of acks in flight. A failed
//! publish (NATS down, a timeout) is retried with the same ids, in order, from the first batch
//! not acked, so the stream's dedup window drops any copy that did land, and one server's
//! records keep their order. While NATS is away the queue fills; records beyond
//! `--nats-buffer` are dropped and counted (every server then lacks them alike: the stream is
//! still the one history).

use super::Counters;
use super::record::{Batch, MAX_BATCH_BYTES, Record};
use async_nats::jetstream;
use prost::Message;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tracing::warn;

/// Acks awaited at once (pipelined publishes).
const IN_FLIGHT: usize = 32;
/// First retry delay after a failed publish (doubles up to [`RETRY_MAX`]).
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// The bounded queue of records (shared by the RPC handlers and the publisher).
pub struct Outbox {
    queue: parking_lot::Mutex<VecDeque<Record>>,
    capacity: usize,
    wake: tokio::sync::Notify,
    counters: Arc<Counters>,
}

impl Outbox {
    pub fn new(capacity: usize, counters: Arc<Counters>) -> Self {
        Self {
            queue: parking_lot::Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
            wake: tokio::sync::Notify::new(),
            counters,
        }
    }

    /// Queues `record`, or drops and counts it when the queue is full.
    pub fn push(&self, record: Record) {
        {
            let mut q = self.queue.lock();
            if q.len() >= self.capacity {
                drop(q);
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.push_back(record);
            self.counters
                .buffered
                .store(q.len() as u64, Ordering::Relaxed);
        }
        self.wake.notify_one();
    }

    /// Records waiting.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// No record waiting.
    pub fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Takes records for one batch (at most `MAX_BATCH_BYTES` encoded, at least one).
    fn take_batch(&self) -> Vec<Record> {
        let mut q = self.queue.lock();
        let mut out = Vec::new();
        let mut size = 0usize;
        while let Some(r) = q.front() {
            let len = r.encoded_len() + 8;
            if !out.is_empty() && size + len > MAX_BATCH_BYTES {
                break;
            }
            size += len;
            if let Some(r) = q.pop_front() {
                out.push(r);
            }
        }
        self.counters
            .buffered
            .store(q.len() as u64, Ordering::Relaxed);
        out
    }

    /// Publishes forever (spawned once per process).
    pub async fn run(
        self: Arc<Self>,
        js: jetstream::Context,
        subject: String,
        origin: String,
        epoch: u64,
    ) {
        let mut next_seq = 1u64;
        // Published, not yet acked, oldest first.
        let mut pending: VecDeque<(Batch, Vec<u8>, jetstream::context::PublishAckFuture)> =
            VecDeque::new();
        // Batches to publish again after a failure, oldest first.
        let mut retry: VecDeque<(Batch, Vec<u8>)> = VecDeque::new();
        let mut delay = RETRY_MIN;
        loop {
            // Refill the window: retries first (their order), then new records.
            while pending.len() < IN_FLIGHT {
                let (batch, bytes) = if let Some(b) = retry.pop_front() {
                    b
                } else {
                    let records = self.take_batch();
                    if records.is_empty() {
                        break;
                    }
                    let batch = Batch {
                        origin: origin.clone(),
                        epoch,
                        seq: next_seq,
                        records,
                    };
                    next_seq += 1;
                    let bytes = batch.encode_to_vec();
                    (batch, bytes)
                };
                let publish = jetstream::message::PublishMessage::build()
                    .payload(bytes.clone().into())
                    .message_id(batch.message_id());
                match js.send_publish(subject.clone(), publish).await {
                    Ok(ack) => {
                        self.counters
                            .in_flight
                            .fetch_add(batch.records.len() as u64, Ordering::Relaxed);
                        pending.push_back((batch, bytes, ack));
                    }
                    Err(err) => {
                        if matches!(
                            err.kind(),
                            jetstream::context::PublishErrorKind::MaxPayloadExceeded
                        ) {
                            warn!(err = %err, records = batch.records.len(), "replication_batch_too_large");
                            self.counters
                                .dropped
                                .fetch_add(batch.records.len() as u64, Ordering::Relaxed);
                            continue;
                        }
                        self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                        retry.push_front((batch, bytes));
                        break;
                    }
                }
            }
            if pending.is_empty() {
                if !retry.is_empty() {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                    continue;
                }
                self.wake.notified().await;
                continue;
            }
            // Await the oldest ack; on failure every batch from it on goes again, in order.
            let Some((batch, bytes, ack)) = pending.pop_front() else {
                continue;
            };
            self.counters
                .in_flight
                .fetch_sub(batch.records.len() as u64, Ordering::Relaxed);
            match ack.await {
                Ok(_) => {
                    delay = RETRY_MIN;
                    self.counters
                        .published
                        .fetch_add(batch.records.len() as u64, Ordering::Relaxed);
                }
                Err(err) => {
                    self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(err = %err, batch = %batch.message_id(), "replication_publish_failed");
                    let mut again: VecDeque<(Batch, Vec<u8>)> = VecDeque::new();
                    again.push_back((batch, bytes));
                    // The later acks may still arrive; their batches are retried anyway
                    // (deduplicated by id if they landed).
                    for (b, by, _) in pending.drain(..) {
                        self.counters
                            .in_flight
                            .fetch_sub(b.records.len() as u64, Ordering::Relaxed);
                        again.push_back((b, by));
                    }
                    again.extend(retry.drain(..));
                    retry = again;
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    }
}
