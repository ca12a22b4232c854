//! Shared helpers for the engine's integration tests (index.md §11 notation).
#![allow(dead_code)]

pub mod source_text;

use inferencecache_engine::*;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

pub const T0: i64 = 1_700_000_000_000_000;
pub const MIN_US: i64 = 60_000_000;
pub const HOUR_MS: i64 = 3_600_000;

#[derive(Default)]
pub struct TestResolvers {
    pub ttl: Mutex<HashMap<String, i64>>,
    pub lfu: Mutex<HashSet<String>>,
    pub quota: Mutex<HashMap<String, i64>>,
}

impl Resolvers for TestResolvers {
    fn ttl_ms(&self, tenant: &str) -> Option<i64> {
        self.ttl.lock().get(tenant).copied()
    }
    fn algorithm(&self, tenant: &str) -> Algorithm {
        if self.lfu.lock().contains(tenant) {
            Algorithm::Lfu
        } else {
            Algorithm::Lru
        }
    }
    fn quota(&self, tenant: &str) -> Option<i64> {
        self.quota.lock().get(tenant).copied()
    }
}

pub struct Env {
    pub ix: Arc<Index>,
    pub clock: Arc<ManualClock>,
    pub res: Arc<TestResolvers>,
}

pub fn cfg_1h() -> IndexConfig {
    IndexConfig {
        global_ttl_ms: HOUR_MS,
        max_entries: 0,
        ..IndexConfig::default()
    }
}

pub fn env() -> Env {
    env_with(cfg_1h())
}

pub fn env_with(cfg: IndexConfig) -> Env {
    let clock = Arc::new(ManualClock::new(T0));
    let res = Arc::new(TestResolvers::default());
    let ix = Arc::new(Index::new(cfg, res.clone(), clock.clone()));
    Env { ix, clock, res }
}

pub struct Put<'a> {
    pub tenant: &'a str,
    pub model: &'a str,
    pub scheme: &'a str,
    pub adapter: &'a str,
    pub replica: &'a str,
    pub ts: i64,
    pub tier: i32,
}

impl Default for Put<'_> {
    fn default() -> Self {
        Put {
            tenant: "t",
            model: "m",
            scheme: "vllm",
            adapter: "",
            replica: "r",
            ts: 0,
            tier: 0,
        }
    }
}

