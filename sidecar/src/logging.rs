//! Log output in the server's schema (`server.md` §13): one JSON object per line on stderr,
//! keys `time`, `level`, `msg`, then the event's attributes in the order they were recorded;
//! or tracing's plain text with `--log-format text`.

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

/// Installs the process-wide logger on stderr (a second call is a no-op).
pub fn init(level: Level, format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(false);
    let _ = match format {
        LogFormat::Json => builder.event_format(JsonLines).try_init(),
        LogFormat::Text => builder.try_init(),
    };
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
}
