//! Engine metrics scraper (spec `sidecar.md` §8): Prometheus text exposition → `ReplicaStats`
//! for the vLLM and SGLang profiles.

use inferencecache_proto::v1alpha1::ReplicaStats;
use std::collections::HashMap;
use std::fmt;

/// Metric type of a sample, from its family's `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Other,
}

/// One parsed sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
    pub kind: Kind,
}

impl Sample {
    /// A label's value, if set.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A parsed exposition.
#[derive(Debug, Clone, Default)]
pub struct Exposition {
    pub samples: Vec<Sample>,
}

/// A scrape failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeError(pub String);

impl fmt::Display for ScrapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ScrapeError {}

/// A sample line before its type is known: name, labels, value.
type RawSample = (String, Vec<(String, String)>, f64);

/// Parses the Prometheus text format. Lines that cannot be parsed are skipped.
pub fn parse_exposition(text: &str) -> Exposition {
    let mut types: HashMap<String, Kind> = HashMap::new();
    let mut raw: Vec<RawSample> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let mut it = rest.split_whitespace();
            if it.next() == Some("TYPE")
                && let (Some(name), Some(ty)) = (it.next(), it.next())
            {
                let kind = match ty {
                    "counter" => Kind::Counter,
                    "gauge" => Kind::Gauge,
                    _ => Kind::Other,
                };
                types.insert(name.to_string(), kind);
            }
            continue;
        }
        if let Some(s) = parse_sample_line(line) {
            raw.push(s);
        }
    }
    let kind_of = |name: &str| -> Kind {
        if let Some(k) = types.get(name) {
            return *k;
        }
        // OpenMetrics-style: `# TYPE x counter` with samples named `x_total`.
        if let Some(base) = name.strip_suffix("_total")
            && let Some(Kind::Counter) = types.get(base)
        {
            return Kind::Counter;
        }
        Kind::Other
    };
    let samples = raw
        .into_iter()
        .map(|(name, labels, value)| {
            let kind = kind_of(&name);
            Sample {
                name,
                labels,
                value,
                kind,
            }
        })
        .collect();
    Exposition { samples }
}

fn parse_sample_line(line: &str) -> Option<RawSample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        let (parsed, after) = parse_labels(&rest[1..])?;
        labels = parsed;
        rest = after;
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().ok()?,
    };
    Some((name.to_string(), labels, value))
}

/// Parses `k="v",…}` and returns the labels and the rest after `}`.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_string();
        s = s[eq + 1..].trim_start();
        s = s.strip_prefix('"')?;
        let mut val = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => val.push('\n'),
                    other => val.push(other),
                },
                '"' => break i,
                c => val.push(c),
            }
        };
        labels.push((key, val));
        s = s[end + 1..].trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        }
    }
}

/// Which metric names to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Vllm,
    Sglang,
}

impl Profile {
    /// `sglang` → SGLang; anything else → vLLM.
    pub fn for_scheme(scheme: &str) -> Self {
        if scheme == "sglang" {
            Profile::Sglang
        } else {
            Profile::Vllm
        }
    }

    fn running(self) -> &'static str {
        match self {
            Profile::Vllm => "vllm:num_requests_running",
            Profile::Sglang => "sglang:num_running_reqs",
        }
    }

    fn waiting(self) -> &'static str {
        match self {
            Profile::Vllm => "vllm:num_requests_waiting",
            Profile::Sglang => "sglang:num_queue_reqs",
        }
    }

    /// Every family name this profile knows.
    fn families(self) -> &'static [&'static str] {
        match self {
            Profile::Vllm => &[
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
                "vllm:cpu_cache_usage_perc",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:prefix_cache_hits",
                "vllm:prefix_cache_queries",
                "vllm:external_prefix_cache_hits",
                "vllm:external_prefix_cache_queries",
            ],
            Profile::Sglang => &[
                "sglang:token_usage",
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:cache_hit_rate",
            ],
        }
    }
}

