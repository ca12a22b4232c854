//! End-to-end tests of loading a models directory and encoding prompts, on tokenizer files the
//! tests build themselves with the `tokenizers` crate.

#![cfg(feature = "hf")]

mod common;

use std::fs;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use inferencecache_tokenize::{ChatMessage, LoadStats, PromptTokenizer, TokenizeError, Tokenizers};
use serde_json::json;
use tempfile::TempDir;

fn tmp() -> TempDir {
    tempfile::Builder::new()
        .prefix("ic-tokenize-")
        .tempdir()
        .expect("temp dir")
}

fn load_one(template: Option<&str>) -> (TempDir, Tokenizers) {
    let root = tmp();
    write_model(root.path(), "org/name", template.map(config_with_template));
    let t = Tokenizers::load(root.path());
    assert_eq!(t.model_ids().collect::<Vec<_>>(), ["org/name"]);
    (root, t)
}

#[test]
fn chatml_template_gives_exact_ids() {
    let (_root, t) = load_one(Some(CHATML));
    assert!(t.has_chat_template("org/name"));
    assert_eq!(
        t.render_chat("org/name", "hello world").unwrap(),
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    );
    // Rendered, then encoded WITHOUT the post-processor's <s> ... </s>.
    assert_eq!(
        t.encode_chat("org/name", "hello world").unwrap(),
        [IM_START, USER, HELLO, WORLD, IM_END, IM_START, ASSISTANT]
    );
    // Raw encoding adds special tokens.
    assert_eq!(
        t.encode_raw("org/name", "hello world").unwrap(),
        [BOS, HELLO, WORLD, EOS]
    );
    // Unknown words map to [UNK]; special tokens inside the prompt are recognised.
    assert_eq!(
        t.encode_chat("org/name", "hello<|im_end|>there").unwrap(),
        [
            IM_START, USER, HELLO, IM_END, UNK, IM_END, IM_START, ASSISTANT
        ]
    );
}

#[test]
fn trait_object_and_deadline() {
    let (_root, t) = load_one(Some(CHATML));
    let shared: Arc<dyn PromptTokenizer> = Arc::new(t);
    assert_eq!(
        shared.encode_chat("org/name", "hello").unwrap(),
        [IM_START, USER, HELLO, IM_END, IM_START, ASSISTANT]
    );
    let later = Instant::now() + Duration::from_secs(60);
    assert_eq!(
        shared
            .encode_chat_until("org/name", "hello", later)
            .unwrap(),
        [IM_START, USER, HELLO, IM_END, IM_START, ASSISTANT]
    );
    let past = Instant::now();
    assert_eq!(
        shared.encode_chat_until("org/name", "hello", past),
        Err(TokenizeError::DeadlineExceeded)
    );
}

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

#[test]
fn conversations_and_raw_text_through_the_trait() {
    let (_root, t) = load_one(Some(CHATML));
    let shared: Arc<dyn PromptTokenizer> = Arc::new(t);
    let later = Instant::now() + Duration::from_secs(60);
    // Every turn rendered in order, then the generation prompt; no post-processor tokens.
    assert_eq!(
        shared
            .encode_messages_until(
                "org/name",
                &[message("system", "hello"), message("user", "world")],
                later
            )
            .unwrap(),
        [
            IM_START, SYSTEM, HELLO, IM_END, IM_START, USER, WORLD, IM_END, IM_START, ASSISTANT
        ]
    );
    // One user message is exactly encode_chat.
    assert_eq!(
        shared
            .encode_messages_until("org/name", &[message("user", "hello")], later)
            .unwrap(),
        shared.encode_chat("org/name", "hello").unwrap()
    );
    // A completion prompt: raw, with the tokenizer's special tokens.
    assert_eq!(
        shared
            .encode_text_until("org/name", "hello world", later)
            .unwrap(),
        [BOS, HELLO, WORLD, EOS]
    );
    let past = Instant::now();
    assert_eq!(
        shared.encode_messages_until("org/name", &[message("user", "hello")], past),
        Err(TokenizeError::DeadlineExceeded)
    );
    assert_eq!(
        shared.encode_text_until("missing/model", "hello", later),
        Err(TokenizeError::UnknownModel)
    );
}

#[test]
fn model_without_template_encodes_raw_prompt_without_special_tokens() {
    let (_root, t) = load_one(None);
    assert!(!t.has_chat_template("org/name"));
    assert_eq!(
        t.render_chat("org/name", "hello world").unwrap(),
        "hello world"
    );
    assert_eq!(
        t.encode_chat("org/name", "hello world").unwrap(),
        [HELLO, WORLD]
    );

    // A config without `chat_template` is the same.
    let root = tmp();
    write_model(root.path(), "m", Some(json!({ "eos_token": "</s>" })));
    let t = Tokenizers::load(root.path());
    assert!(!t.has_chat_template("m"));
    assert_eq!(t.encode_chat("m", "hello").unwrap(), [HELLO]);
}

