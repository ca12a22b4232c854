//! `sidecar_event`: bytes → the sidecar's msgpack batch decoder (sidecar.md §4) and the
//! positional re-keying of the decoded pages into 16-token index blocks (sidecar.md §5).

use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
use inferencecache_sidecar::positional::ReverseMap;
use inferencecache_sidecar::wire::{
    BlockStored, Event, EventBatch, TAG_ALL_CLEARED, TAG_BLOCK_REMOVED, TAG_BLOCK_STORED,
    decode_batch, encode,
};
use rmpv::Value;

/// Decodes `data` as an engine event batch. A decoded batch must re-encode (in both the map and
/// the array event forms) to bytes that decode to the same batch, and its blocks must re-key the
/// same way whether stored in one event or split across a parent and a child event.
pub fn sidecar_event(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    for form in [Form::Map, Form::Array] {
        let again = decode_batch(&encode(&canonical(&batch, form)))
            .unwrap_or_else(|e| panic!("a re-encoded batch ({form:?}) failed to decode: {e}"));
        assert_eq!(again.ts.to_bits(), batch.ts.to_bits(), "timestamp changed");
        assert_eq!(
            again.events,
            expressible(&batch.events, form),
            "events changed ({form:?})"
        );
    }
    let mut map = ReverseMap::new(INDEX_BLOCK);
    for ev in &batch.events {
        match ev {
            Event::BlockStored(bs) => {
                // §4: block_size is positive once decoded.
                assert!(bs.block_size > 0, "block_size {}", bs.block_size);
                // The single-group re-keying (grouped mode is covered by the sidecar's tests).
                let single = BlockStored {
                    group_idx: None,
                    lookahead_tokens: None,
                    ..bs.clone()
                };
                check_store(&mut map, &single);
            }
            Event::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => {
                map.remove(block_hashes, medium.as_deref(), true);
                if medium.is_none() {
                    assert!(block_hashes.iter().all(|h| !map.contains(h)));
                }
            }
            Event::AllBlocksCleared => {
                map.clear();
                assert!(map.is_empty());
            }
        }
    }
}

/// Tokens per index block of the re-keying checks.
const INDEX_BLOCK: usize = 16;

#[derive(Debug, Clone, Copy)]
enum Form {
    Map,
    Array,
}

/// The events as the array form can carry them: no LoRA name, extra keys, cache salt or vLLM
/// 0.33 group and offload fields.
fn expressible(events: &[Event], form: Form) -> Vec<Event> {
    events
        .iter()
        .map(|ev| match (ev, form) {
            (Event::BlockStored(bs), Form::Array) => Event::BlockStored(BlockStored {
                lora_name: None,
                first_keyed_block: None,
                cache_salt: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
                locality: None,
                ownership: None,
                session_id: None,
                lookahead_tokens: None,
                ..bs.clone()
            }),
            (
                Event::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                },
                Form::Array,
            ) => Event::BlockRemoved {
                block_hashes: block_hashes.clone(),
                medium: medium.clone(),
                group_idx: None,
                locality: None,
                ownership: None,
            },
            _ => ev.clone(),
        })
        .collect()
}

fn optional_str(v: &Option<String>) -> Value {
    v.as_deref().map_or(Value::Nil, Value::from)
}

