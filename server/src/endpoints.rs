//! Which `ip:port` serves each replica, and how many picked requests each endpoint holds.
//!
//! Two sources name endpoints:
//! - **Reported**: a sidecar's `ReplicaStats.endpoint` (`--engine-api-address`), recorded on
//!   every server that applies the update (locally, or from the replication stream, so every
//!   picker replica learns the same map).
//! - **File**: `--epp-endpoints-file`, a JSON list of `{"replica_id", "endpoint", "models"}`
//!   re-read when it changes (deployments whose sidecars report no address). A file entry names
//!   a live candidate for its models even before its replica reports anything.
//!
//! A reported address wins over the file's for the same replica. Invariant: the map never
//! grows past [`MAX_REPLICAS`] reported entries (new replicas past it are ignored and counted),
//! so renamed pods cannot grow it without bound for longer than [`REPORTED_TTL`].

use parking_lot::RwLock;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// Reported endpoints kept at most.
pub const MAX_REPLICAS: usize = 65_536;
/// A reported endpoint not refreshed for this long is dropped (the sidecar reports every
/// `--stats-interval`, 10 s by default).
pub const REPORTED_TTL: Duration = Duration::from_secs(15 * 60);

/// One line of the endpoints file.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub replica_id: String,
    pub endpoint: String,
    /// Models served there; empty: every model.
    #[serde(default)]
    pub models: Vec<String>,
}

/// Parses and validates an endpoints file's text.
pub fn parse_file(text: &str) -> anyhow::Result<Vec<FileEntry>> {
    let entries: Vec<FileEntry> = serde_json::from_str(text)
        .map_err(|e| anyhow::anyhow!("endpoints file is not a JSON list of entries: {e}"))?;
    for entry in &entries {
        if entry.replica_id.is_empty() {
            anyhow::bail!("endpoints file: an entry has an empty replica_id");
        }
        if !valid_endpoint(&entry.endpoint) {
            anyhow::bail!(
                "endpoints file: replica {:?} has endpoint {:?}, not ip:port",
                entry.replica_id,
                entry.endpoint
            );
        }
    }
    Ok(entries)
}

/// An endpoint is a literal `ip:port` (what Envoy's override_host matches against its hosts).
pub fn valid_endpoint(endpoint: &str) -> bool {
    endpoint.parse::<SocketAddr>().is_ok()
}

#[derive(Debug, Clone)]
struct Reported {
    endpoint: String,
    seen: Instant,
}

/// The registry (one per server; cheap when the picker is off).
#[derive(Debug, Default)]
pub struct Registry {
    reported: RwLock<HashMap<String, Reported>>,
    file: RwLock<Arc<Vec<FileEntry>>>,
    in_flight: RwLock<HashMap<String, Arc<AtomicU32>>>,
    /// Reported endpoints ignored at the cap, or not `ip:port`.
    pub refused: AtomicU64,
}