#[test]
fn chat_template_jinja_file_is_a_fallback() {
    let root = tmp();
    write_model(root.path(), "m", Some(json!({ "eos_token": "</s>" })));
    fs::write(
        root.path().join("m/chat_template.jinja"),
        "{{ messages[0].content }} {{ eos_token }}",
    )
    .unwrap();
    let t = Tokenizers::load(root.path());
    assert_eq!(t.render_chat("m", "hello").unwrap(), "hello </s>");
}

#[test]
fn truncation_saved_in_tokenizer_json_is_ignored() {
    let root = tmp();
    write_model_with(
        root.path(),
        "m",
        Some(config_with_template(CHATML)),
        Some(2),
    );
    let t = Tokenizers::load(root.path());
    assert_eq!(t.encode_chat("m", "hello world").unwrap().len(), 7);
}

#[test]
fn nested_ids_are_found_and_model_dirs_not_descended() {
    let root = tmp();
    let r = root.path();
    write_model(r, "plain", None);
    write_model(r, "org/name", Some(config_with_template(CHATML)));
    write_model(r, "org/team/deep-model", None);
    // Inside a model directory: not a separate model.
    write_model(r, "org/name/inner", None);
    // Directories without tokenizer files are just walked through.
    fs::create_dir_all(r.join("empty/dir")).unwrap();
    fs::write(r.join("README.md"), "models").unwrap();

    let t = Tokenizers::load(r);
    assert_eq!(
        t.model_ids().collect::<Vec<_>>(),
        ["org/name", "org/team/deep-model", "plain"]
    );
    assert_eq!(
        t.stats(),
        LoadStats {
            loaded: 3,
            failed: 0,
            unsafe_ids: 0
        }
    );
    assert!(t.contains("org/team/deep-model"));
    assert!(!t.contains("org/name/inner"));
    assert_eq!(
        t.encode_chat("org/name/inner", "hello"),
        Err(TokenizeError::UnknownModel)
    );
    assert_eq!(
        t.encode_chat("org/team/deep-model", "hello").unwrap(),
        [HELLO]
    );
}

#[test]
fn tokenizer_files_in_the_root_are_not_a_model() {
    let root = tmp();
    build_tokenizer(None)
        .save(root.path().join("tokenizer.json"), false)
        .unwrap();
    write_model(root.path(), "m", None);
    let t = Tokenizers::load(root.path());
    assert_eq!(t.model_ids().collect::<Vec<_>>(), ["m"]);
}

#[test]
fn unsafe_and_unknown_ids_are_rejected() {
    let (_root, t) = load_one(Some(CHATML));
    for id in [
        "",
        "/org/name",
        "org//name",
        "org/name/",
        "./org/name",
        "org/./name",
        "org/../org/name",
        "../org/name",
        "org\\name",
        "C:/org/name",
        "org/name\0",
    ] {
        assert_eq!(
            t.encode_chat(id, "hello"),
            Err(TokenizeError::UnsafeModelId),
            "{id:?}"
        );
        assert!(!t.contains(id));
    }
    assert_eq!(
        t.encode_chat("org/other", "hello"),
        Err(TokenizeError::UnknownModel)
    );
    assert_eq!(
        t.encode_chat("ORG/NAME", "hello"),
        Err(TokenizeError::UnknownModel)
    );
    assert_eq!(
        t.encode_raw("nope", "hello"),
        Err(TokenizeError::UnknownModel)
    );
}

#[test]
fn directories_giving_unsafe_ids_are_skipped() {
    let root = tmp();
    write_model(root.path(), "ok", None);
    write_model(root.path(), "bad\\name", None);
    write_model(root.path(), "C:/drive", None);
    let t = Tokenizers::load(root.path());
    assert_eq!(t.model_ids().collect::<Vec<_>>(), ["ok"]);
    assert_eq!(t.stats().unsafe_ids, 2);
}

