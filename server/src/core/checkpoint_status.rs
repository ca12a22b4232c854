//! What the checkpoints did: the last write, the startup restore, the failures. The
//! [`Status`] lives in the core handle ([`super::Core`]) so `/checkpoint` and the metrics can
//! read it whether or not a checkpointer (`crate::checkpoint::Checkpointer`) runs; only the
//! checkpointer writes it.

use crate::metrics::Family;
use parking_lot::Mutex;
use serde::Serialize;

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
    pub(crate) inner: Mutex<StatusInner>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct StatusInner {
    pub(crate) enabled: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) state_dir: Option<String>,
    pub(crate) interval_seconds: f64,
    pub(crate) restoring: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) last_checkpoint: Option<WriteStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) last_success_unix_ms: Option<i64>,
    pub(crate) failures: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) restore: Option<RestoreStatus>,
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
