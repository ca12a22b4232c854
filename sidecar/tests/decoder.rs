//! msgpack wire forms (spec `sidecar.md` §4): SC01, SC02 and every malformed case.

use inferencecache_sidecar::wire::{
    BlockStored, Event, Frames, decode_batch, encode, split_message,
};
use rmpv::Value;

fn s(x: &str) -> Value {
    Value::from(x)
}
fn arr(v: Vec<Value>) -> Value {
    Value::Array(v)
}
fn map(kv: Vec<(&str, Value)>) -> Value {
    Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
}
fn ints(v: &[u64]) -> Value {
    arr(v.iter().map(|x| Value::from(*x)).collect())
}
fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&arr(vec![Value::F64(1.5), arr(events)]))
}
fn stored_tuple(hashes: Value, parent: Value, tokens: Value, bs: Value) -> Value {
    arr(vec![s("BlockStored"), hashes, parent, tokens, bs])
}
fn good_stored_map() -> Vec<(&'static str, Value)> {
    vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1, 2])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&[10, 11, 12, 13])),
        ("block_size", Value::from(2)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
    ]
}
fn with(mut kv: Vec<(&'static str, Value)>, key: &'static str, v: Option<Value>) -> Value {
    kv.retain(|(k, _)| *k != key);
    if let Some(v) = v {
        kv.push((key, v));
    }
    map(kv)
}

#[test]
fn sc01_map_form_vllm_batch() {
    let payload = encode(&arr(vec![
        Value::F64(1_700_000_000.25),
        arr(vec![
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", ints(&[0xE000, 0xE001])),
                ("parent_block_hash", Value::from(0xDFFFu64)),
                ("token_ids", ints(&[1, 2, 3, 4])),
                ("block_size", Value::from(2)),
                ("lora_id", Value::from(3)),
                ("medium", s("GPU")),
                ("group_idx", Value::from(0)),
                ("kv_cache_spec_kind", s("full_attention")),
                ("kv_cache_spec_sliding_window", Value::Nil),
                ("locality", s("local")),
            ]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[0xE001])),
                ("medium", s("GPU")),
            ]),
            map(vec![("type", s("AllBlocksCleared"))]),
            map(vec![("type", s("SomethingNew")), ("x", Value::Nil)]),
        ]),
        Value::from(0), // data-parallel rank
    ]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!(b.ts, 1_700_000_000.25);
    assert_eq!(b.events.len(), 3);
    assert_eq!(
        b.events[0],
        Event::BlockStored(BlockStored {
            block_hashes: vec![
                0xE000u64.to_be_bytes().to_vec(),
                0xE001u64.to_be_bytes().to_vec()
            ],
            parent_block_hash: Some(0xDFFFu64.to_be_bytes().to_vec()),
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_id: Some(3),
            medium: Some("GPU".into()),
            // vLLM 0.33's group and offload fields are decoded (issue 47).
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            locality: Some("local".into()),
            ..BlockStored::default()
        })
    );
    assert_eq!(
        b.events[1],
        Event::BlockRemoved {
            block_hashes: vec![0xE001u64.to_be_bytes().to_vec()],
            medium: Some("GPU".into()),
            group_idx: None,
            locality: None,
            ownership: None,
        }
    );
    assert_eq!(b.data_parallel_rank, Some(0));
    assert_eq!(b.events[2], Event::AllBlocksCleared);
}

