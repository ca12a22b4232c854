//! Helpers shared by the index's unit tests.

use super::Index;
use crate::types::*;

pub(super) const NOW: i64 = 1_700_000_000_000_000;

pub(super) fn chain(ix: &Index, rep: &str, keys: &[[u8; 8]]) {
    let counts = vec![16i32; keys.len()];
    ix.ingest(CacheStateUpdate {
        replica_id: rep,
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "s",
        timestamp_us: NOW,
        adapter_id: "",
        stats: None,
        prefixes: std::iter::once(PrefixRef {
            prefix_hash: b"",
            token_count: 0,
            block_hashes: keys,
            block_token_counts: &counts,
            tier: 0,
            adapter_id: "",
        }),
    });
}
