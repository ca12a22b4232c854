//! msgpack decoding of engine KV-event messages (spec `sidecar.md` §3–§4).
//!
//! A ZMQ message is `[topic, seq (u64 big-endian), payload]`; [`split_message`] takes the frames
//! apart. The payload is `EventBatch = [ts, events, data_parallel_rank?, …]`. Each event is
//! either a map with a `"type"` key (vLLM, SGLang) or an array whose element 0 is the tag (older
//! engines). Unknown tags are skipped. [`decode_batch`] rejects the whole batch when an event with a
//! known tag is malformed; [`decode_batch_lenient`] (the subscriber's decoder) drops only that
//! event and reports it, so one bad event cannot hide the rest of an engine step.
//!
//! vLLM 0.33 map-form events also carry per-group and offload fields (`group_idx`,
//! `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`,
//! `lookahead_token_ids`); they are decoded here and interpreted by [`crate::groups`] and
//! [`crate::positional`]. Keys the decoder does not know are ignored.

use rmpv::Value;
use std::fmt;

/// Tag of a stored-blocks event.
pub const TAG_BLOCK_STORED: &str = "BlockStored";
/// Tag of a removed-blocks event.
pub const TAG_BLOCK_REMOVED: &str = "BlockRemoved";
/// Tag of a clear-everything event.
pub const TAG_ALL_CLEARED: &str = "AllBlocksCleared";

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine timestamp, float seconds since the epoch (0 = unknown).
    pub ts: f64,
    /// Events with a known tag, in wire order.
    pub events: Vec<Event>,
    /// The batch's trailing data-parallel rank (vLLM `data_parallel_rank`, SGLang
    /// `attn_dp_rank`), when present and an integer.
    pub data_parallel_rank: Option<i64>,
}

/// A decoded engine event.
// Stores are most of the stream, so boxing the large variant would add an allocation to nearly
// every event without making a batch's `Vec<Event>` smaller.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved {
        block_hashes: Vec<Vec<u8>>,
        /// Storage medium of the removed copy; `None` = every copy.
        medium: Option<String>,
        /// vLLM KV-cache group the copy belonged to; `None` = every group.
        group_idx: Option<u32>,
        /// vLLM `locality` (`LOCAL`, `REMOTE`); `None` = unspecified (local).
        locality: Option<String>,
        /// vLLM `ownership`: the secondary offloading tier that held the copy.
        ownership: Option<String>,
    },
    AllBlocksCleared,
}

/// `BlockStored` fields, normalized.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// Engine block hashes, normalized to bytes (integers → 8 bytes big-endian).
    pub block_hashes: Vec<Vec<u8>>,
    /// Parent engine block hash, if any.
    pub parent_block_hash: Option<Vec<u8>>,
    /// Token ids of the stored blocks (nil → empty).
    pub token_ids: Vec<u32>,
    /// Tokens per block (> 0).
    pub block_size: i64,
    /// Engine LoRA id, if any.
    pub lora_id: Option<i64>,
    /// Storage medium (`GPU`, `CPU`, `CPU_PINNED`, `DISK`, …); `None` = unspecified.
    pub medium: Option<String>,
    /// Public LoRA adapter name (vLLM and SGLang `lora_name`).
    pub lora_name: Option<String>,
    /// Index of the first block whose hash depends on more than its tokens and LoRA: vLLM
    /// `extra_keys` (multimodal identifiers, cache salt, prompt embeddings). `None` = no block.
    pub first_keyed_block: Option<usize>,
    /// SGLang `cache_salt`: every block of the event is namespaced by it.
    pub cache_salt: Option<String>,
    /// vLLM KV-cache group of the stored copies (`group_idx`); `None` = a single-group engine.
    pub group_idx: Option<u32>,
    /// vLLM `kv_cache_spec_kind` of that group (`full_attention`, `sliding_window`, `mamba`, …).
    pub kv_cache_spec_kind: Option<String>,
    /// vLLM `kv_cache_spec_sliding_window`: the window in tokens of a sliding-window group.
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// vLLM `locality` (`LOCAL`, `REMOTE`); `None` = unspecified (local).
    pub locality: Option<String>,
    /// vLLM `ownership`: the secondary offloading tier that produced the copy.
    pub ownership: Option<String>,
    /// vLLM `session_id` (attribution only; the hash does not depend on it).
    pub session_id: Option<String>,
    /// vLLM `lookahead_token_ids`, as the number of tokens after each block that its hash
    /// covers; `None` when lookahead hashing is off.
    pub lookahead_tokens: Option<Vec<usize>>,
}