#[test]
fn sc01_tuple_form_with_extras_trailing_elements_and_unknown_event() {
    let payload = encode(&arr(vec![
        Value::from(42), // integer ts accepted
        arr(vec![
            arr(vec![
                s("BlockStored"),
                arr(vec![Value::Binary(vec![9, 9]), s("h2"), Value::from(-1i64)]),
                s("parent"),
                ints(&[5, 6, 7, 8, 9, 10, 11]),
                Value::from(2),
                Value::from(7),
                s("extra-field"),
                Value::from(99),
            ]),
            arr(vec![s("UnknownEvent"), Value::F64(3.0), Value::Nil]),
            arr(vec![s("BlockRemoved"), ints(&[u64::MAX]), s("medium")]),
            arr(vec![s("AllBlocksCleared")]),
        ]),
        Value::from(1),
        s("trailing"),
    ]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!(b.ts, 42.0);
    assert_eq!(b.events.len(), 3);
    let Event::BlockStored(st) = &b.events[0] else {
        panic!("not stored")
    };
    assert_eq!(
        st.block_hashes,
        vec![vec![9, 9], b"h2".to_vec(), vec![0xFF; 8]]
    );
    assert_eq!(st.parent_block_hash.as_deref(), Some(&b"parent"[..]));
    assert_eq!(st.token_ids, vec![5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(st.block_size, 2);
    assert_eq!(st.lora_id, Some(7));
    // Positional forms: a string after lora_id is read as the medium.
    assert_eq!(st.medium.as_deref(), Some("extra-field"));
    assert_eq!(
        b.events[1],
        Event::BlockRemoved {
            block_hashes: vec![vec![0xFF; 8]],
            medium: Some("medium".into()),
            group_idx: None,
            locality: None,
            ownership: None,
        }
    );
    assert_eq!(b.data_parallel_rank, Some(1));
    assert_eq!(b.events[2], Event::AllBlocksCleared);
}

#[test]
fn sc02_five_element_tuple_decodes_without_lora() {
    let b = decode_batch(&batch(vec![stored_tuple(
        ints(&[1]),
        Value::Nil,
        ints(&[1, 2]),
        Value::from(2),
    )]))
    .unwrap();
    let Event::BlockStored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.lora_id, None);
    assert_eq!(st.parent_block_hash, None);
}

#[test]
fn optional_fields_nil_and_absent() {
    // token_ids nil → empty; parent/lora absent → none; negative lora accepted.
    let mut kv = good_stored_map();
    kv.retain(|(k, _)| *k != "parent_block_hash" && *k != "lora_id");
    let b = decode_batch(&batch(vec![with(kv, "token_ids", Some(Value::Nil))])).unwrap();
    let Event::BlockStored(st) = &b.events[0] else {
        panic!()
    };
    assert!(st.token_ids.is_empty());
    assert_eq!(st.parent_block_hash, None);
    assert_eq!(st.lora_id, None);
    let b = decode_batch(&batch(vec![with(
        good_stored_map(),
        "lora_id",
        Some(Value::from(-4)),
    )]))
    .unwrap();
    let Event::BlockStored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.lora_id, Some(-4));
    // u32::MAX token id is fine.
    assert!(
        decode_batch(&batch(vec![with(
            good_stored_map(),
            "token_ids",
            Some(ints(&[u64::from(u32::MAX), 0]))
        )]))
        .is_ok()
    );
}

/// Every malformed case rejects the whole batch, even with a good event before it.
#[test]
fn sc02_malformed_events_reject_the_whole_batch() {
    let good = map(good_stored_map());
    let cases: Vec<(&str, Value)> = vec![
        (
            "map BlockStored without block_size",
            with(good_stored_map(), "block_size", None),
        ),
        (
            "block_size 0",
            with(good_stored_map(), "block_size", Some(Value::from(0))),
        ),
        (
            "block_size -3",
            with(good_stored_map(), "block_size", Some(Value::from(-3))),
        ),
        (
            "block_size str",
            with(good_stored_map(), "block_size", Some(s("16"))),
        ),
        (
            "block_size float",
            with(good_stored_map(), "block_size", Some(Value::F64(16.0))),
        ),
        (
            "block_size nil",
            with(good_stored_map(), "block_size", Some(Value::Nil)),
        ),
        (
            "without block_hashes",
            with(good_stored_map(), "block_hashes", None),
        ),
        (
            "block_hashes not array",
            with(good_stored_map(), "block_hashes", Some(Value::from(1))),
        ),
        (
            "nil hash element",
            with(
                good_stored_map(),
                "block_hashes",
                Some(arr(vec![Value::from(1), Value::Nil])),
            ),
        ),
        (
            "float hash element",
            with(
                good_stored_map(),
                "block_hashes",
                Some(arr(vec![Value::F64(1.0)])),
            ),
        ),
        (
            "bool hash element",
            with(
                good_stored_map(),
                "block_hashes",
                Some(arr(vec![Value::Boolean(true)])),
            ),
        ),
        (
            "without token_ids key",
            with(good_stored_map(), "token_ids", None),
        ),
        (
            "token_ids str",
            with(good_stored_map(), "token_ids", Some(s("1 2"))),
        ),
        (
            "negative token",
            with(
                good_stored_map(),
                "token_ids",
                Some(arr(vec![Value::from(-1)])),
            ),
        ),
        (
            "token above u32",
            with(good_stored_map(), "token_ids", Some(ints(&[1 << 32]))),
        ),
        (
            "float token",
            with(
                good_stored_map(),
                "token_ids",
                Some(arr(vec![Value::F64(1.0)])),
            ),
        ),
        (
            "nil token",
            with(good_stored_map(), "token_ids", Some(arr(vec![Value::Nil]))),
        ),
        (
            "parent float",
            with(
                good_stored_map(),
                "parent_block_hash",
                Some(Value::F64(2.0)),
            ),
        ),
        ("lora str", with(good_stored_map(), "lora_id", Some(s("1")))),
        (
            "lora float",
            with(good_stored_map(), "lora_id", Some(Value::F64(1.0))),
        ),
        (
            "lora above i64::MAX",
            with(good_stored_map(), "lora_id", Some(Value::from(u64::MAX))),
        ),
        (
            "tuple BlockStored with 4 elements",
            arr(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1, 2]),
            ]),
        ),
        (
            "tuple BlockStored with 3 elements",
            arr(vec![s("BlockStored"), ints(&[1]), Value::Nil]),
        ),
        (
            "tuple BlockStored nil hash",
            stored_tuple(
                arr(vec![Value::Nil]),
                Value::Nil,
                ints(&[1, 2]),
                Value::from(2),
            ),
        ),
        (
            "tuple BlockStored block_size 0",
            stored_tuple(ints(&[1]), Value::Nil, ints(&[1, 2]), Value::from(0)),
        ),
        (
            "tuple BlockStored lora str",
            arr(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1, 2]),
                Value::from(2),
                s("x"),
            ]),
        ),
        (
            "map BlockRemoved without hashes",
            map(vec![("type", s("BlockRemoved")), ("medium", s("GPU"))]),
        ),
        (
            "tuple BlockRemoved without hashes",
            arr(vec![s("BlockRemoved")]),
        ),
        (
            "BlockRemoved nil hash",
            arr(vec![s("BlockRemoved"), arr(vec![Value::Nil])]),
        ),
        (
            "map event without type",
            map(vec![("block_hashes", ints(&[1]))]),
        ),
        (
            "map event with integer type",
            map(vec![("type", Value::from(1))]),
        ),
        ("empty tuple event", arr(vec![])),
        (
            "tuple tag not a string",
            arr(vec![Value::from(1), ints(&[1])]),
        ),
        ("event is an integer", Value::from(5)),
        ("event is a string", s("BlockStored")),
    ];
    for (name, bad) in cases {
        let payload = batch(vec![good.clone(), bad]);
        assert!(decode_batch(&payload).is_err(), "{name} should be rejected");
    }
}

