//! Namespace policies and tenant quotas (spec `server.md` §6).
//!
//! Two layers: the file layer (`--config`) and the pushed layer (the last `/policy` body). A
//! lookup resolves its tenant's policy from an immutable snapshot swapped atomically, so the
//! request path takes no lock (C4).

use arc_swap::ArcSwap;
use inferencecache_engine::{Algorithm, PROBE_TENANT, Resolvers};
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Arc;

/// A fully resolved policy: every knob has a value.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// `evictionTTL` in ns; ≤ 0 means the global TTL.
    pub eviction_ttl_ns: i64,
    pub minimum_prefix_tokens: i32,
    pub minimum_matched_tokens: i32,
    pub routing_floor_score: f32,
    /// ≤ 0 means unbounded.
    pub lookup_timeout_ms: i32,
    pub affinity_routing: bool,
    pub algorithm: Algorithm,
    pub enable_chain_matching: bool,
    pub require_chain: bool,
    pub enable_tenant_hot: bool,
}

impl Policy {
    /// The "no policy for the namespace" column of §6.1.
    pub const NONE: Policy = Policy {
        eviction_ttl_ns: 0,
        minimum_prefix_tokens: 0,
        minimum_matched_tokens: 64,
        routing_floor_score: 0.1,
        lookup_timeout_ms: 0,
        affinity_routing: true,
        algorithm: Algorithm::Lru,
        enable_chain_matching: true,
        require_chain: false,
        enable_tenant_hot: true,
    };
}

/// One policy entry as written in a `/policy` body or the config file; absent keys are `None`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicyEntry {
    #[serde(default)]
    pub namespace: String,
    #[serde(default, rename = "evictionTTL")]
    pub eviction_ttl: Option<i64>,
    #[serde(default)]
    pub minimum_prefix_tokens: Option<i32>,
    #[serde(default)]
    pub minimum_matched_tokens: Option<i32>,
    #[serde(default)]
    pub routing_floor_score: Option<f32>,
    #[serde(default)]
    pub lookup_timeout_ms: Option<i32>,
    #[serde(default)]
    pub affinity_routing: Option<bool>,
    #[serde(default)]
    pub eviction: Option<String>,
    #[serde(default)]
    pub strategy: Option<StrategyEntry>,
}

/// `strategy` sub-object of a policy entry.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StrategyEntry {
    #[serde(default)]
    pub enable_chain_matching: Option<bool>,
    #[serde(default)]
    pub require_chain: Option<bool>,
    #[serde(default)]
    pub enable_tenant_hot: Option<bool>,
}

/// One tenant quota entry.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantEntry {
    #[serde(default, rename = "tenantID")]
    pub tenant_id: String,
    #[serde(default, rename = "maxIndexEntries")]
    pub max_index_entries: Option<i64>,
    #[serde(default, rename = "isolationMode")]
    pub isolation_mode: Option<String>,
}

/// A `/policy` push body (§6.4).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushBody {
    pub version: i64,
    #[serde(default)]
    pub policies: Option<Vec<PolicyEntry>>,
    #[serde(default)]
    pub tenants: Option<Vec<TenantEntry>>,
}

/// Why a `/policy` push was refused (HTTP 400 with this text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushError(pub String);

impl std::fmt::Display for PushError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Largest accepted `/policy` body.
pub const MAX_PUSH_BYTES: usize = 1 << 20;

/// Decodes and normalizes a `/policy` body into a pushed layer (§6.4, in order: size, strict
/// decode of the first JSON value, version range, normalization).
pub fn decode_push(body: &[u8]) -> Result<Layer, PushError> {
    if body.len() > MAX_PUSH_BYTES {
        return Err(PushError(
            "decode policy snapshot: body exceeds 1 MiB".into(),
        ));
    }
    // Only the first JSON value counts (§6.4, like a streaming decoder).
    let mut stream = serde_json::Deserializer::from_slice(body).into_iter::<serde_json::Value>();
    let first = match stream.next() {
        Some(Ok(v)) => v,
        Some(Err(e)) => return Err(PushError(format!("decode policy snapshot: {e}"))),
        None => return Err(PushError("decode policy snapshot: empty body".into())),
    };
    objects_where_expected(&first)
        .map_err(|e| PushError(format!("decode policy snapshot: {e}")))?;
    let parsed: PushBody = serde_json::from_value(first)
        .map_err(|e| PushError(format!("decode policy snapshot: {e}")))?;
    if !(3..=7).contains(&parsed.version) {
        return Err(PushError("unsupported policy snapshot version".into()));
    }
    let version = parsed.version;
    let mut layer = Layer::default();
    for mut entry in parsed.policies.unwrap_or_default() {
        if entry.namespace.is_empty() {
            continue;
        }
        normalize(&mut entry, version);
        let resolved = resolve_entry(&entry, &PUSHED_BASE);
        // Duplicate namespaces: the last one wins.
        layer
            .namespaces
            .insert(entry.namespace.clone(), Arc::new(resolved));
    }
    for t in parsed.tenants.unwrap_or_default() {
        layer.insert_quota(&t.tenant_id, t.max_index_entries);
    }
    Ok(layer)
}

