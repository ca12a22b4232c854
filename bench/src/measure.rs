//! Measurement method of `benchmarks.md` §3: wall-time insert/remove, lookups as warm-up + timed
//! rounds (median round mean) + a per-op timed pass for percentiles, `VmRSS`, and the
//! one-JSON-line-per-metric output.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Iteration counts of a lookup bench.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Warm-up ops (cycling over the queries).
    pub warmup: usize,
    /// Timed rounds over all queries.
    pub rounds: usize,
}

impl Plan {
    /// The spec's plan: 10,000 warm-up, 3 rounds.
    pub const FULL: Plan = Plan {
        warmup: crate::w1m::WARMUP,
        rounds: crate::w1m::ROUNDS,
    };
}

/// Result of one lookup bench.
#[derive(Debug, Clone)]
pub struct LookupStats {
    /// Mean ns/op of each timed round.
    pub round_means: Vec<f64>,
    /// Median of the round means (the figure).
    pub mean: f64,
    /// Per-op pass percentiles (ns, `Instant` overhead included).
    pub p50: f64,
    /// p99.
    pub p99: f64,
    /// p99.9.
    pub p999: f64,
}

/// Per-query check sums; every round's total must equal `n × expected`.
pub type Sums = [u64; 3];

fn add(acc: &mut Sums, s: Sums) {
    acc[0] = acc[0].wrapping_add(s[0]);
    acc[1] = acc[1].wrapping_add(s[1]);
    acc[2] = acc[2].wrapping_add(s[2]);
}

fn check(label: &str, pass: &str, got: Sums, expected: Sums, n: usize) -> Result<(), String> {
    let want = [
        expected[0] * n as u64,
        expected[1] * n as u64,
        expected[2] * n as u64,
    ];
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "{label}: {pass}: check sums {got:?} != expected {want:?} ({n} queries × {expected:?})"
        ))
    }
}

/// Nearest-rank percentile of sorted samples.
#[must_use]
pub fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64
}

/// Median of a list (mean of the two middle values for even lengths).
#[must_use]
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Runs one lookup bench over `n` queries: `op(i)` performs query `i` and returns its check
/// sums, which must add up to `n × expected` in every round and in the per-op pass.
pub fn bench_lookup<F>(
    label: &str,
    n: usize,
    plan: Plan,
    expected: Sums,
    mut op: F,
) -> Result<LookupStats, String>
where
    F: FnMut(usize) -> Sums,
{
    let mut stats = bench_lookups(&[label], n, plan, &[expected], |_, i| op(i))?;
    Ok(stats.remove(0))
}

/// Queries per turn of the per-op pass of [`bench_lookups`].
const TURN: usize = 1_000;

/// Runs several lookup variants over the same `n` queries, taking turns: `op(v, i)` performs
/// query `i` with variant `v` (its check sums must add up to `n × expected[v]`). Each variant
/// warms up, then every timed round runs each variant over all queries in turn, and the per-op
/// pass alternates the variants every `TURN` queries. So a ratio between two variants (P6:
/// the full LookupRoute over the core match) compares timings taken side by side: a host that
/// slows down for a while slows both. One variant is exactly [`bench_lookup`].
pub fn bench_lookups<F>(
    labels: &[&str],
    n: usize,
    plan: Plan,
    expected: &[Sums],
    mut op: F,
) -> Result<Vec<LookupStats>, String>
where
    F: FnMut(usize, usize) -> Sums,
{
    assert!(n > 0, "no queries");
    assert_eq!(labels.len(), expected.len(), "one expected sum per variant");
    let variants = labels.len();
    for v in 0..variants {
        for i in 0..plan.warmup {
            black_box(op(v, i % n));
        }
    }
    let mut round_means = vec![Vec::with_capacity(plan.rounds); variants];
    for r in 0..plan.rounds {
        for (v, means) in round_means.iter_mut().enumerate() {
            let mut sums = [0u64; 3];
            let t = Instant::now();
            for i in 0..n {
                add(&mut sums, op(v, black_box(i)));
            }
            let el = t.elapsed();
            check(labels[v], &format!("round {}", r + 1), sums, expected[v], n)?;
            means.push(el.as_nanos() as f64 / n as f64);
        }
    }
    let mut samples = vec![Vec::with_capacity(n); variants];
    let mut sums = vec![[0u64; 3]; variants];
    for start in (0..n).step_by(TURN) {
        let end = (start + TURN).min(n);
        for v in 0..variants {
            for i in start..end {
                let t = Instant::now();
                let s = op(v, black_box(i));
                let el = t.elapsed();
                add(&mut sums[v], s);
                samples[v].push(el.as_nanos() as u64);
            }
        }
    }
    let mut out = Vec::with_capacity(variants);
    for (v, (mut samples, means)) in samples.into_iter().zip(round_means).enumerate() {
        check(labels[v], "per-op pass", sums[v], expected[v], n)?;
        samples.sort_unstable();
        out.push(LookupStats {
            mean: median(&means),
            round_means: means,
            p50: percentile(&samples, 0.50),
            p99: percentile(&samples, 0.99),
            p999: percentile(&samples, 0.999),
        });
    }
    Ok(out)
}

/// `VmRSS` of this process in bytes (0 where `/proc` is unavailable).
#[must_use]
pub fn vm_rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix("VmRSS:") {
            let kb: u64 = rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            return kb * 1024;
        }
    }
    0
}

/// Throughput figures of a write pass over `blocks` blocks.
#[must_use]
pub fn throughput(blocks: usize, el: Duration) -> (f64, f64) {
    let ns = el.as_nanos() as f64;
    let mblk_s = blocks as f64 / (ns / 1e9) / 1e6;
    (mblk_s, ns / blocks as f64)
}

