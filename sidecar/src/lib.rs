//! The observation sidecar (spec `sidecar.md`): engine KV events over ZMQ become
//! `ReportCacheState` updates and `PublishEvent` calls; the engine's Prometheus `/metrics`
//! become stats-only updates.
//!
//! Modules follow the pipeline: [`subscriber`] (ZMQ, with [`sequence`] tracking and the
//! engine's [`replay`] socket) → [`wire`] (msgpack) → [`reporter`] (positional hashing via
//! [`positional`] with vLLM's per-group hit rule from [`groups`], tiers via [`tier`], adapters
//! via [`lora`]) → [`client`] (gRPC, through the in-order outbox and the reconcile of [`link`]),
//! and
//! [`metrics`] + [`stats`] (through [`scrape_client`]) for the stats path. [`telemetry`] counts, [`exporter`] serves the
//! counters, [`logging`] formats logs. [`fake_engine`] is the test publisher.

pub mod app;
pub mod client;
pub mod config;
pub mod exporter;
pub mod fake_engine;
pub mod groups;
pub mod link;
pub use inferencecache_logging as logging;
pub mod lora;
pub mod metrics;
pub mod positional;
pub mod replay;
pub mod reporter;
pub mod scrape_client;
pub mod sequence;
pub mod stats;
pub mod subscriber;
pub mod telemetry;
pub mod tier;
pub mod wire;
