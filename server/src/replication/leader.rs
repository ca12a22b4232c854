//! The stream, its buckets, and what only the leader does.
//!
//! **Lease.** The leader is the server holding key `leader` in the KV bucket `<stream>-lease`,
//! whose entries expire after [`LEASE_TTL`]. The holder renews it every [`LEASE_RENEW`] with a
//! revision-checked update, so a renewal fails once somebody else took the key; a server that
//! is not leader tries to create the key, which succeeds only when it is absent (expired). Two
//! servers may both act as leader for up to one renewal period after a partition: harmless,
//! since every decision is a conditional removal that all servers apply alike.
//!
//! **Duties of the leader** (only while it is caught up): local eviction (the cap and quotas
//! on ingest, on the apply thread; the TTL removal of the index's sweep thread), publishing
//! those removals ([`Decisions`]), and a checkpoint every `--checkpoint-interval`, uploaded to
//! the object store `<stream>-checkpoints` as `checkpoint-<seq>`, then named in the KV bucket
//! `<stream>-meta` under `checkpoint`. The pointer moves only after the upload completed, so a
//! torn upload is never read; the two newest objects are kept.

use super::apply::Handle;
use super::outbox::Outbox;
use super::record::{Body, Evictions, Holder, Record};
use super::{Counters, Settings};
use crate::core::Core;
use anyhow::Context as _;
use async_nats::jetstream::{self, kv, object_store, stream};
use inferencecache_engine::{Decided, DecisionLog};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tracing::{info, warn};

/// A lease not renewed for this long expires.
pub const LEASE_TTL: Duration = Duration::from_secs(3);
/// How often the holder renews (and others try to take) the lease.
pub const LEASE_RENEW: Duration = Duration::from_millis(750);
/// A checkpoint cut and upload that takes longer is abandoned (and retried next interval).
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the stream deduplicates a retried message id.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The stream and buckets of one replicated deployment.
#[derive(Clone)]
pub struct Stores {
    js: jetstream::Context,
    stream_name: String,
    lease: kv::Store,
    meta: kv::Store,
    checkpoints: object_store::ObjectStore,
    /// Failed stream queries of [`Stores::bounds`] (callers retry it in loops).
    bounds_failures: RateLimitedWarning,
}

/// How often a stream query that keeps failing is logged.
const QUERY_WARNING_PERIOD: Duration = Duration::from_secs(10);

/// A warning for a call that may fail on every try of a retry loop: the first failure is
/// logged at once, later ones at most once per period with the count of failures in between.
#[derive(Clone, Default)]
struct RateLimitedWarning {
    state: Arc<std::sync::Mutex<WarningState>>,
}

#[derive(Default)]
struct WarningState {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl RateLimitedWarning {
    /// Records a failure at `now`; returns the number of failures to report (this one and the
    /// ones suppressed since the last report) when a warning is due.
    fn failure(&self, now: std::time::Instant, period: Duration) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.suppressed += 1;
        if state
            .last
            .is_some_and(|last| now.duration_since(last) < period)
        {
            return None;
        }
        state.last = Some(now);
        Some(std::mem::take(&mut state.suppressed))
    }
}

