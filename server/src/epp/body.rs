//! OpenAI request bodies as the picker reads them: `/v1/completions` and
//! `/v1/chat/completions`, only the fields a pick needs (`model`, `prompt` or `messages`,
//! `stream`). Everything else in the body is ignored and forwarded unchanged.
//!
//! Parsing never fails the request by itself: the caller decides what a [`BodyError`] costs
//! (docs/epp.md, "Bad input": a pick by load, or 400 for a body that is not JSON at all).

use inferencecache_tokenize::ChatMessage;
use serde::Deserialize;

/// What the pick needs from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiRequest {
    pub model: String,
    pub prompt: Prompt,
    pub stream: bool,
}

/// The text the engine will tokenize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `/v1/completions`: the raw prompt (no chat template).
    Text(String),
    /// `/v1/chat/completions`: the conversation, rendered with the model's chat template.
    Messages(Vec<ChatMessage>),
}

/// Why a body gives no prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// Over the picker's body limit (`--epp-max-body-bytes`).
    TooLarge,
    /// Not a JSON object.
    NotJson(String),
    /// JSON without a string `model`.
    MissingModel,
    /// A chat body without a non-empty `messages` array, or a completion without `prompt`.
    MissingPrompt,
}

impl BodyError {
    /// The `reason` label of `inferencecache_epp_body_parse_failures_total`.
    pub fn label(&self) -> &'static str {
        match self {
            BodyError::TooLarge => "too_large",
            BodyError::NotJson(_) => "not_json",
            BodyError::MissingModel => "missing_model",
            BodyError::MissingPrompt => "missing_prompt",
        }
    }
}

#[derive(Deserialize)]
struct RawBody {
    model: Option<serde_json::Value>,
    prompt: Option<serde_json::Value>,
    messages: Option<serde_json::Value>,
    stream: Option<serde_json::Value>,
}

/// Parses a request body; `chat` says whether the path was `/v1/chat/completions` (a body with
/// `messages` and no `prompt` is read as chat on any path).
pub fn parse(body: &[u8], chat: bool) -> Result<OpenAiRequest, BodyError> {
    let raw: RawBody =
        serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let model = match raw.model {
        Some(serde_json::Value::String(m)) if !m.is_empty() => m,
        _ => return Err(BodyError::MissingModel),
    };
    let stream = matches!(raw.stream, Some(serde_json::Value::Bool(true)));
    let prompt = if chat || (raw.prompt.is_none() && raw.messages.is_some()) {
        Prompt::Messages(messages(raw.messages)?)
    } else {
        Prompt::Text(prompt_text(raw.prompt)?)
    };
    Ok(OpenAiRequest {
        model,
        prompt,
        stream,
    })
}

/// `prompt`: a string, or a list whose first element is a string (a batch of prompts is routed
/// by its first one).
fn prompt_text(prompt: Option<serde_json::Value>) -> Result<String, BodyError> {
    match prompt {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s),
        Some(serde_json::Value::Array(items)) => match items.into_iter().next() {
            Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s),
            _ => Err(BodyError::MissingPrompt),
        },
        _ => Err(BodyError::MissingPrompt),
    }
}

/// `messages`: each `{role, content}` where content is a string or a list of parts whose
/// `text` parts are concatenated (image and audio parts carry no text and are skipped).
fn messages(messages: Option<serde_json::Value>) -> Result<Vec<ChatMessage>, BodyError> {
    let Some(serde_json::Value::Array(items)) = messages else {
        return Err(BodyError::MissingPrompt);
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let serde_json::Value::Object(mut fields) = item else {
            return Err(BodyError::MissingPrompt);
        };
        let role = match fields.remove("role") {
            Some(serde_json::Value::String(r)) => r,
            _ => return Err(BodyError::MissingPrompt),
        };
        let content = match fields.remove("content") {
            Some(serde_json::Value::String(c)) => c,
            Some(serde_json::Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .collect::<Vec<_>>()
                .join(""),
            // An assistant turn with only tool calls has no text.
            Some(serde_json::Value::Null) | None => String::new(),
            Some(_) => return Err(BodyError::MissingPrompt),
        };
        out.push(ChatMessage { role, content });
    }
    if out.is_empty() {
        return Err(BodyError::MissingPrompt);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn chat_body_with_string_and_part_contents() {
        let body = br#"{"model":"m","stream":true,"temperature":0.2,"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hel"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"lo"}]},
            {"role":"assistant","content":null}]}"#;
        let parsed = parse(body, true).unwrap();
        assert_eq!(parsed.model, "m");
        assert!(parsed.stream);
        assert_eq!(
            parsed.prompt,
            Prompt::Messages(vec![
                message("system", "be brief"),
                message("user", "hello"),
                message("assistant", ""),
            ])
        );
    }

    #[test]
    fn completion_body_string_and_batch() {
        let parsed = parse(br#"{"model":"m","prompt":"abc"}"#, false).unwrap();
        assert_eq!(parsed.prompt, Prompt::Text("abc".into()));
        assert!(!parsed.stream);
        let parsed = parse(br#"{"model":"m","prompt":["first","second"]}"#, false).unwrap();
        assert_eq!(parsed.prompt, Prompt::Text("first".into()));
        // Messages on the completions path still read as chat.
        let parsed = parse(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
            false,
        )
        .unwrap();
        assert_eq!(parsed.prompt, Prompt::Messages(vec![message("user", "x")]));
    }

    #[test]
    fn bad_bodies_name_their_fault() {
        assert!(matches!(
            parse(b"not json", true),
            Err(BodyError::NotJson(_))
        ));
        assert!(matches!(parse(b"[1,2]", true), Err(BodyError::NotJson(_))));
        assert_eq!(
            parse(br#"{"messages":[]}"#, true),
            Err(BodyError::MissingModel)
        );
        assert_eq!(parse(br#"{"model":7}"#, true), Err(BodyError::MissingModel));
        assert_eq!(
            parse(br#"{"model":"m"}"#, true),
            Err(BodyError::MissingPrompt)
        );
        assert_eq!(
            parse(br#"{"model":"m","messages":[]}"#, true),
            Err(BodyError::MissingPrompt)
        );
        assert_eq!(
            parse(br#"{"model":"m","messages":[{"content":"x"}]}"#, true),
            Err(BodyError::MissingPrompt)
        );
        assert_eq!(
            parse(br#"{"model":"m","messages":"hi"}"#, true),
            Err(BodyError::MissingPrompt)
        );
        assert_eq!(
            parse(br#"{"model":"m","prompt":""}"#, false),
            Err(BodyError::MissingPrompt)
        );
        assert_eq!(
            parse(br#"{"model":"m","prompt":[1]}"#, false),
            Err(BodyError::MissingPrompt)
        );
    }
}
