//! Applying the stream: one thread owns every change to the index in replicated mode.
//!
//! The [`Consumer`] task reads the stream with an ordered consumer from the sequence after the
//! last one applied and hands each message to the apply thread ([`spawn`]), which applies its
//! records in order and then records the sequence. Checkpoint cuts, digests and bootstraps run
//! on the same thread between two messages, so each sees the index exactly at one stream
//! sequence.
//!
//! **Contiguity.** Stream sequences have no holes but those trimming makes at the head. A
//! message whose sequence is not the next one means the records in between are gone: the
//! server re-bootstraps from the newest checkpoint that the stream still continues.

use super::counters::Counters;
use super::decisions::{Decisions, install_decisions};
use super::record::{Batch, Body, Record};
use super::stores::Stores;
use crate::core::Core;
use futures_util::StreamExt;
use inferencecache_engine::IndexDigest;
use inferencecache_engine::checkpoint::{read, write};
use prost::Message;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, info, warn};

/// Messages queued for the apply thread at most (the consumer waits beyond).
const QUEUE: usize = 256;
/// Blob name of the policy layer inside a checkpoint (same as warm restart).
const POLICY_BLOB: &str = crate::checkpoint::POLICY_BLOB;

/// The index's digest at one applied sequence (`GET /digest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DigestAt {
    pub stream_seq: u64,
    pub digest: IndexDigest,
}

/// A checkpoint cut on the apply thread.
pub struct Cut {
    pub stream_seq: u64,
    pub bytes: Vec<u8>,
    pub entries: u64,
}

enum Command {
    Apply {
        seq: u64,
        published_us: i64,
        batch: Batch,
    },
    Skip {
        seq: u64,
    },
    Checkpoint(oneshot::Sender<anyhow::Result<Cut>>),
    Digest(oneshot::Sender<DigestAt>),
    Bootstrap {
        checkpoint: Option<Vec<u8>>,
        start_after: u64,
        reply: oneshot::Sender<anyhow::Result<u64>>,
    },
}

/// Commands to the apply thread.
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Command>,
}

impl Handle {
    async fn send(&self, c: Command) -> bool {
        self.tx.send(c).await.is_ok()
    }

    pub async fn digest(&self) -> Option<DigestAt> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Digest(tx)).await.then_some(())?;
        rx.await.ok()
    }

    pub async fn checkpoint(&self) -> anyhow::Result<Cut> {
        let (tx, rx) = oneshot::channel();
        if !self.send(Command::Checkpoint(tx)).await {
            anyhow::bail!("the apply thread stopped");
        }
        rx.await?
    }

    /// Empties the index, loads `checkpoint` (if any) and returns the sequence now applied
    /// (the checkpoint's, else `start_after`).
    pub async fn bootstrap(
        &self,
        checkpoint: Option<Vec<u8>>,
        start_after: u64,
    ) -> anyhow::Result<u64> {
        let (tx, rx) = oneshot::channel();
        if !self
            .send(Command::Bootstrap {
                checkpoint,
                start_after,
                reply: tx,
            })
            .await
        {
            anyhow::bail!("the apply thread stopped");
        }
        rx.await?
    }
}

/// Starts the apply thread of `state`.
pub fn spawn(
    state: Core,
    counters: Arc<Counters>,
    decisions: Arc<Decisions>,
) -> anyhow::Result<Handle> {
    let (tx, mut rx) = mpsc::channel::<Command>(QUEUE);
    install_decisions(&state, decisions.clone());
    std::thread::Builder::new()
        .name("replication-apply".into())
        .spawn(move || {
            while let Some(command) = rx.blocking_recv() {
                run_command(&state, &counters, command);
                decisions.flush();
            }
        })?;
    Ok(Handle { tx })
}