impl Stores {
    /// Creates (or opens) the stream and buckets.
    pub async fn open(js: &jetstream::Context, settings: &Settings) -> anyhow::Result<Self> {
        let max_bytes = i64::try_from(settings.max_bytes).unwrap_or(i64::MAX);
        js.get_or_create_stream(stream::Config {
            name: settings.stream.clone(),
            subjects: vec![settings.subject()],
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::File,
            max_age: settings.max_age,
            max_bytes: if max_bytes == 0 { -1 } else { max_bytes },
            duplicate_window: DUPLICATE_WINDOW.min(settings.max_age),
            ..Default::default()
        })
        .await
        .with_context(|| format!("create stream {}", settings.stream))?;
        let lease = key_value(js, &format!("{}-lease", settings.stream), Some(LEASE_TTL))
            .await
            .context("create the lease bucket")?;
        let meta = key_value(js, &format!("{}-meta", settings.stream), None)
            .await
            .context("create the meta bucket")?;
        let checkpoints = js
            .create_object_store(object_store::Config {
                bucket: format!("{}-checkpoints", settings.stream),
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .context("create the checkpoint object store")?;
        Ok(Self {
            js: js.clone(),
            stream_name: settings.stream.clone(),
            lease,
            meta,
            checkpoints,
            bounds_failures: RateLimitedWarning::default(),
        })
    }

    /// The stream's first and last sequence (`None` when NATS does not answer; logged, at
    /// most once per 10 s, since a server restoring retries this until it
    /// answers and would otherwise wait without a word).
    pub async fn bounds(&self) -> Option<(u64, u64)> {
        let query = async {
            let stream = self
                .js
                .get_stream(&self.stream_name)
                .await
                .context("get the stream")?;
            let info = stream.get_info().await.context("read the stream's state")?;
            anyhow::Ok((info.state.first_sequence, info.state.last_sequence))
        };
        match query.await {
            Ok(bounds) => Some(bounds),
            Err(err) => {
                if let Some(failures) = self
                    .bounds_failures
                    .failure(std::time::Instant::now(), QUERY_WARNING_PERIOD)
                {
                    warn!(err = %format!("{err:#}"), stream = %self.stream_name, failures, "replication_stream_query_failed");
                }
                None
            }
        }
    }

    /// An ordered consumer's messages from `start`.
    pub async fn messages_from(
        &self,
        start: u64,
    ) -> anyhow::Result<jetstream::consumer::pull::Ordered> {
        let stream = self.js.get_stream(&self.stream_name).await?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: start.max(1),
                },
                ..Default::default()
            })
            .await?;
        Ok(consumer.messages().await?)
    }

    /// The newest checkpoint: its stream sequence and bytes.
    pub async fn newest_checkpoint(&self) -> Option<(u64, Vec<u8>)> {
        let name = self.meta.get("checkpoint").await.ok()??;
        let name = String::from_utf8(name.to_vec()).ok()?;
        let seq: u64 = name.strip_prefix("checkpoint-")?.parse().ok()?;
        let mut object = match self.checkpoints.get(&name).await {
            Ok(o) => o,
            Err(err) => {
                warn!(err = %err, object = %name, "replication_checkpoint_missing");
                return None;
            }
        };
        let mut bytes = Vec::new();
        if let Err(err) = object.read_to_end(&mut bytes).await {
            warn!(err = %err, object = %name, "replication_checkpoint_read_failed");
            return None;
        }
        Some((seq, bytes))
    }

    /// Uploads a checkpoint, then points `checkpoint` at it. Returns the object's name.
    async fn upload(&self, seq: u64, bytes: &[u8]) -> anyhow::Result<String> {
        let name = format!("checkpoint-{seq}");
        let mut reader = bytes;
        self.checkpoints
            .put(name.as_str(), &mut reader)
            .await
            .context("upload the checkpoint")?;
        self.meta
            .put("checkpoint", name.clone().into_bytes().into())
            .await
            .context("point at the checkpoint")?;
        Ok(name)
    }

    /// Deletes an object a newer checkpoint replaced.
    async fn forget(&self, name: &str) {
        if let Err(err) = self.checkpoints.delete(name).await {
            warn!(err = %err, object = %name, "replication_checkpoint_delete_failed");
        }
    }
}

/// Opens a KV bucket, creating its stream first with the bucket layout (one value per key,
/// rollups, direct gets). The stream is created directly rather than through
/// `create_key_value`, which also reads the account's info in a form older servers (2.9,
/// Debian's) do not send.
async fn key_value(
    js: &jetstream::Context,
    bucket: &str,
    max_age: Option<Duration>,
) -> anyhow::Result<kv::Store> {
    js.get_or_create_stream(stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_age: max_age.unwrap_or_default(),
        storage: if max_age.is_some() {
            stream::StorageType::Memory
        } else {
            stream::StorageType::File
        },
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        num_replicas: 1,
        ..Default::default()
    })
    .await?;
    Ok(js.get_key_value(bucket).await?)
}

/// The leader's removals, grouped per (partition, replica), published after each command of
/// the apply thread.
pub struct Decisions {
    outbox: Arc<Outbox>,
    pending: parking_lot::Mutex<Vec<Evictions>>,
}

impl Decisions {
    pub fn new(outbox: Arc<Outbox>) -> Self {
        Self {
            outbox,
            pending: parking_lot::Mutex::new(Vec::new()),
        }
    }

    pub fn flush(&self) {
        let pending = std::mem::take(&mut *self.pending.lock());
        for e in pending {
            self.outbox.push_decided(Record {
                body: Some(Body::Evictions(e)),
            });
        }
    }
}

impl DecisionLog for Decisions {
    fn removed(&self, d: &Decided<'_>) {
        let mut pending = self.pending.lock();
        let same = pending.last().is_some_and(|e| {
            e.keys.len() < 4096
                && e.holder.as_ref().is_some_and(|h| {
                    h.tenant_id == d.tenant_id
                        && h.model_id == d.model_id
                        && h.hash_scheme == d.hash_scheme
                        && h.adapter_id == d.adapter_id
                        && h.replica_id == d.replica_id
                })
        });
        if !same {
            pending.push(Evictions {
                holder: Some(Holder {
                    tenant_id: d.tenant_id.into(),
                    model_id: d.model_id.into(),
                    hash_scheme: d.hash_scheme.into(),
                    adapter_id: d.adapter_id.into(),
                    replica_id: d.replica_id.into(),
                }),
                ..Default::default()
            });
        }
        if let Some(e) = pending.last_mut() {
            e.keys.push(d.key.to_vec());
            e.last_seen_ms.push(d.last_seen_ms);
        }
    }
}

