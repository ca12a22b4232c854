//! Stats path (spec `sidecar.md` §8–§9): scrape the engine's `/metrics`, derive
//! `ReplicaStats`, send stats-only updates on an interval, and log staleness transitions.

use crate::client::Sink;
use crate::metrics::{Deriver, ScrapeError, parse_exposition};
use crate::reporter::Identity;
use inferencecache_proto::v1alpha1::CacheStateUpdate;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// Scrape timeout.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// Consecutive non-deliveries that make the load signal stale.
pub const STALE_THRESHOLD: u32 = 3;

/// Plain HTTP/1.1 GET of an `http://host[:port]/path` URL; returns the body of a 200 response.
pub async fn http_get(url: &str) -> Result<String, ScrapeError> {
    match tokio::time::timeout(SCRAPE_TIMEOUT, http_get_inner(url)).await {
        Ok(r) => r,
        Err(_) => Err(ScrapeError(format!("GET {url}: timed out"))),
    }
}

async fn http_get_inner(url: &str) -> Result<String, ScrapeError> {
    let e = |m: String| ScrapeError(format!("GET {url}: {m}"));
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| e("only http:// URLs are supported".into()))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        && !authority.ends_with(']')
    {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let mut stream = TcpStream::connect(&addr)
        .await
        .map_err(|err| e(err.to_string()))?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\nUser-Agent: inferencecache-sidecar\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(req.as_bytes())
        .await
        .map_err(|err| e(err.to_string()))?;
    let mut buf = Vec::new();
    stream
        .read_to_end(&mut buf)
        .await
        .map_err(|err| e(err.to_string()))?;
    parse_http_response(&buf).map_err(e)
}

/// Parses a complete HTTP/1.1 response (Content-Length, chunked or read-to-close body).
pub fn parse_http_response(buf: &[u8]) -> Result<String, String> {
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("truncated response head")?;
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| "non-UTF-8 response head")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let code: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    if code != 200 {
        return Err(format!("status {code}"));
    }
    let mut chunked = false;
    let mut length: Option<usize> = None;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked") {
                chunked = true;
            } else if k == "content-length" {
                length = v.parse().ok();
            }
        }
    }
    let body = &buf[head_end + 4..];
    let body = if chunked {
        dechunk(body)?
    } else if let Some(n) = length {
        body.get(..n).ok_or("truncated body")?.to_vec()
    } else {
        body.to_vec()
    };
    String::from_utf8(body).map_err(|_| "non-UTF-8 body".to_string())
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk size")?;
        let size_str = std::str::from_utf8(&b[..eol]).map_err(|_| "bad chunk size")?;
        let size_str = size_str.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_str, 16).map_err(|_| "bad chunk size")?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(b.get(..size).ok_or("truncated chunk")?);
        b = b.get(size + 2..).ok_or("truncated chunk")?;
    }
}

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
            err, "engine load stats update failed; will retry"
        ),
        StaleLog::Stale {
            consecutive,
            never_delivered: true,
        } => error!(
            event = "load_signal_stale",
            consecutive_failures = consecutive,
            err,
            "engine load stats were never delivered; the server has no load signal for this replica"
        ),
        StaleLog::Stale { consecutive, .. } => error!(
            event = "load_signal_stale",
            consecutive_failures = consecutive,
            err,
            "engine load stats are stale; the server keeps the last delivered sample"
        ),
        StaleLog::Debug { consecutive } => debug!(
            consecutive_failures = consecutive,
            err, "engine load stats update failed again"
        ),
        StaleLog::Recovered { after_failures } => info!(
            event = "load_signal_recovered",
            after_failures, "engine load stats delivered again"
        ),
        StaleLog::Quiet => {}
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
    pub interval: Duration,
    pub deriver: Deriver,
    pub sink: S,
    pub staleness: Staleness,
}

impl<S: Sink> StatsReporter<S> {
    /// One scrape + delivery attempt; returns the error text on non-delivery.
    pub async fn tick(&mut self) -> Result<(), String> {
        let body = http_get(&self.url).await.map_err(|e| e.to_string())?;
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
                ..stats
            }),
            adapter_id: String::new(),
        };
        match self.sink.report(update).await {
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
                emit(log, "");
                log
            }
            Err(e) => {
                let log = self.staleness.failure();
                emit(log, &e);
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
    fn http_parsing() {
        assert_eq!(
            parse_http_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef").unwrap(),
            "abc"
        );
        assert_eq!(
            parse_http_response(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
            )
            .unwrap(),
            "abcde"
        );
        assert_eq!(
            parse_http_response(b"HTTP/1.0 200 OK\r\n\r\nall").unwrap(),
            "all"
        );
        assert!(parse_http_response(b"HTTP/1.1 404 Not Found\r\n\r\n").is_err());
        assert!(parse_http_response(b"HTTP/1.1 200").is_err());
    }

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
