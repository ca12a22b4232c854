//! The optional TOML configuration file (`--config`, spec `server.md` §2, D1).
//!
//! Precedence: command-line flags, then this file, then built-in defaults. The policy part
//! (`[policy.default]`, `[[policy.namespaces]]`, `[[tenants]]`) forms the file layer of the
//! [`PolicyStore`]; it is reloaded when the file changes. Every other key needs a restart.
//! Unknown keys, type errors and invalid values are errors (exit 2 at startup; ignored with an
//! ERROR log on reload).

use crate::policy::{Layer, Policy, PolicyEntry, PolicyStore, StrategyEntry, resolve_entry};
use anyhow::{Context, bail};
use inferencecache_cli_flags::parse_duration;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tracing::{error, info, warn};

/// The whole file. Field names are the TOML keys.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub grpc_bind_address: Option<String>,
    pub http_bind_address: Option<String>,
    pub snapshot_bind_address: Option<String>,
    pub engine_block_size: Option<i64>,
    pub tokenizer_models_dir: Option<String>,
    pub log_format: Option<String>,
    pub log_level: Option<String>,
    pub insecure_disable_auth: Option<bool>,
    #[serde(default)]
    pub tls: TlsSection,
    #[serde(default)]
    pub auth: AuthSection,
    #[serde(default)]
    pub index: IndexSection,
    #[serde(default)]
    pub streams: StreamsSection,
    #[serde(default)]
    pub limits: LimitsSection,
    #[serde(default)]
    pub state: StateSection,
    #[serde(default)]
    pub replication: ReplicationSection,
    #[serde(default)]
    pub policy: PolicySection,
    #[serde(default)]
    pub tenants: Vec<TenantToml>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    pub client_ca_file: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AuthSection {
    pub controller_token_file: Option<String>,
    pub policy_token_file: Option<String>,
    pub producer_token_file: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IndexSection {
    pub max_entries: Option<i64>,
    pub ttl: Option<String>,
    pub sweep_interval: Option<String>,
    pub hot_access_threshold: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StreamsSection {
    pub buffer_events: Option<i64>,
    pub max_subscribers: Option<i64>,
}

/// `[state]`: warm-restart checkpoints (same names as the flags).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StateSection {
    pub dir: Option<String>,
    pub checkpoint_interval: Option<String>,
}

/// `[replication]`: replicated mode over NATS JetStream (the `--nats-*` flags without the
/// prefix: `url`, `stream`, ...; docs/scale-out.md).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReplicationSection {
    pub url: Option<String>,
    pub stream: Option<String>,
    pub creds_file: Option<String>,
    pub token_file: Option<String>,
    pub tls_ca_file: Option<String>,
    pub buffer: Option<u64>,
    pub max_age: Option<String>,
    pub max_bytes: Option<u64>,
    pub server_id: Option<String>,
}

/// `[limits]`: the memory and rate limits (same names as the flags; `docs/robustness.md`).
/// Negative values are type errors (exit 2).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    pub max_chain_length: Option<u64>,
    pub max_hash_bytes: Option<u64>,
    pub max_id_bytes: Option<u64>,
    pub max_prefixes_per_update: Option<u64>,
    pub max_message_bytes: Option<u64>,
    pub producer_max_blocks_per_sec: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicySection {
    pub default: Option<PolicyToml>,
    #[serde(default)]
    pub namespaces: Vec<PolicyToml>,
}

/// A duration as a string (`"10m"`) or integer nanoseconds.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum DurationValue {
    Nanos(i64),
    Text(String),
}

