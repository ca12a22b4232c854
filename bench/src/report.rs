//! Multi-process report: medians / min / max of the JSON lines of N fresh processes per index,
//! the side-by-side table, and the pass bars of `benchmarks.md` §5 as same-run ratios.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::measure::{Metric, median};
use crate::ours::{ROW_CORE, ROW_CORE_BESIDE, ROW_ROUTE, ROW_ROUTE_INTO};

/// Aggregated figures: (row, metric) → values across processes.
#[derive(Debug, Default)]
pub struct Aggregate {
    rows: Vec<String>,
    values: BTreeMap<(String, String), Vec<f64>>,
}

/// Row order of the table: ours first, then the peers of §1, then anything else.
const ORDER: [&str; 8] = [
    ROW_CORE,
    ROW_CORE_BESIDE,
    ROW_ROUTE,
    ROW_ROUTE_INTO,
    "kv-index find_matches",
    "kv-index score_into",
    "dynamo crtc",
    "dynamo radixtree",
];

impl Aggregate {
    /// Builds the aggregate from JSON lines (other lines are ignored).
    #[must_use]
    pub fn from_lines<'a>(lines: impl IntoIterator<Item = &'a str>) -> Self {
        let mut a = Aggregate::default();
        for l in lines {
            if let Some(m) = Metric::parse(l) {
                a.add(m);
            }
        }
        let mut rows = std::mem::take(&mut a.rows);
        rows.sort_by_key(|r| ORDER.iter().position(|o| o == r).unwrap_or(ORDER.len()));
        a.rows = rows;
        a
    }

    fn add(&mut self, m: Metric) {
        if !self.rows.contains(&m.index) {
            self.rows.push(m.index.clone());
        }
        self.values
            .entry((m.index, m.metric))
            .or_default()
            .push(m.value);
    }

    /// Median of a figure across processes.
    #[must_use]
    pub fn med(&self, row: &str, metric: &str) -> Option<f64> {
        self.values
            .get(&(row.to_string(), metric.to_string()))
            .map(|v| median(v))
    }

    /// Median across processes of `row`'s figure over `beside`'s figure in the same process.
    ///
    /// Every process prints each of its rows once, so the i-th value of two rows of one index
    /// comes from the same process; a ratio of two rows timed side by side in one process is
    /// taken per process, which keeps out what differs between processes (address-space
    /// layout, page placement) and is shared by both rows. `None` when the rows do not pair
    /// up (a process that printed only some of its rows).
    #[must_use]
    pub fn paired_ratio(&self, row: &str, beside: &str, metric: &str) -> Option<f64> {
        let a = self.values.get(&(row.to_string(), metric.to_string()))?;
        let b = self.values.get(&(beside.to_string(), metric.to_string()))?;
        if a.len() != b.len() || a.is_empty() || b.iter().any(|v| *v <= 0.0) {
            return None;
        }
        let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        Some(median(&ratios))
    }

    fn peers(&self) -> impl Iterator<Item = &String> {
        self.rows
            .iter()
            .filter(|r| !r.starts_with("inferencecache"))
    }

    /// Best (min or max) median of a figure over the peer rows, with the row.
    fn best_peer(&self, metric: &str, lower_is_better: bool) -> Option<(String, f64)> {
        let mut best: Option<(String, f64)> = None;
        for r in self.peers() {
            if let Some(v) = self.med(r, metric) {
                let better = match &best {
                    None => true,
                    Some((_, b)) => {
                        if lower_is_better {
                            v < *b
                        } else {
                            v > *b
                        }
                    }
                };
                if better {
                    best = Some((r.clone(), v));
                }
            }
        }
        best
    }

    /// The side-by-side markdown table of medians.
    #[must_use]
    pub fn table(&self) -> String {
        let mut s = String::new();
        let f = |v: Option<f64>| match v {
            Some(x) if x >= 100.0 => format!("{x:.0}"),
            Some(x) => format!("{x:.2}"),
            None => "″".to_string(),
        };
        s.push_str(
            "| Index | insert M blk/s (ns/blk) | remove M blk/s (ns/blk) | RSS B/entry | \
             Q50 mean / p50 / p99 / p99.9 (ns) | Q100 mean / p99 (ns) | Q0 mean / p99 (ns) | runs |\n",
        );
        s.push_str("|---|---|---|---|---|---|---|---|\n");
        for r in &self.rows {
            let write = |w: &str| match (
                self.med(r, &format!("{w}_mblk_s")),
                self.med(r, &format!("{w}_ns_blk")),
            ) {
                (Some(m), Some(ns)) => format!("{m:.2} ({ns:.0})"),
                _ => "″".to_string(),
            };
            let runs = self
                .values
                .iter()
                .filter(|((row, _), _)| row == r)
                .map(|(_, v)| v.len())
                .max()
                .unwrap_or(0);
            let _ = writeln!(
                s,
                "| {r} | {} | {} | {} | {} / {} / {} / {} | {} / {} | {} / {} | {runs} |",
                write("insert"),
                write("remove"),
                f(self.med(r, "rss_b_entry")),
                f(self.med(r, "q50_mean")),
                f(self.med(r, "q50_p50")),
                f(self.med(r, "q50_p99")),
                f(self.med(r, "q50_p999")),
                f(self.med(r, "q100_mean")),
                f(self.med(r, "q100_p99")),
                f(self.med(r, "q0_mean")),
                f(self.med(r, "q0_p99")),
            );
        }
        s
    }

    /// Pass bars (§5) as same-run ratios of medians; P6 over our own core as the median of
    /// per-process ratios ([`Aggregate::paired_ratio`]).
    #[must_use]
    pub fn pass_bars(&self) -> String {
        let mut s = String::new();
        s.push_str("| ID | What | Ours | Reference | Ratio | Bar | Result |\n");
        s.push_str("|---|---|---|---|---|---|---|\n");
        let mut line = |id: &str,
                        what: &str,
                        ours: Option<f64>,
                        reference: Option<(String, f64)>,
                        bar: f64,
                        at_most: bool| {
            match (ours, reference) {
                (Some(o), Some((rname, rv))) if rv > 0.0 => {
                    let ratio = o / rv;
                    let ok = if at_most { ratio <= bar } else { ratio >= bar };
                    let _ = writeln!(
                        s,
                        "| {id} | {what} | {o:.2} | {rv:.2} ({rname}) | {ratio:.3}× | {} {bar}× | {} |",
                        if at_most { "≤" } else { "≥" },
                        if ok { "PASS" } else { "FAIL" }
                    );
                }
                _ => {
                    let _ = writeln!(
                        s,
                        "| {id} | {what} | {} | n/a | — | {bar}× | not measured |",
                        ours.map_or("—".to_string(), |o| format!("{o:.2}"))
                    );
                }
            }
        };
        let kv = |m: &str| {
            self.med("kv-index score_into", m)
                .map(|v| ("kv-index score_into".to_string(), v))
        };
        line(
            "P1",
            "core match Q50 mean (ns)",
            self.med(ROW_CORE, "q50_mean"),
            kv("q50_mean"),
            0.56,
            true,
        );
        line(
            "P1",
            "core match Q50 p99 (ns)",
            self.med(ROW_CORE, "q50_p99"),
            kv("q50_p99"),
            0.55,
            true,
        );
        line(
            "P2",
            "core match Q0 mean (ns), best peer",
            self.med(ROW_CORE, "q0_mean"),
            self.best_peer("q0_mean", true),
            1.2,
            true,
        );
        line(
            "P3",
            "insert (M blk/s), best peer",
            self.med(ROW_CORE, "insert_mblk_s"),
            self.best_peer("insert_mblk_s", false),
            1.31,
            false,
        );
        line(
            "P4",
            "remove (M blk/s), best peer",
            self.med(ROW_CORE, "remove_mblk_s"),
            self.best_peer("remove_mblk_s", false),
            1.40,
            false,
        );
        line(
            "P5",
            "RSS B/entry, best peer",
            self.med(ROW_CORE, "rss_b_entry"),
            self.best_peer("rss_b_entry", true),
            0.71,
            true,
        );
        for set in ["q50", "q100"] {
            for stat in ["mean", "p99"] {
                let m = format!("{set}_{stat}");
                // Paired per process (see `paired_ratio`); the ratio of the two medians when
                // the rows do not pair up.
                match self.paired_ratio(ROW_ROUTE, ROW_CORE_BESIDE, &m) {
                    Some(ratio) => line(
                        "P6",
                        &format!(
                            "full lookup_route {} {stat} over our core timed beside it, \
                             median of per-process ratios",
                            set.to_uppercase()
                        ),
                        Some(ratio),
                        Some(("parity with our core".to_string(), 1.0)),
                        2.0,
                        true,
                    ),
                    None => line(
                        "P6",
                        &format!(
                            "full lookup_route {} {stat} vs our core timed beside it",
                            set.to_uppercase()
                        ),
                        self.med(ROW_ROUTE, &m),
                        self.med(ROW_CORE_BESIDE, &m)
                            .map(|v| ("our core beside it".to_string(), v)),
                        2.0,
                        true,
                    ),
                }
            }
        }
        for set in ["q50", "q100"] {
            line(
                "P6",
                &format!(
                    "full lookup_route {} mean vs reference Go (47 µs recorded)",
                    set.to_uppercase()
                ),
                self.med(ROW_ROUTE, &format!("{set}_mean")),
                Some(("reference Go, recorded".to_string(), 47_000.0)),
                0.02,
                true,
            );
        }
        line(
            "Q100",
            "core match Q100 mean beats every peer",
            self.med(ROW_CORE, "q100_mean"),
            self.best_peer("q100_mean", true),
            1.0,
            true,
        );
        // Two-sided: |memory_bytes() / RSS delta − 1| ≤ 15%.
        match (
            self.med(ROW_CORE, "mem_b_entry"),
            self.med(ROW_CORE, "rss_b_entry"),
        ) {
            (Some(m), Some(r)) if r > 0.0 => {
                let ratio = m / r;
                let ok = (0.85..=1.15).contains(&ratio);
                let _ = writeln!(
                    s,
                    "| mem | memory_bytes() B/entry vs RSS delta B/entry | {m:.2} | {r:.2} (RSS delta) | {ratio:.3}× | 0.85–1.15× | {} |",
                    if ok { "PASS" } else { "FAIL" }
                );
            }
            _ => s.push_str(
                "| mem | memory_bytes() vs RSS delta | — | n/a | — | 0.85–1.15× | not measured |\n",
            ),
        }
        s
    }

    /// Median / min / max of every figure.
    #[must_use]
    pub fn spread(&self) -> String {
        let mut s = String::new();
        s.push_str("| Index | Metric | median | min | max | n |\n|---|---|---|---|---|---|\n");
        for r in &self.rows {
            for ((row, metric), v) in &self.values {
                if row != r {
                    continue;
                }
                let min = v.iter().copied().fold(f64::INFINITY, f64::min);
                let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let _ = writeln!(
                    s,
                    "| {row} | {metric} | {:.3} | {min:.3} | {max:.3} | {} |",
                    median(v),
                    v.len()
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregates_medians_and_ratios() {
        let lines = [
            r#"{"index":"inferencecache core","metric":"q50_mean","value":200,"unit":"ns"}"#,
            r#"{"index":"inferencecache core","metric":"q50_mean","value":220,"unit":"ns"}"#,
            r#"{"index":"inferencecache core","metric":"q50_mean","value":900,"unit":"ns"}"#,
            r#"{"index":"kv-index score_into","metric":"q50_mean","value":440,"unit":"ns"}"#,
        ];
        let a = Aggregate::from_lines(lines);
        assert_eq!(a.med(ROW_CORE, "q50_mean"), Some(220.0));
        let bars = a.pass_bars();
        assert!(bars.contains("| P1 | core match Q50 mean (ns) | 220.00 | 440.00"));
        assert!(bars.contains("PASS"));
        assert!(a.table().starts_with("| Index |"));
    }

    #[test]
    fn route_over_core_is_paired_per_process() {
        // Process 1 is slow for both rows, process 2 fast for both: per process the route is
        // 1.5x and 1.2x its core (median 1.35x), while the ratio of the medians would be 1.0x.
        let mut lines = Vec::new();
        for (route, core) in [(600.0, 400.0), (240.0, 200.0)] {
            lines.push(format!(
                r#"{{"index":"{ROW_CORE_BESIDE}","metric":"q50_p99","value":{core},"unit":"ns"}}"#
            ));
            lines.push(format!(
                r#"{{"index":"{ROW_ROUTE}","metric":"q50_p99","value":{route},"unit":"ns"}}"#
            ));
        }
        let a = Aggregate::from_lines(lines.iter().map(String::as_str));
        let ratio = a.paired_ratio(ROW_ROUTE, ROW_CORE_BESIDE, "q50_p99");
        assert!(ratio.is_some_and(|r| (r - 1.35).abs() < 1e-9), "{ratio:?}");
        assert!(a.pass_bars().contains(
            "| P6 | full lookup_route Q50 p99 over our core timed beside it, median of \
             per-process ratios | 1.35 | 1.00 (parity with our core) | 1.350× | ≤ 2× | PASS |"
        ));
        // A process that printed only one of the two rows: no pairing, no paired ratio.
        lines.push(format!(
            r#"{{"index":"{ROW_ROUTE}","metric":"q50_p99","value":300,"unit":"ns"}}"#
        ));
        let unpaired = Aggregate::from_lines(lines.iter().map(String::as_str));
        assert_eq!(
            unpaired.paired_ratio(ROW_ROUTE, ROW_CORE_BESIDE, "q50_p99"),
            None
        );
    }
}
