//! Hugging Face backend: `tokenizer.json` via the `tokenizers` crate and Jinja chat templates
//! via `minijinja` (compiled only with the `hf` feature).

use std::path::Path;

use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};
use tokenizers::Tokenizer;

use crate::TokenizeError;

/// Name of the single template registered in each model's environment.
const TEMPLATE_NAME: &str = "chat_template";

/// One loaded model: its tokenizer and, when it has one, its chat template.
pub(crate) struct Model {
    tokenizer: Tokenizer,
    chat: Option<ChatTemplate>,
    /// Why the segment cache cannot serve this tokenizer (`None`: it can), from
    /// [`crate::segments::cacheable`] at load.
    uncacheable: Option<String>,
    /// This model's part of the segment cache's key (its load order).
    slot: u32,
}

struct ChatTemplate {
    env: Environment<'static>,
    /// Special tokens exposed to the template (`bos_token`, `eos_token`, ...), only those that
    /// the config sets; absent ones stay undefined, as in `transformers`.
    special: Vec<(&'static str, String)>,
}

impl Model {
    /// Loads `dir/tokenizer.json` and the chat template from `dir/tokenizer_config.json`.
    ///
    /// A missing `tokenizer_config.json`, or one without `chat_template`, means "no template"
    /// (then `chat_template.jinja`, the file newer `transformers` versions write, is used when
    /// present). An unreadable or invalid config, or a template that does not compile, fails
    /// the load: encoding without the template the engine uses would give different tokens.
    pub(crate) fn load(dir: &Path) -> Result<Model, String> {
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| format!("tokenizer.json: {e}"))?;
        // The engine tokenizes the whole prompt; a truncation or padding setting saved in the
        // file must not change the ids (transformers also clears both for a plain encode).
        tokenizer
            .with_truncation(None)
            .map_err(|e| format!("tokenizer.json: {e}"))?;
        tokenizer.with_padding(None);

        let config_path = dir.join("tokenizer_config.json");
        let config: Option<serde_json::Value> = match std::fs::read(&config_path) {
            Ok(bytes) => Some(
                serde_json::from_slice(&bytes)
                    .map_err(|e| format!("tokenizer_config.json: {e}"))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("tokenizer_config.json: {e}")),
        };
        let mut source = match &config {
            Some(cfg) => template_from_config(cfg)?,
            None => None,
        };
        if source.is_none() {
            match std::fs::read_to_string(dir.join("chat_template.jinja")) {
                Ok(s) => source = Some(s),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("chat_template.jinja: {e}")),
            }
        }
        let chat = match source {
            None => None,
            Some(src) => {
                let special = config.as_ref().map(special_tokens).unwrap_or_default();
                Some(ChatTemplate {
                    env: build_env(src).map_err(|e| format!("chat template: {e:#}"))?,
                    special,
                })
            }
        };
        let uncacheable = crate::segments::cacheable(&tokenizer).err();
        Ok(Model {
            tokenizer,
            chat,
            uncacheable,
            slot: 0,
        })
    }

    /// Sets this model's part of the segment cache's key (unique per loaded model).
    pub(crate) fn set_slot(&mut self, slot: u32) {
        self.slot = slot;
    }

    /// Why the segment cache cannot serve this model (`None`: it can).
    pub(crate) fn uncacheable(&self) -> Option<&str> {
        self.uncacheable.as_deref()
    }

    pub(crate) fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// The text the engine would tokenize for a single user message: the rendered chat
    /// template, or the prompt itself for a model without a template.
    pub(crate) fn render_chat(&self, prompt: &str) -> Result<String, TokenizeError> {
        self.render_messages(&[crate::ChatMessage {
            role: "user".to_owned(),
            content: prompt.to_owned(),
        }])
    }

    /// The text the engine would tokenize for a conversation: the rendered chat template with
    /// `add_generation_prompt`, or the contents joined by newlines for a model without one.
    pub(crate) fn render_messages(
        &self,
        messages: &[crate::ChatMessage],
    ) -> Result<String, TokenizeError> {
        let Some(chat) = &self.chat else {
            let contents: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
            return Ok(contents.join("\n"));
        };
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())])
            })
            .collect();
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(true)),
        ];
        for (name, tok) in &chat.special {
            ctx.push((name, Value::from(tok.as_str())));
        }
        let template = chat
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        template
            .render(Value::from_pairs(ctx))
            .map_err(|e| TokenizeError::Template(describe(&e)))
    }

    /// Encodes text; `add_special_tokens` controls the post-processor (BOS/EOS insertion).
    /// Special tokens written *in* the text (`<|im_start|>`) are always recognised. Without
    /// added special tokens and with a `cache`, the pieces between added tokens come from the
    /// segment cache when this tokenizer allows it (the ids are the same: `segments.rs`).
    pub(crate) fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        cache: Option<&crate::segments::SegmentCache>,
    ) -> Result<Vec<u32>, TokenizeError> {
        match cache {
            Some(cache) if !add_special_tokens && self.uncacheable.is_none() => {
                cache.encode(&self.tokenizer, self.slot, text)
            }
            _ => {
                if let Some(cache) = cache
                    && !add_special_tokens
                {
                    cache.count_plain_encode();
                }
                self.tokenizer
                    .encode_fast(text, add_special_tokens)
                    .map(|enc| enc.get_ids().to_vec())
                    .map_err(|e| TokenizeError::Encode(e.to_string()))
            }
        }
    }
}

/// `chat_template` is a string, or a list of `{name, template}` (pick `default`, else the first).
fn template_from_config(cfg: &serde_json::Value) -> Result<Option<String>, String> {
    match cfg.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let named = |want: Option<&str>| {
                list.iter().find_map(|item| {
                    let name = item.get("name").and_then(|n| n.as_str());
                    let tmpl = item.get("template").and_then(|t| t.as_str())?;
                    match want {
                        Some(w) if name != Some(w) => None,
                        _ => Some(tmpl.to_owned()),
                    }
                })
            };
            named(Some("default"))
                .or_else(|| named(None))
                .map(Some)
                .ok_or_else(|| "chat_template: list holds no template".to_owned())
        }
        Some(_) => Err("chat_template: neither a string nor a list".to_owned()),
    }
}

/// The special tokens `transformers` passes to the template (its `special_tokens_map`),
/// each a string or an `AddedToken` object with `content`.
fn special_tokens(cfg: &serde_json::Value) -> Vec<(&'static str, String)> {
    ["bos_token", "eos_token", "unk_token", "pad_token"]
        .into_iter()
        .filter_map(|name| {
            let v = cfg.get(name)?;
            let s = match v {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_owned(),
                _ => return None,
            };
            Some((name, s))
        })
        .collect()
}

/// A sandboxed environment configured like `transformers`' chat-template environment:
/// `trim_blocks`, `lstrip_blocks`, loop controls, its `tojson`, `raise_exception` and
/// `strftime_now`, plus Python string/dict methods (`.strip()`, `.items()`, ...).
fn build_env(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", crate::json::tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |fmt: String| {
        crate::strftime::strftime_now(&fmt)
    });
    env.add_template_owned(TEMPLATE_NAME, source)?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// A one-line description of a render error: the message plus where it happened.
fn describe(err: &Error) -> String {
    match (err.detail(), err.line()) {
        (Some(detail), Some(line)) => format!("{detail} (line {line})"),
        (Some(detail), None) => detail.to_owned(),
        _ => err.to_string(),
    }
}