/// One ZMQ message taken apart: `[topic, seq, payload]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames<'a> {
    /// The topic frame (empty when the message has a single frame).
    pub topic: &'a [u8],
    /// The sequence number, when the frame before the payload is 8 bytes.
    pub seq: Option<u64>,
    /// The last frame.
    pub payload: &'a [u8],
}

/// Splits a multipart message: the payload is the last frame, the sequence the 8-byte frame
/// before it when there are at least three frames, the topic the first frame. `None` for an
/// empty message.
pub fn split_message<'a>(frames: &[&'a [u8]]) -> Option<Frames<'a>> {
    let (&payload, rest) = frames.split_last()?;
    let seq = match rest.last() {
        Some(f) if rest.len() >= 2 && f.len() == 8 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(f);
            Some(u64::from_be_bytes(b))
        }
        _ => None,
    };
    Some(Frames {
        topic: rest.first().copied().unwrap_or_default(),
        seq,
        payload,
    })
}

/// Why a batch could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

fn err<T>(msg: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(msg.into()))
}

/// Decodes one msgpack payload (the last frame of a ZMQ message); a malformed event rejects
/// the whole batch.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let value = read_payload(payload)?;
    decode_batch_value(&value)
}

/// A batch decoded event by event: the malformed events are left out and listed.
#[derive(Debug, Clone, PartialEq)]
pub struct LenientBatch {
    /// The well-formed events, in wire order.
    pub batch: EventBatch,
    /// Why each dropped event was rejected (its position is in the message).
    pub dropped: Vec<DecodeError>,
}

/// Decodes one payload, dropping (and listing) each malformed event instead of rejecting the
/// batch. The envelope (`[ts, events, …]`) must still be well formed.
pub fn decode_batch_lenient(payload: &[u8]) -> Result<LenientBatch, DecodeError> {
    let value = read_payload(payload)?;
    decode_envelope(&value, false)
}

fn read_payload(payload: &[u8]) -> Result<Value, DecodeError> {
    let mut rd = payload;
    rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError(format!("invalid msgpack: {e}")))
}

/// Decodes an already parsed batch value.
pub fn decode_batch_value(value: &Value) -> Result<EventBatch, DecodeError> {
    decode_envelope(value, true).map(|lenient| lenient.batch)
}

fn decode_envelope(value: &Value, strict: bool) -> Result<LenientBatch, DecodeError> {
    let Value::Array(items) = value else {
        return err("batch is not an array");
    };
    if items.len() < 2 {
        return err(format!(
            "batch has {} elements, need at least 2",
            items.len()
        ));
    }
    let ts = match &items[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => match (i.as_i64(), i.as_u64()) {
            (Some(v), _) => v as f64,
            (None, Some(v)) => v as f64,
            _ => return err("batch timestamp is not a number"),
        },
        other => return err(format!("batch timestamp has type {}", type_name(other))),
    };
    let Value::Array(raw_events) = &items[1] else {
        return err("batch events is not an array");
    };
    let mut events = Vec::with_capacity(raw_events.len());
    let mut dropped = Vec::new();
    for (i, raw) in raw_events.iter().enumerate() {
        match decode_event(raw) {
            Ok(Some(ev)) => events.push(ev),
            Ok(None) => {}
            Err(e) => {
                let e = DecodeError(format!("event {i}: {e}"));
                if strict {
                    return Err(e);
                }
                dropped.push(e);
            }
        }
    }
    let data_parallel_rank = items.get(2).and_then(Value::as_i64);
    Ok(LenientBatch {
        batch: EventBatch {
            ts,
            events,
            data_parallel_rank,
        },
        dropped,
    })
}

