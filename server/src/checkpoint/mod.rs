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

use crate::grpc::service::AppState;
use crate::metrics::Family;
use inferencecache_engine::checkpoint::{files, write::WriteOptions};
use parking_lot::Mutex;
use serde::Serialize;
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

/// The last checkpoint written.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WriteStatus {
    /// When it started (ms since the epoch).
    pub unix_ms: i64,
    /// How long it took (ms).
    pub duration_ms: f64,
    /// Entries written.
    pub entries: u64,
    /// Stats records written.
    pub stats: u64,
    /// File size.
    pub bytes: u64,
    /// Why it failed, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A checkpoint refused at restore.
#[derive(Debug, Clone, Serialize)]
pub struct RefusedFile {
    /// The file.
    pub file: String,
    /// Why it was refused.
    pub reason: String,
}

/// The restore at startup.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RestoreStatus {
    /// When it finished (ms since the epoch).
    pub unix_ms: i64,
    /// How long it took (ms).
    pub duration_ms: f64,
    /// The file restored (none: started empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// When that checkpoint was written (ms since the epoch).
    pub checkpoint_unix_ms: i64,
    /// Entries in the file.
    pub entries: u64,
    /// Entries loaded.
    pub loaded: u64,
    /// Entries skipped because they expired during the downtime.
    pub expired: u64,
    /// Entries skipped (over the cap, or refused by the index).
    pub dropped: u64,
    /// Stats records loaded.
    pub stats: u64,
    /// File size.
    pub bytes: u64,
    /// Files found and refused, in the order tried.
    pub refused: Vec<RefusedFile>,
}

/// What `/checkpoint` and the metrics report.
#[derive(Debug, Default)]
pub struct Status {
    inner: Mutex<StatusInner>,
}

#[derive(Debug, Clone, Default, Serialize)]
struct StatusInner {
    enabled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    state_dir: Option<String>,
    interval_seconds: f64,
    restoring: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_checkpoint: Option<WriteStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_success_unix_ms: Option<i64>,
    failures: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    restore: Option<RestoreStatus>,
}

impl Status {
    /// The `/checkpoint` body.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(&*self.inner.lock()).unwrap_or_else(|_| "{}".into()) + "\n"
    }

    /// The `inferencecache_checkpoint_*` families.
    pub fn families(&self) -> Vec<Family> {
        let s = self.inner.lock().clone();
        let last = s.last_checkpoint.clone().unwrap_or_default();
        let restore = s.restore.clone().unwrap_or_default();
        vec![
            Family::gauge(
                "inferencecache_checkpoint_enabled",
                "1 when a state directory is configured",
                f64::from(u8::from(s.enabled)),
            ),
            Family::gauge(
                "inferencecache_checkpoint_duration_seconds",
                "time the last checkpoint write took",
                last.duration_ms / 1e3,
            ),
            Family::gauge(
                "inferencecache_checkpoint_bytes",
                "size of the last checkpoint written",
                last.bytes as f64,
            ),
            Family::gauge(
                "inferencecache_checkpoint_entries",
                "entries in the last checkpoint written",
                last.entries as f64,
            ),
            Family::counter(
                "inferencecache_checkpoint_failures_total",
                "checkpoint writes that failed",
                s.failures as f64,
            ),
            Family::gauge(
                "inferencecache_checkpoint_last_success_timestamp_seconds",
                "when the last successful checkpoint started (0 = none yet)",
                s.last_success_unix_ms.unwrap_or(0) as f64 / 1e3,
            ),
            Family::gauge(
                "inferencecache_checkpoint_restore_duration_seconds",
                "time the startup restore took",
                restore.duration_ms / 1e3,
            ),
            Family::gauge(
                "inferencecache_checkpoint_restore_entries",
                "entries loaded by the startup restore",
                restore.loaded as f64,
            ),
            Family::gauge(
                "inferencecache_checkpoint_restore_refused",
                "checkpoint files refused by the startup restore",
                restore.refused.len() as f64,
            ),
            Family::gauge(
                "inferencecache_checkpoint_restoring",
                "1 while the startup restore runs",
                f64::from(u8::from(s.restoring)),
            ),
        ]
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Writes and restores the checkpoints of one state directory.
pub struct Checkpointer {
    settings: StateSettings,
    state: AppState,
    /// One write at a time (a periodic tick and the shutdown write never overlap).
    writing: tokio::sync::Mutex<()>,
    /// Workers of periodic checkpoints: half the cores, so lookups and ingest keep the rest
    /// while a checkpoint encodes (the shutdown write, after the drain, uses every core).
    background: Option<Arc<rayon::ThreadPool>>,
}

impl Checkpointer {
    /// A checkpointer for `state` (records its settings in the status).
    pub fn new(settings: StateSettings, state: AppState) -> Arc<Self> {
        {
            let mut s = state.checkpoint_status().inner.lock();
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
            state,
            writing: tokio::sync::Mutex::new(()),
            background,
        })
    }

    /// Restores the newest valid checkpoint (see the module docs), then leaves *restoring*.
    /// The caller entered *restoring* before the listeners started.
    pub async fn restore(&self) {
        self.state.checkpoint_status().inner.lock().restoring = true;
        let index = self.state.index().clone();
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
                        self.state.restore_pushed_policy(body);
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
            let mut s = self.state.checkpoint_status().inner.lock();
            s.restore = Some(status);
            s.restoring = false;
        }
        self.state.end_restore();
    }

    /// Writes one checkpoint now on every core (the shutdown write). Never before the restore
    /// finished.
    pub async fn write_now(&self) -> Option<WriteStatus> {
        self.write(None).await
    }

    async fn write(&self, pool: Option<Arc<rayon::ThreadPool>>) -> Option<WriteStatus> {
        if self.state.restoring() {
            return None;
        }
        let _one = self.writing.lock().await;
        let index = self.state.index().clone();
        let dir = self.settings.dir.clone();
        let policy = self.state.pushed_policy_body();
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
        let mut s = self.state.checkpoint_status().inner.lock();
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
