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
//! those removals ([`super::decisions::Decisions`]), and a checkpoint every `--checkpoint-interval`, uploaded to
//! the object store `<stream>-checkpoints` as `checkpoint-<seq>`, then named in the KV bucket
//! `<stream>-meta` under `checkpoint`. The pointer moves only after the upload completed, so a
//! torn upload is never read; the two newest objects are kept.

use super::apply::Handle;
use super::counters::Counters;
use super::settings::Settings;
use super::stores::{LEASE_TTL, Stores};
use crate::core::Core;
use async_nats::jetstream::kv;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tracing::{info, warn};

/// How often the holder renews (and others try to take) the lease.
pub const LEASE_RENEW: Duration = Duration::from_millis(750);
/// A checkpoint cut and upload that takes longer is abandoned (and retried next interval).
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(60);

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
