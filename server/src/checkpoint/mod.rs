//! Warm restart: periodic and shutdown checkpoints of the index into `--state-dir`, and the
//! restore at startup.
//!
//! Lifecycle (one [`Checkpointer`] per process, only with a state directory):
//! 1. Startup: the state enters *restoring* before any listener serves. While it lasts, gRPC
//!    health is NOT_SERVING, `/readyz` answers 503, LookupRoute answers NO_HINT (fail-open), and
//!    producer RPCs and `/policy` pushes wait, so nothing a producer sends is overwritten by an
//!    older checkpoint entry and no removal is undone by the restore.
//! 2. The newest checkpoint that checks (`current`, then `previous`) is loaded; each refused
//!    file is logged at ERROR with its reason. The pushed policy layer stored with it is
//!    re-applied. Then the state leaves *restoring*.
//! 3. Every `--checkpoint-interval`, and once more after the shutdown drain, a checkpoint is
//!    written on a blocking thread while lookups and ingest continue (the engine's dump takes a
//!    per-entry consistent cut, `inferencecache_engine::checkpoint`). A failed write (disk full,
//!    permission) is logged and counted and leaves the previous checkpoints in place. No
//!    checkpoint is written before the restore has finished, so a slow or failed restore
//!    never replaces a good checkpoint with a partial index.

use crate::core::Core;
pub use crate::core::checkpoint_status::{RefusedFile, RestoreStatus, Status, WriteStatus};

