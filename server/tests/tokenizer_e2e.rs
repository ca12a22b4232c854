//! `prompt_text` end to end with real files: a tokenizer built here with the `tokenizers` crate
//! and a ChatML-style `tokenizer_config.json` in a temporary models dir, served by the real
//! binary (server.md §7.2–§7.4; SV46–SV50).

mod common;

use common::{ServerProcess, lookup, prompt_lookup, report_token_chain};
use std::path::{Path, PathBuf};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::{AddedToken, Tokenizer};

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
const BLOCK: usize = 8;

fn tokenizer() -> Tokenizer {
    let words = [
        "[UNK]",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "hello",
        "world",
        "cache",
        "route",
    ];
    let vocab = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    tok.add_special_tokens([
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ])
    .unwrap();
    tok
}

fn models_dir() -> PathBuf {
    let root = std::env::temp_dir().join(format!("ic-tok-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dir = root.join("org").join("chat");
    std::fs::create_dir_all(&dir).unwrap();
    tokenizer().save(dir.join("tokenizer.json"), false).unwrap();
    let config = serde_json::json!({ "chat_template": CHATML, "eos_token": "<|im_end|>" });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    // Tiny test blocks: turn the default 64-token matched floor off for tenant "t".
    std::fs::write(
        root.join("server.toml"),
        "[[policy.namespaces]]\nnamespace = \"t\"\nminimumMatchedTokens = 0\n",
    )
    .unwrap();
    root
}

/// Renders the one-user-turn prompt and encodes it without special tokens, independently of
/// the server.
fn expected_tokens(prompt: &str) -> Vec<u32> {
    let rendered = format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n");
    tokenizer()
        .encode(rendered, false)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// The binary with the models directory (and its config) of [`models_dir`].
fn start(models: &Path) -> ServerProcess {
    ServerProcess::start(
        models,
        &[
            "--engine-block-size",
            &BLOCK.to_string(),
            "--tokenizer-models-dir",
            models.to_str().unwrap(),
            "--config",
            models.join("server.toml").to_str().unwrap(),
            "--log-level",
            "warn",
        ],
    )
}

#[tokio::test]
async fn prompt_text_with_a_real_tokenizer_and_chat_template() {
    let models = models_dir();
    let server = start(&models);
    let mut c = server.client().await;

    let text = "hello world cache route hello world";
    let expected = expected_tokens(text);
    assert_eq!(expected.len(), 11, "{expected:?}");
    // Nothing indexed yet: the answer is built after tokenizing, so the tokens are echoed.
    let r = lookup(&mut c, prompt_lookup("org/chat", text)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    assert_eq!(
        r.token_ids, expected,
        "echo equals an independent render + encode"
    );

    // Blocks ingested from those tokens are found by the prompt.
    report_token_chain(&mut c, "r1", "org/chat", &expected, BLOCK).await;
    let r = lookup(&mut c, prompt_lookup("org/chat", text)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(
        r.replica_scores[0].matched_tokens, BLOCK as i32,
        "one full block of 8 tokens"
    );
    assert_eq!(r.token_ids, expected);

    // A sub-block prompt fails open with echo.
    let short = lookup(&mut c, prompt_lookup("org/chat", "hi")).await;
    assert_eq!(short.reason_code, "NO_HINT");
    assert_eq!(short.token_ids, expected_tokens("hi"));
    // Unknown or unsafe model ids and oversized text fail open without echo.
    for model in [
        "org/other",
        "../org/chat",
        "/org/chat",
        "org//chat",
        "org\\chat",
        "",
    ] {
        let r = lookup(&mut c, prompt_lookup(model, text)).await;
        assert_eq!(
            (r.reason_code.as_str(), r.token_ids.len()),
            ("NO_HINT", 0),
            "model {model:?}"
        );
    }
    let huge = "hello ".repeat((1 << 20) / 6 + 1);
    let r = lookup(&mut c, prompt_lookup("org/chat", &huge)).await;
    assert_eq!((r.reason_code.as_str(), r.token_ids.len()), ("NO_HINT", 0));
    let _ = std::fs::remove_dir_all(models);
}
