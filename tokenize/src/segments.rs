//! The segment cache: token ids of the text between added tokens, keyed by that text.
//!
//! # Why it is exact
//!
//! The `tokenizers` pipeline first splits the input on its added tokens (`<|im_start|>`,
//! `<|im_end|>`, ...): `AddedVocabulary::extract_and_normalize` cuts the text at every match
//! (stretched over the whitespace an `lstrip`/`rstrip` token eats), and every later stage —
//! the normalizer, the pre-tokenizer, the model — runs on each piece on its own. With
//! `add_special_tokens = false` the post-processor adds no ids, so the ids of the whole text
//! are the ids of its pieces in order: an added token's own id, or the ids of the text between
//! two of them. A rendered chat prompt repeats most of those pieces from request to request (the
//! system prompt, earlier turns), so the cache maps a piece's text to its ids and only the new
//! pieces are encoded.
//!
//! That independence does not hold for every tokenizer; [`cacheable`] refuses (and the model
//! encodes the whole text as before) when a piece's ids could depend on where it stands:
//! - a pre-tokenizer that looks at the piece's position in the whole input (`Metaspace` with
//!   `prepend_scheme: first` marks only the piece at offset 0) or one this module does not know;
//! - an added token with `single_word` (whether it matches depends on the characters around the
//!   piece);
//! - added tokens matched on normalized text (`normalized: true`) under a normalizer: the cut
//!   points then depend on the normalized text, which this module does not compute;
//! - BPE dropout (the ids are random).
//!
//! The pieces are found with the tokenizer's own splitter, and a piece missing from the cache
//! is encoded by the tokenizer itself, so the rules the tokenizer applies inside a piece are
//! its own. `tokenize/tests/segment_cache.rs` compares cached and plain encodes over many
//! prompts and tokenizer kinds.
//!
//! # Bounds
//!
//! One cache is shared by every model (the key holds the model's slot). Its weight is an
//! estimate of the memory an entry holds (the text, 4 bytes per id, and a fixed overhead for
//! the key, the shared id slice and the cache's slot), and the cache evicts (CLOCK-Pro, from
//! `quick_cache`) to stay under the configured byte capacity. A piece heavier than an eighth
//! of the capacity is encoded but not stored.

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::{OffsetReferential, OffsetType, Tokenizer};

use crate::{SegmentCacheStats, TokenizeError};

/// Bytes an entry costs besides its text and ids (key and value headers, the cache's slot).
const ENTRY_OVERHEAD_BYTES: u64 = 96;

/// Pre-tokenizer kinds (their serialized `type`) that treat every piece alike, wherever it
/// stands in the input. `Metaspace` is checked separately (its `first` prepend scheme is not).
const POSITION_FREE_PRE_TOKENIZERS: &[&str] = &[
    "BertPreTokenizer",
    "ByteLevel",
    "CharDelimiterSplit",
    "Delimiter",
    "Digits",
    "FixedLength",
    "Punctuation",
    "Sequence",
    "Split",
    "UnicodeScripts",
    "Whitespace",
    "WhitespaceSplit",
];

#[derive(Debug, PartialEq, Eq, Hash)]
struct SegmentKey {
    model: u32,
    text: Box<str>,
}

/// The borrowed form of [`SegmentKey`] a lookup uses (same fields, so the same hash).
#[derive(Hash)]
struct SegmentQuery<'a> {
    model: u32,
    text: &'a str,
}

impl quick_cache::Equivalent<SegmentKey> for SegmentQuery<'_> {
    fn equivalent(&self, key: &SegmentKey) -> bool {
        self.model == key.model && self.text == &*key.text
    }
}

#[derive(Clone)]
struct Weight;

impl quick_cache::Weighter<SegmentKey, Arc<[u32]>> for Weight {
    fn weight(&self, key: &SegmentKey, ids: &Arc<[u32]>) -> u64 {
        entry_bytes(key.text.len(), ids.len())
    }
}

fn entry_bytes(text_bytes: usize, ids: usize) -> u64 {
    text_bytes as u64 + 4 * ids as u64 + ENTRY_OVERHEAD_BYTES
}

/// The shared cache and its counters.
pub(crate) struct SegmentCache {
    cache: quick_cache::sync::Cache<SegmentKey, Arc<[u32]>, Weight>,
    capacity_bytes: u64,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_tokens: AtomicU64,
    plain_encodes: AtomicU64,
}

impl SegmentCache {
    /// A cache holding at most about `capacity_bytes` (must be > 0).
    pub(crate) fn new(capacity_bytes: u64) -> Self {
        // quick_cache sizes its tables from the item estimate; a chat prompt's pieces average
        // a few hundred bytes.
        let estimated_items = usize::try_from(capacity_bytes / 512)
            .unwrap_or(usize::MAX)
            .clamp(16, 1 << 20);
        Self {
            cache: quick_cache::sync::Cache::with_weighter(estimated_items, capacity_bytes, Weight),
            capacity_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hit_tokens: AtomicU64::new(0),
            plain_encodes: AtomicU64::new(0),
        }
    }

