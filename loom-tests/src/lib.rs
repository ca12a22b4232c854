//! Loom model checks of the InferenceCache engine's concurrent protocols.
//!
//! The models live in `tests/models.rs` and only exist in a `--cfg loom --cfg crossbeam_loom`
//! build; see `README.md` and `run.sh`. A normal build of this crate is empty.