fn run_command(state: &Core, counters: &Counters, command: Command) {
    match command {
        Command::Apply {
            seq,
            published_us,
            batch,
        } => {
            for record in &batch.records {
                apply_record(state, record);
            }
            counters.applied_seq.store(seq, Ordering::Release);
            let lag = (now_us() - published_us).max(0) as u64;
            let behind = counters.stream_last_seq.load(Ordering::Relaxed) > seq;
            counters
                .lag_seconds_micros
                .store(if behind { lag } else { 0 }, Ordering::Relaxed);
        }
        Command::Skip { seq } => counters.applied_seq.store(seq, Ordering::Release),
        Command::Checkpoint(reply) => {
            let seq = counters.applied_seq.load(Ordering::Acquire);
            let policy = state.pushed_policy_body();
            let mut blobs: Vec<(&str, &[u8])> = Vec::new();
            if let Some(body) = &policy {
                blobs.push((POLICY_BLOB, body));
            }
            let opts = write::WriteOptions {
                created_ms: now_us() / 1000,
                stream_seq: seq,
                blobs,
            };
            let mut bytes = Vec::new();
            let result = write::write_checkpoint(state.index(), &mut bytes, &opts)
                .map(|report| Cut {
                    stream_seq: seq,
                    bytes,
                    entries: report.entries,
                })
                .map_err(anyhow::Error::from);
            let _ = reply.send(result);
        }
        Command::Digest(reply) => {
            let _ = reply.send(DigestAt {
                stream_seq: counters.applied_seq.load(Ordering::Acquire),
                digest: state.index().digest(),
            });
        }
        Command::Bootstrap {
            checkpoint,
            start_after,
            reply,
        } => {
            let removed = state.index().remove_everything();
            let result = match checkpoint {
                None => Ok(start_after),
                Some(bytes) => match read::restore(state.index(), std::io::Cursor::new(bytes)) {
                    Ok(report) => {
                        if let Some((_, body)) = report.blobs.iter().find(|(n, _)| n == POLICY_BLOB)
                        {
                            state.restore_pushed_policy(body);
                        }
                        let seq = report.header.map_or(0, |h| h.stream_seq);
                        info!(
                            stream_seq = seq,
                            loaded = report.outcome.loaded,
                            expired = report.outcome.expired,
                            removed_before = removed,
                            "replication_checkpoint_loaded"
                        );
                        Ok(seq)
                    }
                    Err(err) => Err(anyhow::anyhow!("checkpoint refused: {err}")),
                },
            };
            if let Ok(seq) = result {
                counters.applied_seq.store(seq, Ordering::Release);
                counters.bootstraps.fetch_add(1, Ordering::Relaxed);
            }
            let _ = reply.send(result);
        }
    }
}

/// Applies one record (the same code on every server).
fn apply_record(state: &Core, record: &Record) {
    let index = state.index();
    match &record.body {
        Some(Body::Update(update)) => {
            state.observe_endpoint(update);
            crate::translate::ingest(index, update)
        }
        Some(Body::Event(event)) => crate::translate::apply_event(index, event),
        Some(Body::Policy(body)) => match crate::policy::decode_push(body) {
            Ok(layer) => state.push_policy(body, layer),
            Err(err) => warn!(err = %err, "replication_policy_refused"),
        },
        Some(Body::Evictions(e)) => {
            let Some(h) = &e.holder else { return };
            let entries: Vec<(&[u8], i64)> = e
                .keys
                .iter()
                .zip(&e.last_seen_ms)
                .map(|(k, ms)| (k.as_slice(), *ms))
                .collect();
            index.remove_decided(
                &h.tenant_id,
                &h.model_id,
                &h.hash_scheme,
                &h.adapter_id,
                &h.replica_id,
                &entries,
            );
        }
        Some(Body::Credits(c)) => {
            let Some(h) = &c.holder else { return };
            for (key, times) in c.keys.iter().zip(&c.times) {
                index.credit_entry(
                    &h.tenant_id,
                    &h.model_id,
                    &h.hash_scheme,
                    &h.adapter_id,
                    &h.replica_id,
                    key,
                    *times,
                );
            }
        }
        None => {}
    }
}

pub(crate) fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Reads the stream into the apply thread (see the module docs).
pub struct Consumer {
    pub stores: Stores,
    pub handle: Handle,
    pub counters: Arc<Counters>,
    pub state: Core,
    /// How long a bootstrap waits for a checkpoint the stream continues before it starts
    /// from the stream's head alone.
    pub checkpoint_wait: Duration,
}