use inferencecache_engine::checkpoint::{files, write::WriteOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::{error, info};

/// Name of the blob holding the last `/policy` push body.
pub const POLICY_BLOB: &str = "policy.pushed";

/// Checkpoint settings (`--state-dir`, `--checkpoint-interval`).
#[derive(Debug, Clone)]
pub struct StateSettings {
    /// The state directory.
    pub dir: PathBuf,
    /// Time between periodic checkpoints.
    pub interval: Duration,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Writes and restores the checkpoints of one state directory.
pub struct Checkpointer {
    settings: StateSettings,
    core: Core,
    /// One write at a time (a periodic tick and the shutdown write never overlap).
    writing: tokio::sync::Mutex<()>,
    /// Workers of periodic checkpoints: half the cores, so lookups and ingest keep the rest
    /// while a checkpoint encodes (the shutdown write, after the drain, uses every core).
    background: Option<Arc<rayon::ThreadPool>>,
}

impl Checkpointer {
    /// A checkpointer over the server's core (records its settings in the status).
    pub fn new(settings: StateSettings, core: Core) -> Arc<Self> {
        {
            let mut s = core.checkpoint_status().inner.lock();
            s.enabled = true;
            s.state_dir = Some(settings.dir.display().to_string());
            s.interval_seconds = settings.interval.as_secs_f64();
        }
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let background = rayon::ThreadPoolBuilder::new()
            .num_threads((cores / 2).max(1))
            .thread_name(|i| format!("checkpoint-{i}"))
            .build()
            .map_err(|err| error!(err = %err, "checkpoint_pool_failed"))
            .ok()
            .map(Arc::new);
        Arc::new(Self {
            settings,
            core,
            writing: tokio::sync::Mutex::new(()),
            background,
        })
    }

    /// Restores the newest valid checkpoint (see the module docs), then leaves *restoring*.
    /// The caller entered *restoring* before the listeners started.
    pub async fn restore(&self) {
        self.core.checkpoint_status().inner.lock().restoring = true;
        let index = self.core.index().clone();
        let dir = self.settings.dir.clone();
        let started = std::time::Instant::now();
        let result = tokio::task::spawn_blocking(move || files::restore_newest(&index, &dir)).await;
        let mut status = RestoreStatus::default();
        match result {
            Ok(outcome) => {
                for r in &outcome.refused {
                    error!(
                        file = %r.path.display(),
                        reason = %r.reason,
                        "checkpoint_refused"
                    );
                    status.refused.push(RefusedFile {
                        file: r.path.display().to_string(),
                        reason: r.reason.to_string(),
                    });
                }
                if let Some((path, report)) = outcome.restored {
                    if let Some((_, body)) = report.blobs.iter().find(|(n, _)| n == POLICY_BLOB) {
                        self.core.restore_pushed_policy(body);
                    }
                    status.file = Some(path.display().to_string());
                    status.checkpoint_unix_ms = report.header.map_or(0, |h| h.created_ms);
                    status.entries = report.entries;
                    status.loaded = report.outcome.loaded;
                    status.expired = report.outcome.expired;
                    status.dropped = report.outcome.dropped;
                    status.stats = report.stats_loaded;
                    status.bytes = report.bytes;
                    info!(
                        file = %path.display(),
                        entries = report.entries,
                        loaded = report.outcome.loaded,
                        expired = report.outcome.expired,
                        dropped = report.outcome.dropped,
                        stats = report.stats_loaded,
                        bytes = report.bytes,
                        duration_ms = report.duration.as_secs_f64() * 1e3,
                        "checkpoint_restored"
                    );
                } else {
                    info!(
                        state_dir = %self.settings.dir.display(),
                        refused = outcome.refused.len(),
                        "checkpoint_none_restored"
                    );
                }
            }
            Err(err) => error!(err = %err, "checkpoint_restore_failed"),
        }
        status.duration_ms = started.elapsed().as_secs_f64() * 1e3;
        status.unix_ms = now_ms();
        {
            let mut s = self.core.checkpoint_status().inner.lock();
            s.restore = Some(status);
            s.restoring = false;
        }
        self.core.end_restore();
    }

    /// Writes one checkpoint now on every core (the shutdown write). Never before the restore
    /// finished.
    pub async fn write_now(&self) -> Option<WriteStatus> {
        self.write(None).await
    }

    async fn write(&self, pool: Option<Arc<rayon::ThreadPool>>) -> Option<WriteStatus> {
        if self.core.restoring() {
            return None;
        }
        let _one = self.writing.lock().await;
        let index = self.core.index().clone();
        let dir = self.settings.dir.clone();
        let policy = self.core.pushed_policy_body();
        let created_ms = now_ms();
        let result = tokio::task::spawn_blocking(move || {
            let mut blobs: Vec<(&str, &[u8])> = Vec::new();
            if let Some(body) = &policy {
                blobs.push((POLICY_BLOB, body));
            }
            let opts = WriteOptions {
                created_ms,
                stream_seq: 0,
                blobs,
            };
            match pool {
                Some(pool) => pool.install(|| files::write_to_dir(&index, &dir, &opts)),
                None => files::write_to_dir(&index, &dir, &opts),
            }
        })
        .await;
        let mut w = WriteStatus {
            unix_ms: created_ms,
            ..Default::default()
        };
        let mut s = self.core.checkpoint_status().inner.lock();
        match result {
            Ok(Ok(report)) => {
                w.duration_ms = report.duration.as_secs_f64() * 1e3;
                w.entries = report.entries;
                w.stats = report.stats;
                w.bytes = report.bytes;
                s.last_success_unix_ms = Some(created_ms);
                info!(
                    entries = report.entries,
                    bytes = report.bytes,
                    duration_ms = w.duration_ms,
                    "checkpoint_written"
                );
            }
            Ok(Err(err)) => {
                error!(state_dir = %self.settings.dir.display(), err = %err, "checkpoint_write_failed");
                w.error = Some(err.to_string());
                s.failures += 1;
            }
            Err(err) => {
                error!(err = %err, "checkpoint_write_failed");
                w.error = Some(err.to_string());
                s.failures += 1;
            }
        }
        s.last_checkpoint = Some(w.clone());
        Some(w)
    }

    /// Writes a checkpoint every interval until the process ends (the first one an interval
    /// after the restore).
    pub fn spawn_periodic(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(me.settings.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                me.write(me.background.clone()).await;
            }
        });
    }
}
