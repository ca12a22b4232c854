//! Engine input and output types. Inputs borrow from the caller (no copies of the server's
//! messages); chain arrays are generic over `H: AsRef<[u8]>` so that `&[Vec<u8>]` (prost) and
//! `&[[u8; 8]]` (benches) both work without allocation.

use crate::ReplicaId;
use std::sync::Arc;

/// Wire tier values (contract §3.5).
pub mod tier {
    /// `CACHE_TIER_UNSPECIFIED`.
    pub const UNSPECIFIED: i32 = 0;
    /// `CACHE_TIER_T1`.
    pub const T1: i32 = 1;
    /// `CACHE_TIER_T2`.
    pub const T2: i32 = 2;
    /// `CACHE_TIER_T3`.
    pub const T3: i32 = 3;
}

/// Wire values of `CacheEvent.Type` (contract §3.16).
pub mod event_type {
    /// `TYPE_UNSPECIFIED`.
    pub const UNSPECIFIED: i32 = 0;
    /// `PREFIX_ADDED`.
    pub const PREFIX_ADDED: i32 = 1;
    /// `PREFIX_EVICTED`.
    pub const PREFIX_EVICTED: i32 = 2;
    /// `REPLICA_UPDATED`.
    pub const REPLICA_UPDATED: i32 = 3;
    /// `ALL_CLEARED`.
    pub const ALL_CLEARED: i32 = 4;
}

/// L5 tier fold on wire-style values: `0` if either is 0, else the max.
pub fn coldest(a: i32, b: i32) -> i32 {
    if a == 0 || b == 0 { 0 } else { a.max(b) }
}

/// One `PrefixEntry` of an update, borrowed.
#[derive(Debug)]
pub struct PrefixRef<'a, H: AsRef<[u8]> = Vec<u8>> {
    /// Legacy exact key, or the co-set key of a chain ref (K9).
    pub prefix_hash: &'a [u8],
    /// Tokens covered by `prefix_hash`.
    pub token_count: i32,
    /// Chain block hashes.
    pub block_hashes: &'a [H],
    /// Chain block token counts (parallel to `block_hashes`).
    pub block_token_counts: &'a [i32],
    /// Wire tier value (K6).
    pub tier: i32,
    /// Adapter; empty falls back to the update's adapter (K5).
    pub adapter_id: &'a str,
}

/// Stats carried by an update (S2). The nested `replica_id` and `client_version` are ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaStatsInput {
    /// KV-cache bytes in use.
    pub cache_memory_bytes: i64,
    /// Engine prefix-cache hit rate.
    pub hit_rate: f32,
    /// Load proxy.
    pub pressure: f32,
    /// Tokens served from the offload tier.
    pub t2_hit_tokens: i64,
    /// Tokens looked up in the offload tier.
    pub t2_query_tokens: i64,
}

/// A `CacheStateUpdate`, borrowed. `prefixes` is any iterator of [`PrefixRef`], e.g.
/// `msg.prefixes.iter().map(|p| PrefixRef { .. })`.
#[derive(Debug, Clone)]
pub struct CacheStateUpdate<'a, I> {
    /// Reporting replica.
    pub replica_id: &'a str,
    /// Model.
    pub model_id: &'a str,
    /// Tenant.
    pub tenant_id: &'a str,
    /// Hash scheme; empty indexes nothing (K4).
    pub hash_scheme: &'a str,
    /// µs since the epoch; 0 = now (K3).
    pub timestamp_us: i64,
    /// The holdings.
    pub prefixes: I,
    /// Optional stats (S2).
    pub stats: Option<ReplicaStatsInput>,
    /// Default adapter (K5).
    pub adapter_id: &'a str,
}

/// A published `CacheEvent`, borrowed (E1–E6).
#[derive(Debug, Clone, Copy)]
pub struct CacheEventInput<'a> {
    /// Wire event type ([`event_type`]); unknown values are skipped (E6).
    pub event_type: i32,
    /// Replica.
    pub replica_id: &'a str,
    /// Model.
    pub model_id: &'a str,
    /// Tenant.
    pub tenant_id: &'a str,
    /// Prefix key (PREFIX_* only).
    pub prefix_hash: &'a [u8],
    /// µs; 0 = now.
    pub timestamp_us: i64,
    /// PREFIX_EVICTED: limit to this adapter partition (empty = all).
    pub adapter_id: &'a str,
}

/// A lookup request (index level), borrowed.
#[derive(Debug)]
pub struct LookupRequest<'a, H: AsRef<[u8]> = Vec<u8>> {
    /// Tenant.
    pub tenant_id: &'a str,
    /// Model.
    pub model_id: &'a str,
    /// Hash scheme.
    pub hash_scheme: &'a str,
    /// Adapter partition.
    pub adapter_id: &'a str,
    /// Exact key (legacy form).
    pub prefix_hash: &'a [u8],
    /// Caller's token count for `prefix_hash` (not read by the index).
    pub prefix_token_count: i32,
    /// Chain block hashes.
    pub block_hashes: &'a [H],
    /// Chain token counts.
    pub block_token_counts: &'a [i32],
    /// SLO ttft budget (R3).
    pub ttft_ms: i32,
    /// SLO tbt budget (never read, R3).
    pub tbt_ms: i32,
}

impl<'a, H: AsRef<[u8]>> LookupRequest<'a, H> {
    /// A request with only the partition set; fill the inputs with struct update syntax.
    pub fn new(tenant_id: &'a str, model_id: &'a str, hash_scheme: &'a str) -> Self {
        Self {
            tenant_id,
            model_id,
            hash_scheme,
            adapter_id: "",
            prefix_hash: &[],
            prefix_token_count: 0,
            block_hashes: &[],
            block_token_counts: &[],
            ttft_ms: 0,
            tbt_ms: 0,
        }
    }
}

