//! Server metrics (spec `server.md` §11): the reference's names, labels and buckets plus ours.
//!
//! Storage is plain atomics, looked up without allocation on the request path (per-model series
//! live in a lock-free map keyed by the model string). Index-only lookup latency goes into
//! per-thread HDR histograms, each behind a mutex only the scraper ever contends for, merged at
//! scrape time into a summary over a sliding window.
//!
//! Per-model series are bounded: a model gets its own `lookup_route_*` and `index_entries`
//! series only while the index holds it ([`Index::holds_model`]) and only for the first
//! `--max-metric-models` such models; every other lookup and entry is counted under
//! `model="_other"`. So a lookup never creates a series for an id the index does not hold, and
//! a model's series go away at the first scrape after the index lets the model go. A model's
//! `lookup_route_latency_seconds` histogram (like `_other`'s) appears with its first lookup: a
//! scrape would otherwise render an empty 19-sample histogram for every held model admitted.
//!
//! Exposition is produced from one structured snapshot ([`Metrics::gather`]) so that `/metrics`
//! (Prometheus text format 0.0.4) and `StreamMetrics` report exactly the same samples. The
//! families and their text rendering come from the workspace's `inferencecache-exposition`
//! crate, which the sidecar's `/metrics` shares.

pub mod epp;
pub mod process;
pub mod tokenizer;

pub use inferencecache_exposition::{Family, Sample, format_float, render_text};

use crate::translate::Reason;
use hdrhistogram::Histogram;
use inferencecache_engine::{Algorithm, EvictionReason, Index};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// `lookup_route_latency_seconds` buckets: the reference's ten (from 100 µs), preceded by six
/// that resolve microseconds, where nearly every index-served lookup lands. Every reference
/// boundary is kept, so queries written against the reference's `le` values still work.
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, // microsecond resolution
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, // the reference's
];

/// Event type names for `events_total{type}` (index = wire value; unknown → 0).
pub const EVENT_TYPES: [&str; 5] = [
    "TYPE_UNSPECIFIED",
    "PREFIX_ADDED",
    "PREFIX_EVICTED",
    "REPLICA_UPDATED",
    "ALL_CLEARED",
];

/// Default `--max-metric-models`.
pub const DEFAULT_MAX_METRIC_MODELS: usize = 1_000;

/// The `model` label of what is counted outside the per-model series.
pub const OTHER_MODEL: &str = "_other";

/// Auth outcomes of the control-plane routes.
pub const AUTH_RESULTS: [&str; 4] = ["ok", "unauth", "forbidden", "error"];

