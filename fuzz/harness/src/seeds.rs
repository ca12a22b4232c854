//! Seed inputs of every target: encoded real requests, written into `fuzz/corpus/<target>/` by
//! `cargo run -p inferencecache-fuzz-harness --example write_seeds` and replayed by the tests.

use crate::fixture::{self, BLOCK};
use inferencecache_engine::{PROBE_TENANT, event_type, fingerprint};
use inferencecache_proto::v1alpha1 as pb;
use prost::Message;
use rmpv::Value;

/// `(target, seeds)` for every target of [`crate::TARGETS`].
pub fn all() -> Vec<(&'static str, Vec<Vec<u8>>)> {
    vec![
        ("lookup_route", lookup_route()),
        ("cache_state_update", cache_state_update()),
        ("cache_event", cache_event()),
        ("engine_ops", engine_ops()),
        ("policy_body", policy_body()),
        ("checkpoint_file", checkpoint_file()),
        ("probe_body", probe_body()),
        ("sidecar_event", sidecar_event()),
    ]
}

fn lookup(tenant: &str, f: impl FnOnce(&mut pb::LookupRouteRequest)) -> Vec<u8> {
    let mut req = pb::LookupRouteRequest {
        model_id: "m".into(),
        tenant_id: tenant.into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    };
    f(&mut req);
    req.encode_to_vec()
}

fn lookup_route() -> Vec<Vec<u8>> {
    let tokens = fixture::prompt_tokens();
    let (chain, counts) = fingerprint::chain(&tokens, BLOCK);
    let chain: Vec<Vec<u8>> = chain.iter().map(|h| h.to_vec()).collect();
    let mut out = Vec::new();
    for tenant in fixture::TENANTS
        .iter()
        .copied()
        .chain([PROBE_TENANT, "nobody"])
    {
        out.push(lookup(tenant, |r| {
            r.block_hashes = chain.clone();
            r.block_token_counts = counts.clone();
        }));
        out.push(lookup(tenant, |r| {
            r.prefix_hash = b"p".to_vec();
            r.prefix_token_count = 128;
        }));
        out.push(lookup(tenant, |r| r.token_ids = tokens[..80].to_vec()));
    }
    out.push(lookup("t", |r| {
        r.block_hashes = vec![
            b"b1".to_vec(),
            b"b2".to_vec(),
            b"b3".to_vec(),
            b"x4".to_vec(),
        ];
        r.block_token_counts = vec![64; 4];
        r.slo = Some(pb::Slo {
            ttft_ms: 50,
            tbt_ms: 0,
        });
    }));
    out.push(lookup("t", |r| r.prefix_hash = b"novel".to_vec()));
    out.push(lookup("t", |r| {
        r.prefix_hash = b"p".to_vec();
        r.adapter_id = "lora".into();
    }));
    out.push(lookup("t", |r| {
        r.block_hashes = vec![b"b1".to_vec(), b"b2".to_vec()];
        r.block_token_counts = vec![64];
    }));
    out.push(lookup("t", |r| {
        r.hash_scheme = "sglang".into();
        r.prefix_hash = b"p".to_vec();
    }));
    out.push(lookup("t", |r| {
        r.model_id = "n".into();
        r.hash_scheme = "sglang".into();
        r.prefix_hash = b"p".to_vec();
    }));
    out.push(lookup("t", |r| r.prompt_text = "hello world".into()));
    out.push(pb::LookupRouteRequest::default().encode_to_vec());
    out
}

fn cache_state_update() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = fixture::seed_updates()
        .into_iter()
        .take(4)
        .map(|u| u.encode_to_vec())
        .collect();
    out.push(
        pb::CacheStateUpdate {
            replica_id: "r9".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            timestamp_us: 0,
            prefixes: vec![
                pb::PrefixEntry {
                    prefix_hash: b"full".to_vec(),
                    token_count: 48,
                    block_hashes: vec![b"c1".to_vec(), b"c2".to_vec(), b"c1".to_vec()],
                    block_token_counts: vec![16, 16, 16],
                    tier: 2,
                    adapter_id: "lora".into(),
                },
                pb::PrefixEntry {
                    prefix_hash: b"bad".to_vec(),
                    token_count: 1,
                    block_hashes: vec![b"c1".to_vec()],
                    block_token_counts: vec![],
                    tier: -1,
                    adapter_id: String::new(),
                },
                pb::PrefixEntry {
                    prefix_hash: b"legacy".to_vec(),
                    token_count: -3,
                    tier: 99,
                    ..Default::default()
                },
            ],
            stats: Some(pb::ReplicaStats {
                hit_rate: f32::NAN,
                pressure: f32::INFINITY,
                cache_memory_bytes: 7,
                ..Default::default()
            }),
            adapter_id: "base".into(),
        }
        .encode_to_vec(),
    );
    out.push(
        pb::CacheStateUpdate {
            replica_id: "r0".into(),
            tenant_id: "quota".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            prefixes: vec![pb::PrefixEntry {
                prefix_hash: b"z".to_vec(),
                token_count: 16,
                ..Default::default()
            }],
            ..Default::default()
        }
        .encode_to_vec(),
    );
    out.push(
        pb::CacheStateUpdate {
            tenant_id: PROBE_TENANT.into(),
            replica_id: "r0".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            prefixes: vec![pb::PrefixEntry {
                prefix_hash: b"p".to_vec(),
                token_count: 16,
                ..Default::default()
            }],
            ..Default::default()
        }
        .encode_to_vec(),
    );
    out
}