/// A policy entry in TOML. Keys are snake_case; the camelCase `/policy` names (D1's original
/// TOML spelling) are accepted as aliases, so files written for either keep loading. Giving
/// both spellings of one key is a duplicate-key error. `eviction_ttl` also accepts a duration.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicyToml {
    #[serde(default)]
    pub namespace: String,
    #[serde(alias = "evictionTTL")]
    pub eviction_ttl: Option<DurationValue>,
    #[serde(alias = "minimumPrefixTokens")]
    pub minimum_prefix_tokens: Option<i32>,
    #[serde(alias = "minimumMatchedTokens")]
    pub minimum_matched_tokens: Option<i32>,
    #[serde(alias = "routingFloorScore")]
    pub routing_floor_score: Option<f32>,
    #[serde(alias = "lookupTimeoutMs")]
    pub lookup_timeout_ms: Option<i32>,
    #[serde(alias = "affinityRouting")]
    pub affinity_routing: Option<bool>,
    pub eviction: Option<String>,
    pub strategy: Option<StrategyToml>,
}

/// The `strategy` table of a TOML policy entry (snake_case, camelCase aliases).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StrategyToml {
    #[serde(alias = "enableChainMatching")]
    pub enable_chain_matching: Option<bool>,
    #[serde(alias = "requireChain")]
    pub require_chain: Option<bool>,
    #[serde(alias = "enableTenantHot")]
    pub enable_tenant_hot: Option<bool>,
}

/// A tenant quota entry in TOML (snake_case, the `/policy` camelCase names as aliases).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantToml {
    #[serde(alias = "tenantID", default)]
    pub tenant_id: String,
    #[serde(alias = "maxIndexEntries")]
    pub max_index_entries: Option<i64>,
    #[serde(alias = "isolationMode")]
    pub isolation_mode: Option<String>,
}

impl PolicyToml {
    fn to_entry(&self) -> anyhow::Result<PolicyEntry> {
        let eviction_ttl = match &self.eviction_ttl {
            None => None,
            Some(DurationValue::Nanos(n)) => Some(*n),
            Some(DurationValue::Text(s)) => Some(
                parse_duration(s)
                    .with_context(|| format!("invalid eviction_ttl {s:?}"))?
                    .positive()
                    .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
            ),
        };
        Ok(PolicyEntry {
            namespace: self.namespace.clone(),
            eviction_ttl,
            minimum_prefix_tokens: self.minimum_prefix_tokens,
            minimum_matched_tokens: self.minimum_matched_tokens,
            routing_floor_score: self.routing_floor_score,
            lookup_timeout_ms: self.lookup_timeout_ms,
            affinity_routing: self.affinity_routing,
            eviction: self.eviction.clone(),
            strategy: self.strategy.as_ref().map(|s| StrategyEntry {
                enable_chain_matching: s.enable_chain_matching,
                require_chain: s.require_chain,
                enable_tenant_hot: s.enable_tenant_hot,
            }),
        })
    }
}

