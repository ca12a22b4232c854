//! Helpers shared by the index's unit tests: updates of one ref into tenant `t`, model `m`,
//! scheme `s`, adapter `""`, at [`NOW`].

use super::Index;
use crate::clock::ManualClock;
use crate::config::{Algorithm, DefaultResolvers, IndexConfig, Resolvers};
use crate::types::*;
use std::sync::Arc;

pub(super) const NOW: i64 = 1_700_000_000_000_000;

/// Resolvers of one algorithm for every tenant, no TTL, and a key quota for one tenant.
pub(super) struct Policy {
    pub(super) algorithm: Algorithm,
    /// (tenant, keys).
    pub(super) quota: Option<(&'static str, i64)>,
}

impl Resolvers for Policy {
    fn ttl_ms(&self, _: &str) -> Option<i64> {
        None
    }
    fn algorithm(&self, _: &str) -> Algorithm {
        self.algorithm
    }
    fn quota(&self, tenant: &str) -> Option<i64> {
        self.quota
            .and_then(|(quota_tenant, keys)| (tenant == quota_tenant).then_some(keys))
    }
}

/// An index with the default configuration whose clock stands at [`NOW`].
pub(super) fn index_at_now() -> Index {
    Index::new(
        IndexConfig::default(),
        Arc::new(DefaultResolvers),
        Arc::new(ManualClock::new(NOW)),
    )
}

/// Applies ALL_CLEARED from `rep`.
pub(super) fn all_cleared(ix: &Index, rep: &str) {
    ix.apply_event(CacheEventInput {
        event_type: event_type::ALL_CLEARED,
        replica_id: rep,
        model_id: "m",
        tenant_id: "t",
        prefix_hash: &[],
        timestamp_us: NOW,
        adapter_id: "",
    });
}

/// Ingests `r` as the only ref of an update from `rep`.
fn ingest_ref<H: AsRef<[u8]>>(ix: &Index, rep: &str, r: PrefixRef<'_, H>) {
    ix.ingest(CacheStateUpdate {
        replica_id: rep,
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "s",
        timestamp_us: NOW,
        adapter_id: "",
        stats: None,
        prefixes: std::iter::once(r),
    });
}

/// A chain-form ref of `keys`, 16 tokens per block.
pub(super) fn chain(ix: &Index, rep: &str, keys: &[[u8; 8]]) {
    let counts = vec![16i32; keys.len()];
    ingest_ref(
        ix,
        rep,
        PrefixRef {
            prefix_hash: b"",
            token_count: 0,
            block_hashes: keys,
            block_token_counts: &counts,
            tier: 0,
            adapter_id: "",
        },
    );
}

/// A single-key (legacy `prefix_hash`) ref of `key`, 16 tokens.
pub(super) fn single(ix: &Index, rep: &str, key: &[u8]) {
    ingest_ref(
        ix,
        rep,
        PrefixRef::<&[u8]> {
            prefix_hash: key,
            token_count: 16,
            block_hashes: &[],
            block_token_counts: &[],
            tier: 0,
            adapter_id: "",
        },
    );
}