/// Strict decode (§6.4) refuses a value of the wrong type, but serde's derived struct decoder
/// also reads a struct from a JSON array (`[7]` would be a version-7 push). The schema's struct
/// positions — the body, each `policies` / `tenants` entry and a `strategy` — must be objects
/// (`null` entries stay as the typed decode treats them).
fn objects_where_expected(body: &serde_json::Value) -> Result<(), String> {
    let Some(obj) = body.as_object() else {
        return Err("the body must be a JSON object".into());
    };
    for list in ["policies", "tenants"] {
        let Some(serde_json::Value::Array(items)) = obj.get(list) else {
            continue;
        };
        for item in items {
            if item.is_array() {
                return Err(format!("{list} entries must be JSON objects"));
            }
            if let Some(strategy) = item.get("strategy")
                && strategy.is_array()
            {
                return Err("strategy must be a JSON object".into());
            }
        }
    }
    Ok(())
}

/// Per-version normalization of a pushed entry (§6.4).
fn normalize(entry: &mut PolicyEntry, version: i64) {
    if version >= 7 {
        return;
    }
    if version < 4 && entry.minimum_matched_tokens.unwrap_or(0) == 0 {
        entry.minimum_matched_tokens = Some(64);
    }
    if version < 5 && entry.routing_floor_score.is_none() {
        entry.routing_floor_score = Some(0.1);
    }
    if version < 6 {
        let s = entry.strategy.get_or_insert_with(StrategyEntry::default);
        s.enable_chain_matching.get_or_insert(true);
        s.require_chain.get_or_insert(false);
        s.enable_tenant_hot.get_or_insert(true);
    }
    if entry.affinity_routing.is_none() {
        entry.affinity_routing = Some(true);
    }
}

/// Defaults for keys absent from a pushed entry ("policy present, key absent").
const PUSHED_BASE: Policy = Policy {
    minimum_matched_tokens: 0,
    ..Policy::NONE
};

/// Resolves an entry over `base` (the value of every absent key).
pub fn resolve_entry(entry: &PolicyEntry, base: &Policy) -> Policy {
    let strategy = entry.strategy.clone().unwrap_or_default();
    Policy {
        eviction_ttl_ns: entry.eviction_ttl.unwrap_or(base.eviction_ttl_ns),
        minimum_prefix_tokens: entry
            .minimum_prefix_tokens
            .unwrap_or(base.minimum_prefix_tokens),
        minimum_matched_tokens: entry
            .minimum_matched_tokens
            .unwrap_or(base.minimum_matched_tokens)
            .max(0),
        routing_floor_score: entry
            .routing_floor_score
            .unwrap_or(base.routing_floor_score)
            .max(0.0),
        lookup_timeout_ms: entry.lookup_timeout_ms.unwrap_or(base.lookup_timeout_ms),
        affinity_routing: entry.affinity_routing.unwrap_or(base.affinity_routing),
        algorithm: match &entry.eviction {
            Some(s) if s.eq_ignore_ascii_case("lfu") => Algorithm::Lfu,
            Some(_) => Algorithm::Lru,
            None => base.algorithm,
        },
        enable_chain_matching: strategy
            .enable_chain_matching
            .unwrap_or(base.enable_chain_matching),
        require_chain: strategy.require_chain.unwrap_or(base.require_chain),
        enable_tenant_hot: strategy.enable_tenant_hot.unwrap_or(base.enable_tenant_hot),
    }
}

