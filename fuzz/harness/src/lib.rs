//! Bodies of the fuzz targets in `fuzz/` (issue #9), one plain function per target.
//!
//! Each function takes the raw fuzzer input, runs it through the same code the product runs and
//! panics when a documented rule is broken. The cargo-fuzz targets (`fuzz/fuzz_targets/`) are
//! one-line wrappers, and `tests/replay_corpus.rs` replays the committed corpora through the same
//! functions with `cargo test`, so CI needs neither nightly nor libFuzzer.
//!
//! | target | input | checked against |
//! |---|---|---|
//! | [`lookup_route`] | protobuf `LookupRouteRequest` | contract §4.1/§5, server.md §7 |
//! | [`cache_state_update`] | protobuf `CacheStateUpdate` | index.md K3–K15, S2, server.md §8.2 |
//! | [`cache_event`] | protobuf `CacheEvent` | index.md E1–E7, server.md §8.3 |
//! | [`engine_ops`] | `arbitrary` operation sequence | the reference model (`engine/tests/model`) |
//! | [`policy_body`] | `/policy` JSON | server.md §6.4 |
//! | [`probe_body`] | `/probe` JSON | server.md §12.4 |
//! | [`sidecar_event`] | msgpack event batch | sidecar.md §4–§5 |
//! | [`checkpoint_file`] | a warm-restart checkpoint file | `engine::checkpoint::format` |

mod checkpoint;
mod engine_ops;
mod fixture;
mod ingest;
mod lookup;
mod policy;
mod probe;
pub mod seeds;
mod sidecar;

pub use checkpoint::{checkpoint_file, sample as checkpoint_sample};
pub use engine_ops::engine_ops;
pub use ingest::{cache_event, cache_state_update};
pub use lookup::lookup_route;
pub use policy::policy_body;
pub use probe::probe_body;
pub use sidecar::sidecar_event;

/// A target body: one fuzzer input in, a panic when a rule is broken.
pub type Target = fn(&[u8]);

/// Every target by the name of its `fuzz/fuzz_targets/<name>.rs` and corpus directory.
pub const TARGETS: [(&str, Target); 8] = [
    ("lookup_route", lookup_route),
    ("cache_state_update", cache_state_update),
    ("cache_event", cache_event),
    ("engine_ops", engine_ops),
    ("policy_body", policy_body),
    ("probe_body", probe_body),
    ("sidecar_event", sidecar_event),
    ("checkpoint_file", checkpoint_file),
];
