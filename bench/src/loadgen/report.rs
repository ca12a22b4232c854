//! The `ic-loadgen` report: JSON document, human summary and SVG latency plot.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use hdrhistogram::Histogram;
use plotters::prelude::*;
use serde::Serialize;

use super::Args;
use super::workload::{ConversationShape, InputForm};

/// Formats nanoseconds for humans (`812µs`, `1.42ms`).
pub fn fmt_ns(ns: u64) -> String {
    if ns >= 1_000_000_000 {
        format!("{:.2}s", ns as f64 / 1e9)
    } else if ns >= 1_000_000 {
        format!("{:.2}ms", ns as f64 / 1e6)
    } else {
        format!("{}µs", ns / 1_000)
    }
}

/// One summary row of latency percentiles (µs) in human units; labels are padded so the rows'
/// columns line up.
fn write_latency_row(s: &mut String, label: &str, p: &Percentiles) {
    let us = |v: f64| fmt_ns((v * 1e3) as u64);
    let _ = writeln!(
        s,
        "  {label:<24}p50 {}  p90 {}  p99 {}  p99.9 {}  max {}",
        us(p.p50),
        us(p.p90),
        us(p.p99),
        us(p.p999),
        us(p.max)
    );
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

impl Percentiles {
    fn from_scaled(h: &Histogram<u64>, to_us: f64) -> Self {
        let q = |x: f64| h.value_at_quantile(x) as f64 * to_us;
        Percentiles {
            count: h.len(),
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            p999: q(0.999),
            max: h.max() as f64 * to_us,
            mean: h.mean() * to_us,
        }
    }

    /// From a histogram of nanoseconds.
    pub fn from_ns(h: &Histogram<u64>) -> Self {
        Self::from_scaled(h, 1e-3)
    }

    /// From a histogram of microseconds.
    pub fn from_us(h: &Histogram<u64>) -> Self {
        Self::from_scaled(h, 1.0)
    }
}

/// One measured second of CO-corrected lookup latency (µs).
#[derive(Debug, Clone, Serialize)]
pub struct WindowStat {
    /// End of the window, seconds since the measurement started.
    pub t: f64,
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl WindowStat {
    /// From a window histogram of nanoseconds.
    pub fn from_hist(t: f64, h: &Histogram<u64>) -> Self {
        let p = Percentiles::from_ns(h);
        WindowStat {
            t,
            count: p.count,
            p50: p.p50,
            p90: p.p90,
            p99: p.p99,
            p999: p.p999,
            max: p.max,
        }
    }
}

/// Ground-truth scoring of the answers.
#[derive(Debug, Clone, Serialize)]
pub struct HitSection {
    /// `hits / lookups_with_prefix`: the top replica truly held the longest prefix any replica
    /// held.
    pub realized_hit_rate: f64,
    /// Measured OK lookups for which some replica truly held a prefix of the chain.
    pub lookups_with_prefix: u64,
    pub hits: u64,
    /// Share of OK lookups whose top `matched_tokens` (0 without scores) equals the true
    /// longest prefix in tokens.
    pub matched_tokens_exact_rate: f64,
    pub matched_tokens_exact: u64,
    /// Answers claiming more matched tokens than any replica truly holds.
    pub matched_over_truth: u64,
    /// Hit rate over the lookups where the replicas' prefixes differ (not every replica holds
    /// the longest one), i.e. where the ranking matters.
    pub contested_hit_rate: f64,
    pub contested_lookups: u64,
    /// `matched_tokens` exact among PREFIX_MATCH answers (AFFINITY_HINT answers carry 0).
    pub prefix_match_exact_rate: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LookupSection {
    pub offered_per_sec: f64,
    /// OK responses of requests due in the measured window, per measured second.
    pub achieved_per_sec: f64,
    /// Requests due in the measured window.
    pub issued: u64,
    /// OK responses among them.
    pub completed: u64,
    pub ok: u64,
    /// gRPC errors on LookupRoute, any phase (warm-up included).
    pub errors: u64,
    /// Intended send time → response (coordinated-omission-correct).
    pub latency_us: Percentiles,
    /// Actual send time → response.
    pub service_time_us: Percentiles,
    /// The server's own `lookup_latency_us`.
    pub server_lookup_latency_us: Percentiles,
    pub reason_codes: BTreeMap<String, u64>,
    pub hit: HitSection,
}

#[derive(Debug, Clone, Serialize)]
pub struct IngestSection {
    pub offered_blocks_per_sec: f64,
    pub achieved_blocks_per_sec: f64,
    pub updates_per_sec: f64,
    /// Whole run, warm-up included.
    pub blocks_total: u64,
    pub updates_total: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EventSection {
    pub offered_per_sec: f64,
    pub achieved_per_sec: f64,
    pub prefix_evicted_total: u64,
    pub all_cleared_total: u64,
    /// Evictions queued but not yet published at the end (events slower than churn).
    pub eviction_backlog: u64,
    /// (replica, block) entries the fleet truly held at the end.
    pub truth_entries_held: u64,
}

/// The run's settings, echoed into the report.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigEcho {
    pub target: String,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub replicas: usize,
    pub ingest_blocks_per_sec: f64,
    pub events_per_sec: f64,
    pub clear_interval_s: f64,
    pub lookup_rate: f64,
    pub max_inflight: usize,
    pub connections: usize,
    pub input: InputForm,
    // Flattened in place, so the JSON keeps its flat layout and key order.
    #[serde(flatten)]
    pub shape: ConversationShape,
    pub tenant: String,
    pub model: String,
    pub hash_scheme: String,
    pub seed: u64,
}

impl ConfigEcho {
    pub fn from_args(a: &Args) -> Self {
        ConfigEcho {
            target: a.target.clone(),
            duration_s: a.duration.as_secs_f64(),
            warmup_s: a.warmup.as_secs_f64(),
            replicas: a.replicas,
            ingest_blocks_per_sec: a.ingest_blocks_per_sec,
            events_per_sec: a.events_per_sec,
            clear_interval_s: a.clear_interval.as_secs_f64(),
            lookup_rate: a.lookup_rate,
            max_inflight: a.max_inflight,
            connections: a.connections,
            input: a.input,
            shape: a.conversation_shape(),
            tenant: a.tenant.clone(),
            model: a.model.clone(),
            hash_scheme: a.hash_scheme.clone(),
            seed: a.seed,
        }
    }
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub tool: String,
    pub started_unix_ms: u64,
    pub config: ConfigEcho,
    pub measured_seconds: f64,
    pub lookups: LookupSection,
    pub ingest: IngestSection,
    pub events: EventSection,
    /// LookupRoute gRPC errors by code; any entry makes the binary exit non-zero.
    pub consumer_errors: BTreeMap<String, u64>,
    /// ReportCacheState / PublishEvent errors by code (reported, not fatal).
    pub producer_errors: BTreeMap<String, u64>,
    /// Things that make the numbers harder to read (rates not reached, truth drift risks).
    pub warnings: Vec<String>,
    /// Per measured second.
    pub timeline: Vec<WindowStat>,
}

/// A plotted percentile: legend name, colour, value of a window.
type Series = (&'static str, RGBColor, fn(&WindowStat) -> f64);

/// Entry cap of a server with default settings (`--max-entries`).
const DEFAULT_SERVER_CAP: u64 = 1_000_000;

impl Report {
    /// Fills [`Report::warnings`] from the measured numbers.
    pub fn add_warnings(&mut self) {
        let mut w = Vec::new();
        let l = &self.lookups;
        if l.offered_per_sec > 0.0 && l.achieved_per_sec < 0.95 * l.offered_per_sec {
            w.push(format!(
                "lookups achieved {:.0}/s of {:.0}/s offered: the server (or this machine) is saturated; the CO-corrected latency includes the queueing",
                l.achieved_per_sec, l.offered_per_sec
            ));
        }
        let i = &self.ingest;
        if i.offered_blocks_per_sec > 0.0
            && i.achieved_blocks_per_sec < 0.95 * i.offered_blocks_per_sec
        {
            w.push(format!(
                "ingest achieved {:.0} of {:.0} blocks/s offered",
                i.achieved_blocks_per_sec, i.offered_blocks_per_sec
            ));
        }
        if self.events.eviction_backlog > 0 {
            w.push(format!(
                "{} evictions were still queued (--events-per-sec below the churn): the index grew during the run",
                self.events.eviction_backlog
            ));
        }
        if self.events.truth_entries_held > DEFAULT_SERVER_CAP * 9 / 10 {
            w.push(format!(
                "the fleet holds {} entries, near or over a default server's cap of {DEFAULT_SERVER_CAP}: cap evictions are invisible to the ground truth",
                self.events.truth_entries_held
            ));
        }
        self.warnings = w;
    }

    /// gRPC errors on consumer RPCs.
    pub fn consumer_error_count(&self) -> u64 {
        self.consumer_errors.values().sum()
    }

    /// Human-readable summary.
    pub fn summary(&self) -> String {
        let l = &self.lookups;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "ic-loadgen: {} for {:.1}s (+{:.1}s warm-up), {} replicas, input {:?}",
            self.config.target,
            self.measured_seconds,
            self.config.warmup_s,
            self.config.replicas,
            self.config.input
        );
        let _ = writeln!(
            s,
            "  lookups   offered {:.0}/s  achieved {:.0}/s  ({} due, {} ok, {} errors)",
            l.offered_per_sec, l.achieved_per_sec, l.issued, l.ok, l.errors
        );
        write_latency_row(&mut s, "latency (CO-corrected)", &l.latency_us);
        write_latency_row(&mut s, "service time", &l.service_time_us);
        let p = &l.server_lookup_latency_us;
        let _ = writeln!(
            s,
            "  server lookup_latency_us  p50 {}  p99 {}  max {}",
            p.p50, p.p99, p.max
        );
        let total: u64 = l.reason_codes.values().sum();
        let mix: Vec<String> = l
            .reason_codes
            .iter()
            .map(|(k, v)| format!("{k} {:.1}%", 100.0 * *v as f64 / total.max(1) as f64))
            .collect();
        let _ = writeln!(s, "  reason codes  {}", mix.join(", "));
        let h = &l.hit;
        let _ = writeln!(
            s,
            "  realized hit rate {:.2}% ({}/{} lookups with a held prefix; {:.2}% of the {} where replicas differ)",
            100.0 * h.realized_hit_rate,
            h.hits,
            h.lookups_with_prefix,
            100.0 * h.contested_hit_rate,
            h.contested_lookups,
        );
        let _ = writeln!(
            s,
            "  matched_tokens = truth  {:.2}% of answers, {:.2}% of PREFIX_MATCH answers; over-claims {}",
            100.0 * h.matched_tokens_exact_rate,
            100.0 * h.prefix_match_exact_rate,
            h.matched_over_truth
        );
        let i = &self.ingest;
        let _ = writeln!(
            s,
            "  ingest    offered {:.0} blocks/s  achieved {:.0} blocks/s  ({:.0} updates/s)",
            i.offered_blocks_per_sec, i.achieved_blocks_per_sec, i.updates_per_sec
        );
        let e = &self.events;
        let _ = writeln!(
            s,
            "  events    offered {:.0}/s  achieved {:.0}/s  (PREFIX_EVICTED {}, ALL_CLEARED {}, backlog {}); truth holds {} entries",
            e.offered_per_sec,
            e.achieved_per_sec,
            e.prefix_evicted_total,
            e.all_cleared_total,
            e.eviction_backlog,
            e.truth_entries_held
        );
        let _ = writeln!(
            s,
            "  errors    consumer {:?}  producer {:?}",
            self.consumer_errors, self.producer_errors
        );
        for w in &self.warnings {
            let _ = writeln!(s, "  warning   {w}");
        }
        s
    }

    /// Writes the JSON report to `path` (creating its directory) and the SVG latency plot next
    /// to it; returns the SVG path.
    pub fn write(&self, path: &Path) -> Result<PathBuf, super::Error> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(self)? + "\n")?;
        let svg = path.with_extension("svg");
        self.plot(&svg)?;
        Ok(svg)
    }

    /// Latency percentiles per measured second (log scale), with the whole-run percentiles in
    /// the caption.
    pub fn plot(&self, path: &Path) -> Result<(), super::Error> {
        let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
        root.fill(&WHITE)?;
        let points = &self.timeline;
        let t_max = points.last().map(|w| w.t).unwrap_or(1.0).max(1.0);
        let y_max = points
            .iter()
            .map(|w| w.max)
            .fold(self.lookups.latency_us.max, f64::max)
            .max(10.0)
            * 1.5;
        let y_min = points
            .iter()
            .filter(|w| w.count > 0)
            .map(|w| w.p50)
            .fold(f64::INFINITY, f64::min)
            .min(self.lookups.latency_us.p50)
            .max(1.0)
            / 1.5;
        let p = &self.lookups.latency_us;
        let caption = format!(
            "LookupRoute latency, CO-corrected ({:.0}/s offered, {:.0}/s achieved): p50 {:.0}µs p99 {:.0}µs p99.9 {:.0}µs max {:.0}µs",
            self.lookups.offered_per_sec,
            self.lookups.achieved_per_sec,
            p.p50,
            p.p99,
            p.p999,
            p.max
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..t_max, (y_min..y_max).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("seconds since measurement start")
            .y_desc("latency (µs, log)")
            .draw()?;
        let series: [Series; 5] = [
            ("p50", RGBColor(31, 119, 180), |w| w.p50),
            ("p90", RGBColor(44, 160, 44), |w| w.p90),
            ("p99", RGBColor(255, 127, 14), |w| w.p99),
            ("p99.9", RGBColor(214, 39, 40), |w| w.p999),
            ("max", RGBColor(127, 127, 127), |w| w.max),
        ];
        for (name, color, f) in series {
            chart
                .draw_series(LineSeries::new(
                    points
                        .iter()
                        .filter(|w| w.count > 0)
                        .map(|w| (w.t, f(w).max(y_min))),
                    color.stroke_width(2),
                ))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        root.present()?;
        Ok(())
    }
}
