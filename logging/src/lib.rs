//! Log output in the server's schema (`server.md` §13), shared by the server and the sidecar:
//! one JSON object per line on stderr, keys `time`, `level`, `msg` (a stable snake_case event
//! name), then the event's attributes in the order they were recorded; or tracing's plain text
//! with `--log-format text`.
//!
//! Two mappings keep every line in the schema whatever its call site wrote:
//! - a call site that names its event in an `event` attribute (`warn!(event = "replay_failed",
//!   …, "gap replay failed")`) gets that name as `msg`; its English message is dropped;
//! - a line from another crate (a dependency's `log` or `tracing` output, e.g. the `zeromq`
//!   crate's) becomes `msg` `third_party_log` with `target` (its module path) and `detail` (its
//!   text), never the `log.file` / `log.line` source paths; below WARN such lines are dropped.
//!
//! [`check_json_line`] is the schema as a test asserts it, for the server's and the sidecar's
//! output alike.

use std::fmt::{self, Write as _};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Module-path prefix of this workspace's crates; events from any other target are third-party.
pub const OWN_TARGET_PREFIX: &str = "inferencecache";

/// `msg` of a line written by another crate.
pub const THIRD_PARTY_MSG: &str = "third_party_log";

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// JSON lines (the default).
    Json,
    /// tracing's human-readable text.
    Text,
}

/// Parses `--log-format` (`json`, `text`).
pub fn parse_format(s: &str) -> Result<LogFormat, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "json" => Ok(LogFormat::Json),
        "text" => Ok(LogFormat::Text),
        other => Err(format!(
            "invalid --log-format {other:?}: expected json or text"
        )),
    }
}

/// Parses `--log-level` (`debug`, `info`, `warn`, `error`).
pub fn parse_level(s: &str) -> Result<Level, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "debug" => Ok(Level::DEBUG),
        "" | "info" => Ok(Level::INFO),
        "warn" | "warning" => Ok(Level::WARN),
        "error" => Ok(Level::ERROR),
        other => Err(format!(
            "invalid --log-level {other:?}: expected debug, info, warn or error"
        )),
    }
}

/// Which events are written: this workspace's at `level` and above, other crates' at WARN and
/// above (or `level`, if stricter): a dependency's chatter is not the operator's business.
pub fn targets(level: Level) -> Targets {
    let own = LevelFilter::from_level(level);
    Targets::new()
        .with_target(OWN_TARGET_PREFIX, own)
        .with_default(own.min(LevelFilter::WARN))
}

/// Installs the process-wide logger on stderr (also receiving the `log` crate's records).
/// Fails when one is installed already.
pub fn init(level: Level, format: LogFormat) -> Result<(), String> {
    let filter = targets(level);
    let registry = tracing_subscriber::registry();
    match format {
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .event_format(JsonLines)
                    .with_filter(filter),
            )
            .try_init(),
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_target(false)
                    .with_filter(filter),
            )
            .try_init(),
    }
    .map_err(|e| format!("cannot install the logger: {e}"))
}

/// The JSON-lines event formatter.
pub struct JsonLines;

#[derive(Default)]
struct Record {
    /// The call site's message (an event name in this workspace's convention).
    message: String,
    /// The `event` attribute, when the call site named its event that way.
    event: Option<String>,
    /// `log.target` of a record bridged from the `log` crate.
    log_target: Option<String>,
    attributes: String,
}

fn text_of(value: serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s,
        other => other.to_string(),
    }
}

impl Record {
    fn push(&mut self, name: &str, value: serde_json::Value) {
        match name {
            "message" => self.message = text_of(value),
            "event" => self.event = Some(text_of(value)),
            "log.target" => self.log_target = Some(text_of(value)),
            // The `log` bridge's source location (a registry path on a build machine).
            "log.file" | "log.line" | "log.module_path" => {}
            _ => {
                let key = serde_json::Value::String(name.to_string());
                let _ = write!(self.attributes, ",{key}:{value}");
            }
        }
    }
}

