//! Log output (spec `server.md` §13): JSON records `{"time", "level", "msg", …attributes}` or
//! text, on stderr. `msg` is a stable snake_case event name; attributes follow in the order they
//! were recorded.

use std::fmt::{self, Write as _};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// One JSON object per line, keys in the order `time`, `level`, `msg`, then attributes.
pub struct JsonLines;

struct Fields {
    msg: String,
    rest: String,
}

impl Fields {
    fn push(&mut self, name: &str, value: serde_json::Value) {
        if name == "message" {
            self.msg = match value {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            return;
        }
        let key = serde_json::Value::String(name.to_string());
        let _ = write!(self.rest, ",{key}:{value}");
    }
}

impl Visit for Fields {
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
        self.push(
            field.name(),
            serde_json::Number::from_f64(value).map_or(serde_json::Value::Null, Into::into),
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
        let mut fields = Fields {
            msg: String::new(),
            rest: String::new(),
        };
        event.record(&mut fields);
        writeln!(
            writer,
            "{{\"time\":{},\"level\":\"{}\",\"msg\":{}{}}}",
            serde_json::Value::String(time),
            level_name(event.metadata().level()),
            serde_json::Value::String(fields.msg),
            fields.rest
        )
    }
}
