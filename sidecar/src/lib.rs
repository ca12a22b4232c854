//! The observation sidecar (spec `sidecar.md`): engine KV events over ZMQ become
//! `ReportCacheState` updates and `PublishEvent` calls; the engine's Prometheus `/metrics`
//! become stats-only updates.
//!
//! Modules follow the pipeline: [`subscriber`] (ZMQ) → [`wire`] (msgpack) → [`reporter`]
//! (positional hashing via [`positional`], adapters via [`lora`]) → [`client`] (gRPC), and
//! [`metrics`] + [`stats`] for the stats path. [`fake_engine`] is the test publisher.

pub mod app;
pub mod client;
pub mod config;
pub mod fake_engine;
pub mod lora;
pub mod metrics;
pub mod positional;
pub mod reporter;
pub mod stats;
pub mod subscriber;
pub mod wire;
