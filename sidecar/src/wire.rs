//! msgpack decoding of engine KV-event batches (spec `sidecar.md` §4).
//!
//! `EventBatch = [ts, events, …]`. Each event is either a map with a `"type"` key (newer vLLM) or
//! an array whose element 0 is the tag (SGLang, older vLLM). Unknown tags are skipped; a malformed
//! event with a known tag rejects the whole batch.

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
}

/// A decoded engine event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved { block_hashes: Vec<Vec<u8>> },
    AllBlocksCleared,
}

/// `BlockStored` fields, normalized.
#[derive(Debug, Clone, PartialEq)]
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

/// Decodes one msgpack payload (the last frame of a ZMQ message).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value(&mut rd)
        .map_err(|e| DecodeError(format!("invalid msgpack: {e}")))?;
    decode_batch_value(&value)
}

/// Decodes an already parsed batch value.
pub fn decode_batch_value(value: &Value) -> Result<EventBatch, DecodeError> {
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
    for (i, raw) in raw_events.iter().enumerate() {
        if let Some(ev) = decode_event(raw).map_err(|e| DecodeError(format!("event {i}: {e}")))? {
            events.push(ev);
        }
    }
    Ok(EventBatch { ts, events })
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
            Ok(Some(Event::BlockStored(BlockStored {
                block_hashes: hash_list(hashes)?,
                parent_block_hash: optional_hash(map_get(kv, "parent_block_hash"))?,
                token_ids: token_list(tokens)?,
                block_size: block_size(bs)?,
                lora_id: lora_id(map_get(kv, "lora_id"))?,
            })))
        }
        TAG_BLOCK_REMOVED => {
            let Some(hashes) = map_get(kv, "block_hashes") else {
                return err("BlockRemoved without block_hashes");
            };
            Ok(Some(Event::BlockRemoved {
                block_hashes: hash_list(hashes)?,
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
            Ok(Some(Event::BlockStored(BlockStored {
                block_hashes: hash_list(&items[1])?,
                parent_block_hash: optional_hash(Some(&items[2]))?,
                token_ids: token_list(&items[3])?,
                block_size: block_size(&items[4])?,
                lora_id: lora_id(items.get(5))?,
            })))
        }
        TAG_BLOCK_REMOVED => {
            if items.len() < 2 {
                return err("BlockRemoved has no block_hashes");
            }
            Ok(Some(Event::BlockRemoved {
                block_hashes: hash_list(&items[1])?,
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
