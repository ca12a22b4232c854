//! Replicated mode's settings, as `crate::config` validates them from the flags and the file.

use std::time::Duration;

/// Replicated mode's settings (`--nats-*`, `[replication]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub url: String,
    pub stream: String,
    pub creds_file: Option<std::path::PathBuf>,
    pub token_file: Option<std::path::PathBuf>,
    pub tls_ca_file: Option<std::path::PathBuf>,
    pub buffer: usize,
    pub max_age: Duration,
    pub max_bytes: u64,
    pub server_id: String,
    /// Leader checkpoint uploads (`--checkpoint-interval`).
    pub checkpoint_interval: Duration,
}

impl Settings {
    pub(super) fn subject(&self) -> String {
        format!("{}.records", self.stream)
    }
}
