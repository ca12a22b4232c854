//! Log output in the server's schema (`server.md` §13), shared by the server and the sidecar:
//! one JSON object per line on stderr, keys `time`, `level`, `msg` (a stable snake_case event
//! name), then the event's attributes in the order they were recorded; or tracing's plain text
//! with `--log-format text`.

use std::fmt::{self, Write as _};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

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

/// Installs the process-wide logger on stderr. Fails when one is installed already.
pub fn init(level: Level, format: LogFormat) -> Result<(), String> {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(false);
    match format {
        LogFormat::Json => builder.event_format(JsonLines).try_init(),
        LogFormat::Text => builder.try_init(),
    }
    .map_err(|e| format!("cannot install the logger: {e}"))
}

/// The JSON-lines event formatter.
pub struct JsonLines;

#[derive(Default)]
struct Record {
    msg: String,
    attributes: String,
}

impl Record {
    fn push(&mut self, name: &str, value: serde_json::Value) {
        if name == "message" {
            self.msg = match value {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
        } else {
            let key = serde_json::Value::String(name.to_string());
            let _ = write!(self.attributes, ",{key}:{value}");
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
        writeln!(
            writer,
            "{{\"time\":{},\"level\":\"{}\",\"msg\":{}{}}}",
            serde_json::Value::String(time),
            level_name(event.metadata().level()),
            serde_json::Value::String(record.msg),
            record.attributes
        )
    }
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
}