/// `--cache-tier`: which usage gauge to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheTierSel {
    Auto,
    Kv,
    Gpu,
    Cpu,
}

impl CacheTierSel {
    /// Parses `auto`, `kv`, `gpu`, `cpu`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "kv" => Ok(Self::Kv),
            "gpu" => Ok(Self::Gpu),
            "cpu" => Ok(Self::Cpu),
            other => Err(format!(
                "invalid cache tier {other:?}: want auto, kv, gpu or cpu"
            )),
        }
    }
}

/// Scraper settings.
#[derive(Debug, Clone)]
pub struct ScraperConfig {
    pub profile: Profile,
    pub tier: CacheTierSel,
    /// `--engine-model-name`; empty = no filter.
    pub model_name: String,
    /// `--engine-cache-size-bytes`.
    pub capacity_bytes: i64,
    /// `--max-concurrency-ceiling`.
    pub ceiling: i64,
}

/// Turns expositions into stats; keeps the vLLM hit-rate baseline between scrapes.
#[derive(Debug, Clone)]
pub struct Deriver {
    cfg: ScraperConfig,
    baseline: Option<(f64, f64)>,
}

fn clamp01(x: f64) -> f64 {
    if x.is_nan() { 0.0 } else { x.clamp(0.0, 1.0) }
}

impl Deriver {
    /// A deriver without a hit-rate baseline.
    pub fn new(cfg: ScraperConfig) -> Self {
        Self {
            cfg,
            baseline: None,
        }
    }

    /// The current vLLM hit-rate baseline `(hits, queries)`.
    pub fn baseline(&self) -> Option<(f64, f64)> {
        self.baseline
    }

    fn model_ok(&self, s: &Sample) -> bool {
        self.cfg.model_name.is_empty()
            || s.label("model_name") == Some(self.cfg.model_name.as_str())
    }