#[test]
fn broken_models_are_skipped_while_others_load() {
    let root = tmp();
    let r = root.path();
    write_model(r, "good/a", Some(config_with_template(CHATML)));
    write_model(r, "good/b", None);
    // Not JSON at all.
    fs::create_dir_all(r.join("bad/garbage")).unwrap();
    fs::write(r.join("bad/garbage/tokenizer.json"), "{ not json").unwrap();
    // Valid JSON, not a tokenizer.
    fs::create_dir_all(r.join("bad/shape")).unwrap();
    fs::write(r.join("bad/shape/tokenizer.json"), r#"{"model": 42}"#).unwrap();
    // Good tokenizer, broken config.
    write_model(r, "bad/config", None);
    fs::write(r.join("bad/config/tokenizer_config.json"), "[1,").unwrap();
    // Good tokenizer, template that does not compile.
    write_model(
        r,
        "bad/template",
        Some(config_with_template("{% for m in messages %}")),
    );
    // Good tokenizer, chat_template of the wrong type.
    write_model(r, "bad/type", Some(json!({ "chat_template": 7 })));

    let t = Tokenizers::load(r);
    assert_eq!(t.model_ids().collect::<Vec<_>>(), ["good/a", "good/b"]);
    assert_eq!(
        t.stats(),
        LoadStats {
            loaded: 2,
            failed: 5,
            unsafe_ids: 0
        }
    );
    assert_eq!(
        t.encode_chat("bad/garbage", "hello"),
        Err(TokenizeError::UnknownModel)
    );
    assert_eq!(
        t.encode_chat("good/b", "hello world").unwrap(),
        [HELLO, WORLD]
    );
}

#[test]
fn tiktoken_only_model_counts_as_load_failure() {
    let root = tmp();
    let r = root.path();
    write_model(r, "hf/model", None);
    fs::create_dir_all(r.join("openai/tik")).unwrap();
    fs::write(r.join("openai/tik/cl100k_base.tiktoken"), "aGVsbG8= 0\n").unwrap();
    // Its sub-directories are not walked either (it is a model directory).
    write_model(r, "openai/tik/sub", None);
    let t = Tokenizers::load(r);
    assert_eq!(t.model_ids().collect::<Vec<_>>(), ["hf/model"]);
    assert_eq!(
        t.stats(),
        LoadStats {
            loaded: 1,
            failed: 1,
            unsafe_ids: 0
        }
    );
    assert_eq!(
        t.encode_chat("openai/tik", "hello"),
        Err(TokenizeError::UnknownModel)
    );

    // tokenizer.json next to a *.tiktoken file: the tokenizer.json is used.
    fs::write(r.join("hf/model/extra.tiktoken"), "aGVsbG8= 0\n").unwrap();
    let t = Tokenizers::load(r);
    assert!(t.contains("hf/model"));
}

#[test]
fn missing_or_non_directory_root_loads_nothing() {
    let root = tmp();
    let t = Tokenizers::load(&root.path().join("does-not-exist"));
    assert!(t.is_empty());
    assert_eq!(t.stats(), LoadStats::default());
    fs::write(root.path().join("file"), "x").unwrap();
    assert!(Tokenizers::load(&root.path().join("file")).is_empty());
    assert!(Tokenizers::load(root.path()).is_empty());
    assert_eq!(
        Tokenizers::empty().encode_chat("m", "hello"),
        Err(TokenizeError::UnknownModel)
    );
}

#[cfg(unix)]
#[test]
fn symlinked_models_load_and_loops_terminate() {
    let root = tmp();
    let store = tmp();
    write_model(store.path(), "real", Some(config_with_template(CHATML)));
    std::os::unix::fs::symlink(store.path().join("real"), root.path().join("alias")).unwrap();
    fs::create_dir_all(root.path().join("loop")).unwrap();
    std::os::unix::fs::symlink(root.path(), root.path().join("loop/back")).unwrap();
    let t = Tokenizers::load(root.path());
    assert_eq!(t.model_ids().collect::<Vec<_>>(), ["alias"]);
    assert_eq!(t.encode_chat("alias", "hello").unwrap().len(), 6);
}

#[test]
fn raw_encoding_rejects_nul() {
    let (_root, t) = load_one(Some(CHATML));
    assert!(matches!(
        t.encode_raw("org/name", "hello\0world"),
        Err(TokenizeError::InvalidInput(_))
    ));
}

#[test]
fn raise_exception_surfaces_as_template_error() {
    let tmpl = "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}{% endfor %}";
    let (_root, t) = load_one(Some(tmpl));
    match t.encode_chat("org/name", "hello") {
        Err(TokenizeError::Template(msg)) => {
            assert!(
                msg.contains("Conversation roles must alternate user/assistant"),
                "{msg}"
            );
        }
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn strftime_now_renders_the_current_date() {
    let tmpl = "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}";
    let (_root, t) = load_one(Some(tmpl));
    let out = t.render_chat("org/name", "hello").unwrap();
    let (iso, human) = out.split_once('|').unwrap();
    let parts: Vec<&str> = iso.split('-').collect();
    assert_eq!(parts.len(), 3, "{out}");
    let year: u32 = parts[0].parse().unwrap();
    assert!((2024..=9999).contains(&year), "{out}");
    assert!(
        human.ends_with(parts[0]) && human.starts_with(parts[2]),
        "{out}"
    );
    assert!(!out.contains('%'), "{out}");
}

#[test]
fn tools_and_documents_are_undefined_and_special_tokens_are_exposed() {
    let tmpl = "{% if tools is defined %}T{% else %}no-tools{% endif %}|{% if documents is defined %}D{% else %}no-docs{% endif %}|{{ bos_token }}|{{ eos_token }}|{% if pad_token is defined %}P{% else %}no-pad{% endif %}|{{ add_generation_prompt }}|{{ messages | length }}";
    let (_root, t) = load_one(Some(tmpl));
    assert_eq!(
        t.render_chat("org/name", "hello").unwrap(),
        "no-tools|no-docs|<s>|</s>|no-pad|True|1"
    );
}

#[test]
fn template_list_picks_default_then_first() {
    let root = tmp();
    write_model(
        root.path(),
        "with-default",
        Some(json!({ "chat_template": [
            { "name": "tool_use", "template": "TOOLS {{ messages[0].content }}" },
            { "name": "default", "template": "DEFAULT {{ messages[0].content }}" }
        ]})),
    );
    write_model(
        root.path(),
        "no-default",
        Some(json!({ "chat_template": [
            { "name": "rag", "template": "RAG {{ messages[0].content }}" },
            { "name": "tool_use", "template": "TOOLS {{ messages[0].content }}" }
        ]})),
    );
    let t = Tokenizers::load(root.path());
    assert_eq!(t.render_chat("with-default", "hi").unwrap(), "DEFAULT hi");
    assert_eq!(t.render_chat("no-default", "hi").unwrap(), "RAG hi");
}

#[test]
fn python_style_methods_tojson_and_whitespace_control() {
    // Shaped like real HF templates: `-` whitespace control, trim_blocks/lstrip_blocks,
    // namespace(), Python string methods, dict access styles, tojson with indent.
    let tmpl = r#"{%- set ns = namespace(found=false) -%}
{%- for message in messages %}
    {%- if message['role'] == 'user' and message.content.strip().startswith('hello') %}
        {%- set ns.found = true %}
    {%- endif %}
{%- endfor %}
{% for message in messages %}
{{ '<|im_start|>' + message.role + '\n' + message['content'].strip().upper() + '<|im_end|>' + '\n' }}
{% endfor %}
{% if ns.found %}
found {{ messages[0] | tojson(indent=2) }} {{ messages | tojson }} {{ "a,b".split(",") | join("+") }}
{% endif %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' }}
{% endif %}"#;
    let (_root, t) = load_one(Some(tmpl));
    assert_eq!(
        t.render_chat("org/name", "  hello <b>  ").unwrap(),
        // Reference: the same template rendered by Python Jinja2 3.1 configured as in
        // `transformers` (trim_blocks, lstrip_blocks, loopcontrols, json.dumps tojson).
        "<|im_start|>user\nHELLO <B><|im_end|>\n\n\
         found {\n  \"role\": \"user\",\n  \"content\": \"  hello <b>  \"\n} \
         [{\"role\": \"user\", \"content\": \"  hello <b>  \"}] a+b\n\
         <|im_start|>assistant\n\n"
    );
}

#[test]
fn render_errors_are_typed() {
    // Calling an undefined function is a render-time error, not a panic or a load failure.
    let (_root, t) = load_one(Some("{{ no_such_function() }}"));
    assert!(matches!(
        t.encode_chat("org/name", "hello"),
        Err(TokenizeError::Template(_))
    ));
}

/// The spec's golden value for the real Qwen2.5 tokenizer. Runs only when
/// `INFERENCECACHE_TOKENIZER_MODELS_DIR` points at a models dir that holds
/// `Qwen/Qwen2.5-0.5B-Instruct/tokenizer.json` (no hub is reachable to download it).
#[test]
fn golden_qwen2_5_hello_world() {
    const MODEL: &str = "Qwen/Qwen2.5-0.5B-Instruct";
    let Some(dir) = std::env::var_os("INFERENCECACHE_TOKENIZER_MODELS_DIR") else {
        println!(
            "golden_qwen2_5_hello_world: skipped, INFERENCECACHE_TOKENIZER_MODELS_DIR is not set"
        );
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    if !dir.join(MODEL).join("tokenizer.json").is_file() {
        println!(
            "golden_qwen2_5_hello_world: skipped, {} has no {MODEL}/tokenizer.json",
            dir.display()
        );
        return;
    }
    let t = Tokenizers::load(&dir);
    assert_eq!(t.encode_raw(MODEL, "hello world").unwrap(), [14990, 1879]);
    let chat = t.encode_chat(MODEL, "hello world").unwrap();
    assert!(chat.windows(2).any(|w| w == [14990, 1879]), "{chat:?}");
}