impl Env {
    pub fn now(&self) -> i64 {
        self.clock.now_us()
    }
    pub fn set_lfu(&self, tenant: &str) {
        self.res.lfu.lock().insert(tenant.into());
    }
    pub fn set_quota(&self, tenant: &str, keys: i64) {
        self.res.quota.lock().insert(tenant.into(), keys);
    }
    pub fn set_ttl(&self, tenant: &str, ms: i64) {
        self.res.ttl.lock().insert(tenant.into(), ms);
    }
    /// r{p:N} under (t, m, vllm, "").
    pub fn put(&self, replica: &str, key: &[u8], tokens: i32) -> IngestOutcome {
        self.put_with(
            &Put {
                replica,
                ..Put::default()
            },
            key,
            tokens,
        )
    }
    pub fn put_with(&self, p: &Put<'_>, key: &[u8], tokens: i32) -> IngestOutcome {
        let none: &[Vec<u8>] = &[];
        let refs = [PrefixRef {
            prefix_hash: key,
            token_count: tokens,
            block_hashes: none,
            block_token_counts: &[],
            tier: p.tier,
            adapter_id: "",
        }];
        self.ix.ingest(CacheStateUpdate {
            replica_id: p.replica,
            model_id: p.model,
            tenant_id: p.tenant,
            hash_scheme: p.scheme,
            timestamp_us: p.ts,
            prefixes: refs.iter().copied(),
            stats: None,
            adapter_id: p.adapter,
        })
    }
    pub fn chain(&self, replica: &str, hashes: &[&[u8]], counts: &[i32]) -> IngestOutcome {
        self.chain_with(
            &Put {
                replica,
                ..Put::default()
            },
            hashes,
            counts,
            b"",
            0,
        )
    }
    pub fn chain_with(
        &self,
        p: &Put<'_>,
        hashes: &[&[u8]],
        counts: &[i32],
        full: &[u8],
        full_tokens: i32,
    ) -> IngestOutcome {
        let refs = [PrefixRef {
            prefix_hash: full,
            token_count: full_tokens,
            block_hashes: hashes,
            block_token_counts: counts,
            tier: p.tier,
            adapter_id: "",
        }];
        self.ix.ingest(CacheStateUpdate {
            replica_id: p.replica,
            model_id: p.model,
            tenant_id: p.tenant,
            hash_scheme: p.scheme,
            timestamp_us: p.ts,
            prefixes: refs.iter().copied(),
            stats: None,
            adapter_id: p.adapter,
        })
    }
    pub fn stats_with(
        &self,
        tenant: &str,
        model: &str,
        replica: &str,
        hit: f32,
        pressure: f32,
        ts: i64,
    ) {
        let none: [PrefixRef<'_, Vec<u8>>; 0] = [];
        self.ix.ingest(CacheStateUpdate {
            replica_id: replica,
            model_id: model,
            tenant_id: tenant,
            hash_scheme: "vllm",
            timestamp_us: ts,
            prefixes: none.iter().copied(),
            stats: Some(ReplicaStatsInput {
                cache_memory_bytes: 0,
                hit_rate: hit,
                pressure,
                t2_hit_tokens: 0,
                t2_query_tokens: 0,
            }),
            adapter_id: "",
        });
    }
    pub fn stats(&self, replica: &str, hit: f32, pressure: f32) {
        self.stats_with("t", "m", replica, hit, pressure, 0)
    }
    pub fn event(&self, ty: i32, replica: &str, key: &[u8], adapter: &str) {
        self.event_full(ty, "t", "m", replica, key, adapter, 0)
    }
    #[allow(clippy::too_many_arguments)]
    pub fn event_full(
        &self,
        ty: i32,
        tenant: &str,
        model: &str,
        replica: &str,
        key: &[u8],
        adapter: &str,
        ts: i64,
    ) {
        self.ix.apply_event(CacheEventInput {
            event_type: ty,
            replica_id: replica,
            model_id: model,
            tenant_id: tenant,
            prefix_hash: key,
            timestamp_us: ts,
            adapter_id: adapter,
        });
    }
    pub fn exact(&self, key: &[u8]) -> RouteResult {
        self.route(&LookupRequest::<Vec<u8>> {
            prefix_hash: key,
            ..LookupRequest::new("t", "m", "vllm")
        })
    }
    pub fn chain_route(&self, hashes: &[&[u8]], counts: &[i32]) -> RouteResult {
        self.ix.lookup_route(&LookupRequest {
            block_hashes: hashes,
            block_token_counts: counts,
            ..LookupRequest::new("t", "m", "vllm")
        })
    }
    pub fn route<H: AsRef<[u8]>>(&self, req: &LookupRequest<'_, H>) -> RouteResult {
        self.ix.lookup_route(req)
    }
}

pub fn ids(r: &[ScoredReplica]) -> Vec<String> {
    r.iter().map(|s| s.replica_id.to_string()).collect()
}

pub fn f16(n: usize) -> Vec<i32> {
    vec![16; n]
}

/// Collects change events.
/// (kind, tenant, replica, hash, adapter, timestamp).
pub type Recorded = (ChangeKind, String, String, Vec<u8>, String, i64);

#[derive(Default)]
pub struct Recorder {
    pub events: Mutex<Vec<Recorded>>,
}

impl ChangeSink for Recorder {
    fn is_active(&self) -> bool {
        true
    }
    fn publish(&self, e: &ChangeEvent<'_>) {
        self.events.lock().push((
            e.kind,
            e.tenant_id.to_string(),
            e.replica_id.to_string(),
            e.prefix_hash.to_vec(),
            e.adapter_id.to_string(),
            e.timestamp_us,
        ));
    }
}

impl Recorder {
    pub fn kinds(&self) -> Vec<ChangeKind> {
        self.events.lock().iter().map(|e| e.0).collect()
    }
    pub fn take(&self) -> Vec<ChangeKind> {
        std::mem::take(&mut *self.events.lock())
            .into_iter()
            .map(|e| e.0)
            .collect()
    }
}