/// Decodes one event; `Ok(None)` for an unknown tag.
fn decode_event(raw: &Value) -> Result<Option<Event>, DecodeError> {
    match raw {
        Value::Map(kv) => decode_map_event(kv),
        Value::Array(items) => decode_tuple_event(items),
        other => err(format!("event has type {}", type_name(other))),
    }
}

fn map_get<'a>(kv: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    kv.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn decode_map_event(kv: &[(Value, Value)]) -> Result<Option<Event>, DecodeError> {
    let Some(tag) = map_get(kv, "type") else {
        return err("map event without \"type\"");
    };
    let Some(tag) = tag.as_str() else {
        return err("map event \"type\" is not a string");
    };
    match tag {
        TAG_BLOCK_STORED => {
            let Some(hashes) = map_get(kv, "block_hashes") else {
                return err("BlockStored without block_hashes");
            };
            let Some(tokens) = map_get(kv, "token_ids") else {
                return err("BlockStored without token_ids");
            };
            let Some(bs) = map_get(kv, "block_size") else {
                return err("BlockStored without block_size");
            };
            let lora_name = optional_str(map_get(kv, "lora_name"), "lora_name")?;
            let first_keyed_block =
                first_keyed_block(map_get(kv, "extra_keys"), lora_name.as_deref())?;
            Ok(Some(Event::BlockStored(BlockStored {
                block_hashes: hash_list(hashes)?,
                parent_block_hash: optional_hash(map_get(kv, "parent_block_hash"))?,
                token_ids: token_list(tokens)?,
                block_size: block_size(bs)?,
                lora_id: lora_id(map_get(kv, "lora_id"))?,
                medium: optional_str(map_get(kv, "medium"), "medium")?,
                lora_name,
                first_keyed_block,
                cache_salt: optional_str(map_get(kv, "cache_salt"), "cache_salt")?,
                group_idx: group_idx(map_get(kv, "group_idx"))?,
                kv_cache_spec_kind: optional_str(
                    map_get(kv, "kv_cache_spec_kind"),
                    "kv_cache_spec_kind",
                )?,
                kv_cache_spec_sliding_window: optional_int(
                    map_get(kv, "kv_cache_spec_sliding_window"),
                    "kv_cache_spec_sliding_window",
                )?,
                locality: optional_str(map_get(kv, "locality"), "locality")?,
                ownership: optional_str(map_get(kv, "ownership"), "ownership")?,
                session_id: optional_str(map_get(kv, "session_id"), "session_id")?,
                lookahead_tokens: lookahead_tokens(map_get(kv, "lookahead_token_ids"), hashes)?,
            })))
        }
        TAG_BLOCK_REMOVED => {
            let Some(hashes) = map_get(kv, "block_hashes") else {
                return err("BlockRemoved without block_hashes");
            };
            Ok(Some(Event::BlockRemoved {
                block_hashes: hash_list(hashes)?,
                medium: optional_str(map_get(kv, "medium"), "medium")?,
                group_idx: group_idx(map_get(kv, "group_idx"))?,
                locality: optional_str(map_get(kv, "locality"), "locality")?,
                ownership: optional_str(map_get(kv, "ownership"), "ownership")?,
            }))
        }
        TAG_ALL_CLEARED => Ok(Some(Event::AllBlocksCleared)),
        _ => Ok(None),
    }
}