impl Visit for Record {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field.name(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.push(field.name(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.push(field.name(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.push(field.name(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        let number = serde_json::Number::from_f64(value);
        self.push(
            field.name(),
            number.map_or(serde_json::Value::Null, Into::into),
        );
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field.name(), format!("{value:?}").into());
    }
}

fn level_name(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARN",
        Level::INFO => "INFO",
        _ => "DEBUG",
    }
}

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut time = String::new();
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        let mut record = Record::default();
        event.record(&mut record);
        let target = record
            .log_target
            .take()
            .unwrap_or_else(|| event.metadata().target().to_string());
        let (msg, attributes) = if !target.starts_with(OWN_TARGET_PREFIX) {
            let mut attributes = format!(
                ",\"target\":{},\"detail\":{}",
                serde_json::Value::String(target),
                serde_json::Value::String(record.message)
            );
            attributes.push_str(&record.attributes);
            (THIRD_PARTY_MSG.to_string(), attributes)
        } else {
            (record.event.unwrap_or(record.message), record.attributes)
        };
        writeln!(
            writer,
            "{{\"time\":{},\"level\":\"{}\",\"msg\":{}{}}}",
            serde_json::Value::String(time),
            level_name(event.metadata().level()),
            serde_json::Value::String(msg),
            attributes
        )
    }
}

/// Checks one JSON log line against the schema: a JSON object whose first keys are `time`
/// (RFC 3339), `level` (`ERROR`, `WARN`, `INFO`, `DEBUG`) and `msg` (a snake_case event name),
/// with no `event` attribute (the event is `msg`), no `log.*` source metadata, and no value in
/// Rust's `Debug` notation (`Some(…)`, `None`, a `Duration` such as `1800s`): attributes carry
/// plain strings and numbers. Returns the parsed object.
pub fn check_json_line(line: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON ({e}): {line}"))?;
    let serde_json::Value::Object(object) = value else {
        return Err(format!("not a JSON object: {line}"));
    };
    // serde_json's map sorts keys: read the order from the line itself.
    let position = |key: &str| line.find(&format!("\"{key}\":"));
    match (position("time"), position("level"), position("msg")) {
        (Some(0..=1), Some(l), Some(m)) if l < m => {}
        _ => return Err(format!("keys must start time, level, msg: {line}")),
    }
    let time = object.get("time").and_then(|v| v.as_str()).unwrap_or("");
    let rfc3339 = time.len() >= 20
        && time.as_bytes()[4] == b'-'
        && time.as_bytes()[10] == b'T'
        && (time.ends_with('Z') || time.contains('+'));
    if !rfc3339 {
        return Err(format!("time is not RFC 3339: {line}"));
    }
    let level = object.get("level").and_then(|v| v.as_str()).unwrap_or("");
    if !matches!(level, "ERROR" | "WARN" | "INFO" | "DEBUG") {
        return Err(format!(
            "level {level:?} is not ERROR, WARN, INFO or DEBUG: {line}"
        ));
    }
    let msg = object.get("msg").and_then(|v| v.as_str()).unwrap_or("");
    let snake = msg.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && msg
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !snake {
        return Err(format!(
            "msg {msg:?} is not a snake_case event name: {line}"
        ));
    }
    for (key, value) in &object {
        if key == "event" || key.starts_with("log.") {
            return Err(format!(
                "attribute {key:?} does not belong in the schema: {line}"
            ));
        }
        if let Some(text) = value.as_str()
            && looks_like_debug(text)
        {
            return Err(format!("{key} = {text:?} is Rust Debug notation: {line}"));
        }
    }
    Ok(object)
}

/// `Some(…)`, `None`, or a `Duration`'s Debug form (`1800s`, `1.5ms`).
fn looks_like_debug(text: &str) -> bool {
    if text == "None" || (text.starts_with("Some(") && text.ends_with(')')) {
        return true;
    }
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    number_end > 0 && matches!(&text[number_end..], "s" | "ms" | "µs" | "ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags() {
        assert_eq!(parse_level("WARN").unwrap(), Level::WARN);
        assert_eq!(parse_level("").unwrap(), Level::INFO);
        assert!(parse_level("loud").is_err());
        assert_eq!(parse_format("text").unwrap(), LogFormat::Text);
        assert!(parse_format("xml").is_err());
    }

    /// A writer into a shared buffer, for the formatter's output.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn events_are_json_lines_with_time_level_msg_then_attributes_in_order() {
        let out = Captured::default();
        let sink = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_max_level(Level::DEBUG)
            .event_format(JsonLines)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(err = %"no \"stream\"", failures = 3u64, ok = false, "query_failed");
            tracing::info!(ratio = 0.5f64, nan = f64::NAN, "measured");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).expect("every line is one JSON object"))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        // The keys in order (serde_json's map sorts them, so read the line itself).
        let first = text.lines().next().unwrap();
        let at = |key: &str| first.find(&format!("\"{key}\":")).expect(key);
        let order = ["time", "level", "msg", "err", "failures", "ok"].map(at);
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{first}");
        assert!(first.starts_with("{\"time\":"), "{first}");
        assert_eq!(lines[0]["level"], "WARN");
        assert_eq!(lines[0]["msg"], "query_failed");
        assert_eq!(lines[0]["err"], "no \"stream\"");
        assert_eq!(lines[0]["failures"], 3);
        assert_eq!(lines[0]["ok"], false);
        assert_eq!(lines[1]["level"], "INFO");
        assert_eq!(lines[1]["ratio"], 0.5);
        assert!(lines[1]["nan"].is_null(), "a NaN is written as null");
        assert!(lines[0]["time"].as_str().is_some_and(|t| !t.is_empty()));
    }

    fn capture(level: Level, body: impl FnOnce()) -> String {
        let out = Captured::default();
        let sink = out.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(move || sink.clone())
                .event_format(JsonLines)
                .with_filter(targets(level)),
        );
        tracing::subscriber::with_default(subscriber, body);
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn an_event_attribute_becomes_msg_and_every_line_passes_the_check() {
        let text = capture(Level::INFO, || {
            tracing::warn!(event = "replay_failed", seq = 4u64, "gap replay failed");
            tracing::info!(endpoint = "tcp://x", "subscribed");
        });
        let lines: Vec<_> = text.lines().map(|l| check_json_line(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["msg"], "replay_failed");
        assert_eq!(lines[0]["seq"], 4);
        assert!(!text.contains("gap replay failed"), "{text}");
        assert_eq!(lines[1]["msg"], "subscribed");
    }

    #[test]
    fn third_party_lines_are_mapped_and_filtered_below_warn() {
        let text = capture(Level::DEBUG, || {
            tracing::warn!(target: "zeromq::codec", "Connection reset by peer");
            tracing::info!(target: "zeromq::endpoint", "chatter");
            tracing::debug!(event = "own_debug", "kept");
        });
        let lines: Vec<_> = text.lines().map(|l| check_json_line(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["msg"], THIRD_PARTY_MSG);
        assert_eq!(lines[0]["level"], "WARN");
        assert_eq!(lines[0]["target"], "zeromq::codec");
        assert_eq!(lines[0]["detail"], "Connection reset by peer");
        assert_eq!(lines[1]["msg"], "own_debug");
    }

    #[test]
    fn the_check_refuses_what_the_schema_forbids() {
        let good = r#"{"time":"2026-12-06T16:29:59.009593Z","level":"INFO","msg":"startup","ttl_seconds":1800}"#;
        assert!(check_json_line(good).is_ok());
        for bad in [
            "not json",
            r#"["time"]"#,
            r#"{"level":"INFO","time":"2026-12-06T16:29:59Z","msg":"startup"}"#,
            r#"{"time":"yesterday","level":"INFO","msg":"startup"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"NOTICE","msg":"startup"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"INFO","msg":"sidecar starting"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"INFO","msg":"a","event":"a"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"INFO","msg":"a","log.file":"/x.rs"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"INFO","msg":"a","state_dir":"None"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"INFO","msg":"a","state_dir":"Some(\"/x\")"}"#,
            r#"{"time":"2026-12-06T16:29:59Z","level":"INFO","msg":"a","ttl":"1800s"}"#,
        ] {
            assert!(check_json_line(bad).is_err(), "{bad}");
        }
    }
}
