//! Index configuration and policy resolvers (index.md §0 Defaults, C4).

/// 30 minutes in ms: the default global TTL.
pub const DEFAULT_TTL_MS: i64 = 30 * 60 * 1000;
/// 60 s in ms: the default sweep interval.
pub const DEFAULT_SWEEP_INTERVAL_MS: i64 = 60 * 1000;
/// Default global cap (storage entries).
pub const DEFAULT_MAX_ENTRIES: i64 = 1_000_000;
/// Default hot access threshold (D4).
pub const DEFAULT_HOT_ACCESS_THRESHOLD: u32 = 8;
/// The reserved probe tenant (K15).
pub const PROBE_TENANT: &str = "inferencecache.io/probe";

/// Ranker constants (index.md §4). Fixed in the product; tests use other values (R8).
#[derive(Debug, Clone, PartialEq)]
pub struct RankerConfig {
    /// PressureWeight `W`.
    pub pressure_weight: f32,
    /// SLOTightTTFTMs.
    pub slo_tight_ttft_ms: i32,
    /// SLOTightBias.
    pub slo_tight_bias: f32,
    /// TenantHotMinHitRate (inclusive).
    pub tenant_hot_min_hit_rate: f32,
    /// TenantHotMaxAge in ms; ≤ 0 disables TENANT_HOT.
    pub tenant_hot_max_age_ms: i64,
}

impl Default for RankerConfig {
    fn default() -> Self {
        Self {
            pressure_weight: 1.0,
            slo_tight_ttft_ms: 200,
            slo_tight_bias: 1.0,
            tenant_hot_min_hit_rate: 0.1,
            tenant_hot_max_age_ms: 5 * 60 * 1000,
        }
    }
}

impl RankerConfig {
    /// The all-zero config of R8 (disables pressure, SLO bias and TENANT_HOT).
    pub fn zero() -> Self {
        Self {
            pressure_weight: 0.0,
            slo_tight_ttft_ms: 0,
            slo_tight_bias: 0.0,
            tenant_hot_min_hit_rate: 0.0,
            tenant_hot_max_age_ms: 0,
        }
    }
}

/// Index configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexConfig {
    /// Global TTL in ms; ≤ 0 is replaced by 30 min.
    pub global_ttl_ms: i64,
    /// Sweep interval in ms; ≤ 0 is replaced by 60 s.
    pub sweep_interval_ms: i64,
    /// Global cap in storage entries (≤ 0 = unbounded), enforced at the end of every ingest (V2).
    pub max_entries: i64,
    /// Hot access threshold (D4); 0 is treated as 1.
    pub hot_access_threshold: u32,
    /// Ranker constants.
    pub ranker: RankerConfig,
    /// Reserved tenants (K15); `""` is ignored.
    pub reserved_tenants: Vec<String>,
    /// Seed of the eviction sampler (V2, V5 approximate victim selection; T89 runs the
    /// acceptance scenarios under many seeds). Any value is valid; the default is 0.
    pub eviction_seed: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            global_ttl_ms: DEFAULT_TTL_MS,
            sweep_interval_ms: DEFAULT_SWEEP_INTERVAL_MS,
            max_entries: DEFAULT_MAX_ENTRIES,
            hot_access_threshold: DEFAULT_HOT_ACCESS_THRESHOLD,
            ranker: RankerConfig::default(),
            reserved_tenants: vec![PROBE_TENANT.to_string()],
            eviction_seed: 0,
        }
    }
}

impl IndexConfig {
    /// Applies the "≤ 0 → default" rules (T80).
    pub fn normalized(mut self) -> Self {
        if self.global_ttl_ms <= 0 {
            self.global_ttl_ms = DEFAULT_TTL_MS;
        }
        if self.sweep_interval_ms <= 0 {
            self.sweep_interval_ms = DEFAULT_SWEEP_INTERVAL_MS;
        }
        if self.hot_access_threshold == 0 {
            self.hot_access_threshold = 1;
        }
        self.reserved_tenants.retain(|t| !t.is_empty());
        self
    }
}

/// Eviction algorithm of a tenant's namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Least recently used (default).
    #[default]
    Lru,
    /// Least frequently used: lookups capture hits that the service credits (V3, V4).
    Lfu,
}

impl Algorithm {
    /// Metric label (`lru` / `lfu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Lru => "lru",
            Algorithm::Lfu => "lfu",
        }
    }
}

/// Per-tenant policy resolvers. Must be lock-free for readers (C4); the index calls them once per
/// operation (once per tenant per sweep).
pub trait Resolvers: Send + Sync {
    /// The tenant's TTL in ms; `None` or a value ≤ 0 means the global TTL (L7).
    fn ttl_ms(&self, tenant: &str) -> Option<i64>;
    /// The tenant's eviction algorithm.
    fn algorithm(&self, tenant: &str) -> Algorithm;
    /// The tenant's key quota in distinct keys (V5); `None` or a negative value = unbounded.
    fn quota(&self, tenant: &str) -> Option<i64>;
}

/// No per-tenant policy: global TTL, LRU, no quota.
#[derive(Debug, Default, Clone, Copy)]
pub struct DefaultResolvers;

impl Resolvers for DefaultResolvers {
    fn ttl_ms(&self, _tenant: &str) -> Option<i64> {
        None
    }
    fn algorithm(&self, _tenant: &str) -> Algorithm {
        Algorithm::Lru
    }
    fn quota(&self, _tenant: &str) -> Option<i64> {
        None
    }
}
