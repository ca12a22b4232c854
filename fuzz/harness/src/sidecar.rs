//! `sidecar_event`: bytes → the sidecar's msgpack batch decoder (sidecar.md §4) and the
//! positional re-keying of the decoded blocks (sidecar.md §5).

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
        assert_eq!(again.events, batch.events, "events changed ({form:?})");
    }
    let mut map = ReverseMap::new();
    for ev in &batch.events {
        match ev {
            Event::BlockStored(bs) => {
                // §4: block_size is positive once decoded.
                assert!(bs.block_size > 0, "block_size {}", bs.block_size);
                check_store(&mut map, bs);
            }
            Event::BlockRemoved { block_hashes } => {
                map.remove(block_hashes);
                assert!(block_hashes.iter().all(|h| map.get(h).is_none()));
            }
            Event::AllBlocksCleared => {
                map.clear();
                assert!(map.is_empty());
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Form {
    Map,
    Array,
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
                    ],
                ),
                Event::BlockRemoved { block_hashes } => (
                    TAG_BLOCK_REMOVED,
                    vec![("block_hashes", bin_list(block_hashes))],
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
                        .chain(fields.into_iter().map(|(_, v)| v))
                        .collect(),
                ),
            }
        })
        .collect();
    Value::Array(vec![Value::F64(batch.ts), Value::Array(events)])
}

/// Stores one decoded `BlockStored` and checks the derived entries (§5).
fn check_store(map: &mut ReverseMap, bs: &BlockStored) {
    let parent_known = bs
        .parent_block_hash
        .as_ref()
        .is_some_and(|p| map.get(p).is_some());
    let entries = map.store(bs, "");
    if entries.is_empty() {
        return;
    }
    let n = bs.block_hashes.len();
    assert_eq!(entries.len(), n, "one entry per stored block");
    for pair in entries.windows(2) {
        assert!(
            pair[0].token_count <= pair[1].token_count,
            "cumulative token counts decrease"
        );
    }
    if parent_known {
        return;
    }
    // A root event is the gateway's fingerprint of its own tokens.
    let bsz = usize::try_from(bs.block_size).expect("a stored block size fits usize");
    let want: Vec<[u8; 8]> = prefix_hashes(&bs.token_ids, bsz)
        .into_iter()
        .map(to_wire)
        .collect();
    let got: Vec<[u8; 8]> = entries.iter().map(|e| e.prefix_hash).collect();
    assert_eq!(
        got, want,
        "root event re-keyed differently from the fingerprint"
    );
    // The same blocks split into a root and a child naming its parent give the same entries.
    if n >= 2 {
        let k = n / 2;
        let mut split = ReverseMap::new();
        let head = BlockStored {
            block_hashes: bs.block_hashes[..k].to_vec(),
            parent_block_hash: None,
            token_ids: bs.token_ids[..k * bsz].to_vec(),
            block_size: bs.block_size,
            lora_id: bs.lora_id,
        };
        let tail = BlockStored {
            block_hashes: bs.block_hashes[k..].to_vec(),
            parent_block_hash: Some(bs.block_hashes[k - 1].clone()),
            token_ids: bs.token_ids[k * bsz..].to_vec(),
            block_size: bs.block_size,
            lora_id: bs.lora_id,
        };
        let mut parts = split.store(&head, "");
        parts.extend(split.store(&tail, ""));
        assert_eq!(parts, entries, "a split event re-keyed differently");
    }
}