/// The batch as an engine would send it: hashes as bin, nil for absent optionals.
fn canonical(batch: &EventBatch, form: Form) -> Value {
    let bin_list =
        |hs: &[Vec<u8>]| Value::Array(hs.iter().map(|h| Value::Binary(h.clone())).collect());
    let events = batch
        .events
        .iter()
        .map(|ev| {
            let (tag, fields): (&str, Vec<(&str, Value)>) = match ev {
                Event::BlockStored(bs) => (
                    TAG_BLOCK_STORED,
                    vec![
                        ("block_hashes", bin_list(&bs.block_hashes)),
                        (
                            "parent_block_hash",
                            bs.parent_block_hash
                                .as_ref()
                                .map_or(Value::Nil, |p| Value::Binary(p.clone())),
                        ),
                        (
                            "token_ids",
                            Value::Array(bs.token_ids.iter().map(|t| Value::from(*t)).collect()),
                        ),
                        ("block_size", Value::from(bs.block_size)),
                        ("lora_id", bs.lora_id.map_or(Value::Nil, Value::from)),
                        ("medium", optional_str(&bs.medium)),
                        // Map form only (the array decoder stops at the medium).
                        ("lora_name", optional_str(&bs.lora_name)),
                        ("cache_salt", optional_str(&bs.cache_salt)),
                        ("extra_keys", extra_keys(bs.first_keyed_block)),
                        ("group_idx", bs.group_idx.map_or(Value::Nil, Value::from)),
                        ("kv_cache_spec_kind", optional_str(&bs.kv_cache_spec_kind)),
                        (
                            "kv_cache_spec_sliding_window",
                            bs.kv_cache_spec_sliding_window
                                .map_or(Value::Nil, Value::from),
                        ),
                        ("locality", optional_str(&bs.locality)),
                        ("ownership", optional_str(&bs.ownership)),
                        ("session_id", optional_str(&bs.session_id)),
                        (
                            "lookahead_token_ids",
                            bs.lookahead_tokens.as_ref().map_or(Value::Nil, |l| {
                                Value::Array(
                                    l.iter()
                                        .map(|&n| Value::Array(vec![Value::from(0); n]))
                                        .collect(),
                                )
                            }),
                        ),
                    ],
                ),
                Event::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                    locality,
                    ownership,
                } => (
                    TAG_BLOCK_REMOVED,
                    vec![
                        ("block_hashes", bin_list(block_hashes)),
                        ("medium", optional_str(medium)),
                        ("group_idx", group_idx.map_or(Value::Nil, Value::from)),
                        ("locality", optional_str(locality)),
                        ("ownership", optional_str(ownership)),
                    ],
                ),
                Event::AllBlocksCleared => (TAG_ALL_CLEARED, vec![]),
            };
            match form {
                Form::Map => Value::Map(
                    std::iter::once((Value::from("type"), Value::from(tag)))
                        .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                        .collect(),
                ),
                Form::Array => Value::Array(
                    std::iter::once(Value::from(tag))
                        .chain(
                            fields
                                .into_iter()
                                .filter(|(k, _)| {
                                    matches!(
                                        *k,
                                        "block_hashes"
                                            | "parent_block_hash"
                                            | "token_ids"
                                            | "block_size"
                                            | "lora_id"
                                            | "medium"
                                    )
                                })
                                .map(|(_, v)| v),
                        )
                        .collect(),
                ),
            }
        })
        .collect();
    Value::Array(vec![Value::F64(batch.ts), Value::Array(events)])
}

/// vLLM-style per-block extra keys whose first keyed block is `first` (a non-string key, so
/// it is never taken for the LoRA name).
fn extra_keys(first: Option<usize>) -> Value {
    match first {
        None => Value::Nil,
        Some(k) => Value::Array(
            std::iter::repeat_n(Value::Nil, k)
                .chain(std::iter::once(Value::Array(vec![Value::from(0)])))
                .collect(),
        ),
    }
}

/// Stores one decoded `BlockStored` and checks the derived entries (§5).
fn check_store(map: &mut ReverseMap, bs: &BlockStored) {
    let n = bs.block_hashes.len();
    let parent_known = bs.parent_block_hash.as_ref().map(|p| map.contains(p));
    let distinct = {
        let mut seen = std::collections::HashSet::new();
        bs.block_hashes.iter().all(|h| seen.insert(h))
    };
    let fresh = distinct && bs.block_hashes.iter().all(|h| !map.contains(h));
    let stored = map.store(bs, "");
    let entries = &stored.entries;
    if stored.mismatched {
        assert!(
            entries.is_empty(),
            "entries from token ids that do not cover the pages"
        );
        return;
    }
    if parent_known == Some(false) {
        // The index never keys pages whose prefix it does not know.
        assert!(entries.is_empty(), "an orphan page was indexed");
        assert_eq!(stored.orphan_pages, n);
        return;
    }
    if fresh {
        for pair in entries.windows(2) {
            assert!(
                pair[0].token_count < pair[1].token_count,
                "cumulative token counts do not increase"
            );
        }
    }
    let keyed = bs.cache_salt.is_some() || bs.first_keyed_block.is_some_and(|k| k < n);
    if parent_known.is_some() || !fresh || keyed {
        return;
    }
    // A root event is the gateway's fingerprint of its own tokens, in index blocks.
    let page = usize::try_from(bs.block_size).expect("a stored block size fits usize");
    let tokens = &bs.token_ids[..n * page];
    let want: Vec<[u8; 8]> = prefix_hashes(tokens, INDEX_BLOCK)
        .into_iter()
        .map(to_wire)
        .collect();
    let got: Vec<[u8; 8]> = entries.iter().map(|e| e.prefix_hash).collect();
    assert_eq!(
        got, want,
        "root event re-keyed differently from the fingerprint"
    );
    // The same pages split into a root and a child naming its parent give the same entries.
    if n >= 2 {
        let k = n / 2;
        let mut split = ReverseMap::new(INDEX_BLOCK);
        let head = BlockStored {
            block_hashes: bs.block_hashes[..k].to_vec(),
            parent_block_hash: None,
            token_ids: tokens[..k * page].to_vec(),
            ..bs.clone()
        };
        let tail = BlockStored {
            block_hashes: bs.block_hashes[k..].to_vec(),
            parent_block_hash: Some(bs.block_hashes[k - 1].clone()),
            token_ids: tokens[k * page..].to_vec(),
            ..bs.clone()
        };
        let mut parts = split.store(&head, "").entries;
        parts.extend(split.store(&tail, "").entries);
        assert_eq!(&parts, entries, "a split event re-keyed differently");
    }
}
