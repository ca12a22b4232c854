//! The stream and the buckets of one replicated deployment: the record stream, the lease and
//! meta KV buckets and the checkpoint object store, opened (or created) once at startup.

use super::settings::Settings;
use anyhow::Context as _;
use async_nats::jetstream::{self, kv, object_store, stream};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tracing::warn;

/// A lease not renewed for this long expires.
pub const LEASE_TTL: Duration = Duration::from_secs(3);
/// How long the stream deduplicates a retried message id.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The stream and buckets of one replicated deployment.
#[derive(Clone)]
pub struct Stores {
    pub(super) js: jetstream::Context,
    pub(super) stream_name: String,
    pub(super) lease: kv::Store,
    pub(super) meta: kv::Store,
    pub(super) checkpoints: object_store::ObjectStore,
    /// Failed stream queries of [`Stores::bounds`] (callers retry it in loops).
    pub(super) bounds_failures: RateLimitedWarning,
}

/// How often a stream query that keeps failing is logged.
const QUERY_WARNING_PERIOD: Duration = Duration::from_secs(10);

/// A warning for a call that may fail on every try of a retry loop: the first failure is
/// logged at once, later ones at most once per period with the count of failures in between.
#[derive(Clone, Default)]
pub(super) struct RateLimitedWarning {
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
    pub(super) fn failure(&self, now: std::time::Instant, period: Duration) -> Option<u64> {
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
    pub(super) async fn upload(&self, seq: u64, bytes: &[u8]) -> anyhow::Result<String> {
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
    pub(super) async fn forget(&self, name: &str) {
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
