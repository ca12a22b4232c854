//! Replicated mode's decision log: the removals the deciding server's cap, quota and sweep
//! make, handed to whoever replicates them (see `replicate.rs`, `docs/scale-out.md`).

/// One entry the leader's cap, quota or sweep removed (reported to the decision log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decided<'a> {
    /// Tenant.
    pub tenant_id: &'a str,
    /// Model.
    pub model_id: &'a str,
    /// Hash scheme of the partition.
    pub hash_scheme: &'a str,
    /// Adapter of the partition.
    pub adapter_id: &'a str,
    /// Replica that held the entry.
    pub replica_id: &'a str,
    /// Key hash.
    pub key: &'a [u8],
    /// The entry's `last_seen` when it was removed (ms since the epoch).
    pub last_seen_ms: i64,
}

/// Receives the leader's eviction decisions. Called on the evicting thread, after the removal:
/// it must not block and must not call back into the index.
pub trait DecisionLog: Send + Sync {
    /// One removed entry.
    fn removed(&self, decided: &Decided<'_>);
}