#[test]
fn malformed_batch_envelopes() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty payload", vec![]),
        ("invalid msgpack", vec![0xc1]),
        (
            "truncated msgpack",
            encode(&arr(vec![Value::F64(1.0), arr(vec![])]))[..3].to_vec(),
        ),
        ("not an array", encode(&map(vec![("ts", Value::F64(1.0))]))),
        ("one element", encode(&arr(vec![Value::F64(1.0)]))),
        ("ts string", encode(&arr(vec![s("now"), arr(vec![])]))),
        ("ts nil", encode(&arr(vec![Value::Nil, arr(vec![])]))),
        (
            "events not array",
            encode(&arr(vec![Value::F64(1.0), map(vec![])])),
        ),
        (
            "events nil",
            encode(&arr(vec![Value::F64(1.0), Value::Nil])),
        ),
    ];
    for (name, payload) in cases {
        assert!(decode_batch(&payload).is_err(), "{name} should be rejected");
    }
}

#[test]
fn message_frames_give_topic_sequence_and_payload() {
    let seq = 7u64.to_be_bytes();
    let three: [&[u8]; 3] = [b"kv-events", &seq, b"payload"];
    assert_eq!(
        split_message(&three),
        Some(Frames {
            topic: b"kv-events",
            seq: Some(7),
            payload: b"payload"
        })
    );
    // vLLM and SGLang default to the empty topic.
    let empty_topic: [&[u8]; 3] = [b"", &seq, b"p"];
    assert_eq!(split_message(&empty_topic).unwrap().seq, Some(7));
    // Without a sequence frame the message is unnumbered; the payload is the last frame.
    let two: [&[u8]; 2] = [b"kv-events", b"p"];
    assert_eq!(
        split_message(&two),
        Some(Frames {
            topic: b"kv-events",
            seq: None,
            payload: b"p"
        })
    );
    let one: [&[u8]; 1] = [b"p"];
    assert_eq!(split_message(&one).unwrap().payload, b"p");
    assert_eq!(split_message(&[]), None);
    // A non-8-byte middle frame is not a sequence.
    let odd: [&[u8]; 3] = [b"t", b"abc", b"p"];
    assert_eq!(split_message(&odd).unwrap().seq, None);
}