fn decode_tuple_event(items: &[Value]) -> Result<Option<Event>, DecodeError> {
    let Some(tag) = items.first() else {
        return err("empty event array");
    };
    let Some(tag) = tag.as_str() else {
        return err("event tag is not a string");
    };
    match tag {
        TAG_BLOCK_STORED => {
            if items.len() < 5 {
                return err(format!(
                    "BlockStored has {} elements, need at least 5",
                    items.len()
                ));
            }
            // Older array-form engines put `medium` after `lora_id`; later positions vary.
            Ok(Some(Event::BlockStored(BlockStored {
                block_hashes: hash_list(&items[1])?,
                parent_block_hash: optional_hash(Some(&items[2]))?,
                token_ids: token_list(&items[3])?,
                block_size: block_size(&items[4])?,
                lora_id: lora_id(items.get(5))?,
                medium: lenient_str(items.get(6)),
                ..BlockStored::default()
            })))
        }
        TAG_BLOCK_REMOVED => {
            if items.len() < 2 {
                return err("BlockRemoved has no block_hashes");
            }
            Ok(Some(Event::BlockRemoved {
                block_hashes: hash_list(&items[1])?,
                medium: lenient_str(items.get(2)),
                group_idx: None,
                locality: None,
                ownership: None,
            }))
        }
        TAG_ALL_CLEARED => Ok(Some(Event::AllBlocksCleared)),
        _ => Ok(None),
    }
}

/// Normalizes one block hash: bin as is, str as UTF-8 bytes, integer as 8 bytes big-endian.
pub fn normalize_hash(v: &Value) -> Result<Vec<u8>, DecodeError> {
    match v {
        Value::Binary(b) => Ok(b.clone()),
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Integer(i) => {
            let u = match (i.as_u64(), i.as_i64()) {
                (Some(u), _) => u,
                (None, Some(s)) => s as u64,
                _ => return err("block hash integer out of range"),
            };
            Ok(u.to_be_bytes().to_vec())
        }
        other => err(format!("block hash has type {}", type_name(other))),
    }
}

fn hash_list(v: &Value) -> Result<Vec<Vec<u8>>, DecodeError> {
    let Value::Array(items) = v else {
        return err(format!("block_hashes has type {}", type_name(v)));
    };
    items.iter().map(normalize_hash).collect()
}

fn optional_hash(v: Option<&Value>) -> Result<Option<Vec<u8>>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => normalize_hash(v).map(Some),
    }
}

fn token_list(v: &Value) -> Result<Vec<u32>, DecodeError> {
    match v {
        Value::Nil => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|t| match t.as_u64() {
                Some(x) if x <= u64::from(u32::MAX) => Ok(x as u32),
                _ => err(format!("token id {t} is not an integer in 0..2^32-1")),
            })
            .collect(),
        other => err(format!("token_ids has type {}", type_name(other))),
    }
}

fn block_size(v: &Value) -> Result<i64, DecodeError> {
    match v {
        Value::Integer(i) => match (i.as_i64(), i.as_u64()) {
            (Some(x), _) if x > 0 => Ok(x),
            (None, Some(_)) => err("block_size out of range"),
            _ => err(format!("block_size {v} is not positive")),
        },
        other => err(format!("block_size has type {}", type_name(other))),
    }
}

fn lora_id(v: Option<&Value>) -> Result<Option<i64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Integer(i)) => match i.as_i64() {
            Some(x) => Ok(Some(x)),
            None => err("lora_id above i64::MAX"),
        },
        Some(other) => err(format!("lora_id has type {}", type_name(other))),
    }
}

/// A string field that may be absent or nil; any other type is an error.
fn optional_str(v: Option<&Value>, what: &str) -> Result<Option<String>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            Some(text) => Ok(Some(text.to_string())),
            None => err(format!("{what} is not valid UTF-8")),
        },
        Some(other) => err(format!("{what} has type {}", type_name(other))),
    }
}

/// An integer field that may be absent or nil; any other type is an error.
fn optional_int(v: Option<&Value>, what: &str) -> Result<Option<i64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Integer(i)) => match i.as_i64() {
            Some(x) => Ok(Some(x)),
            None => err(format!("{what} above i64::MAX")),
        },
        Some(other) => err(format!("{what} has type {}", type_name(other))),
    }
}

