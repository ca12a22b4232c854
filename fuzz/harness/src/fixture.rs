//! A server state seeded with a small, fixed index and pushed policies, shared by the targets
//! that exercise the server's handlers.

use inferencecache_engine::{ManualClock, fingerprint};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_server::grpc::CacheService;
use inferencecache_server::policy::decode_push;
use inferencecache_server::state::{AppState, ServerOptions};
use inferencecache_server::translate;
use std::sync::{Arc, OnceLock};

/// The fixed "now" of every fixture (µs since the epoch). The clock never moves, so a lookup
/// answers the same way every time it is replayed.
pub const T0_US: i64 = 1_700_000_000_000_000;

/// Tenants with a pushed policy (server.md §6.4), one per code path of the handler.
pub const POLICY_BODY: &str = r#"{"version":7,"policies":[
 {"namespace":"lfu","eviction":"lfu","routingFloorScore":0},
 {"namespace":"req","strategy":{"requireChain":true}},
 {"namespace":"nochain","strategy":{"enableChainMatching":false}},
 {"namespace":"gate","minimumPrefixTokens":100,"affinityRouting":false},
 {"namespace":"nohot","affinityRouting":false,"strategy":{"enableTenantHot":false}},
 {"namespace":"floor","minimumMatchedTokens":64,"routingFloorScore":50}
],"tenants":[{"tenantID":"quota","maxIndexEntries":4}]}"#;

/// Tenants the fixture seeds: `t` has no policy (the "no policy" column of §6.1), the others the
/// policies of [`POLICY_BODY`].
pub const TENANTS: [&str; 8] = [
    "t", "lfu", "req", "nochain", "gate", "nohot", "floor", "quota",
];

/// Tokens per block (the server default, `DefaultEngineBlockSize`).
pub const BLOCK: usize = 16;

/// The seeded token prompt: `0..128`, eight blocks. A `token_ids` lookup of any leading part of
/// it matches replica `r0` (eight blocks) and `r1` (the first four).
pub fn prompt_tokens() -> Vec<u32> {
    (0..128).collect()
}

/// The seed updates applied to every fixture, as the gRPC messages a producer would send.
pub fn seed_updates() -> Vec<pb::CacheStateUpdate> {
    let (chain, counts) = fingerprint::chain(&prompt_tokens(), BLOCK);
    let chain: Vec<Vec<u8>> = chain.iter().map(|h| h.to_vec()).collect();
    let mut out = Vec::new();
    for tenant in TENANTS {
        out.push(pb::CacheStateUpdate {
            replica_id: "r0".into(),
            model_id: "m".into(),
            tenant_id: tenant.into(),
            hash_scheme: "vllm".into(),
            timestamp_us: 0,
            prefixes: vec![
                chain_entry(&chain, &counts, 1, ""),
                legacy_entry(b"p", 128, 1, ""),
            ],
            stats: None,
            adapter_id: String::new(),
        });
        out.push(pb::CacheStateUpdate {
            replica_id: "r1".into(),
            model_id: "m".into(),
            tenant_id: tenant.into(),
            hash_scheme: "vllm".into(),
            // A minute old: fresh, but less so than r0.
            timestamp_us: T0_US - 60_000_000,
            prefixes: vec![
                chain_entry(&chain[..4], &counts[..4], 2, ""),
                legacy_entry(b"q", 64, 2, ""),
                chain_entry(
                    &[b"b1".to_vec(), b"b2".to_vec(), b"b3".to_vec()],
                    &[64, 64, 64],
                    0,
                    "",
                ),
            ],
            stats: Some(stats(0.8, 0.1)),
            adapter_id: String::new(),
        });
        out.push(pb::CacheStateUpdate {
            replica_id: "r2".into(),
            model_id: "m".into(),
            tenant_id: tenant.into(),
            hash_scheme: "vllm".into(),
            timestamp_us: 0,
            prefixes: vec![
                legacy_entry(b"p", 32, 3, "lora"),
                chain_entry(&[b"b1".to_vec(), b"b2".to_vec()], &[64, 64], -1, ""),
            ],
            stats: Some(stats(0.5, 0.0)),
            adapter_id: String::new(),
        });
        out.push(pb::CacheStateUpdate {
            replica_id: "r0".into(),
            model_id: "n".into(),
            tenant_id: tenant.into(),
            hash_scheme: "sglang".into(),
            timestamp_us: 0,
            prefixes: vec![legacy_entry(b"p", 16, 1, "")],
            stats: Some(stats(0.3, 2.0)),
            adapter_id: String::new(),
        });
    }
    out
}

fn chain_entry(
    hashes: &[impl AsRef<[u8]>],
    counts: &[i32],
    tier: i32,
    adapter: &str,
) -> pb::PrefixEntry {
    pb::PrefixEntry {
        prefix_hash: Vec::new(),
        token_count: 0,
        block_hashes: hashes.iter().map(|h| h.as_ref().to_vec()).collect(),
        block_token_counts: counts.to_vec(),
        tier,
        adapter_id: adapter.into(),
    }
}

fn legacy_entry(hash: &[u8], tokens: i32, tier: i32, adapter: &str) -> pb::PrefixEntry {
    pb::PrefixEntry {
        prefix_hash: hash.to_vec(),
        token_count: tokens,
        block_hashes: Vec::new(),
        block_token_counts: Vec::new(),
        tier,
        adapter_id: adapter.into(),
    }
}

fn stats(hit_rate: f32, pressure: f32) -> pb::ReplicaStats {
    pb::ReplicaStats {
        replica_id: String::new(),
        cache_memory_bytes: 1 << 20,
        hit_rate,
        pressure,
        client_version: String::new(),
        t2_hit_tokens: 0,
        t2_query_tokens: 0,
        endpoint: String::new(),
    }
}

/// A fresh server state: the policies pushed and the seed updates ingested, clock at [`T0_US`].
/// No sweep ticker runs (the state is never started), so nothing changes behind a target's back.
pub fn new_state() -> AppState {
    let state = AppState::with_clock(ServerOptions::default(), Arc::new(ManualClock::new(T0_US)));
    let layer = decode_push(POLICY_BODY.as_bytes()).expect("the fixture's policy body is valid");
    state.policies().replace_pushed(layer);
    for update in seed_updates() {
        translate::ingest(state.index(), &update);
    }
    state
}

/// One current-thread runtime for the whole process (the handlers are async).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime builds")
    })
}

/// The process-wide fixture of the lookup target: built once, read-mostly afterwards (lookups
/// change nothing but LFU access counts, L8).
pub fn shared_service() -> &'static CacheService {
    static SVC: OnceLock<CacheService> = OnceLock::new();
    SVC.get_or_init(|| CacheService::new(new_state()))
}
