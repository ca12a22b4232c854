//! W1M benchmark harness (`benchmarks.md`): the bit-exact workload generator ([`w1m`]), the
//! measurement method ([`measure`]), InferenceCache's side of the bench ([`ours`]) and the
//! multi-process report ([`report`]), machine notes for reports ([`host`]), plus the `ic-loadgen` gRPC load generator ([`loadgen`]).
//! The peers live in `bench/peers` (outside the workspace).

// The same fixed-policy `Resolvers` as the engine tests and loom models (one copy, see there).
#[path = "../../engine/tests/fixed_policy/mod.rs"]
pub mod fixed_policy;
pub mod fleet;
pub mod host;
pub mod loadgen;
pub mod measure;
pub mod mooncake;
pub mod mooncake_bench;
pub mod mooncake_ours;
pub mod ours;
pub mod progress;
pub mod report;
pub mod w1m;
