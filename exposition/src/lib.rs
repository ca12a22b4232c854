//! The Prometheus text exposition (format 0.0.4) the server's `/metrics` and the sidecar's
//! `/metrics` both write: metric families as data ([`Family`], [`Sample`]) and one renderer
//! ([`render_text`]).
//!
//! Families are data, not registered collectors, because the server reports the same snapshot
//! twice (`/metrics` text and the `StreamMetrics` RPC's samples) and needs summaries, which the
//! maintained Rust Prometheus crates either lack or cannot hand back as values. The renderer
//! writes `# HELP`, `# TYPE`, then each sample as `name{k="v",…} value`: labels in the order
//! given, label values escaped (`\\`, `\"`, `\n`), values as Rust prints an `f64` (`3`, `0.5`,
//! `NaN`, `+Inf`, `-Inf`). Dashboards, the promtool rule tests and the metric docs depend on
//! these bytes.

use std::fmt::Write as _;

/// One metric family: its samples share a name stem, a type and a help text.
#[derive(Debug, Clone)]
pub struct Family {
    /// The family name as the `# HELP` and `# TYPE` lines write it.
    pub name: String,
    /// `counter`, `gauge`, `histogram` or `summary`.
    pub kind: &'static str,
    /// The `# HELP` text.
    pub help: &'static str,
    /// The samples, in exposition order.
    pub samples: Vec<Sample>,
}

/// Label pairs of one sample, in exposition order.
pub type Labels = Vec<(String, String)>;

/// One label pair.
pub fn label(key: &str, value: &str) -> Labels {
    vec![(key.to_string(), value.to_string())]
}

/// One exposition sample.
#[derive(Debug, Clone)]
pub struct Sample {
    /// The sample name (the family's, or with a `_bucket`, `_sum`, `_count` suffix).
    pub name: String,
    /// Label pairs in exposition order.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Family {
    /// An empty family.
    pub fn new(name: &str, kind: &'static str, help: &'static str) -> Self {
        Self {
            name: name.to_string(),
            kind,
            help,
            samples: Vec::new(),
        }
    }

    /// A family of `kind` with one sample named `name` per `(labels, count)`. Counts stay far
    /// below 2^53, where an `f64` holds every integer exactly, so they render as written.
    pub fn with_counts(
        name: &str,
        kind: &'static str,
        help: &'static str,
        samples: &[(Labels, u64)],
    ) -> Self {
        let mut family = Self::new(name, kind, help);
        for (labels, count) in samples {
            family.push(name, labels.clone(), *count as f64);
        }
        family
    }

    /// A gauge family with one unlabelled sample.
    pub fn gauge(name: &str, help: &'static str, value: f64) -> Self {
        let mut f = Self::new(name, "gauge", help);
        f.push(name, Vec::new(), value);
        f
    }

    /// A counter family with one unlabelled sample (`name` ends in `_total`).
    pub fn counter(name: &str, help: &'static str, value: f64) -> Self {
        let mut f = Self::new(name, "counter", help);
        f.push(name, Vec::new(), value);
        f
    }

    /// Appends a sample.
    pub fn push(&mut self, name: &str, labels: Vec<(String, String)>, value: f64) {
        self.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }

    /// The family name as Prometheus declares it (`…_total` stripped for counters).
    pub fn declared_name(&self) -> &str {
        self.name
            .strip_suffix("_total")
            .filter(|_| self.kind == "counter")
            .unwrap_or(&self.name)
    }
}

/// Renders families in the Prometheus text exposition format (0.0.4).
pub fn render_text(families: &[Family]) -> String {
    let mut out = String::with_capacity(4096);
    for f in families {
        let _ = writeln!(out, "# HELP {} {}", f.name, f.help);
        let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind);
        for s in &f.samples {
            out.push_str(&s.name);
            if !s.labels.is_empty() {
                out.push('{');
                for (i, (k, v)) in s.labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{k}=\"{}\"", escape_label(v));
                }
                out.push('}');
            }
            let _ = writeln!(out, " {}", format_float(s.value));
        }
    }
    out
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A value as the exposition writes it (`3`, `0.5`, `NaN`, `+Inf`, `-Inf`), also for `le` and
/// `quantile` label values.
pub fn format_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_help_type_and_samples_in_order() {
        let mut f = Family::new("requests_total", "counter", "Requests, by code.");
        f.push(
            "requests_total",
            vec![("code".into(), "200".into()), ("path".into(), "/a".into())],
            3.0,
        );
        f.push("requests_total", vec![], 0.5);
        let text = render_text(&[f, Family::gauge("up", "1 while up.", 1.0)]);
        assert_eq!(
            text,
            "# HELP requests_total Requests, by code.\n# TYPE requests_total counter\n\
             requests_total{code=\"200\",path=\"/a\"} 3\nrequests_total 0.5\n\
             # HELP up 1 while up.\n# TYPE up gauge\nup 1\n"
        );
    }

    #[test]
    fn label_values_are_escaped_and_special_values_spelled() {
        let mut f = Family::new("x", "gauge", "h");
        f.push("x", vec![("l".into(), "a\\b\"c\nd".into())], f64::NAN);
        f.push("x", vec![], f64::INFINITY);
        f.push("x", vec![], f64::NEG_INFINITY);
        f.push("x", vec![], 1e21);
        assert_eq!(
            render_text(&[f]),
            "# HELP x h\n# TYPE x gauge\nx{l=\"a\\\\b\\\"c\\nd\"} NaN\nx +Inf\nx -Inf\n\
             x 1000000000000000000000\n"
        );
    }

    #[test]
    fn counts_render_as_integers() {
        let f = Family::with_counts(
            "c_total",
            "counter",
            "h",
            &[(label("k", "v"), 7), (Labels::new(), (1 << 53) - 1)],
        );
        assert_eq!(
            render_text(&[f]),
            "# HELP c_total h\n# TYPE c_total counter\nc_total{k=\"v\"} 7\nc_total 9007199254740991\n"
        );
    }

    #[test]
    fn counters_declare_their_name_without_total() {
        assert_eq!(Family::counter("a_total", "h", 1.0).declared_name(), "a");
        assert_eq!(
            Family::gauge("a_total", "h", 1.0).declared_name(),
            "a_total"
        );
    }
}