/// Index result kind (index.md §0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// `NO_HINT`.
    #[default]
    None,
    /// `PREFIX_MATCH`.
    PrefixMatch,
    /// `TENANT_HOT`.
    TenantHot,
    /// `UNKNOWN_TENANT`.
    UnknownTenant,
    /// `UNKNOWN_MODEL`.
    UnknownModel,
    /// `UNKNOWN_HASH_SCHEME`.
    UnknownHashScheme,
}

impl Strategy {
    /// The wire reason code.
    pub fn reason_code(self) -> &'static str {
        match self {
            Strategy::None => "NO_HINT",
            Strategy::PrefixMatch => "PREFIX_MATCH",
            Strategy::TenantHot => "TENANT_HOT",
            Strategy::UnknownTenant => "UNKNOWN_TENANT",
            Strategy::UnknownModel => "UNKNOWN_MODEL",
            Strategy::UnknownHashScheme => "UNKNOWN_HASH_SCHEME",
        }
    }
}

/// One ranked replica.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredReplica {
    /// Replica id (interned: copying or dropping it touches no shared counter).
    pub replica_id: ReplicaId,
    /// Score (higher is better).
    pub score: f32,
    /// Matched tokens (0 for TENANT_HOT).
    pub matched_tokens: i32,
    /// Freshness (PREFIX_MATCH) or hit rate (TENANT_HOT).
    pub estimated_cache_hit_prob: f32,
    /// Wire tier (0 = UNSPECIFIED, 1–3 = T1–T3).
    pub tier: i32,
}

/// Alias matching index.md §10 naming.
pub type ReplicaScore = ScoredReplica;

/// Stats of one replica as reported by [`crate::Index::cache_state`] (G1).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaStatsOut {
    /// Replica id.
    pub replica_id: Arc<str>,
    /// KV-cache bytes.
    pub cache_memory_bytes: i64,
    /// Hit rate.
    pub hit_rate: f32,
    /// Pressure.
    pub pressure: f32,
    /// Offload hits.
    pub t2_hit_tokens: i64,
    /// Offload queries.
    pub t2_query_tokens: i64,
}

/// `GetCacheState` data (G1).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CacheState {
    /// Distinct keys of (tenant, model), stale-unswept included.
    pub total_prefixes: i64,
    /// Keys whose summed access count ≥ the hot threshold (D4).
    pub hot_prefixes: i64,
    /// Stats records sorted by replica id.
    pub replicas: Vec<ReplicaStatsOut>,
}

/// One `/snapshot` replica row (G2).
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotReplicaRow {
    /// Tenant.
    pub tenant_id: Arc<str>,
    /// Replica.
    pub replica_id: Arc<str>,
    /// Whether any stats record exists.
    pub stats_reported: bool,
    /// Chosen record's fields (zero when none).
    pub cache_memory_bytes: i64,
    /// Hit rate.
    pub hit_rate: f32,
    /// Pressure.
    pub pressure: f32,
    /// Offload hits.
    pub t2_hit_tokens: i64,
    /// Offload queries.
    pub t2_query_tokens: i64,
    /// Chosen record's liveness `last_seen` in µs (ms resolution); 0 = none.
    pub last_update_us: i64,
    /// Storage entries of (tenant, replica).
    pub prefix_count: i64,
    /// Max entry `last_seen` in µs (ms resolution); 0 = none.
    pub last_event_at_us: i64,
}

/// One `/snapshot` tenant row (G2).
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotTenantRow {
    /// Tenant.
    pub tenant_id: Arc<str>,
    /// Distinct keys across models.
    pub index_entries: i64,
    /// Mean hit rate over the tenant's stats-bearing replica rows (f64 mean of the f32 values).
    pub hit_rate: f64,
    /// At least one sample.
    pub hit_rate_reported: bool,
    /// Always 0.
    pub memory_used: i64,
}

/// `/snapshot` data (G2). Reserved tenants are excluded.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SnapshotData {
    /// Rows sorted by (tenant, replica).
    pub replicas: Vec<SnapshotReplicaRow>,
    /// Rows sorted by tenant.
    pub tenants: Vec<SnapshotTenantRow>,
    /// Σ index_entries.
    pub total_prefixes: i64,
    /// Σ hot keys.
    pub hot_prefixes: i64,
}

/// What an ingest did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Upserts applied (one per chain block, co-set key or legacy ref), reserved included.
    pub upserts: u64,
    /// New keys created.
    pub keys_added: u64,
    /// New storage entries created.
    pub entries_added: u64,
    /// Whether a stats record was stored.
    pub stats_stored: bool,
    /// Prefix refs dropped because their scope already names the most replicas a holder can
    /// index (2^20) and this update's replica is not one of them.
    pub refs_dropped: u64,
}

/// Test/debug view of one storage entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryView {
    /// Stored token count.
    pub token_count: i32,
    /// `last_seen` in µs (ms resolution).
    pub last_seen_us: i64,
    /// Wire tier as reported (0 for colder than T3).
    pub tier: i32,
    /// LFU access count.
    pub access_count: u32,
}

impl<H: AsRef<[u8]>> Clone for PrefixRef<'_, H> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<H: AsRef<[u8]>> Copy for PrefixRef<'_, H> {}
impl<H: AsRef<[u8]>> Clone for LookupRequest<'_, H> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<H: AsRef<[u8]>> Copy for LookupRequest<'_, H> {}