    fn gauges<'a>(
        &'a self,
        exp: &'a Exposition,
        name: &'a str,
    ) -> impl Iterator<Item = &'a Sample> {
        exp.samples.iter().filter(move |s| {
            s.name == name && s.kind == Kind::Gauge && s.value.is_finite() && self.model_ok(s)
        })
    }

    fn gauge_max(&self, exp: &Exposition, name: &str) -> Option<f64> {
        self.gauges(exp, name).map(|s| s.value).reduce(f64::max)
    }

    /// Sum of a load gauge over series without a `priority` breakdown; `None` when absent.
    fn load_sum(&self, exp: &Exposition, name: &str) -> Option<f64> {
        let mut present = false;
        let mut sum = 0.0;
        for s in self.gauges(exp, name) {
            present = true;
            if s.label("priority").is_none_or(str::is_empty) {
                sum += s.value;
            }
        }
        present.then_some(sum)
    }

    /// Counter sum, `<name>_total` first, then `<name>`; `None` when absent.
    fn counter(&self, exp: &Exposition, name: &str) -> Option<f64> {
        let total = format!("{name}_total");
        for candidate in [total.as_str(), name] {
            let mut present = false;
            let mut sum = 0.0;
            for s in exp.samples.iter().filter(|s| {
                s.name == candidate
                    && s.kind == Kind::Counter
                    && s.value.is_finite()
                    && self.model_ok(s)
            }) {
                present = true;
                sum += s.value;
            }
            if present {
                return Some(sum);
            }
        }
        None
    }

    /// Derives stats from one exposition (§8 order of evaluation).
    pub fn derive(&mut self, exp: &Exposition) -> Result<ReplicaStats, ScrapeError> {
        let profile = self.cfg.profile;
        // 1. Any known family at all, ignoring the model filter.
        let known = profile.families().iter().any(|f| {
            let total = format!("{f}_total");
            exp.samples.iter().any(|s| s.name == *f || s.name == total)
        });
        if !known {
            return Err(ScrapeError(format!(
                "no recognized metric families for the {profile:?} profile"
            )));
        }
        // 2. Both load gauges.
        let running = self.load_sum(exp, profile.running());
        let waiting = self.load_sum(exp, profile.waiting());
        let (Some(running), Some(waiting)) = (running, waiting) else {
            return Err(ScrapeError(format!(
                "load gauges missing: {} present={}, {} present={}",
                profile.running(),
                running.is_some(),
                profile.waiting(),
                waiting.is_some()
            )));
        };
        // 3. Pressure.
        let load = running + waiting;
        let pressure = if self.cfg.ceiling <= 0 || load <= 0.0 {
            0.0
        } else {
            clamp01(load / self.cfg.ceiling as f64)
        };
        // 4. Usage.
        let usage = match profile {
            Profile::Sglang => self.gauge_max(exp, "sglang:token_usage"),
            Profile::Vllm => match self.cfg.tier {
                CacheTierSel::Kv => self.gauge_max(exp, "vllm:kv_cache_usage_perc"),
                CacheTierSel::Gpu => self.gauge_max(exp, "vllm:gpu_cache_usage_perc"),
                CacheTierSel::Cpu => self.gauge_max(exp, "vllm:cpu_cache_usage_perc"),
                CacheTierSel::Auto => {
                    self.gauge_max(exp, "vllm:kv_cache_usage_perc").or_else(|| {
                        let g = self.gauge_max(exp, "vllm:gpu_cache_usage_perc");
                        let c = self.gauge_max(exp, "vllm:cpu_cache_usage_perc");
                        match (g, c) {
                            (Some(g), Some(c)) => Some(g.max(c)),
                            (g, c) => g.or(c),
                        }
                    })
                }
            },
        }
        .map(clamp01)
        .unwrap_or(0.0);
        let cache_memory_bytes = if self.cfg.capacity_bytes > 0 {
            (usage * self.cfg.capacity_bytes as f64) as i64
        } else {
            0
        };
        // 5. Hit rate.
        let hit_rate = match profile {
            Profile::Sglang => self
                .gauge_max(exp, "sglang:cache_hit_rate")
                .map(clamp01)
                .unwrap_or(0.0),
            Profile::Vllm => {
                let hits = self.counter(exp, "vllm:prefix_cache_hits");
                let queries = self.counter(exp, "vllm:prefix_cache_queries");
                match (hits, queries) {
                    (Some(h), Some(q)) => match self.baseline.replace((h, q)) {
                        None => 0.0,
                        Some((bh, bq)) => {
                            let dh = h - bh;
                            let dq = q - bq;
                            if dh < 0.0 || dq <= 0.0 {
                                0.0
                            } else {
                                clamp01(dh / dq)
                            }
                        }
                    },
                    _ => 0.0,
                }
            }
        };
        // 6. T2 counters.
        let (t2_hit_tokens, t2_query_tokens) = match profile {
            Profile::Sglang => (0, 0),
            Profile::Vllm => (
                self.counter(exp, "vllm:external_prefix_cache_hits")
                    .unwrap_or(0.0) as i64,
                self.counter(exp, "vllm:external_prefix_cache_queries")
                    .unwrap_or(0.0) as i64,
            ),
        };
        Ok(ReplicaStats {
            replica_id: String::new(),
            cache_memory_bytes,
            hit_rate: hit_rate as f32,
            pressure: pressure as f32,
            client_version: String::new(),
            t2_hit_tokens,
            t2_query_tokens,
            endpoint: String::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_and_special_values() {
        let exp = parse_exposition(
            "# TYPE a gauge\na{x=\"1\",y=\"q\\\"z\"} 2.5\na NaN\n# TYPE c counter\nc_total 3 1700000\nbad line here\n",
        );
        assert_eq!(exp.samples.len(), 3);
        assert_eq!(exp.samples[0].labels.len(), 2);
        assert_eq!(exp.samples[0].label("y"), Some("q\"z"));
        assert_eq!(exp.samples[0].kind, Kind::Gauge);
        assert!(exp.samples[1].value.is_nan());
        assert_eq!(exp.samples[2].kind, Kind::Counter);
        assert_eq!(exp.samples[2].value, 3.0);
    }
}
