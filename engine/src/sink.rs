//! Change notifications (index.md §8, N1–N4).

/// Kind of an applied change (N1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    /// A new (key, replica) storage entry (wire `PREFIX_ADDED`).
    Added,
    /// A storage entry removed by PREFIX_EVICTED, TTL, cap or quota (wire `PREFIX_EVICTED`).
    Removed,
    /// ALL_CLEARED applied (wire `ALL_CLEARED`).
    Cleared,
    /// Stats replaced or refreshed (wire `REPLICA_UPDATED`).
    Stats,
}

/// One applied change. Borrowed: the sink copies what it keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChangeEvent<'a> {
    /// Kind.
    pub kind: ChangeKind,
    /// Tenant.
    pub tenant_id: &'a str,
    /// Model.
    pub model_id: &'a str,
    /// Replica.
    pub replica_id: &'a str,
    /// Key hash (empty for Cleared/Stats).
    pub prefix_hash: &'a [u8],
    /// Adapter partition of the entry (empty for Cleared/Stats).
    pub adapter_id: &'a str,
    /// Resolved timestamp (µs, never 0 unless the clock reads 0).
    pub timestamp_us: i64,
}

/// Receives applied changes. Must never block (N4): a full subscriber buffer drops.
pub trait ChangeSink: Send + Sync {
    /// Fast check: with no subscriber the index constructs no event at all (N4).
    fn is_active(&self) -> bool;
    /// Called by writers after a change was applied, in application order per entry (N3).
    fn publish(&self, event: &ChangeEvent<'_>);
}