#[test]
fn vllm_extra_keys_beyond_the_lora_name_mark_the_first_keyed_block() {
    let stored = |extra: Value, lora_name: Value| {
        let mut kv = good_stored_map();
        kv.push(("extra_keys", extra));
        kv.push(("lora_name", lora_name));
        let b = decode_batch(&batch(vec![map(kv)])).unwrap();
        let Event::BlockStored(st) = &b.events[0] else {
            panic!("not stored")
        };
        st.clone()
    };
    // Only the LoRA name: a token-only block of that adapter.
    let st = stored(
        arr(vec![arr(vec![s("sql")]), arr(vec![s("sql")])]),
        s("sql"),
    );
    assert_eq!(st.first_keyed_block, None);
    assert_eq!(st.lora_name.as_deref(), Some("sql"));
    // A multimodal identifier in block 1.
    let st = stored(
        arr(vec![
            Value::Nil,
            arr(vec![arr(vec![s("img-hash"), Value::from(0)])]),
        ]),
        Value::Nil,
    );
    assert_eq!(st.first_keyed_block, Some(1));
    // LoRA name plus a salt in block 0.
    let st = stored(
        arr(vec![arr(vec![s("sql"), s("salt")]), Value::Nil]),
        s("sql"),
    );
    assert_eq!(st.first_keyed_block, Some(0));
    assert_eq!(stored(Value::Nil, Value::Nil).first_keyed_block, None);
    // Malformed: not an array, or an element that is neither nil nor an array.
    for bad in [s("x"), arr(vec![Value::from(3)])] {
        let mut kv = good_stored_map();
        kv.push(("extra_keys", bad));
        assert!(decode_batch(&batch(vec![map(kv)])).is_err());
    }
    // SGLang's cache_salt and a non-string medium.
    let mut kv = good_stored_map();
    kv.push(("cache_salt", s("s1")));
    let b = decode_batch(&batch(vec![map(kv)])).unwrap();
    let Event::BlockStored(st) = &b.events[0] else {
        panic!("not stored")
    };
    assert_eq!(st.cache_salt.as_deref(), Some("s1"));
    assert!(
        decode_batch(&batch(vec![with(
            good_stored_map(),
            "medium",
            Some(Value::from(1))
        )]))
        .is_err()
    );
}
