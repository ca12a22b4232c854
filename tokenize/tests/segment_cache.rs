//! The segment cache gives the same ids as a plain encode (`tokenize/src/segments.rs`): many
//! generated conversations, each rendered with a ChatML template and encoded by the same models
//! directory loaded with and without the cache, over tokenizer kinds built and trained here
//! with the `tokenizers` crate (word level, byte-level BPE, Metaspace BPE, WordPiece with a
//! lower-casing normalizer, added tokens that strip whitespace). Tokenizers whose pieces are not
//! independent are refused, and the refusal is shown to matter.

#![cfg(feature = "hf")]

mod common;

use std::time::{Duration, Instant};

use inferencecache_tokenize::{ChatMessage, PromptTokenizer, Tokenizers};
use serde_json::json;
use tempfile::TempDir;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::models::wordpiece::{WordPiece, WordPieceTrainer};
use tokenizers::models::{ModelWrapper, TrainerWrapper};
use tokenizers::normalizers::{BertNormalizer, NFC};
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

const MODEL: &str = "org/chat";

/// Words the conversations are made of: ASCII, accents, CJK, digits, punctuation, an added
/// token's text and look-alikes of one, whitespace runs.
const WORDS: &[&str] = &[
    "hello",
    "world",
    "the",
    "cache",
    "Résumé",
    "naïve",
    "東京",
    "数据",
    "42",
    "3.14",
    "!",
    "?",
    "don't",
    "  ",
    "\n",
    "\t",
    "<|im_end|>",
    "<|im_start|>",
    "<|im",
    "end|>",
    "<s>",
    "Hello",
    "WORLD",
    "tokens",
    "prefix",
    "système",
    "🙂",
    "a",
    "zz",
    ",",
    "-",
    "user",
    "assistant",
];

/// A deterministic generator (xorshift64*), so a failure names its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn text(&mut self, words: usize) -> String {
        let mut out = String::new();
        for i in 0..words {
            if i > 0 && self.below(4) != 0 {
                out.push(' ');
            }
            out.push_str(WORDS[self.below(WORDS.len())]);
        }
        out
    }
}

/// Conversations sharing a few system prompts and earlier turns (what the cache reuses), with
/// edge cases: empty contents, leading and trailing whitespace, added tokens in the text.
fn conversations(seed: u64, count: usize) -> Vec<Vec<ChatMessage>> {
    let mut rng = Rng(seed);
    let systems: Vec<String> = (0..5).map(|_| rng.text(40)).collect();
    let mut out = Vec::new();
    for _ in 0..count {
        let mut messages = vec![ChatMessage {
            role: "system".into(),
            content: systems[rng.below(systems.len())].clone(),
        }];
        for turn in 0..rng.below(4) + 1 {
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            let content = match rng.below(8) {
                0 => String::new(),
                1 => format!("  {}  ", rng.text(3)),
                2 => format!("\n{}\n", rng.text(5)),
                _ => {
                    let words = rng.below(30) + 1;
                    rng.text(words)
                }
            };
            messages.push(ChatMessage {
                role: role.into(),
                content,
            });
        }
        out.push(messages);
    }
    out
}

fn corpus() -> Vec<String> {
    let mut rng = Rng(7);
    (0..400).map(|_| rng.text(20)).collect()
}

fn train(tokenizer: &mut Tokenizer, mut trainer: TrainerWrapper) {
    tokenizer
        .train(&mut trainer, corpus().into_iter())
        .expect("train");
}

fn bpe(pre_tokenizer: PreTokenizerWrapper, normalizer: Option<NormalizerWrapper>) -> Tokenizer {
    let mut tokenizer = Tokenizer::new(ModelWrapper::from(BPE::default()));
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_normalizer(normalizer).expect("normalizer");
    let trainer = BpeTrainer::builder()
        .vocab_size(500)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    train(&mut tokenizer, trainer.into());
    tokenizer
}

fn wordpiece() -> Tokenizer {
    let mut tokenizer = Tokenizer::new(ModelWrapper::from(WordPiece::default()));
    tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
    tokenizer
        .with_normalizer(Some(BertNormalizer::new(true, true, None, true)))
        .expect("normalizer");
    let trainer = WordPieceTrainer::builder()
        .vocab_size(500)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from("[UNK]", true)])
        .build();
    train(&mut tokenizer, trainer.into());
    tokenizer
}

/// ChatML's markers as special tokens (`strip`: `<|im_start|>` eats whitespace on its left,
/// `<|im_end|>` on its right).
fn chatml_tokens(tokenizer: &mut Tokenizer, strip: bool) {
    tokenizer
        .add_special_tokens([
            AddedToken::from("<|im_start|>", true).lstrip(strip),
            AddedToken::from("<|im_end|>", true).rstrip(strip),
        ])
        .expect("special tokens");
}

