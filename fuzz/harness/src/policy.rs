//! `policy_body`: bytes → `/policy` decoding and normalization (server.md §6.4).

use inferencecache_engine::{Algorithm, PROBE_TENANT};
use inferencecache_server::policy::{Layer, PolicyStore, decode_push};
use serde_json::{Value, json};

/// Decodes `data` as a `/policy` body. A refusal must carry one of §6.4's messages; an accepted
/// body must satisfy the normalization rules, survive a round trip through its own explicit v7
/// form unchanged, and resolve through the policy store exactly as decoded.
pub fn policy_body(data: &[u8]) {
    let layer = match decode_push(data) {
        Ok(layer) => layer,
        Err(e) => {
            assert!(
                e.0.starts_with("decode policy snapshot: ")
                    || e.0 == "unsupported policy snapshot version",
                "unexpected refusal {:?}",
                e.0
            );
            return;
        }
    };
    assert!(layer.default.is_none(), "a push has no default policy");
    for (ns, p) in &layer.namespaces {
        // §6.2: entries with an empty namespace are dropped; §6.1: negative floors clamp to 0.
        assert!(!ns.is_empty(), "empty namespace kept");
        assert!(
            p.minimum_matched_tokens >= 0,
            "{ns}: negative minimumMatchedTokens"
        );
        assert!(
            p.routing_floor_score >= 0.0,
            "{ns}: routingFloorScore {}",
            p.routing_floor_score
        );
    }
    for (t, q) in &layer.quotas {
        // §6.1: empty tenant ids are dropped; negative budgets clamp to 0.
        assert!(!t.is_empty() && *q >= 0, "quota {t:?} = {q}");
    }

    // Only the first JSON value is read (§6.4); it decoded, so it is an object with a version.
    let first: Value = serde_json::Deserializer::from_slice(data)
        .into_iter::<Value>()
        .next()
        .expect("an accepted body has a first value")
        .expect("an accepted body's first value is JSON");
    // §6.4 strict decode: struct positions written as JSON arrays are refused (serde's derive
    // alone would read them positionally; the server checks the schema's objects first).
    let arrays_inside = ["policies", "tenants"].iter().any(|k| {
        first[*k].as_array().is_some_and(|v| {
            v.iter()
                .any(|e| e.is_array() || e.get("strategy").is_some_and(Value::is_array))
        })
    });
    assert!(
        first.is_object() && !arrays_inside,
        "an array-form body or entry was accepted"
    );
    let version = first["version"]
        .as_i64()
        .expect("an accepted body has an integer version");
    assert!((3..=7).contains(&version), "version {version} accepted");

    // §6.4: "the only rule with a visible effect is the first": the same body as version 7, with
    // a zero or absent minimumMatchedTokens turned into 64 for versions below 4, decodes the same.
    let mut as_v7 = first.clone();
    as_v7["version"] = json!(7);
    if version < 4
        && let Some(policies) = as_v7.get_mut("policies").and_then(Value::as_array_mut)
    {
        for p in policies.iter_mut().filter_map(Value::as_object_mut) {
            let mmt = p.entry("minimumMatchedTokens").or_insert(Value::Null);
            if mmt.is_null() || mmt.as_i64() == Some(0) {
                *mmt = json!(64);
            }
        }
    }
    let v7 = decode_push(as_v7.to_string().as_bytes()).expect("the v7 form of an accepted body");
    assert_same(&layer, &v7, "the body restated as version 7");

    // Normalization is idempotent: the decoded layer written back with every key explicit
    // decodes to itself.
    let explicit = decode_push(explicit_body(&layer).as_bytes()).expect("the explicit form");
    assert_same(&layer, &explicit, "the explicit v7 form");

    // §6.2: a push replaces the pushed layer; each namespace resolves to its entry, each tenant
    // to its quota, and the reserved tenant never gets one.
    let store = PolicyStore::new(0);
    store.replace_pushed(layer.clone());
    for (ns, p) in &layer.namespaces {
        assert_eq!(*store.resolve(ns), **p, "{ns} resolved differently");
    }
    for (t, q) in &layer.quotas {
        let want = (t != PROBE_TENANT).then_some(*q);
        assert_eq!(store.quota(t), want, "quota of {t:?}");
    }
}

fn assert_same(a: &Layer, b: &Layer, what: &str) {
    assert_eq!(a.namespaces, b.namespaces, "{what}: policies differ");
    assert_eq!(a.quotas, b.quotas, "{what}: quotas differ");
}

/// A v7 body restating every resolved knob of `layer` explicitly.
fn explicit_body(layer: &Layer) -> String {
    let policies: Vec<Value> = layer
        .namespaces
        .iter()
        .map(|(ns, p)| {
            // JSON has no infinity; any literal beyond f32::MAX decodes to it again.
            let floor = if p.routing_floor_score.is_finite() {
                json!(p.routing_floor_score)
            } else {
                json!(1e39)
            };
            json!({
                "namespace": ns,
                "evictionTTL": p.eviction_ttl_ns,
                "minimumPrefixTokens": p.minimum_prefix_tokens,
                "minimumMatchedTokens": p.minimum_matched_tokens,
                "routingFloorScore": floor,
                "lookupTimeoutMs": p.lookup_timeout_ms,
                "affinityRouting": p.affinity_routing,
                "eviction": if p.algorithm == Algorithm::Lfu { "lfu" } else { "lru" },
                "strategy": {
                    "enableChainMatching": p.enable_chain_matching,
                    "requireChain": p.require_chain,
                    "enableTenantHot": p.enable_tenant_hot,
                },
            })
        })
        .collect();
    let tenants: Vec<Value> = layer
        .quotas
        .iter()
        .map(|(t, q)| json!({"tenantID": t, "maxIndexEntries": q}))
        .collect();
    json!({"version": 7, "policies": policies, "tenants": tenants}).to_string()
}