/// One source of policies and quotas.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    /// Namespace → resolved policy.
    pub namespaces: HashMap<String, Arc<Policy>>,
    /// Policy for namespaces without their own entry (file layer only).
    pub default: Option<Arc<Policy>>,
    /// Tenant → key quota (≥ 0).
    pub quotas: HashMap<String, i64>,
}

impl Layer {
    /// Records a tenant's key quota as both sources write it (a `/policy` push's `tenants`, the
    /// file's `[[tenants]]`): an entry without a tenant id is skipped, an absent or negative
    /// quota is 0, and a repeated tenant's last entry wins.
    pub fn insert_quota(&mut self, tenant_id: &str, max_index_entries: Option<i64>) {
        if tenant_id.is_empty() {
            return;
        }
        self.quotas
            .insert(tenant_id.to_string(), max_index_entries.unwrap_or(0).max(0));
    }
}

#[derive(Debug, Default)]
struct Snapshot {
    pushed: Layer,
    file: Layer,
}

/// Lock-free policy resolution over the two layers.
#[derive(Debug)]
pub struct PolicyStore {
    snapshot: ArcSwap<Snapshot>,
    global_ttl_ns: i64,
}

static NO_POLICY: Policy = Policy::NONE;

impl PolicyStore {
    pub fn new(global_ttl_ns: i64) -> Self {
        Self {
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            global_ttl_ns,
        }
    }

    /// Replaces the pushed layer (a `/policy` push).
    pub fn replace_pushed(&self, layer: Layer) {
        self.snapshot.rcu(|cur| Snapshot {
            pushed: layer.clone(),
            file: cur.file.clone(),
        });
    }

    /// Replaces the file layer (config load or reload).
    pub fn replace_file(&self, layer: Layer) {
        self.snapshot.rcu(|cur| Snapshot {
            pushed: cur.pushed.clone(),
            file: layer.clone(),
        });
    }

    /// The policy of namespace `ns` (§6.2): pushed entry, else file entry, else file default,
    /// else the built-in "no policy" values.
    pub fn resolve(&self, ns: &str) -> Arc<Policy> {
        let snap = self.snapshot.load();
        if let Some(p) = snap.pushed.namespaces.get(ns) {
            return p.clone();
        }
        if let Some(p) = snap.file.namespaces.get(ns) {
            return p.clone();
        }
        if let Some(p) = &snap.file.default {
            return p.clone();
        }
        Arc::new(NO_POLICY.clone())
    }

    /// Calls `f` with the namespace's policy without cloning it (request path).
    pub fn with_policy<R>(&self, ns: &str, f: impl FnOnce(&Policy) -> R) -> R {
        let snap = self.snapshot.load();
        let p: &Policy = snap
            .pushed
            .namespaces
            .get(ns)
            .or_else(|| snap.file.namespaces.get(ns))
            .or(snap.file.default.as_ref())
            .map(|p| &**p)
            .unwrap_or(&NO_POLICY);
        f(p)
    }

    /// The tenant's key quota: pushed entry, else file entry, else unbounded.
    pub fn quota(&self, tenant: &str) -> Option<i64> {
        if tenant == PROBE_TENANT {
            return None;
        }
        let snap = self.snapshot.load();
        snap.pushed
            .quotas
            .get(tenant)
            .or_else(|| snap.file.quotas.get(tenant))
            .copied()
    }

    /// Global TTL in ns.
    pub fn global_ttl_ns(&self) -> i64 {
        self.global_ttl_ns
    }
}

impl Resolvers for PolicyStore {
    fn ttl_ms(&self, tenant: &str) -> Option<i64> {
        self.with_policy(tenant, |p| {
            (p.eviction_ttl_ns > 0).then(|| (p.eviction_ttl_ns / 1_000_000).max(1))
        })
    }

    fn algorithm(&self, tenant: &str) -> Algorithm {
        self.with_policy(tenant, |p| p.algorithm)
    }

