//! The outbox: records this server accepted, waiting to be published to the stream.
//!
//! Producer RPCs never wait on NATS: a record goes into a bounded queue and the RPC is acked.
//! One publisher task drains the queue into batches of at most [`MAX_BATCH_BYTES`], publishes
//! them with a message id (`origin:epoch:seq`) and keeps a window of acks in flight. A failed
//! publish (NATS down, a timeout) is retried with the same ids, in order, from the first batch
//! not acked, so the stream's dedup window drops any copy that did land, and one server's
//! records keep their order. A producer faster than the stream waits for room in the queue
//! (backpressure, nothing lost). While NATS is away the queue fills and records beyond
//! `--nats-buffer` are dropped and counted, so producers keep being acked (every server then
//! lacks those records alike: the stream is still the one history).

use super::counters::Counters;
use super::record::{Batch, MAX_BATCH_BYTES, Record};
use async_nats::jetstream;
use bytes::Bytes;
use prost::Message;
use std::collections::VecDeque;
use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::warn;

/// The outbox room a batch's records hold until it is acked.
type Room = Vec<OwnedSemaphorePermit>;

/// An ack on its way.
type AckFuture = <jetstream::context::PublishAckFuture as IntoFuture>::IntoFuture;

/// Acks awaited at once (pipelined publishes).
const IN_FLIGHT: usize = 32;
/// First retry delay after a failed publish (doubles up to [`RETRY_MAX`]).
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// The bounded queue of records (shared by the RPC handlers and the publisher).
pub struct Outbox {
    /// Records with the room they hold (producers' records hold one unit of `room`).
    queue: parking_lot::Mutex<VecDeque<(Record, Option<OwnedSemaphorePermit>)>>,
    wake: tokio::sync::Notify,
    /// `--nats-buffer` units of room: a producer's record holds one from its push until its
    /// batch is acked by the stream.
    room: Arc<Semaphore>,
    counters: Arc<Counters>,
}

impl Outbox {
    pub fn new(capacity: usize, counters: Arc<Counters>) -> Self {
        Self {
            queue: parking_lot::Mutex::new(VecDeque::new()),
            wake: tokio::sync::Notify::new(),
            room: Arc::new(Semaphore::new(capacity.clamp(1, Semaphore::MAX_PERMITS))),
            counters,
        }
    }

    /// Queues a producer's `record`. While NATS is connected a full queue makes the caller
    /// wait for room (the producer is slowed, as by HTTP/2 flow control, and nothing is lost);
    /// while it is not, a full queue drops the record and counts it (the outage bound).
    pub async fn push(&self, record: Record) {
        let permit = loop {
            if !self.counters.connected.load(Ordering::Relaxed) {
                match self.room.clone().try_acquire_owned() {
                    Ok(permit) => break permit,
                    Err(_) => {
                        self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
            // Re-checked at least every 100 ms, so a disconnection while waiting turns into a
            // drop, not a stall.
            let acquire = self.room.clone().acquire_owned();
            match tokio::time::timeout(Duration::from_millis(100), acquire).await {
                Ok(Ok(permit)) => break permit,
                Ok(Err(_closed)) => return,
                Err(_elapsed) => continue,
            }
        };
        self.enqueue(record, Some(permit));
    }

    fn enqueue(&self, record: Record, permit: Option<OwnedSemaphorePermit>) {
        let mut q = self.queue.lock();
        q.push_back((record, permit));
        self.counters
            .buffered
            .store(q.len() as u64, Ordering::Relaxed);
        drop(q);
        self.wake.notify_one();
    }

    /// Queues a record this server decided (evictions, credits) without waiting: they are
    /// bounded by the records that caused them, and dropping one would let servers diverge.
    pub fn push_decided(&self, record: Record) {
        self.enqueue(record, None);
    }

    /// Records waiting.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// No record waiting.
    pub fn is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Takes records for one batch (at most `MAX_BATCH_BYTES` encoded, at least one), with
    /// the room they hold: it is given back once the batch is acked.
    fn take_batch(&self) -> (Vec<Record>, Vec<OwnedSemaphorePermit>) {
        let mut q = self.queue.lock();
        let mut out = Vec::new();
        let mut room = Vec::new();
        let mut size = 0usize;
        while let Some((r, _)) = q.front() {
            let len = r.encoded_len() + 8;
            if !out.is_empty() && size + len > MAX_BATCH_BYTES {
                break;
            }
            size += len;
            if let Some((r, permit)) = q.pop_front() {
                out.push(r);
                room.extend(permit);
            }
        }
        self.counters
            .buffered
            .store(q.len() as u64, Ordering::Relaxed);
        (out, room)
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
        let mut pending: VecDeque<(Batch, Bytes, Room, AckFuture)> = VecDeque::new();
        // Batches to publish again after a failure, oldest first.
        let mut retry: VecDeque<(Batch, Bytes, Room)> = VecDeque::new();
        let mut delay = RETRY_MIN;
        loop {
            // Fill the window: retries first (their order), then new records.
            let mut failed = false;
            while pending.len() < IN_FLIGHT {
                let (batch, bytes, room) = if let Some(b) = retry.pop_front() {
                    b
                } else {
                    let (records, room) = self.take_batch();
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
                    let bytes = Bytes::from(batch.encode_to_vec());
                    (batch, bytes, room)
                };
                let publish = jetstream::message::PublishMessage::build()
                    .payload(bytes.clone())
                    .message_id(batch.message_id());
                match js.send_publish(subject.clone(), publish).await {
                    Ok(ack) => {
                        self.counters
                            .in_flight
                            .fetch_add(batch.records.len() as u64, Ordering::Relaxed);
                        pending.push_back((batch, bytes, room, ack.into_future()));
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
                        retry.push_front((batch, bytes, room));
                        failed = true;
                        break;
                    }
                }
            }
            let room_in_window = pending.len() < IN_FLIGHT && !failed;
            let Some((_, _, _, oldest)) = pending.front_mut() else {
                if failed || !retry.is_empty() {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                } else {
                    self.wake.notified().await;
                }
                continue;
            };
            // Wait for the oldest ack, or for new records while the window has room.
            let outcome = if room_in_window {
                tokio::select! {
                    ack = oldest.as_mut() => Some(ack),
                    _ = self.wake.notified() => None,
                }
            } else {
                Some(oldest.as_mut().await)
            };
            let Some(outcome) = outcome else { continue };
            let Some((batch, bytes, room, _)) = pending.pop_front() else {
                continue;
            };
            self.counters
                .in_flight
                .fetch_sub(batch.records.len() as u64, Ordering::Relaxed);
            match outcome {
                Ok(_) => {
                    // The batch is in the stream: its records' room goes back.
                    drop(room);
                    delay = RETRY_MIN;
                    self.counters
                        .published
                        .fetch_add(batch.records.len() as u64, Ordering::Relaxed);
                }
                Err(err) => {
                    self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(err = %err, batch = %batch.message_id(), "replication_publish_failed");
                    // Every batch from this one on goes again, in order (the later acks may
                    // still arrive; a batch that landed is deduplicated by its id).
                    let mut again: VecDeque<(Batch, Bytes, Room)> = VecDeque::new();
                    again.push_back((batch, bytes, room));
                    for (b, by, ro, _) in pending.drain(..) {
                        self.counters
                            .in_flight
                            .fetch_sub(b.records.len() as u64, Ordering::Relaxed);
                        again.push_back((b, by, ro));
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