impl ConfigFile {
    /// Reads and validates the file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read config {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("invalid config {}", path.display()))
    }

    /// Parses and validates file contents.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: ConfigFile = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        file.validate()?;
        Ok(file)
    }

    fn validate(&self) -> anyhow::Result<()> {
        for (key, value) in [
            ("index.ttl", &self.index.ttl),
            ("index.sweep_interval", &self.index.sweep_interval),
            ("state.checkpoint_interval", &self.state.checkpoint_interval),
            ("replication.max_age", &self.replication.max_age),
        ] {
            if let Some(v) = value {
                parse_duration(v).with_context(|| format!("invalid {key}"))?;
            }
        }
        if let Some(t) = self.index.hot_access_threshold
            && t < 1
        {
            bail!("index.hot_access_threshold must be at least 1, got {t}");
        }
        for (key, value) in [
            ("streams.buffer_events", self.streams.buffer_events),
            ("streams.max_subscribers", self.streams.max_subscribers),
        ] {
            if let Some(v) = value
                && v < 1
            {
                bail!("{key} must be at least 1, got {v}");
            }
        }
        if self.limits.max_message_bytes == Some(0) {
            bail!("limits.max_message_bytes must be at least 1");
        }
        self.policy_layer().map(|_| ())
    }

    /// The file layer of the policy store (§6.2): namespace entries inherit absent keys from
    /// `[policy.default]`, then from the built-in "no policy" values.
    pub fn policy_layer(&self) -> anyhow::Result<Layer> {
        let base = match &self.policy.default {
            Some(d) => resolve_entry(&d.to_entry().context("[policy.default]")?, &Policy::NONE),
            None => Policy::NONE,
        };
        let mut layer = Layer {
            default: self.policy.default.as_ref().map(|_| Arc::new(base.clone())),
            ..Default::default()
        };
        for ns in &self.policy.namespaces {
            if ns.namespace.is_empty() {
                continue;
            }
            let entry = ns
                .to_entry()
                .with_context(|| format!("[[policy.namespaces]] {:?}", ns.namespace))?;
            layer
                .namespaces
                .insert(ns.namespace.clone(), Arc::new(resolve_entry(&entry, &base)));
        }
        for t in &self.tenants {
            layer.insert_quota(&t.tenant_id, t.max_index_entries);
        }
        Ok(layer)
    }

    /// Keys outside the policy layer that differ between two versions (restart required).
    pub fn restart_keys(&self, other: &ConfigFile) -> Vec<&'static str> {
        let mut keys = Vec::new();
        macro_rules! cmp {
            ($($name:literal => $($field:ident).+),* $(,)?) => {
                $( if self.$($field).+ != other.$($field).+ { keys.push($name); } )*
            };
        }
        cmp!(
            "grpc_bind_address" => grpc_bind_address,
            "http_bind_address" => http_bind_address,
            "snapshot_bind_address" => snapshot_bind_address,
            "engine_block_size" => engine_block_size,
            "tokenizer_models_dir" => tokenizer_models_dir,
            "log_format" => log_format,
            "log_level" => log_level,
            "insecure_disable_auth" => insecure_disable_auth,
            "tls" => tls,
            "auth" => auth,
            "index" => index,
            "streams" => streams,
            "limits" => limits,
        );
        keys
    }
}