/// The models directory with `tokenizer`, loaded without and with the segment cache.
fn load(tokenizer: &Tokenizer) -> (TempDir, Tokenizers, Tokenizers) {
    let root = tempfile::Builder::new()
        .prefix("ic-segments-")
        .tempdir()
        .expect("temp dir");
    let dir = root.path().join(MODEL);
    std::fs::create_dir_all(&dir).unwrap();
    tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
    let config = json!({ "chat_template": common::CHATML, "eos_token": "<|im_end|>" });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let plain = Tokenizers::load(root.path());
    let cached = Tokenizers::load(root.path()).with_segment_cache(1 << 20);
    assert_eq!(plain.len(), 1);
    (root, plain, cached)
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// Encodes `count` conversations with and without the cache and asserts identical ids; returns
/// the cache's stats.
fn assert_exact(
    tokenizer: &Tokenizer,
    seed: u64,
    count: usize,
) -> inferencecache_tokenize::SegmentCacheStats {
    let (_root, plain, cached) = load(tokenizer);
    for (i, messages) in conversations(seed, count).iter().enumerate() {
        let want = plain.encode_messages_until(MODEL, messages, far()).unwrap();
        // Twice: the first fills the cache, the second reads it.
        for pass in 0..2 {
            let got = cached
                .encode_messages_until(MODEL, messages, far())
                .unwrap();
            assert_eq!(
                got, want,
                "seed {seed} conversation {i} pass {pass}: {messages:?}"
            );
        }
    }
    cached.segment_cache_stats().expect("a cache")
}

#[test]
fn word_level_with_chatml_is_exact() {
    let stats = assert_exact(&common::build_tokenizer(None), 1, 400);
    assert_eq!(stats.plain_encodes, 0);
    assert!(stats.hits > stats.misses, "{stats:?}");
    assert!(stats.hit_tokens > 0 && stats.entries > 0 && stats.bytes > 0);
    assert!(stats.bytes <= stats.capacity_bytes);
}

#[test]
fn byte_level_bpe_with_stripping_tokens_is_exact() {
    for strip in [false, true] {
        let mut tokenizer = bpe(ByteLevel::new(false, true, true).into(), None);
        chatml_tokens(&mut tokenizer, strip);
        // A normalized (non-special) added token too: without a normalizer it is cut on the
        // text as given, as the tokenizer does.
        tokenizer
            .add_tokens([AddedToken::from("prefix", false)])
            .expect("added token");
        let stats = assert_exact(&tokenizer, 2 + u64::from(strip), 300);
        assert_eq!(stats.plain_encodes, 0, "strip {strip}");
        assert!(stats.hits > 0);
    }
}

#[test]
fn metaspace_always_and_wordpiece_are_exact() {
    let mut metaspace = bpe(
        Metaspace::new('▁', PrependScheme::Always, true).into(),
        Some(NFC.into()),
    );
    chatml_tokens(&mut metaspace, false);
    assert_eq!(assert_exact(&metaspace, 4, 300).plain_encodes, 0);

    let mut bert = wordpiece();
    chatml_tokens(&mut bert, false);
    let stats = assert_exact(&bert, 5, 300);
    assert_eq!(stats.plain_encodes, 0);
    assert!(stats.hits > 0);
}

/// `Metaspace` with `prepend_scheme: first` marks only the piece at offset 0, so a piece's ids
/// depend on where it stands: the cache refuses the model (its encodes go whole, still exact),
/// and encoding the pieces on their own would indeed give other ids.
#[test]
fn position_dependent_tokenizers_are_refused() {
    let mut first = bpe(Metaspace::new('▁', PrependScheme::First, true).into(), None);
    chatml_tokens(&mut first, false);
    let stats = assert_exact(&first, 6, 50);
    assert_eq!((stats.hits, stats.misses, stats.entries), (0, 0, 0));
    assert_eq!(stats.plain_encodes, 100);
    // Why: "hello" after an added token has no "▁" prefix in the whole text, but does alone.
    let whole = first
        .encode_fast("<|im_start|>hello world", false)
        .unwrap()
        .get_ids()
        .to_vec();
    let alone = first
        .encode_fast("hello world", false)
        .unwrap()
        .get_ids()
        .to_vec();
    let start = first.token_to_id("<|im_start|>").unwrap();
    assert_ne!(whole, [vec![start], alone].concat());

    // A single-word added token and a normalized one under a normalizer are refused too.
    let mut single = common::build_tokenizer(None);
    single
        .add_tokens([AddedToken::from("hello", false).single_word(true)])
        .expect("added token");
    assert_eq!(assert_exact(&single, 7, 20).plain_encodes, 40);
    let mut normalized = bpe(ByteLevel::new(false, true, true).into(), Some(NFC.into()));
    chatml_tokens(&mut normalized, false);
    normalized
        .add_tokens([AddedToken::from("prefix", false)])
        .expect("added token");
    assert_eq!(assert_exact(&normalized, 8, 20).plain_encodes, 40);
}

/// The cache stays under its byte bound however many distinct pieces pass through, and keeps
/// giving exact ids after evicting.
#[test]
fn capacity_bounds_the_cache() {
    let tokenizer = common::build_tokenizer(None);
    let root = tempfile::Builder::new()
        .prefix("ic-segments-")
        .tempdir()
        .unwrap();
    common::write_model(
        root.path(),
        MODEL,
        Some(common::config_with_template(common::CHATML)),
    );
    let _ = tokenizer;
    let plain = Tokenizers::load(root.path());
    let cached = Tokenizers::load(root.path()).with_segment_cache(16 * 1024);
    let mut rng = Rng(9);
    for i in 0..2000 {
        let messages = vec![ChatMessage {
            role: "user".into(),
            content: format!("{} {i}", rng.text(10)),
        }];
        assert_eq!(
            cached
                .encode_messages_until(MODEL, &messages, far())
                .unwrap(),
            plain
                .encode_messages_until(MODEL, &messages, far())
                .unwrap()
        );
    }
    let stats = cached.segment_cache_stats().unwrap();
    assert_eq!(stats.capacity_bytes, 16 * 1024);
    assert!(stats.bytes <= stats.capacity_bytes, "{stats:?}");
    assert!(stats.entries < 2000, "{stats:?}");
    // No cache when the capacity is 0.
    assert!(
        Tokenizers::load(root.path())
            .with_segment_cache(0)
            .segment_cache_stats()
            .is_none()
    );
}
