//! The `tojson` filter as Hugging Face `transformers` defines it for chat templates:
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`.
//!
//! MiniJinja's built-in `tojson` escapes `<`, `>`, `&` and `'` for HTML and uses its own
//! spacing; HF deliberately overrides Jinja's filter to avoid exactly that, and the rendered
//! text must match what the engine renders byte for byte, so this module re-implements Python's
//! `json.dumps` output format.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Deepest nesting accepted, so a self-referencing value cannot recurse forever.
const MAX_DEPTH: usize = 128;

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// The filter: `value | tojson(indent=..., separators=..., sort_keys=..., ensure_ascii=...)`.
/// `indent` may also be given positionally, as Jinja's own filter allows.
pub(crate) fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            if let Some(s) = v.as_str() {
                Some(s.to_owned())
            } else if let Some(n) = v.as_i64() {
                // Python: a negative or zero indent still inserts newlines.
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            } else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        }
    };
    let (mut item_sep, mut key_sep) = if indent.is_some() {
        (",".to_owned(), ": ".to_owned())
    } else {
        (", ".to_owned(), ": ".to_owned())
    };
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")?
        && !seps.is_none()
    {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] => {
                item_sep = a.as_str().unwrap_or_default().to_owned();
                key_sep = b.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
        }
    }
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;

    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    // Safe: the output is JSON text the template author asked for, not HTML.
    Ok(Value::from_safe_string(out))
}

fn write_value(out: &mut String, v: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, v),
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), style, depth, |out, i| {
                write_value(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', entries.len(), style, depth, |out, i| {
                let (k, item) = &entries[i];
                write_str(out, k, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_value(out, item, style, depth + 1)
            })?;
        }
        ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid | _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of kind {}", v.kind()),
            ));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    style: &Style,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(ind) = &style.indent {
            out.push('\n');
            push_indent(out, ind, depth + 1);
        }
        item(out, i)?;
    }
    if let Some(ind) = &style.indent {
        out.push('\n');
        push_indent(out, ind, depth);
    }
    out.push(close);
    Ok(())
}

fn push_indent(out: &mut String, ind: &str, level: usize) {
    for _ in 0..level {
        out.push_str(ind);
    }
}

/// Python's `json.dumps` turns non-string keys into strings: `true`, `null`, numbers.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            Ok(s)
        }
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None | ValueKind::Undefined => Ok("null".to_owned()),
        other => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: map keys must be strings, not {other}"),
        )),
    }
}

fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        // Integers (including ones beyond i64) print as their decimal form.
        let _ = write!(out, "{v}");
        return;
    }
    match f64::try_from(v.clone()) {
        Ok(f) if f.is_nan() => out.push_str("NaN"),
        Ok(f) if f.is_infinite() => out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" }),
        Ok(f) => {
            // Rust's `{:?}` matches Python's `repr(float)` except for the exponent sign.
            let s = format!("{f:?}");
            match s.split_once('e') {
                Some((mant, exp)) if !exp.starts_with('-') => {
                    let _ = write!(out, "{mant}e+{exp}");
                }
                _ => out.push_str(&s),
            }
        }
        Err(_) => {
            let _ = write!(out, "{v}");
        }
    }
}

fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use minijinja::{Environment, context};

    fn render(src: &str, ctx: minijinja::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        env.render_str(src, ctx).unwrap()
    }

    #[test]
    fn matches_python_json_dumps() {
        let obj = minijinja::Value::from_pairs([
            ("name", minijinja::Value::from("get_weather")),
            (
                "args",
                minijinja::Value::from(vec![
                    minijinja::Value::from(1),
                    minijinja::Value::from(2.5),
                    minijinja::Value::from(true),
                    minijinja::Value::from(()),
                ]),
            ),
            ("text", minijinja::Value::from("a<b> & \"q\"\n\u{1}é")),
        ]);
        // json.dumps({...}, ensure_ascii=False)
        assert_eq!(
            render("{{ x | tojson }}", context! { x => obj.clone() }),
            r#"{"name": "get_weather", "args": [1, 2.5, true, null], "text": "a<b> & \"q\"\n\u0001é"}"#
        );
        // json.dumps({...}, ensure_ascii=False, indent=2)
        assert_eq!(
            render("{{ x | tojson(indent=2) }}", context! { x => obj.clone() }),
            "{\n  \"name\": \"get_weather\",\n  \"args\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"text\": \"a<b> & \\\"q\\\"\\n\\u0001é\"\n}"
        );
        assert_eq!(
            render(
                "{{ x | tojson(separators=(',', ':'), sort_keys=true, ensure_ascii=true) }}",
                context! { x => obj }
            ),
            r#"{"args":[1,2.5,true,null],"name":"get_weather","text":"a<b> & \"q\"\n\u0001\u00e9"}"#
        );
        assert_eq!(
            render("{{ [] | tojson(indent=4) }}{{ {} | tojson }}", context! {}),
            "[]{}"
        );
        assert_eq!(render("{{ 1e20 | tojson }}", context! {}), "1e+20");
    }

    #[test]
    fn rejects_unknown_kwargs() {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        assert!(
            env.render_str("{{ 1 | tojson(bogus=1) }}", context! {})
                .is_err()
        );
    }
}