fn fingerprint(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Watches the file (mtime and size, polled every `period`) and swaps the policy file layer on
/// every valid change. Runs until the process exits.
pub fn spawn_reloader(
    path: PathBuf,
    mut current: ConfigFile,
    store: Arc<PolicyStore>,
    period: Duration,
) {
    tokio::spawn(async move {
        let mut seen = fingerprint(&path);
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let now = fingerprint(&path);
            if now == seen {
                continue;
            }
            seen = now;
            match ConfigFile::load(&path).and_then(|f| f.policy_layer().map(|layer| (f, layer))) {
                Ok((file, layer)) => {
                    store.replace_file(layer);
                    let keys = current.restart_keys(&file);
                    if !keys.is_empty() {
                        warn!(keys = ?keys, "config_change_requires_restart");
                    }
                    current = file;
                    info!(path = %path.display(), "config_reloaded");
                }
                Err(err) => {
                    error!(err = %format!("{err:#}"), path = %path.display(), "config_reload_failed")
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferencecache_engine::Algorithm;

    const EXAMPLE: &str = r#"
grpc_bind_address = ":9191"

[index]
max_entries = 5000
ttl = "10m"

[policy.default]
minimumMatchedTokens = 32
routingFloorScore = 0.2
eviction = "lru"

[[policy.namespaces]]
namespace = "team-a"
evictionTTL = "10m"
eviction = "lfu"
strategy = { requireChain = true }

[[policy.namespaces]]
namespace = "team-b"
evictionTTL = 5000000000

[[tenants]]
tenantID = "tenant-a"
maxIndexEntries = 100000
isolationMode = "Fairness"
"#;

    #[test]
    fn example_parses_and_inherits_from_the_default() {
        let file = ConfigFile::parse(EXAMPLE).unwrap();
        let layer = file.policy_layer().unwrap();
        let a = &layer.namespaces["team-a"];
        assert_eq!(a.eviction_ttl_ns, 600_000_000_000);
        assert_eq!(a.algorithm, Algorithm::Lfu);
        assert!(a.require_chain && a.enable_chain_matching);
        assert_eq!(
            a.minimum_matched_tokens, 32,
            "inherited from [policy.default]"
        );
        assert_eq!(a.routing_floor_score, 0.2);
        assert_eq!(layer.namespaces["team-b"].eviction_ttl_ns, 5_000_000_000);
        assert_eq!(layer.default.as_ref().unwrap().minimum_matched_tokens, 32);
        assert_eq!(layer.quotas["tenant-a"], 100_000);
    }

    #[test]
    fn file_layer_without_default_inherits_the_no_policy_values() {
        let file =
            ConfigFile::parse("[[policy.namespaces]]\nnamespace = \"x\"\nlookupTimeoutMs = 5\n")
                .unwrap();
        let layer = file.policy_layer().unwrap();
        assert_eq!(layer.namespaces["x"].minimum_matched_tokens, 64);
        assert_eq!(layer.namespaces["x"].lookup_timeout_ms, 5);
        assert!(layer.default.is_none());
    }

    #[test]
    fn unknown_keys_type_errors_and_bad_values_are_rejected() {
        for bad in [
            "bogus = 1",
            "[index]\nttl = 5",
            "[index]\nttl = \"5 parsecs\"",
            "[index]\nhot_access_threshold = 0",
            "[[policy.namespaces]]\nnamespace = \"a\"\nevictionTTL = \"forever\"",
            "[[policy.namespaces]]\nnamespace = \"a\"\nwhatever = true",
            "[streams]\nbuffer_events = 0",
            "[limits]\nmax_chain_length = -1",
            "[limits]\nmax_message_bytes = 0",
            "[limits]\nmax_hash = 5",
        ] {
            assert!(ConfigFile::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn snake_case_keys_and_camel_case_aliases_resolve_alike() {
        let snake = r#"
[policy.default]
minimum_matched_tokens = 32
routing_floor_score = 0.2

[[policy.namespaces]]
namespace = "team-a"
eviction_ttl = "10m"
minimum_prefix_tokens = 8
lookup_timeout_ms = 7
affinity_routing = false
eviction = "lfu"
strategy = { enable_chain_matching = true, require_chain = true, enable_tenant_hot = false }

[[tenants]]
tenant_id = "tenant-a"
max_index_entries = 100000
isolation_mode = "Fairness"
"#;
        let camel = r#"
[policy.default]
minimumMatchedTokens = 32
routingFloorScore = 0.2

[[policy.namespaces]]
namespace = "team-a"
evictionTTL = "10m"
minimumPrefixTokens = 8
lookupTimeoutMs = 7
affinityRouting = false
eviction = "lfu"
strategy = { enableChainMatching = true, requireChain = true, enableTenantHot = false }

[[tenants]]
tenantID = "tenant-a"
maxIndexEntries = 100000
isolationMode = "Fairness"
"#;
        let a = ConfigFile::parse(snake).unwrap();
        let b = ConfigFile::parse(camel).unwrap();
        assert_eq!(a, b, "the aliases decode to the same fields");
        let layer = a.policy_layer().unwrap();
        let p = &layer.namespaces["team-a"];
        assert_eq!(
            (
                p.eviction_ttl_ns,
                p.minimum_prefix_tokens,
                p.minimum_matched_tokens,
                p.lookup_timeout_ms,
                p.affinity_routing,
                p.algorithm,
                p.require_chain,
                p.enable_tenant_hot
            ),
            (
                600_000_000_000,
                8,
                32,
                7,
                false,
                Algorithm::Lfu,
                true,
                false
            )
        );
        assert_eq!(layer.quotas["tenant-a"], 100_000);
        for bad in [
            "[[policy.namespaces]]\nnamespace = \"a\"\nlookup_timeout_ms = 1\nlookupTimeoutMs = 2",
            "[[tenants]]\ntenant_id = \"t\"\ntenantID = \"u\"",
            "[[policy.namespaces]]\nnamespace = \"a\"\nstrategy = { requireChains = true }",
        ] {
            assert!(ConfigFile::parse(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn restart_keys_name_what_changed() {
        let a = ConfigFile::parse(EXAMPLE).unwrap();
        let mut b = a.clone();
        b.grpc_bind_address = Some(":1".into());
        b.policy.namespaces.clear();
        assert_eq!(a.restart_keys(&b), ["grpc_bind_address"]);
    }
}
