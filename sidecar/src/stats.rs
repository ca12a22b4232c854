//! Stats path (spec `sidecar.md` §8–§9): scrape the engine's `/metrics`, derive
//! `ReplicaStats`, send stats-only updates on an interval, and log staleness transitions.

use crate::client::Sink;
use crate::metrics::{Deriver, parse_exposition};
use crate::reporter::Identity;
use crate::scrape_client::MetricsClient;
use inferencecache_proto::v1alpha1::CacheStateUpdate;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// Consecutive non-deliveries that make the load signal stale.
pub const STALE_THRESHOLD: u32 = 3;

/// What the staleness state machine wants logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleLog {
    /// Failures 1–2.
    Warn { consecutive: u32 },
    /// The threshold failure: one ERROR `load_signal_stale`.
    Stale {
        consecutive: u32,
        never_delivered: bool,
    },
    /// Failures past the threshold.
    Debug { consecutive: u32 },
    /// First success after ≥ threshold failures: one INFO `load_signal_recovered`.
    Recovered { after_failures: u32 },
    /// Nothing to log.
    Quiet,
}

/// Consecutive non-delivery tracking (§9).
#[derive(Debug, Clone, Default)]
pub struct Staleness {
    failures: u32,
    delivered_once: bool,
}

impl Staleness {
    /// A fresh machine (nothing delivered yet).
    pub fn new() -> Self {
        Self::default()
    }

    /// Consecutive failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether any delivery succeeded yet.
    pub fn delivered_once(&self) -> bool {
        self.delivered_once
    }

    /// Records a non-delivery.
    pub fn failure(&mut self) -> StaleLog {
        self.failures = self.failures.saturating_add(1);
        let n = self.failures;
        if n < STALE_THRESHOLD {
            StaleLog::Warn { consecutive: n }
        } else if n == STALE_THRESHOLD {
            StaleLog::Stale {
                consecutive: n,
                never_delivered: !self.delivered_once,
            }
        } else {
            StaleLog::Debug { consecutive: n }
        }
    }

    /// Records a delivery.
    pub fn success(&mut self) -> StaleLog {
        let n = std::mem::take(&mut self.failures);
        self.delivered_once = true;
        if n >= STALE_THRESHOLD {
            StaleLog::Recovered { after_failures: n }
        } else {
            StaleLog::Quiet
        }
    }
}

/// Emits the log line for a state-machine decision.
pub fn emit(log: StaleLog, err: &str) {
    match log {
        StaleLog::Warn { consecutive } => warn!(
            consecutive_failures = consecutive,
            err, "load_signal_failed"
        ),
        StaleLog::Stale {
            consecutive,
            never_delivered: true,
        } => error!(consecutive_failures = consecutive, err, "load_signal_stale"),
        StaleLog::Stale { consecutive, .. } => {
            error!(consecutive_failures = consecutive, err, "load_signal_stale")
        }
        StaleLog::Debug { consecutive } => debug!(
            consecutive_failures = consecutive,
            err, "load_signal_failed"
        ),
        StaleLog::Recovered { after_failures } => info!(after_failures, "load_signal_recovered"),
        StaleLog::Quiet => {}
    }
}

/// `--engine-metrics-url`'s default. Scrape failures against it before any delivery mean the
/// operator did not point the sidecar at an engine's metrics (the README quick start): one
/// INFO `engine_metrics_unavailable`, then DEBUG, never the WARN/ERROR staleness sequence of a
/// configured endpoint that stops answering.
pub const DEFAULT_ENGINE_METRICS_URL: &str = "http://127.0.0.1:8000/metrics";

/// What to log for a decision of `staleness` (after it recorded the attempt) for `url`.
pub fn emit_for(url: &str, staleness: &Staleness, log: StaleLog, err: &str) {
    let unconfigured = url == DEFAULT_ENGINE_METRICS_URL && !staleness.delivered_once();
    match log {
        StaleLog::Warn { consecutive: 1 } if unconfigured => info!(
            url,
            err,
            note = "no load statistics until this endpoint answers (--engine-metrics-url)",
            "engine_metrics_unavailable"
        ),
        StaleLog::Warn { consecutive }
        | StaleLog::Stale { consecutive, .. }
        | StaleLog::Debug { consecutive }
            if unconfigured =>
        {
            debug!(
                consecutive_failures = consecutive,
                err, "load_signal_failed"
            )
        }
        other => emit(other, err),
    }
}

/// Wall clock in µs.
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// The stats reporter.
pub struct StatsReporter<S: Sink> {
    pub identity: Identity,
    pub url: String,
    pub client: MetricsClient,
    pub interval: Duration,
    pub deriver: Deriver,
    /// The engine's API address (`ReplicaStats.endpoint`; empty: not reported).
    pub endpoint: String,
    pub sink: S,
    pub staleness: Staleness,
}

impl<S: Sink> StatsReporter<S> {
    /// One scrape + delivery attempt; returns the error text on non-delivery.
    pub async fn tick(&mut self) -> Result<(), String> {
        let body = self
            .client
            .get(&self.url)
            .await
            .map_err(|e| e.to_string())?;
        let stats = self
            .deriver
            .derive(&parse_exposition(&body))
            .map_err(|e| e.to_string())?;
        let update = CacheStateUpdate {
            replica_id: self.identity.replica_id.clone(),
            model_id: self.identity.model_id.clone(),
            tenant_id: self.identity.tenant_id.clone(),
            hash_scheme: self.identity.hash_scheme.clone(),
            timestamp_us: now_us(),
            prefixes: Vec::new(),
            stats: Some(inferencecache_proto::v1alpha1::ReplicaStats {
                replica_id: self.identity.replica_id.clone(),
                endpoint: self.endpoint.clone(),
                ..stats
            }),
            adapter_id: String::new(),
        };
        let outcome = self.sink.report(update).await;
        // A stats-only update is an RPC to the server like any other: its outcome is the
        // sidecar's view of whether the server is reachable (`/readyz`).
        crate::exporter::server_health().record(outcome.is_ok());
        match outcome {
            Ok(ack) if ack.accepted => Ok(()),
            Ok(_) => Err("Ack.accepted = false".into()),
            Err(s) => Err(format!("{:?}: {}", s.code(), s.message())),
        }
    }

    /// One tick plus the staleness bookkeeping and logging.
    pub async fn tick_and_log(&mut self) -> StaleLog {
        match self.tick().await {
            Ok(()) => {
                let log = self.staleness.success();
                emit_for(&self.url, &self.staleness, log, "");
                log
            }
            Err(e) => {
                let log = self.staleness.failure();
                emit_for(&self.url, &self.staleness, log, &e);
                log
            }
        }
    }

    /// Ticks every interval (first tick after one interval) until cancelled.
    pub async fn run(mut self, cancel: CancellationToken) {
        let start = tokio::time::Instant::now() + self.interval;
        let mut ticker = tokio::time::interval_at(start, self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = ticker.tick() => {
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = self.tick_and_log() => {}
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_machine() {
        let mut s = Staleness::new();
        assert_eq!(s.failure(), StaleLog::Warn { consecutive: 1 });
        assert_eq!(s.failure(), StaleLog::Warn { consecutive: 2 });
        assert_eq!(
            s.failure(),
            StaleLog::Stale {
                consecutive: 3,
                never_delivered: true
            }
        );
        assert_eq!(s.failure(), StaleLog::Debug { consecutive: 4 });
        assert_eq!(s.success(), StaleLog::Recovered { after_failures: 4 });
        assert_eq!(s.failure(), StaleLog::Warn { consecutive: 1 });
        assert_eq!(s.success(), StaleLog::Quiet);
    }
}
