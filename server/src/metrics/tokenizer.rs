//! The tokenizer's segment cache counters (`--tokenizer-segment-cache-bytes`), read from the
//! tokenizer at scrape time: the cache keeps its own atomics, so this room holds no state.
//! Exported whether or not a tokenizer is loaded (zeros without one), so the families are
//! always present.

use super::Family;
use inferencecache_tokenize::SegmentCacheStats;

/// The segment cache's metric families.
pub fn families(stats: Option<SegmentCacheStats>) -> Vec<Family> {
    let stats = stats.unwrap_or_default();
    let as_f64 = |v: u64| v as f64;
    let mut lookups = Family::new(
        "inferencecache_tokenizer_segment_cache_lookups_total",
        "counter",
        "pieces of chat prompts (the text between special tokens) looked up in the tokenizer's segment cache, by result",
    );
    for (result, count) in [("hit", stats.hits), ("miss", stats.misses)] {
        lookups.push(
            "inferencecache_tokenizer_segment_cache_lookups_total",
            vec![("result".into(), result.into())],
            as_f64(count),
        );
    }
    let single = |name: &'static str, kind: &'static str, help: &'static str, value: u64| {
        let mut family = Family::new(name, kind, help);
        family.push(name, Vec::new(), as_f64(value));
        family
    };
    vec![
        lookups,
        single(
            "inferencecache_tokenizer_segment_cache_hit_tokens_total",
            "counter",
            "token ids taken from the segment cache instead of encoded",
            stats.hit_tokens,
        ),
        single(
            "inferencecache_tokenizer_segment_cache_whole_encodes_total",
            "counter",
            "chat prompts encoded whole because their tokenizer's pieces are not independent",
            stats.plain_encodes,
        ),
        single(
            "inferencecache_tokenizer_segment_cache_entries",
            "gauge",
            "pieces held in the segment cache",
            stats.entries,
        ),
        single(
            "inferencecache_tokenizer_segment_cache_bytes",
            "gauge",
            "estimated bytes the segment cache holds (text, ids and per-entry overhead)",
            stats.bytes,
        ),
        single(
            "inferencecache_tokenizer_segment_cache_capacity_bytes",
            "gauge",
            "the segment cache's bound (--tokenizer-segment-cache-bytes; 0 without a tokenizer or cache)",
            stats.capacity_bytes,
        ),
    ]
}