/// Followers never evict: the index starts with local eviction off and the log installed
/// (it only receives what local eviction removes, i.e. nothing until this server leads).
pub fn install_decisions(state: &Core, decisions: Arc<Decisions>) {
    state.index().set_local_eviction(false);
    state.index().set_decision_log(Some(decisions));
}

/// The lease loop and the leader's periodic duties.
pub struct Duties {
    pub stores: Stores,
    pub handle: Handle,
    pub counters: Arc<Counters>,
    pub state: Core,
    pub settings: Settings,
}

impl Duties {
    pub async fn run(self) {
        let mut revision: Option<u64> = None;
        let mut next_checkpoint = tokio::time::Instant::now() + self.settings.checkpoint_interval;
        let mut tick = tokio::time::interval(LEASE_RENEW);
        let mut uploaded: Option<u64> = None;
        // Objects uploaded by this server, newest last: the two newest are kept (a server may
        // still be reading the previous one).
        let mut objects: std::collections::VecDeque<String> = std::collections::VecDeque::new();
        loop {
            tick.tick().await;
            // Only a caught-up server leads: its decisions are about the state everyone has.
            if self.state.restoring() {
                if revision.take().is_some() {
                    self.step_down();
                }
                continue;
            }
            let id: bytes::Bytes = self.settings.server_id.clone().into_bytes().into();
            revision = match revision {
                Some(rev) => match tokio::time::timeout(
                    LEASE_TTL,
                    self.stores.lease.update("leader", id, rev),
                )
                .await
                .unwrap_or_else(|_| Err(kv::UpdateError::new(kv::UpdateErrorKind::TimedOut)))
                {
                    Ok(rev) => Some(rev),
                    Err(err) => {
                        warn!(err = %err, "replication_lease_lost");
                        self.step_down();
                        None
                    }
                },
                None => match self.stores.lease.create("leader", id).await {
                    Ok(rev) => {
                        info!(server_id = %self.settings.server_id, "replication_lease_taken");
                        self.state.index().set_local_eviction(true);
                        self.counters.leader.store(true, Ordering::Relaxed);
                        next_checkpoint =
                            tokio::time::Instant::now() + self.settings.checkpoint_interval;
                        Some(rev)
                    }
                    Err(_) => None,
                },
            };
            if revision.is_none() {
                continue;
            }
            let now = tokio::time::Instant::now();
            // A checkpoint only when the stream moved since the last one.
            let applied = self.counters.applied_seq.load(Ordering::Acquire);
            if now >= next_checkpoint && uploaded != Some(applied) {
                next_checkpoint = now + self.settings.checkpoint_interval;
                if let Some((seq, name)) = self.checkpoint().await {
                    uploaded = Some(seq);
                    objects.push_back(name);
                    while objects.len() > 2 {
                        if let Some(old) = objects.pop_front() {
                            self.stores.forget(&old).await;
                        }
                    }
                }
            }
        }
    }

    fn step_down(&self) {
        self.state.index().set_local_eviction(false);
        self.counters.leader.store(false, Ordering::Relaxed);
    }

    async fn checkpoint(&self) -> Option<(u64, String)> {
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(UPLOAD_TIMEOUT, async {
            let cut = self.handle.checkpoint().await?;
            let name = self.stores.upload(cut.stream_seq, &cut.bytes).await?;
            anyhow::Ok((cut, name))
        })
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("timed out after {UPLOAD_TIMEOUT:?}")));
        match result {
            Ok((cut, name)) => {
                self.counters
                    .checkpoint_uploads
                    .fetch_add(1, Ordering::Relaxed);
                info!(
                    stream_seq = cut.stream_seq,
                    entries = cut.entries,
                    bytes = cut.bytes.len(),
                    duration_ms = started.elapsed().as_secs_f64() * 1e3,
                    "replication_checkpoint_uploaded"
                );
                Some((cut.stream_seq, name))
            }
            Err(err) => {
                self.counters
                    .checkpoint_upload_failures
                    .fetch_add(1, Ordering::Relaxed);
                warn!(err = %format!("{err:#}"), "replication_checkpoint_upload_failed");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_failing_query_is_reported_at_once_then_once_per_period_with_the_count() {
        let warning = RateLimitedWarning::default();
        let period = Duration::from_secs(10);
        let start = Instant::now();
        assert_eq!(warning.failure(start, period), Some(1));
        assert_eq!(
            warning.failure(start + Duration::from_secs(3), period),
            None
        );
        assert_eq!(
            warning.failure(start + Duration::from_secs(9), period),
            None
        );
        // The three failures since the first report: the two suppressed and this one.
        assert_eq!(
            warning.failure(start + Duration::from_secs(10), period),
            Some(3)
        );
        // Clones share the state (the stores are cloned into several tasks).
        let clone = warning.clone();
        assert_eq!(clone.failure(start + Duration::from_secs(11), period), None);
        assert_eq!(
            warning.failure(start + Duration::from_secs(21), period),
            Some(2)
        );
    }
}