impl Registry {
    /// Records a sidecar-reported endpoint (empty: nothing reported, the last one stays).
    pub fn observe(&self, replica_id: &str, endpoint: &str) {
        if endpoint.is_empty() || replica_id.is_empty() {
            return;
        }
        if !valid_endpoint(endpoint) {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let now = Instant::now();
        {
            let read = self.reported.read();
            if read.get(replica_id).is_some_and(|r| {
                r.endpoint == endpoint && now.duration_since(r.seen) < REPORTED_TTL / 4
            }) {
                return;
            }
        }
        let mut map = self.reported.write();
        if !map.contains_key(replica_id) && map.len() >= MAX_REPLICAS {
            map.retain(|_, r| now.duration_since(r.seen) < REPORTED_TTL);
            if map.len() >= MAX_REPLICAS {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        map.insert(
            replica_id.to_owned(),
            Reported {
                endpoint: endpoint.to_owned(),
                seen: now,
            },
        );
    }

    /// Replaces the file's entries.
    pub fn replace_file(&self, entries: Vec<FileEntry>) {
        *self.file.write() = Arc::new(entries);
    }

    /// The endpoint serving `replica_id` (reported first, then the file).
    pub fn endpoint_of(&self, replica_id: &str) -> Option<String> {
        if let Some(r) = self.reported.read().get(replica_id)
            && r.seen.elapsed() < REPORTED_TTL
        {
            return Some(r.endpoint.clone());
        }
        self.file
            .read()
            .iter()
            .find(|e| e.replica_id == replica_id)
            .map(|e| e.endpoint.clone())
    }

    /// Every replica with an endpoint (reported or in the file).
    pub fn all_replicas(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .reported
            .read()
            .iter()
            .filter(|(_, r)| r.seen.elapsed() < REPORTED_TTL)
            .map(|(k, _)| k.clone())
            .collect();
        out.extend(self.file.read().iter().map(|e| e.replica_id.clone()));
        out
    }

    /// File entries serving `model` (replica id, endpoint).
    pub fn file_replicas(&self, model: &str) -> Vec<(String, String)> {
        self.file
            .read()
            .iter()
            .filter(|e| e.models.is_empty() || e.models.iter().any(|m| m == model))
            .map(|e| (e.replica_id.clone(), e.endpoint.clone()))
            .collect()
    }

    /// The in-flight counter of `endpoint`.
    pub fn in_flight(&self, endpoint: &str) -> Arc<AtomicU32> {
        if let Some(c) = self.in_flight.read().get(endpoint) {
            return c.clone();
        }
        let mut map = self.in_flight.write();
        // Endpoints are bounded by the reported and file maps; prune idle counters past them.
        if map.len() >= 2 * MAX_REPLICAS {
            map.retain(|_, c| c.load(Ordering::Relaxed) > 0);
        }
        map.entry(endpoint.to_owned()).or_default().clone()
    }
}

/// Holds one in-flight unit of an endpoint; released on drop (the stream ended however it
/// ended: response done, gateway gone, error).
#[derive(Debug)]
pub struct InFlight {
    counter: Arc<AtomicU32>,
    pub endpoint: String,
}

impl InFlight {
    pub fn acquire(registry: &Registry, endpoint: &str) -> Self {
        let counter = registry.in_flight(endpoint);
        counter.fetch_add(1, Ordering::Relaxed);
        Self {
            counter,
            endpoint: endpoint.to_owned(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let _ = self
            .counter
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
    }
}

/// Re-reads the endpoints file every `period` when its modification time or length changes;
/// a file that fails to read or parse keeps the previous entries (logged). `outcome` hears of
/// every re-read (`true`: the entries were replaced).
pub fn spawn_file_reloader(
    path: PathBuf,
    registry: Arc<Registry>,
    period: Duration,
    outcome: impl Fn(bool) + Send + 'static,
) {
    tokio::spawn(async move {
        let mut last: Option<(SystemTime, u64)> = stamp(&path);
        loop {
            tokio::time::sleep(period).await;
            let now = stamp(&path);
            if now == last {
                continue;
            }
            last = now;
            match load_file(&path) {
                Ok(entries) => {
                    tracing::info!(path = %path.display(), entries = entries.len(), "epp_endpoints_reloaded");
                    registry.replace_file(entries);
                    outcome(true);
                }
                Err(err) => {
                    tracing::error!(
                        path = %path.display(),
                        err = %format!("{err:#}"),
                        effect = "the last good entries stay",
                        "epp_endpoints_reload_failed"
                    );
                    outcome(false);
                }
            }
        }
    });
}

/// Reads and parses the endpoints file.
pub fn load_file(path: &Path) -> anyhow::Result<Vec<FileEntry>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    parse_file(&text)
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_wins_over_file_and_empty_keeps_the_last() {
        let registry = Registry::default();
        registry.replace_file(
            parse_file(
                r#"[{"replica_id":"r1","endpoint":"10.0.0.1:8000"},
                    {"replica_id":"r2","endpoint":"10.0.0.2:8000","models":["m"]}]"#,
            )
            .unwrap(),
        );
        assert_eq!(registry.endpoint_of("r1").as_deref(), Some("10.0.0.1:8000"));
        registry.observe("r1", "10.0.0.9:8000");
        assert_eq!(registry.endpoint_of("r1").as_deref(), Some("10.0.0.9:8000"));
        registry.observe("r1", "");
        assert_eq!(registry.endpoint_of("r1").as_deref(), Some("10.0.0.9:8000"));
        registry.observe("r3", "not an address");
        assert_eq!(registry.endpoint_of("r3"), None);
        assert_eq!(registry.refused.load(Ordering::Relaxed), 1);
        assert_eq!(registry.file_replicas("m").len(), 2);
        assert_eq!(
            registry.file_replicas("other"),
            vec![("r1".to_owned(), "10.0.0.1:8000".to_owned())]
        );
    }

    #[test]
    fn bad_files_are_refused_with_context() {
        assert!(parse_file("{}").is_err());
        assert!(parse_file(r#"[{"replica_id":"","endpoint":"1.2.3.4:1"}]"#).is_err());
        let err = parse_file(r#"[{"replica_id":"r","endpoint":"host:80"}]"#).unwrap_err();
        assert!(err.to_string().contains("not ip:port"), "{err}");
        assert!(parse_file(r#"[{"replica_id":"r","endpoint":"1.2.3.4:1","x":1}]"#).is_err());
    }

    #[test]
    fn in_flight_counts_and_releases() {
        let registry = Registry::default();
        let a = InFlight::acquire(&registry, "1.1.1.1:1");
        let b = InFlight::acquire(&registry, "1.1.1.1:1");
        assert_eq!(registry.in_flight("1.1.1.1:1").load(Ordering::Relaxed), 2);
        drop(a);
        drop(b);
        assert_eq!(registry.in_flight("1.1.1.1:1").load(Ordering::Relaxed), 0);
    }
}