fn cache_event() -> Vec<Vec<u8>> {
    let ev = |ty: i32, tenant: &str, replica: &str, hash: &[u8], adapter: &str| {
        pb::CacheEvent {
            r#type: ty,
            replica_id: replica.into(),
            model_id: "m".into(),
            tenant_id: tenant.into(),
            prefix_hash: hash.to_vec(),
            timestamp_us: 0,
            adapter_id: adapter.into(),
        }
        .encode_to_vec()
    };
    vec![
        ev(event_type::PREFIX_EVICTED, "t", "r0", b"p", ""),
        ev(event_type::PREFIX_EVICTED, "t", "r2", b"p", "lora"),
        ev(event_type::PREFIX_EVICTED, "t", "r1", b"b1", ""),
        ev(event_type::ALL_CLEARED, "t", "r1", b"", ""),
        ev(event_type::REPLICA_UPDATED, "t", "r1", b"", ""),
        ev(event_type::PREFIX_ADDED, "t", "r0", b"p", ""),
        ev(event_type::UNSPECIFIED, "t", "r0", b"p", ""),
        ev(9, "t", "r0", b"p", ""),
        ev(event_type::ALL_CLEARED, PROBE_TENANT, "r0", b"", ""),
        pb::CacheEvent {
            r#type: event_type::REPLICA_UPDATED,
            replica_id: "r2".into(),
            model_id: "m".into(),
            tenant_id: "lfu".into(),
            timestamp_us: fixture::T0_US + 5_000_000,
            ..Default::default()
        }
        .encode_to_vec(),
    ]
}

fn engine_ops() -> Vec<Vec<u8>> {
    // Byte strings the `arbitrary` interpretation turns into short, varied sequences; the
    // fuzzer grows real ones from here.
    let mut out = vec![vec![0u8; 64], vec![0xFF; 64]];
    out.push((0u8..=255).collect());
    out.push((0u8..=255).rev().collect());
    out.push((0..256u32).map(|i| (i * 37 % 251) as u8).collect());
    out.push((0..512u32).map(|i| (i * 101 % 13) as u8).collect());
    out
}

fn policy_body() -> Vec<Vec<u8>> {
    [
        fixture::POLICY_BODY,
        r#"{"version":7,"policies":[{"namespace":"team-a","routingFloorScore":0}],"tenants":[{"tenantID":"tenant-a","maxIndexEntries":10}]}"#,
        r#"{"version":3,"policies":[{"namespace":"a","minimumMatchedTokens":0,"evictionTTL":300000000000,"eviction":"LFU"}]}"#,
        r#"{"version":4,"policies":[{"namespace":"a"},{"namespace":"a","lookupTimeoutMs":9}],"tenants":[{"tenantID":"t","maxIndexEntries":-3,"isolationMode":"Fairness"},{"tenantID":""}]}"#,
        r#"{"version":5,"policies":[{"namespace":"b","strategy":{"requireChain":true,"enableChainMatching":false}}]}"#,
        r#"{"version":6,"policies":null,"tenants":null}"#,
        r#"{"version":7,"policies":[{"namespace":"x","minimumMatchedTokens":-5,"routingFloorScore":-1}]} trailing"#,
        r#"{"version":8}"#,
        r#"{"version":7,"bogus":1}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn probe_body() -> Vec<Vec<u8>> {
    [
        r#"{"backend":"b","model":"m","hashScheme":"vllm"}"#,
        r#"{"backend":"vllm-0","model":"Qwen/Qwen2.5-0.5B-Instruct","hashScheme":"sglang","backendType":"LMCache"}"#,
        r#" {"backend":"b\u00e9","model":"m","hashScheme":"v","backendType":null}"#,
        r#"{"backend":"","model":"m","hashScheme":"v"}"#,
        r#"{"backend":"b","model":"m","hashScheme":"v","tenant":"t"}"#,
        r#"{"backend":"b","model":"m","hashScheme":"v"}{}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn sidecar_event() -> Vec<Vec<u8>> {
    let tokens: Vec<Value> = (0..48u32).map(Value::from).collect();
    let stored_map = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(vec![
                Value::from(1u64),
                Value::from(-2i64),
                Value::from("h3"),
            ]),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(tokens.clone())),
        (Value::from("block_size"), Value::from(16)),
        (Value::from("lora_id"), Value::Nil),
    ]);
    let child_tuple = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::Binary(vec![9, 9])]),
        Value::from("h3"),
        Value::Array(tokens[..16].to_vec()),
        Value::from(16),
        Value::from(3),
    ]);
    let removed = Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(vec![Value::from(1u64)]),
    ]);
    let cleared = Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared"))]);
    let unknown = Value::Array(vec![Value::from("Heartbeat"), Value::from(1)]);
    let batch = |ts: Value, events: Vec<Value>| {
        inferencecache_sidecar::wire::encode(&Value::Array(vec![ts, Value::Array(events)]))
    };
    vec![
        batch(
            Value::F64(1_700_000_000.25),
            vec![stored_map, child_tuple, removed.clone(), unknown],
        ),
        batch(Value::from(7), vec![removed, cleared]),
        batch(Value::F32(1.5), vec![]),
    ]
}

fn checkpoint_file() -> Vec<Vec<u8>> {
    // The valid sample, then a cut and a flip in its middle and an empty file: the fuzzer grows
    // the rest from the valid framing.
    let good = crate::checkpoint_sample();
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x20;
    vec![good.clone(), good[..mid].to_vec(), flipped, Vec::new()]
}
