//! The endpoint picker's counters: picks by reason, fallback-list length, served against
//! picked, body failures, the picker's own latency and endpoints-file reloads. They live in the
//! metrics room, not with the picker, so that the server's state holds them without importing
//! the picker (they are rendered on `/metrics` whether or not the picker runs).

use super::Family;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a pick came out as it did (`reason` label of `inferencecache_epp_picks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickReason {
    /// The first endpoint holds part of the prompt.
    Prefix,
    /// No endpoint holds any of it (or the prompt was unusable): by load alone.
    Load,
    /// No candidate endpoint: 503.
    NoEndpoint,
    /// Every candidate over `--epp-shed-in-flight`: 429.
    Shed,
    /// The body is not JSON: 400.
    BadRequest,
}

impl PickReason {
    const ALL: [PickReason; 5] = [
        PickReason::Prefix,
        PickReason::Load,
        PickReason::NoEndpoint,
        PickReason::Shed,
        PickReason::BadRequest,
    ];

    pub fn label(self) -> &'static str {
        match self {
            PickReason::Prefix => "prefix",
            PickReason::Load => "load",
            PickReason::NoEndpoint => "no_endpoint",
            PickReason::Shed => "shed",
            PickReason::BadRequest => "bad_request",
        }
    }
}

const LIST_BUCKETS: [u64; 5] = [1, 2, 3, 4, 8];
const LATENCY_BUCKETS_US: [u64; 11] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 50_000,
];
const BODY_FAILURES: [&str; 6] = [
    "too_large",
    "not_json",
    "missing_model",
    "missing_prompt",
    "tokenizer",
    "stream_closed",
];

/// The picker's counters (rendered on `/metrics` whether or not the picker runs).
#[derive(Debug, Default)]
pub struct EppMetrics {
    picks: [AtomicU64; 5],
    list_buckets: [AtomicU64; LIST_BUCKETS.len()],
    list_sum: AtomicU64,
    list_count: AtomicU64,
    served_picked: AtomicU64,
    served_fallback: AtomicU64,
    served_other: AtomicU64,
    body_failures: [AtomicU64; BODY_FAILURES.len()],
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_US.len()],
    latency_sum_us: AtomicU64,
    latency_count: AtomicU64,
    /// `--epp-endpoints-file` re-reads: [loaded, failed].
    endpoints_reloads: [AtomicU64; 2],
}

impl EppMetrics {
    pub(crate) fn pick(&self, reason: PickReason, list_length: usize, elapsed: Duration) {
        let index = PickReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(0);
        self.picks[index].fetch_add(1, Ordering::Relaxed);
        if list_length > 0 {
            let length = list_length as u64;
            for (bucket, bound) in self.list_buckets.iter().zip(LIST_BUCKETS) {
                if length <= bound {
                    bucket.fetch_add(1, Ordering::Relaxed);
                }
            }
            self.list_sum.fetch_add(length, Ordering::Relaxed);
            self.list_count.fetch_add(1, Ordering::Relaxed);
        }
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        for (bucket, bound) in self.latency_buckets.iter().zip(LATENCY_BUCKETS_US) {
            if micros <= bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_sum_us.fetch_add(micros, Ordering::Relaxed);
        self.latency_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a body (or stream) that gave no prompt.
    pub fn body_failure(&self, label: &str) {
        if let Some(i) = BODY_FAILURES.iter().position(|l| *l == label) {
            self.body_failures[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one re-read of `--epp-endpoints-file` (`loaded`: its entries replaced the
    /// previous ones; else it failed and the last good entries stay).
    pub fn endpoints_reload(&self, loaded: bool) {
        self.endpoints_reloads[usize::from(!loaded)].fetch_add(1, Ordering::Relaxed);
    }

    /// Records the gateway's `x-gateway-destination-endpoint-served` against the pick.
    pub fn served(&self, picked: &[String], served: &str) {
        let counter = match picked.iter().position(|p| p == served) {
            Some(0) => &self.served_picked,
            Some(_) => &self.served_fallback,
            None => &self.served_other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The picker's metric families.
    pub fn families(&self) -> Vec<Family> {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let mut picks = Family::new(
            "inferencecache_epp_picks_total",
            "counter",
            "endpoint-picker decisions by reason",
        );
        for (reason, count) in PickReason::ALL.iter().zip(&self.picks) {
            picks.push(
                "inferencecache_epp_picks_total",
                vec![("reason".into(), reason.label().into())],
                load(count),
            );
        }
        let mut list = Family::new(
            "inferencecache_epp_endpoint_list_length",
            "histogram",
            "endpoints in each routed answer (picked + fallbacks)",
        );
        for (bucket, bound) in self.list_buckets.iter().zip(LIST_BUCKETS) {
            list.push(
                "inferencecache_epp_endpoint_list_length_bucket",
                vec![("le".into(), bound.to_string())],
                load(bucket),
            );
        }
        list.push(
            "inferencecache_epp_endpoint_list_length_bucket",
            vec![("le".into(), "+Inf".into())],
            load(&self.list_count),
        );
        list.push(
            "inferencecache_epp_endpoint_list_length_sum",
            Vec::new(),
            load(&self.list_sum),
        );
        list.push(
            "inferencecache_epp_endpoint_list_length_count",
            Vec::new(),
            load(&self.list_count),
        );
        let mut served = Family::new(
            "inferencecache_epp_served_total",
            "counter",
            "responses by the endpoint that served them",
        );
        for (outcome, count) in [
            ("picked", &self.served_picked),
            ("fallback", &self.served_fallback),
            ("other", &self.served_other),
        ] {
            served.push(
                "inferencecache_epp_served_total",
                vec![("outcome".into(), outcome.into())],
                load(count),
            );
        }
        let mut failures = Family::new(
            "inferencecache_epp_body_parse_failures_total",
            "counter",
            "requests whose body gave no usable prompt",
        );
        for (label, count) in BODY_FAILURES.iter().zip(&self.body_failures) {
            failures.push(
                "inferencecache_epp_body_parse_failures_total",
                vec![("reason".into(), (*label).into())],
                load(count),
            );
        }
        let mut latency = Family::new(
            "inferencecache_epp_pick_latency_seconds",
            "histogram",
            "time from the complete body to the picker's answer (parse, tokenize, lookup, rank)",
        );
        for (bucket, bound) in self.latency_buckets.iter().zip(LATENCY_BUCKETS_US) {
            latency.push(
                "inferencecache_epp_pick_latency_seconds_bucket",
                vec![("le".into(), format!("{}", bound as f64 / 1e6))],
                load(bucket),
            );
        }
        latency.push(
            "inferencecache_epp_pick_latency_seconds_bucket",
            vec![("le".into(), "+Inf".into())],
            load(&self.latency_count),
        );
        latency.push(
            "inferencecache_epp_pick_latency_seconds_sum",
            Vec::new(),
            load(&self.latency_sum_us) / 1e6,
        );
        latency.push(
            "inferencecache_epp_pick_latency_seconds_count",
            Vec::new(),
            load(&self.latency_count),
        );
        let mut reloads = Family::new(
            "inferencecache_epp_endpoints_file_reloads_total",
            "counter",
            "re-reads of the endpoints file after it changed, by outcome",
        );
        for (outcome, count) in ["loaded", "failed"].iter().zip(&self.endpoints_reloads) {
            reloads.push(
                "inferencecache_epp_endpoints_file_reloads_total",
                vec![("outcome".into(), (*outcome).into())],
                load(count),
            );
        }
        vec![picks, list, served, failures, latency, reloads]
    }
}
