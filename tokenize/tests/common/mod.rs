//! Test fixtures: a tiny tokenizer built with the `tokenizers` API and real-style configs.

#![allow(dead_code)]

use std::fs;
use std::path::Path;

use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::utils::truncation::{TruncationDirection, TruncationParams, TruncationStrategy};
use tokenizers::{AddedToken, Tokenizer};

/// The ChatML-like template from the brief (single line, no whitespace control).
pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

pub const UNK: u32 = 0;
pub const IM_START: u32 = 1;
pub const IM_END: u32 = 2;
pub const BOS: u32 = 3;
pub const EOS: u32 = 4;
pub const USER: u32 = 5;
pub const ASSISTANT: u32 = 6;
pub const HELLO: u32 = 7;
pub const WORLD: u32 = 8;
pub const SYSTEM: u32 = 9;

/// A word-level tokenizer: whitespace split, ChatML markers as special tokens, and a
/// `<s> $A </s>` post-processor so that "add special tokens" is observable.
/// `truncate_to` saves a truncation setting into the file (the loader must ignore it).
pub fn build_tokenizer(truncate_to: Option<usize>) -> Tokenizer {
    let vocab = [
        ("[UNK]", UNK),
        ("<|im_start|>", IM_START),
        ("<|im_end|>", IM_END),
        ("<s>", BOS),
        ("</s>", EOS),
        ("user", USER),
        ("assistant", ASSISTANT),
        ("hello", HELLO),
        ("world", WORLD),
        ("system", SYSTEM),
    ]
    .map(|(w, id)| (w.to_owned(), id));
    let model = WordLevel::builder()
        .vocab(vocab.into())
        .unk_token("[UNK]".to_owned())
        .build()
        .expect("word-level model");
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    tok.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<s> $A </s>")
            .expect("template")
            .special_tokens(vec![("<s>", BOS), ("</s>", EOS)])
            .build()
            .expect("post-processor"),
    ));
    tok.add_special_tokens([
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
        AddedToken::from("<s>", true),
        AddedToken::from("</s>", true),
    ])
    .expect("special tokens");
    if let Some(max_length) = truncate_to {
        tok.with_truncation(Some(TruncationParams {
            direction: TruncationDirection::Right,
            max_length,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
        }))
        .expect("truncation");
    }
    tok
}

/// Writes `<root>/<id>/tokenizer.json` (and `tokenizer_config.json` when given).
pub fn write_model(root: &Path, id: &str, config: Option<serde_json::Value>) {
    write_model_with(root, id, config, None);
}

pub fn write_model_with(
    root: &Path,
    id: &str,
    config: Option<serde_json::Value>,
    truncate_to: Option<usize>,
) {
    let dir = root.join(id);
    fs::create_dir_all(&dir).expect("model dir");
    build_tokenizer(truncate_to)
        .save(dir.join("tokenizer.json"), false)
        .expect("save tokenizer.json");
    if let Some(cfg) = config {
        fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::to_vec_pretty(&cfg).expect("config json"),
        )
        .expect("write tokenizer_config.json");
    }
}

/// A `tokenizer_config.json` in the shape `transformers` writes: special tokens as objects,
/// the template as a string.
pub fn config_with_template(template: &str) -> serde_json::Value {
    serde_json::json!({
        "add_bos_token": false,
        "bos_token": { "__type": "AddedToken", "content": "<s>", "lstrip": false,
                       "normalized": false, "rstrip": false, "single_word": false },
        "eos_token": "</s>",
        "pad_token": null,
        "chat_template": template,
        "model_max_length": 4,
        "tokenizer_class": "PreTrainedTokenizerFast"
    })
}