    pub(crate) fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            capacity_bytes: self.capacity_bytes,
            bytes: self.cache.weight(),
            entries: self.cache.len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
            plain_encodes: self.plain_encodes.load(Ordering::Relaxed),
        }
    }

    /// Counts an encode of a model the cache cannot serve (see [`cacheable`]).
    pub(crate) fn count_plain_encode(&self) {
        self.plain_encodes.fetch_add(1, Ordering::Relaxed);
    }

    /// The ids of `text` (encoded without adding special tokens), piece by piece through the
    /// cache. Only for a tokenizer [`cacheable`] accepted.
    pub(crate) fn encode(
        &self,
        tokenizer: &Tokenizer,
        model: u32,
        text: &str,
    ) -> Result<Vec<u32>, TokenizeError> {
        // The tokenizer's own first cut: at its added tokens, on the text as given. Without a
        // normalizer or without normalized added tokens ([`cacheable`]), the second cut on
        // normalized text finds the same pieces the tokenizer's encode does.
        let pieces = tokenizer
            .get_added_vocabulary()
            .extract_and_normalize(None::<&NormalizerWrapper>, text);
        let mut ids = Vec::new();
        for (_, (start, end), tokens) in
            pieces.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            if let Some(tokens) = tokens {
                ids.extend(tokens.iter().map(|token| token.id));
                continue;
            }
            let Some(piece) = text.get(start..end) else {
                // Offsets off a character boundary would be a splitter bug: encode whole.
                return encode_plain(tokenizer, text);
            };
            if piece.is_empty() {
                continue;
            }
            let query = SegmentQuery { model, text: piece };
            if let Some(cached) = self.cache.get(&query) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.hit_tokens
                    .fetch_add(cached.len() as u64, Ordering::Relaxed);
                ids.extend_from_slice(&cached);
                continue;
            }
            self.misses.fetch_add(1, Ordering::Relaxed);
            let encoded = encode_plain(tokenizer, piece)?;
            if entry_bytes(piece.len(), encoded.len()) <= self.capacity_bytes / 8 {
                self.cache.insert(
                    SegmentKey {
                        model,
                        text: piece.into(),
                    },
                    Arc::from(encoded.as_slice()),
                );
            }
            ids.extend_from_slice(&encoded);
        }
        Ok(ids)
    }
}

/// `text`'s ids from the tokenizer alone, without adding special tokens.
pub(crate) fn encode_plain(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, TokenizeError> {
    tokenizer
        .encode_fast(text, false)
        .map(|encoding| encoding.get_ids().to_vec())
        .map_err(|e| TokenizeError::Encode(e.to_string()))
}

/// Whether the ids of the pieces between added tokens are independent of one another for this
/// tokenizer (the module docs list the rules); `Err` names why not.
pub(crate) fn cacheable(tokenizer: &Tokenizer) -> Result<(), String> {
    let added = tokenizer.get_added_tokens_decoder();
    if let Some(token) = added.values().find(|t| t.single_word) {
        return Err(format!(
            "added token {:?} is single_word (its match depends on the text around it)",
            token.content
        ));
    }
    if tokenizer.get_normalizer().is_some()
        && let Some(token) = added.values().find(|t| t.normalized)
    {
        return Err(format!(
            "added token {:?} is matched on normalized text",
            token.content
        ));
    }
    if let Some(pre_tokenizer) = tokenizer.get_pre_tokenizer() {
        let value = serde_json::to_value(pre_tokenizer)
            .map_err(|e| format!("pre-tokenizer not inspectable: {e}"))?;
        position_free(&value)?;
    }
    let model = serde_json::to_value(tokenizer.get_model()).map_err(|e| format!("model: {e}"))?;
    if model
        .get("dropout")
        .and_then(serde_json::Value::as_f64)
        .is_some_and(|dropout| dropout > 0.0)
    {
        return Err("BPE dropout makes the ids random".to_owned());
    }
    Ok(())
}

/// Checks a serialized pre-tokenizer (and any it nests) against the position-free kinds.
fn position_free(value: &serde_json::Value) -> Result<(), String> {
    let kind = value.get("type").and_then(serde_json::Value::as_str);
    match kind {
        Some("Metaspace") => {
            let scheme = value
                .get("prepend_scheme")
                .and_then(serde_json::Value::as_str);
            if scheme == Some("first") {
                return Err(
                    "Metaspace with prepend_scheme \"first\" marks only the piece at \
                            the start of the input"
                        .to_owned(),
                );
            }
        }
        Some(kind) if POSITION_FREE_PRE_TOKENIZERS.contains(&kind) => {}
        Some(kind) => {
            return Err(format!(
                "pre-tokenizer {kind:?} is not known to be position-free"
            ));
        }
        None => return Err("pre-tokenizer without a type".to_owned()),
    }
    if let Some(nested) = value
        .get("pretokenizers")
        .and_then(serde_json::Value::as_array)
    {
        for inner in nested {
            position_free(inner)?;
        }
    }
    Ok(())
}
