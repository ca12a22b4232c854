//! W1M benchmark harness (`benchmarks.md`): the bit-exact workload generator ([`w1m`]), the
//! measurement method ([`measure`]), InferenceCache's side of the bench ([`ours`]) and the
//! multi-process report ([`report`]), plus the `ic-loadgen` gRPC load generator ([`loadgen`]).
//! The peers live in `bench/peers` (outside the workspace).

pub mod loadgen;
pub mod measure;
pub mod ours;
pub mod report;
pub mod w1m;