#[derive(Default)]
struct ModelLookups {
    calls: [[AtomicU64; 2]; Reason::ALL.len()],
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// Window length of the index-latency summary.
const WINDOW: Duration = Duration::from_secs(30);

struct ThreadHistogram {
    current: Histogram<u64>,
    previous: Histogram<u64>,
    window: u64,
}

/// All server metrics.
pub struct Metrics {
    pub server_up: AtomicI64,
    pub grpc_tls_enabled: AtomicI64,
    /// Series of the admitted models (held by the index, at most `max_models`).
    lookups: papaya::HashMap<Box<str>, Arc<ModelLookups>>,
    /// Admitted models, counted with the map so concurrent admissions cannot pass the cap.
    admitted: AtomicUsize,
    max_models: usize,
    /// Lookups of every model without a series of its own.
    other: (Box<str>, Arc<ModelLookups>),
    /// gRPC connections being served, and those closed at accept by `--max-connections`.
    pub grpc_connections_open: AtomicI64,
    pub grpc_connections_refused: AtomicU64,
    events: [AtomicU64; EVENT_TYPES.len()],
    pub stream_events_dropped: AtomicU64,
    /// Inputs cut by the memory limits and producer waits (`docs/robustness.md`).
    pub limits: crate::limits::LimitCounters,
    producer_auth: [AtomicU64; 2],
    producer_auth_enabled: std::sync::atomic::AtomicBool,
    snapshot_auth: [AtomicU64; 4],
    policy_auth: [AtomicU64; 4],
    probe_auth: [AtomicU64; 4],
    index_latency: Mutex<Vec<Arc<Mutex<ThreadHistogram>>>>,
    index_latency_sum_ns: AtomicU64,
    index_latency_count: AtomicU64,
    origin: Instant,
}

thread_local! {
    static LOCAL_HISTOGRAM: std::cell::RefCell<Option<(usize, Arc<Mutex<ThreadHistogram>>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Control-plane audiences with auth counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthRoute {
    Snapshot,
    Policy,
    Probe,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::with_model_cap(DEFAULT_MAX_METRIC_MODELS)
    }

    /// Metrics with at most `max_models` models having series of their own.
    pub fn with_model_cap(max_models: usize) -> Self {
        Self {
            server_up: AtomicI64::new(0),
            grpc_tls_enabled: AtomicI64::new(0),
            lookups: papaya::HashMap::new(),
            admitted: AtomicUsize::new(0),
            max_models,
            other: (OTHER_MODEL.into(), Arc::default()),
            grpc_connections_open: AtomicI64::new(0),
            grpc_connections_refused: AtomicU64::new(0),
            events: Default::default(),
            stream_events_dropped: AtomicU64::new(0),
            limits: Default::default(),
            producer_auth: Default::default(),
            producer_auth_enabled: Default::default(),
            snapshot_auth: Default::default(),
            policy_auth: Default::default(),
            probe_auth: Default::default(),
            index_latency: Mutex::new(Vec::new()),
            index_latency_sum_ns: AtomicU64::new(0),
            index_latency_count: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }

    /// One LookupRoute call (step 17): calls{model, reason_code, hint_used} and latency{model},
    /// under `model="_other"` unless `index` holds the model and the cap leaves it a series.
    pub fn observe_lookup(
        &self,
        index: &Index,
        model: &str,
        reason: Reason,
        hint_used: bool,
        elapsed: Duration,
    ) {
        // The series is borrowed under the map's guard (held to the end): no reference count
        // per call.
        let guard = self.lookups.guard();
        let series: &ModelLookups = match self.lookups.get(model, &guard) {
            Some(s) => s,
            None if index.holds_model(model) => self.admit(model, &guard).unwrap_or(&self.other.1),
            None => &self.other.1,
        };
        series.calls[reason.slot()][usize::from(hint_used)].fetch_add(1, Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            if secs <= *le {
                series.buckets[i].fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
        series.count.fetch_add(1, Ordering::Relaxed);
        series.sum_ns.fetch_add(
            u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// A series for `model` if the cap has room (the caller checked that the index holds it).
    fn admit<'g>(&self, model: &str, guard: &'g impl papaya::Guard) -> Option<&'g ModelLookups> {
        if model == OTHER_MODEL {
            return None; // its lookups are the `_other` series' anyway
        }
        // A slot first, then the series: the map never holds more than `max_models`.
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_models).then_some(n + 1)
            })
            .ok()?;
        match self.lookups.try_insert_with(
            model.into(),
            || Arc::new(ModelLookups::default()),
            guard,
        ) {
            Ok(series) => Some(series),
            Err(existing) => {
                // Another call admitted it first: give the slot back.
                self.admitted.fetch_sub(1, Ordering::AcqRel);
                Some(existing)
            }
        }
    }

    /// Brings the admitted models in line with the index at a scrape: models the index no
    /// longer holds lose their series; held models without one get one while the cap allows
    /// (in name order). `held` is [`Index::entry_counts_by_model`], sorted by name.
    fn sync_models(&self, held: &[(Arc<str>, i64)]) {
        let guard = self.lookups.guard();
        let gone: Vec<Box<str>> = self
            .lookups
            .keys(&guard)
            .filter(|m| held.binary_search_by(|(h, _)| (**h).cmp(&***m)).is_err())
            .cloned()
            .collect();
        for model in gone {
            if self.lookups.remove(&model, &guard).is_some() {
                self.admitted.fetch_sub(1, Ordering::AcqRel);
            }
        }
        for (model, _) in held {
            if self.admitted.load(Ordering::Acquire) >= self.max_models {
                break;
            }
            if self.lookups.get(&**model, &guard).is_none() {
                let _ = self.admit(model, &guard);
            }
        }
    }

    /// Index-only duration of one LookupRoute index call.
    pub fn observe_index_latency(&self, elapsed: Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.index_latency_sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.index_latency_count.fetch_add(1, Ordering::Relaxed);
        let window = self.origin.elapsed().as_secs() / WINDOW.as_secs();
        let me = self as *const Self as usize;
        LOCAL_HISTOGRAM.with(|cell| {
            let mut cell = cell.borrow_mut();
            // Borrowed from the thread's cell: the Arc is cloned only when the slot is created.
            let (_, slot) = match &mut *cell {
                Some(mine) if mine.0 == me => mine,
                other => {
                    let slot = Arc::new(Mutex::new(ThreadHistogram {
                        current: new_histogram(),
                        previous: new_histogram(),
                        window,
                    }));
                    self.index_latency.lock().push(slot.clone());
                    other.insert((me, slot))
                }
            };
            let mut h = slot.lock();
            rotate(&mut h, window);
            let _ = h.current.record(ns);
        });
    }

    pub fn observe_event(&self, event_type: i32) {
        let idx = usize::try_from(event_type)
            .ok()
            .filter(|i| *i < EVENT_TYPES.len())
            .unwrap_or(0);
        self.events[idx].fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_producer_auth(&self, ok: bool) {
        self.producer_auth_enabled.store(true, Ordering::Relaxed);
        self.producer_auth[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_auth(&self, route: AuthRoute, result: &str) {
        let arr = match route {
            AuthRoute::Snapshot => &self.snapshot_auth,
            AuthRoute::Policy => &self.policy_auth,
            AuthRoute::Probe => &self.probe_auth,
        };
        if let Some(i) = AUTH_RESULTS.iter().position(|r| *r == result) {
            arr[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Snapshot of every metric family, in exposition order.
    pub fn gather(&self, index: &Index) -> Vec<Family> {
        let mut out = Vec::new();
        out.push(Family::gauge(
            "inferencecache_server_up",
            "1 while serving",
            self.server_up.load(Ordering::Relaxed) as f64,
        ));
        out.push(Family::gauge(
            "inferencecache_server_grpc_tls_enabled",
            "1 if gRPC terminates TLS",
            self.grpc_tls_enabled.load(Ordering::Relaxed) as f64,
        ));
        let mut entries = Family::new(
            "inferencecache_index_entries",
            "gauge",
            "distinct prefix keys per model",
        );
        let mut by_model = index.entry_counts_by_model();
        // Sorted by the engine already (names are unique). An unstable sort allocates nothing
        // and costs one pass over sorted input; a stable sort takes a scratch buffer as large as
        // the list, 24 B a held model at the scrape's peak (issue 42).
        by_model.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        self.sync_models(&by_model);
        let guard = self.lookups.guard();
        let mut other_entries = None;
        for (model, n) in by_model {
            if self.lookups.contains_key(&*model, &guard) {
                entries.push(
                    "inferencecache_index_entries",
                    vec![("model".into(), model.to_string())],
                    n as f64,
                );
            } else {
                *other_entries.get_or_insert(0) += n;
            }
        }
        if let Some(n) = other_entries {
            entries.push(
                "inferencecache_index_entries",
                vec![("model".into(), OTHER_MODEL.to_string())],
                n as f64,
            );
        }
        drop(guard);
        out.push(entries);

        let mut calls = Family::new(
            "inferencecache_lookup_route_calls_total",
            "counter",
            "LookupRoute calls",
        );
        let mut latency = Family::new(
            "inferencecache_lookup_route_latency_seconds",
            "histogram",
            "LookupRoute handler latency",
        );
        let guard = self.lookups.guard();
        let mut models: Vec<(&Box<str>, &Arc<ModelLookups>)> = self.lookups.iter(&guard).collect();
        models.sort_by(|a, b| a.0.cmp(b.0));
        if self.other.1.count.load(Ordering::Relaxed) > 0 {
            models.push((&self.other.0, &self.other.1));
        }
        for (model, s) in models {
            for reason in Reason::ALL {
                for hint in [false, true] {
                    let v = s.calls[reason.slot()][usize::from(hint)].load(Ordering::Relaxed);
                    if v > 0 {
                        calls.push(
                            "inferencecache_lookup_route_calls_total",
                            vec![
                                ("model".into(), model.to_string()),
                                ("reason_code".into(), reason.code().to_string()),
                                ("hint_used".into(), hint.to_string()),
                            ],
                            v as f64,
                        );
                    }
                }
            }
            let count = s.count.load(Ordering::Relaxed);
            if count == 0 {
                // A model's latency series start with its first lookup, as `_other`'s do: a
                // scrape renders 19 samples per series, and every held model is admitted at
                // the scrape up to the cap, looked up or not. Empty histograms for 1,000
                // models added 12-18 MiB to the peak RSS of a 20,000-model churn wave
                // (issue 42, bench/results/churn-waves.md).
                continue;
            }
            let mut cumulative = 0u64;
            for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
                cumulative += s.buckets[i].load(Ordering::Relaxed);
                latency.push(
                    "inferencecache_lookup_route_latency_seconds_bucket",
                    vec![
                        ("model".into(), model.to_string()),
                        ("le".into(), format_float(*le)),
                    ],
                    cumulative as f64,
                );
            }
            latency.push(
                "inferencecache_lookup_route_latency_seconds_bucket",
                vec![
                    ("model".into(), model.to_string()),
                    ("le".into(), "+Inf".into()),
                ],
                count as f64,
            );
            latency.push(
                "inferencecache_lookup_route_latency_seconds_sum",
                vec![("model".into(), model.to_string())],
                s.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
            );
            latency.push(
                "inferencecache_lookup_route_latency_seconds_count",
                vec![("model".into(), model.to_string())],
                count as f64,
            );
        }
        drop(guard);
        out.push(calls);
        out.push(latency);

        let mut tenant_evictions = Family::new(
            "inferencecache_tenant_evictions_total",
            "counter",
            "keys removed by tenant quota",
        );
        let mut by_tenant = index.tenant_evictions();
        by_tenant.sort();
        for (tenant, n) in by_tenant {
            tenant_evictions.push(
                "inferencecache_tenant_evictions_total",
                vec![
                    ("tenant_id".into(), tenant.to_string()),
                    ("reason".into(), "over_entries".into()),
                ],
                n as f64,
            );
        }
        out.push(tenant_evictions);
        let mut evictions = Family::new(
            "inferencecache_index_evictions_total",
            "counter",
            "storage entries evicted",
        );
        for alg in [Algorithm::Lru, Algorithm::Lfu] {
            for (reason, label) in [(EvictionReason::Cap, "cap"), (EvictionReason::Ttl, "ttl")] {
                let n = index.evictions(alg, reason);
                if n > 0 {
                    evictions.push(
                        "inferencecache_index_evictions_total",
                        vec![
                            ("algorithm".into(), alg.as_str().into()),
                            ("reason".into(), label.into()),
                        ],
                        n as f64,
                    );
                }
            }
        }
        out.push(evictions);
        for (name, arr) in [
            ("inferencecache_snapshot_auth_total", &self.snapshot_auth),
            ("inferencecache_policy_auth_total", &self.policy_auth),
            ("inferencecache_probe_auth_total", &self.probe_auth),
        ] {
            let mut fam = Family::new(name, "counter", "control-plane auth outcomes");
            for (i, result) in AUTH_RESULTS.iter().enumerate() {
                let v = arr[i].load(Ordering::Relaxed);
                if v > 0 {
                    fam.push(name, vec![("result".into(), result.to_string())], v as f64);
                }
            }
            out.push(fam);
        }
        out.push(Family::gauge(
            "inferencecache_index_storage_entries",
            "non-reserved storage entries",
            index.storage_entries() as f64,
        ));
        out.push(Family::gauge(
            "inferencecache_index_memory_bytes",
            "bytes held by the index",
            index.memory_bytes() as f64,
        ));
        let mut ingest = Family::new(
            "inferencecache_ingest_blocks_total",
            "counter",
            "key upserts applied by ingest",
        );
        ingest.push(
            "inferencecache_ingest_blocks_total",
            Vec::new(),
            index.ingest_blocks_total() as f64,
        );
        out.push(ingest);
        let mut events = Family::new(
            "inferencecache_events_total",
            "counter",
            "PublishEvent events received",
        );
        for (i, name) in EVENT_TYPES.iter().enumerate() {
            let v = self.events[i].load(Ordering::Relaxed);
            if v > 0 {
                events.push(
                    "inferencecache_events_total",
                    vec![("type".into(), name.to_string())],
                    v as f64,
                );
            }
        }
        out.push(events);
        let mut dropped = Family::new(
            "inferencecache_stream_events_dropped_total",
            "counter",
            "change events dropped for slow subscribers",
        );
        dropped.push(
            "inferencecache_stream_events_dropped_total",
            Vec::new(),
            self.stream_events_dropped.load(Ordering::Relaxed) as f64,
        );
        out.push(dropped);
        let mut limited = Family::new(
            "inferencecache_limit_exceeded_total",
            "counter",
            "inputs cut by a server limit (ingest refs or lookups), by limit",
        );
        for which in crate::limits::Exceeded::ALL {
            let v = self.limits.get(which);
            if v > 0 {
                limited.push(
                    "inferencecache_limit_exceeded_total",
                    vec![("limit".into(), which.label().into())],
                    v as f64,
                );
            }
        }
        out.push(limited);
        let mut throttled = Family::new(
            "inferencecache_producer_throttled_total",
            "counter",
            "producer messages and events delayed by the per-producer rate limit",
        );
        throttled.push(
            "inferencecache_producer_throttled_total",
            Vec::new(),
            self.limits.throttled() as f64,
        );
        out.push(throttled);
        out.push(Family::gauge(
            "inferencecache_grpc_connections_open",
            "gRPC connections being served",
            self.grpc_connections_open.load(Ordering::Relaxed) as f64,
        ));
        let mut refused = Family::new(
            "inferencecache_grpc_connections_refused_total",
            "counter",
            "gRPC connections closed at accept because --max-connections were open",
        );
        refused.push(
            "inferencecache_grpc_connections_refused_total",
            Vec::new(),
            self.grpc_connections_refused.load(Ordering::Relaxed) as f64,
        );
        out.push(refused);
        out.push(self.index_latency_family());
        if self.producer_auth_enabled.load(Ordering::Relaxed) {
            let mut fam = Family::new(
                "inferencecache_producer_auth_total",
                "counter",
                "producer auth outcomes",
            );
            for (i, result) in ["ok", "unauth"].iter().enumerate() {
                fam.push(
                    "inferencecache_producer_auth_total",
                    vec![("result".into(), result.to_string())],
                    self.producer_auth[i].load(Ordering::Relaxed) as f64,
                );
            }
            out.push(fam);
        }
        out.push(crate::metrics::process::build_info());
        out.extend(crate::metrics::process::process_families());
        out
    }

    fn index_latency_family(&self) -> Family {
        let name = "inferencecache_index_lookup_latency_seconds";
        let mut fam = Family::new(
            name,
            "summary",
            "index-only LookupRoute latency, quantiles over a sliding window of 30-60 s",
        );
        let window = self.origin.elapsed().as_secs() / WINDOW.as_secs();
        let mut merged = new_histogram();
        for slot in self.index_latency.lock().iter() {
            let mut h = slot.lock();
            rotate(&mut h, window);
            let _ = merged.add(&h.current);
            let _ = merged.add(&h.previous);
        }
        for q in [0.5, 0.9, 0.99, 0.999] {
            let v = if merged.is_empty() {
                f64::NAN
            } else {
                merged.value_at_quantile(q) as f64 / 1e9
            };
            fam.push(name, vec![("quantile".into(), format_float(q))], v);
        }
        fam.push(
            &format!("{name}_sum"),
            Vec::new(),
            self.index_latency_sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        );
        fam.push(
            &format!("{name}_count"),
            Vec::new(),
            self.index_latency_count.load(Ordering::Relaxed) as f64,
        );
        fam
    }
}

fn new_histogram() -> Histogram<u64> {
    // 1 ns .. 60 s with 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static histogram bounds are valid")
}

fn rotate(h: &mut ThreadHistogram, window: u64) {
    if h.window == window {
        return;
    }
    if h.window + 1 == window {
        std::mem::swap(&mut h.current, &mut h.previous);
    } else {
        h.previous.reset();
    }
    h.current.reset();
    h.window = window;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_escapes_and_formats() {
        let mut f = Family::new("x_total", "counter", "help");
        f.push("x_total", vec![("model".into(), "a\"b\\c\nd".into())], 3.0);
        let text = render_text(&[f]);
        assert!(text.contains("# TYPE x_total counter\n"));
        assert!(
            text.contains("x_total{model=\"a\\\"b\\\\c\\nd\"} 3\n"),
            "{text}"
        );
    }

    fn index_holding(models: &[&str]) -> Index {
        let config = inferencecache_engine::IndexConfig::default().normalized();
        let policies = Arc::new(crate::policy::PolicyStore::new(
            config.global_ttl_ms.saturating_mul(1_000_000),
        ));
        let clock = Arc::new(inferencecache_engine::ManualClock::new(1_000_000));
        let index = Index::new(config, policies, clock);
        for model in models {
            index.ingest(inferencecache_engine::CacheStateUpdate {
                replica_id: "r",
                model_id: model,
                tenant_id: "t",
                hash_scheme: "vllm",
                timestamp_us: 0,
                adapter_id: "",
                prefixes: std::iter::once(inferencecache_engine::PrefixRef {
                    prefix_hash: b"k",
                    token_count: 16,
                    block_hashes: &[] as &[Vec<u8>],
                    block_token_counts: &[],
                    tier: 0,
                    adapter_id: "",
                }),
                stats: None,
            });
        }
        index
    }

    #[test]
    fn latency_lands_in_the_right_bucket() {
        let m = Metrics::new();
        let index = index_holding(&["m"]);
        m.observe_lookup(
            &index,
            "m",
            Reason::NoHint,
            false,
            Duration::from_micros(300),
        );
        let guard = m.lookups.guard();
        let s = m.lookups.get("m", &guard).unwrap();
        let slot = LATENCY_BUCKETS.iter().position(|le| *le == 0.0005).unwrap();
        assert_eq!(
            s.buckets[slot].load(Ordering::Relaxed),
            1,
            "300 µs is in the 0.0005 bucket"
        );
        assert_eq!(
            s.buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .sum::<u64>(),
            1
        );
        assert_eq!(s.calls[3][0].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn microsecond_lookups_land_in_microsecond_buckets() {
        let m = Metrics::new();
        let names: Vec<String> = LATENCY_BUCKETS.iter().map(|le| format!("m{le}")).collect();
        let index = index_holding(&names.iter().map(String::as_str).collect::<Vec<_>>());
        for (elapsed, le) in [
            (Duration::from_nanos(800), 0.000001),
            (Duration::from_micros(2), 0.0000025),
            (Duration::from_micros(4), 0.000005),
            (Duration::from_micros(7), 0.00001),
            (Duration::from_micros(20), 0.000025),
            (Duration::from_micros(50), 0.00005),
            (Duration::from_micros(90), 0.0001),
        ] {
            m.observe_lookup(&index, &format!("m{le}"), Reason::NoHint, false, elapsed);
            let guard = m.lookups.guard();
            let s = m.lookups.get(format!("m{le}").as_str(), &guard).unwrap();
            let slot = LATENCY_BUCKETS.iter().position(|b| *b == le).unwrap();
            assert_eq!(
                s.buckets[slot].load(Ordering::Relaxed),
                1,
                "{elapsed:?} → le {le}"
            );
        }
        for reference in [
            0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
        ] {
            assert!(
                LATENCY_BUCKETS.contains(&reference),
                "reference bucket {reference} kept"
            );
        }
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn unknown_models_and_models_over_the_cap_count_as_other() {
        let m = Metrics::with_model_cap(2);
        let index = index_holding(&["a", "b", "c", OTHER_MODEL]);
        for model in ["zz", "a", "b", "c", OTHER_MODEL, "yy", "a"] {
            m.observe_lookup(
                &index,
                model,
                Reason::NoHint,
                false,
                Duration::from_micros(1),
            );
        }
        let guard = m.lookups.guard();
        let mut admitted: Vec<&str> = m.lookups.keys(&guard).map(|k| &**k).collect();
        admitted.sort();
        assert_eq!(
            admitted,
            ["a", "b"],
            "held models in arrival order, up to the cap"
        );
        assert_eq!(
            m.lookups
                .get("a", &guard)
                .unwrap()
                .count
                .load(Ordering::Relaxed),
            2
        );
        assert_eq!(
            m.other.1.count.load(Ordering::Relaxed),
            4,
            "zz, c, _other, yy"
        );
        drop(guard);
        let text = render_text(&m.gather(&index));
        assert!(
            text.contains("inferencecache_index_entries{model=\"a\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("inferencecache_index_entries{model=\"_other\"} 2\n"),
            "c and the model literally named _other: {text}"
        );
        assert!(
            text.contains(
                "inferencecache_lookup_route_latency_seconds_count{model=\"_other\"} 4\n"
            )
        );
        assert!(!text.contains("zz") && !text.contains("yy"), "{text}");
    }

    /// A held model admitted at a scrape has its entries gauge at once and its latency
    /// histogram from its first lookup on (as `_other`): no empty histogram per held model.
    #[test]
    fn latency_series_start_with_the_first_lookup() {
        let m = Metrics::with_model_cap(4);
        let index = index_holding(&["a", "b"]);
        let text = render_text(&m.gather(&index));
        assert!(
            text.contains("inferencecache_index_entries{model=\"a\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("inferencecache_index_entries{model=\"b\"} 1\n"),
            "{text}"
        );
        assert!(
            !text.contains("inferencecache_lookup_route_latency_seconds_count{"),
            "{text}"
        );
        m.observe_lookup(&index, "b", Reason::NoHint, false, Duration::from_micros(1));
        let text = render_text(&m.gather(&index));
        assert!(
            text.contains("inferencecache_lookup_route_latency_seconds_count{model=\"b\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "inferencecache_lookup_route_latency_seconds_bucket{model=\"b\",le=\"+Inf\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            !text.contains("inferencecache_lookup_route_latency_seconds_count{model=\"a\"}"),
            "{text}"
        );
    }

    #[test]
    fn series_go_with_the_model_and_free_their_slot() {
        let m = Metrics::with_model_cap(2);
        let held = |names: &[&str]| -> Vec<(Arc<str>, i64)> {
            names.iter().map(|n| (Arc::from(*n), 1)).collect()
        };
        m.sync_models(&held(&["a", "b", "c"]));
        let keys = |m: &Metrics| {
            let guard = m.lookups.guard();
            let mut k: Vec<String> = m.lookups.keys(&guard).map(|k| k.to_string()).collect();
            k.sort();
            k
        };
        assert_eq!(keys(&m), ["a", "b"]);
        // The index let `a` go: its series goes, and the freed slot admits `c`.
        m.sync_models(&held(&["b", "c"]));
        assert_eq!(keys(&m), ["b", "c"]);
        assert_eq!(m.admitted.load(Ordering::Relaxed), 2);
        m.sync_models(&held(&[]));
        assert!(keys(&m).is_empty());
        assert_eq!(m.admitted.load(Ordering::Relaxed), 0);
    }
}