/// vLLM `group_idx`: absent or nil → none, else an integer in 0..2^32−1.
fn group_idx(v: Option<&Value>) -> Result<Option<u32>, DecodeError> {
    match optional_int(v, "group_idx")? {
        None => Ok(None),
        Some(x) => match u32::try_from(x) {
            Ok(g) => Ok(Some(g)),
            Err(_) => err(format!("group_idx {x} is not in 0..2^32-1")),
        },
    }
}

/// vLLM `lookahead_token_ids`: nil, or one token list per block hash. Only the lengths are
/// kept: the tokens are the chain's next tokens, which the sidecar sees as the next pages.
fn lookahead_tokens(v: Option<&Value>, hashes: &Value) -> Result<Option<Vec<usize>>, DecodeError> {
    let items = match v {
        None | Some(Value::Nil) => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return err(format!("lookahead_token_ids has type {}", type_name(other)));
        }
    };
    let blocks = hashes.as_array().map_or(0, Vec::len);
    if items.len() != blocks {
        return err(format!(
            "lookahead_token_ids has {} lists for {blocks} blocks",
            items.len()
        ));
    }
    items
        .iter()
        .map(|item| token_list(item).map(|tokens| tokens.len()))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// A positional string whose meaning depends on the engine version: a string, or nothing.
fn lenient_str(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_string)
}

/// The first block of vLLM's per-block `extra_keys` that carries more than the LoRA name.
///
/// Each entry is nil (the hash is tokens only) or an array starting with the LoRA name when the
/// event has a `lora_name`, then multimodal `(identifier, offset)` pairs, the cache salt and
/// prompt-embedding digests. The LoRA name is already the adapter partition, so only the rest
/// makes a block unmatchable by a token-only lookup.
fn first_keyed_block(
    v: Option<&Value>,
    lora_name: Option<&str>,
) -> Result<Option<usize>, DecodeError> {
    let items = match v {
        None | Some(Value::Nil) => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(other) => return err(format!("extra_keys has type {}", type_name(other))),
    };
    for (i, item) in items.iter().enumerate() {
        let keyed = match item {
            Value::Nil => false,
            Value::Array(keys) => {
                let skip = usize::from(
                    lora_name.is_some() && keys.first().and_then(Value::as_str) == lora_name,
                );
                keys.len() > skip
            }
            other => return err(format!("extra_keys[{i}] has type {}", type_name(other))),
        };
        if keyed {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "bool",
        Value::Integer(_) => "integer",
        Value::F32(_) | Value::F64(_) => "float",
        Value::String(_) => "str",
        Value::Binary(_) => "bin",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "ext",
    }
}

/// Encodes a value as msgpack bytes (used by the fake engine and tests).
pub fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    rmpv::encode::write_value(&mut out, value).expect("msgpack encode into Vec");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn integer_hashes_are_big_endian() {
        assert_eq!(
            normalize_hash(&Value::from(0xE000u64)).unwrap(),
            0xE000u64.to_be_bytes().to_vec()
        );
        assert_eq!(normalize_hash(&Value::from(-1i64)).unwrap(), vec![0xFF; 8]);
        assert_eq!(normalize_hash(&s("ab")).unwrap(), b"ab".to_vec());
        assert!(normalize_hash(&Value::Nil).is_err());
        assert!(normalize_hash(&Value::F64(1.0)).is_err());
    }

    #[test]
    fn batch_shape_errors() {
        assert!(decode_batch(&encode(&Value::Array(vec![Value::F64(1.0)]))).is_err());
        assert!(decode_batch(&encode(&Value::from(3))).is_err());
        assert!(decode_batch(b"\xc1").is_err());
        assert!(decode_batch(&[]).is_err());
        let ok = decode_batch(&encode(&Value::Array(vec![
            Value::from(7),
            Value::Array(vec![]),
        ])))
        .unwrap();
        assert_eq!(ok.ts, 7.0);
        assert!(ok.events.is_empty());
    }
}