/// One measured figure of one index (row).
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    /// Row name, e.g. `inferencecache core` or `kv-index score_into`.
    pub index: String,
    /// Metric name, e.g. `q50_mean`.
    pub metric: String,
    /// Value.
    pub value: f64,
    /// Unit (`ns`, `Mblk/s`, `B`, `MiB`, …).
    pub unit: &'static str,
}

impl Metric {
    /// One JSON object on one line.
    #[must_use]
    pub fn json(&self, extra: &str) -> String {
        format!(
            "{{\"index\":\"{}\",\"metric\":\"{}\",\"value\":{},\"unit\":\"{}\"{}}}",
            self.index, self.metric, self.value, self.unit, extra
        )
    }

    /// Parses a line produced by [`Metric::json`] (the only format this crate reads).
    #[must_use]
    pub fn parse(line: &str) -> Option<Metric> {
        fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
            let key = format!("\"{name}\":");
            let start = line.find(&key)? + key.len();
            let rest = &line[start..];
            if let Some(r) = rest.strip_prefix('"') {
                let end = r.find('"')?;
                Some(&r[..end])
            } else {
                let end = rest.find([',', '}'])?;
                Some(rest[..end].trim())
            }
        }
        let unit = match field(line, "unit")? {
            "ns" => "ns",
            "Mblk/s" => "Mblk/s",
            "B" => "B",
            "MiB" => "MiB",
            "x" => "x",
            _ => "",
        };
        Some(Metric {
            index: field(line, "index")?.to_string(),
            metric: field(line, "metric")?.to_string(),
            value: field(line, "value")?.parse().ok()?,
            unit,
        })
    }
}

/// Collects metrics of one process.
#[derive(Debug, Default)]
pub struct Recorder {
    /// Everything recorded, in order.
    pub metrics: Vec<Metric>,
}

impl Recorder {
    /// Records one figure.
    pub fn put(&mut self, index: &str, metric: &str, value: f64, unit: &'static str) {
        self.metrics.push(Metric {
            index: index.to_string(),
            metric: metric.to_string(),
            value,
            unit,
        });
    }

    /// Records the write figures of a row.
    pub fn put_write(&mut self, index: &str, what: &str, blocks: usize, el: Duration) {
        let (m, ns) = throughput(blocks, el);
        self.put(index, &format!("{what}_mblk_s"), m, "Mblk/s");
        self.put(index, &format!("{what}_ns_blk"), ns, "ns");
    }

    /// Records a lookup bench of a row.
    pub fn put_lookup(&mut self, index: &str, set: &str, s: &LookupStats) {
        self.put(index, &format!("{set}_mean"), s.mean, "ns");
        self.put(index, &format!("{set}_p50"), s.p50, "ns");
        self.put(index, &format!("{set}_p99"), s.p99, "ns");
        self.put(index, &format!("{set}_p999"), s.p999, "ns");
    }

    /// Copies the figures of `from` whose metric starts with one of `prefixes` to row `to`
    /// (rows sharing one write path, e.g. kv-index `find_matches` / `score_into`).
    pub fn copy_row(&mut self, from: &str, to: &str, prefixes: &[&str]) {
        let copies: Vec<Metric> = self
            .metrics
            .iter()
            .filter(|m| m.index == from && prefixes.iter().any(|p| m.metric.starts_with(p)))
            .map(|m| Metric {
                index: to.to_string(),
                ..m.clone()
            })
            .collect();
        self.metrics.extend(copies);
    }

    /// Value of a figure.
    #[must_use]
    pub fn get(&self, index: &str, metric: &str) -> Option<f64> {
        self.metrics
            .iter()
            .find(|m| m.index == index && m.metric == metric)
            .map(|m| m.value)
    }

    /// Prints the JSON lines.
    pub fn print_json(&self, extra: &str) {
        for m in &self.metrics {
            println!("{}", m.json(extra));
        }
    }

    /// Prints a readable table (rows × the main metrics) of this process.
    pub fn print_table(&self) {
        let mut rows: Vec<&str> = Vec::new();
        for m in &self.metrics {
            if !rows.contains(&m.index.as_str()) {
                rows.push(&m.index);
            }
        }
        let cols = [
            ("insert_mblk_s", "ins Mblk/s"),
            ("remove_mblk_s", "rem Mblk/s"),
            ("rss_b_entry", "RSS B/ent"),
            ("q50_mean", "Q50 mean"),
            ("q50_p50", "Q50 p50"),
            ("q50_p99", "Q50 p99"),
            ("q50_p999", "Q50 p99.9"),
            ("q100_mean", "Q100 mean"),
            ("q100_p99", "Q100 p99"),
            ("q0_mean", "Q0 mean"),
            ("q0_p99", "Q0 p99"),
        ];
        print!("{:<34}", "index");
        for (_, h) in cols {
            print!(" {h:>10}");
        }
        println!();
        for r in rows {
            print!("{r:<34}");
            for (k, _) in cols {
                match self.get(r, k) {
                    Some(v) if v >= 100.0 => print!(" {v:>10.0}"),
                    Some(v) => print!(" {v:>10.2}"),
                    None => print!(" {:>10}", "—"),
                }
            }
            println!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_nearest_rank() {
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&v, 0.5), 500.0);
        assert_eq!(percentile(&v, 0.99), 990.0);
        assert_eq!(percentile(&v, 0.999), 999.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn json_round_trip() {
        let m = Metric {
            index: "kv-index score_into".into(),
            metric: "q50_mean".into(),
            value: 444.5,
            unit: "ns",
        };
        let line = m.json(",\"allocator\":\"system\"");
        assert_eq!(Metric::parse(&line), Some(m));
    }
}