impl Consumer {
    pub async fn run(self) {
        let mut applied = self.bootstrap().await;
        loop {
            match self.consume(applied).await {
                Ok(next) => applied = next,
                Err(Gap::Lost { expected, got }) => {
                    self.counters.gaps.fetch_add(1, Ordering::Relaxed);
                    warn!(expected, got, "replication_history_lost_rebootstrap");
                    self.state.begin_restore();
                    applied = self.bootstrap().await;
                }
                Err(Gap::Broken(next, err)) => {
                    applied = next;
                    warn!(err = %err, "replication_consumer_restart");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }

    /// Loads the newest usable checkpoint (or none) and leaves *restoring* once the backlog
    /// seen now is applied. Returns the sequence applied after the load.
    async fn bootstrap(&self) -> u64 {
        let started = std::time::Instant::now();
        loop {
            let Some((first, last)) = self.stores.bounds().await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            self.counters.stream_last_seq.store(last, Ordering::Relaxed);
            let checkpoint = self.stores.newest_checkpoint().await;
            // A checkpoint at S is usable if the stream still holds S + 1 (or nothing after).
            let usable = checkpoint
                .as_ref()
                .is_some_and(|(seq, _)| first <= seq + 1 || first == 0);
            let complete_history = first <= 1;
            let waited = started.elapsed() >= self.checkpoint_wait;
            let (bytes, start_after) = match checkpoint {
                Some((_, bytes)) if usable => (Some(bytes), 0),
                _ if complete_history => (None, 0),
                _ if waited => {
                    warn!(
                        first_seq = first,
                        "replication_bootstrap_partial: no checkpoint the stream continues; \
                         starting from the stream's oldest record (entries older than it are misses)"
                    );
                    (None, first.saturating_sub(1))
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            match self.handle.bootstrap(bytes, start_after).await {
                Ok(applied) => {
                    let target = last;
                    self.spawn_ready_watch(target);
                    return applied;
                }
                Err(err) => {
                    error!(err = %format!("{err:#}"), "replication_bootstrap_failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// Leaves *restoring* once everything published before the bootstrap is applied.
    fn spawn_ready_watch(&self, target: u64) {
        let counters = self.counters.clone();
        let state = self.state.clone();
        tokio::spawn(async move {
            // Ready once the backlog seen at the bootstrap is applied and the lag is under 1 s.
            while counters.applied_seq.load(Ordering::Acquire) < target
                || counters.lag_seconds_micros.load(Ordering::Relaxed) > 1_000_000
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            info!(stream_seq = target, "replication_caught_up");
            state.end_restore();
        });
    }

    /// Consumes from `applied + 1` until the consumer breaks or a gap shows lost history.
    async fn consume(&self, mut applied: u64) -> Result<u64, Gap> {
        let mut messages = match self.stores.messages_from(applied + 1).await {
            Ok(m) => m,
            Err(err) => return Err(Gap::Broken(applied, err)),
        };
        while let Some(message) = messages.next().await {
            let message = match message {
                Ok(m) => m,
                Err(err) => return Err(Gap::Broken(applied, anyhow::anyhow!("{err}"))),
            };
            let (seq, published_us) = match message.info() {
                Ok(info) => (
                    info.stream_sequence,
                    (info.published.unix_timestamp_nanos() / 1000) as i64,
                ),
                Err(err) => return Err(Gap::Broken(applied, anyhow::anyhow!("{err}"))),
            };
            if seq <= applied {
                continue;
            }
            if seq != applied + 1 {
                return Err(Gap::Lost {
                    expected: applied + 1,
                    got: seq,
                });
            }
            let command = match Batch::decode(message.payload.as_ref()) {
                Ok(batch) => Command::Apply {
                    seq,
                    published_us,
                    batch,
                },
                Err(err) => {
                    self.counters.undecodable.fetch_add(1, Ordering::Relaxed);
                    warn!(seq, err = %err, "replication_message_undecodable");
                    Command::Skip { seq }
                }
            };
            if !self.handle.send(command).await {
                return Err(Gap::Broken(
                    applied,
                    anyhow::anyhow!("apply thread stopped"),
                ));
            }
            applied = seq;
        }
        Err(Gap::Broken(
            applied,
            anyhow::anyhow!("message stream ended"),
        ))
    }
}

enum Gap {
    /// Records between `expected` and `got` were trimmed.
    Lost { expected: u64, got: u64 },
    /// The consumer failed; resume after the given sequence.
    Broken(u64, anyhow::Error),
}