    fn quota(&self, tenant: &str) -> Option<i64> {
        PolicyStore::quota(self, tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_with(body: &str) -> PolicyStore {
        let store = PolicyStore::new(0);
        store.replace_pushed(decode_push(body.as_bytes()).expect("valid push"));
        store
    }

    #[test]
    fn no_policy_defaults() {
        let store = PolicyStore::new(0);
        let p = store.resolve("anyone");
        assert_eq!(*p, Policy::NONE);
        assert_eq!(p.minimum_matched_tokens, 64);
        assert_eq!(p.routing_floor_score, 0.1);
    }

    #[test]
    fn v7_absent_floor_means_off_but_other_defaults_hold() {
        let store = store_with(
            r#"{"version":7,"policies":[{"namespace":"team-a","routingFloorScore":0}]}"#,
        );
        let p = store.resolve("team-a");
        assert_eq!(p.minimum_matched_tokens, 0);
        assert_eq!(p.routing_floor_score, 0.0);
        assert!(
            p.affinity_routing
                && p.enable_chain_matching
                && p.enable_tenant_hot
                && !p.require_chain
        );
        assert_eq!(*store.resolve("other"), Policy::NONE);
    }

    #[test]
    fn v3_zero_matched_floor_becomes_64() {
        let store =
            store_with(r#"{"version":3,"policies":[{"namespace":"a","minimumMatchedTokens":0}]}"#);
        assert_eq!(store.resolve("a").minimum_matched_tokens, 64);
        let store = store_with(r#"{"version":4,"policies":[{"namespace":"a"}]}"#);
        assert_eq!(store.resolve("a").minimum_matched_tokens, 0);
    }

    #[test]
    fn negative_values_clamp_and_eviction_is_case_insensitive() {
        let store = store_with(
            r#"{"version":7,"policies":[{"namespace":"a","minimumMatchedTokens":-5,"routingFloorScore":-1,"eviction":"LFU"}],
                "tenants":[{"tenantID":"t","maxIndexEntries":-3},{"tenantID":"","maxIndexEntries":5}]}"#,
        );
        let p = store.resolve("a");
        assert_eq!(
            (p.minimum_matched_tokens, p.routing_floor_score, p.algorithm),
            (0, 0.0, Algorithm::Lfu)
        );
        assert_eq!(store.quota("t"), Some(0));
        assert_eq!(store.quota(""), None);
        assert_eq!(store.quota("nobody"), None);
    }

    #[test]
    fn strict_decoding() {
        for (body, want) in [
            (r#"{"version":2}"#, "unsupported policy snapshot version"),
            (r#"{"version":8}"#, "unsupported policy snapshot version"),
            (r#"{"version":7,"bogus":1}"#, "decode policy snapshot: "),
            (
                r#"{"version":7,"policies":[{"namespace":"a","minimumPrefixTokens":"x"}]}"#,
                "decode policy snapshot: ",
            ),
            (r#"not json"#, "decode policy snapshot: "),
            // Struct positions written as arrays (found by the policy_body fuzz target).
            (r#"[7]"#, "decode policy snapshot: "),
            (
                r#"{"version":7,"policies":[["a"]]}"#,
                "decode policy snapshot: ",
            ),
            (
                r#"{"version":7,"tenants":[["t",5]]}"#,
                "decode policy snapshot: ",
            ),
            (
                r#"{"version":7,"policies":[{"namespace":"a","strategy":[true]}]}"#,
                "decode policy snapshot: ",
            ),
        ] {
            let err = decode_push(body.as_bytes()).unwrap_err();
            assert!(err.0.starts_with(want), "{body}: {err}");
        }
        // Only the first JSON value is read.
        assert!(decode_push(br#"{"version":7} garbage"#).is_ok());
        let big = vec![b' '; MAX_PUSH_BYTES + 1];
        assert!(decode_push(&big).is_err());
    }

    #[test]
    fn push_replaces_whole_layer_and_last_duplicate_wins() {
        let store = store_with(
            r#"{"version":7,"policies":[{"namespace":"a","lookupTimeoutMs":5},{"namespace":"a","lookupTimeoutMs":9}]}"#,
        );
        assert_eq!(store.resolve("a").lookup_timeout_ms, 9);
        store.replace_pushed(decode_push(br#"{"version":7,"policies":[]}"#).unwrap());
        assert_eq!(*store.resolve("a"), Policy::NONE);
    }

    #[test]
    fn resolvers_read_ttl_in_ms() {
        let store = store_with(
            r#"{"version":7,"policies":[{"namespace":"a","evictionTTL":300000000000}]}"#,
        );
        assert_eq!(Resolvers::ttl_ms(&store, "a"), Some(300_000));
        assert_eq!(Resolvers::ttl_ms(&store, "b"), None);
    }
}
