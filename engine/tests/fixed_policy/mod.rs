//! A [`Resolvers`] that gives every tenant the same answers: one eviction algorithm, one optional
//! TTL and one optional quota. The engine tests, the loom models and the benches all need exactly
//! this, so it lives once here and the other crates include this file with `#[path = ...]` (as
//! the fuzz harness does with the reference model) instead of each carrying a copy.
// Each includer uses a different subset of the constructors.
#![allow(dead_code)]

use inferencecache_engine::{Algorithm, Resolvers};

/// The same policy for every tenant.
#[derive(Debug, Clone, Copy)]
pub struct FixedPolicy {
    /// Eviction algorithm of every tenant.
    pub alg: Algorithm,
    /// Tenant TTL override; `None` = the global TTL.
    pub ttl_ms: Option<i64>,
    /// Tenant quota in distinct keys; `None` = unbounded.
    pub quota: Option<i64>,
}

impl FixedPolicy {
    /// LFU if `lfu`, else LRU; no TTL override, no quota.
    pub fn lru_or_lfu(lfu: bool) -> Self {
        Self {
            alg: if lfu { Algorithm::Lfu } else { Algorithm::Lru },
            ttl_ms: None,
            quota: None,
        }
    }
}

impl Resolvers for FixedPolicy {
    fn ttl_ms(&self, _: &str) -> Option<i64> {
        self.ttl_ms
    }
    fn algorithm(&self, _: &str) -> Algorithm {
        self.alg
    }
    fn quota(&self, _: &str) -> Option<i64> {
        self.quota
    }
}
