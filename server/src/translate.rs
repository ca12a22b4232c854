//! The one translation between the wire (`inferencecache.v1alpha1` messages) and the engine's
//! borrowed inputs, and the one vocabulary of LookupRoute reason codes.
//!
//! Every path that hands a producer's message to the index goes through here: the gRPC
//! handlers, the limits (`crate::limits::admit`, which cuts chains and then builds the same
//! borrowed update), and replicated mode's apply loop. Nothing is copied: the engine's inputs
//! borrow the message's strings and byte vectors.
//!
//! [`Reason`] is what a lookup answers and what the metrics count under `reason_code`; the
//! engine's own result kinds map onto it ([`Reason::from_strategy`]), so the wire strings are
//! written once.

use inferencecache_engine::{
    CacheEventInput, CacheStateUpdate, Index, PROBE_TENANT, PrefixRef, ReplicaStatsInput, Strategy,
};
use inferencecache_proto::v1alpha1 as pb;

/// Reason codes of `LookupRoute` (contract §4.1; an open vocabulary). The order of
/// [`Reason::ALL`] is the order the metrics list them in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `PREFIX_MATCH`: replicas holding a prefix of the request.
    PrefixMatch,
    /// `TENANT_HOT`: the tenant's hottest replicas (no prefix matched).
    TenantHot,
    /// `AFFINITY_HINT`: the affinity seed's replica (no prefix, no hot replica).
    AffinityHint,
    /// `NO_HINT`: nothing to recommend (also every fail-open answer).
    NoHint,
    /// `POLICY_REQUIRES_CHAIN`: the tenant's policy asks for chain lookups only.
    PolicyRequiresChain,
    /// `TIMEOUT`: the deadline passed before an answer.
    Timeout,
    /// `UNKNOWN_TENANT`: the index holds nothing for the tenant.
    UnknownTenant,
    /// `UNKNOWN_MODEL`: the index holds nothing for the model.
    UnknownModel,
    /// `UNKNOWN_HASH_SCHEME`: the index holds nothing under the hash scheme.
    UnknownHashScheme,
}

impl Reason {
    /// Every reason, in the metrics' order.
    pub const ALL: [Reason; 9] = [
        Reason::PrefixMatch,
        Reason::TenantHot,
        Reason::AffinityHint,
        Reason::NoHint,
        Reason::PolicyRequiresChain,
        Reason::Timeout,
        Reason::UnknownTenant,
        Reason::UnknownModel,
        Reason::UnknownHashScheme,
    ];

    /// `RenderTemplate`'s success code (not a LookupRoute reason).
    pub const OK: &'static str = "OK";

    /// The wire reason code.
    pub const fn code(self) -> &'static str {
        match self {
            Reason::PrefixMatch => "PREFIX_MATCH",
            Reason::TenantHot => "TENANT_HOT",
            Reason::AffinityHint => "AFFINITY_HINT",
            Reason::NoHint => "NO_HINT",
            Reason::PolicyRequiresChain => "POLICY_REQUIRES_CHAIN",
            Reason::Timeout => "TIMEOUT",
            Reason::UnknownTenant => "UNKNOWN_TENANT",
            Reason::UnknownModel => "UNKNOWN_MODEL",
            Reason::UnknownHashScheme => "UNKNOWN_HASH_SCHEME",
        }
    }

    /// The reason a wire code names, if it is one of ours.
    pub fn from_code(code: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.code() == code)
    }

    /// Position in [`Reason::ALL`] (the metrics' counter slot).
    pub const fn slot(self) -> usize {
        self as usize
    }

    /// The reason for an index answer of this kind.
    pub const fn from_strategy(strategy: Strategy) -> Reason {
        match strategy {
            Strategy::None => Reason::NoHint,
            Strategy::PrefixMatch => Reason::PrefixMatch,
            Strategy::TenantHot => Reason::TenantHot,
            Strategy::UnknownTenant => Reason::UnknownTenant,
            Strategy::UnknownModel => Reason::UnknownModel,
            Strategy::UnknownHashScheme => Reason::UnknownHashScheme,
        }
    }
}

/// One prefix ref, borrowed, with the chain arrays the caller chose (the whole chain, or the
/// part the limits keep).
pub fn prefix_ref<'u>(
    entry: &'u pb::PrefixEntry,
    block_hashes: &'u [Vec<u8>],
    block_token_counts: &'u [i32],
) -> PrefixRef<'u, Vec<u8>> {
    PrefixRef {
        prefix_hash: &entry.prefix_hash,
        token_count: entry.token_count,
        block_hashes,
        block_token_counts,
        tier: entry.tier,
        adapter_id: &entry.adapter_id,
    }
}

/// The engine's borrowed update for `update`, with `prefixes` as its holdings.
pub fn update_with<'u, I>(update: &'u pb::CacheStateUpdate, prefixes: I) -> CacheStateUpdate<'u, I>
where
    I: Iterator<Item = PrefixRef<'u, Vec<u8>>>,
{
    CacheStateUpdate {
        replica_id: &update.replica_id,
        model_id: &update.model_id,
        tenant_id: &update.tenant_id,
        hash_scheme: &update.hash_scheme,
        timestamp_us: update.timestamp_us,
        adapter_id: &update.adapter_id,
        prefixes,
        stats: update.stats.as_ref().map(|s| ReplicaStatsInput {
            cache_memory_bytes: s.cache_memory_bytes,
            hit_rate: s.hit_rate,
            pressure: s.pressure,
            t2_hit_tokens: s.t2_hit_tokens,
            t2_query_tokens: s.t2_query_tokens,
        }),
    }
}

/// Applies one `CacheStateUpdate` as it is (K3–K14); the reserved tenant is skipped silently.
pub fn ingest(index: &Index, update: &pb::CacheStateUpdate) {
    if update.tenant_id == PROBE_TENANT {
        return;
    }
    index.ingest(update_with(
        update,
        update
            .prefixes
            .iter()
            .map(|p| prefix_ref(p, &p.block_hashes, &p.block_token_counts)),
    ));
}

/// Applies one `CacheEvent` (E1–E7); the reserved tenant is skipped silently (§8.3).
pub fn apply_event(index: &Index, event: &pb::CacheEvent) {
    if event.tenant_id == PROBE_TENANT {
        return;
    }
    index.apply_event(CacheEventInput {
        event_type: event.r#type,
        replica_id: &event.replica_id,
        model_id: &event.model_id,
        tenant_id: &event.tenant_id,
        prefix_hash: &event.prefix_hash,
        timestamp_us: event.timestamp_us,
        adapter_id: &event.adapter_id,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_strategy_has_its_reason_code() {
        for (strategy, code) in [
            (Strategy::None, "NO_HINT"),
            (Strategy::PrefixMatch, "PREFIX_MATCH"),
            (Strategy::TenantHot, "TENANT_HOT"),
            (Strategy::UnknownTenant, "UNKNOWN_TENANT"),
            (Strategy::UnknownModel, "UNKNOWN_MODEL"),
            (Strategy::UnknownHashScheme, "UNKNOWN_HASH_SCHEME"),
        ] {
            assert_eq!(Reason::from_strategy(strategy).code(), code);
            assert_eq!(strategy.reason_code(), code, "the engine's own name agrees");
        }
    }

    #[test]
    fn codes_round_trip_and_slots_follow_the_list() {
        for (slot, reason) in Reason::ALL.into_iter().enumerate() {
            assert_eq!(reason.slot(), slot);
            assert_eq!(Reason::from_code(reason.code()), Some(reason));
        }
        assert_eq!(Reason::from_code("OK"), None);
    }
}
