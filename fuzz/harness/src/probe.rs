//! `probe_body`: bytes → the `/probe` request decoding and, when it decodes, the probe run
//! itself (server.md §12.4) against the seeded index.

use crate::fixture;
use inferencecache_server::http::probe::{
    MAX_PROBE_BYTES, ProbeReport, StageResult, decode_probe, run_probe,
};
use inferencecache_server::state::AppState;
use std::sync::OnceLock;

/// Decodes `data` as a `/probe` body; an accepted request must pass the probe (ingest ok,
/// routing ok, t2 skipped without a prober), report valid JSON and leave no probe state behind.
pub fn probe_body(data: &[u8]) {
    let req = match decode_probe(data) {
        Ok(req) => req,
        Err(message) => {
            assert!(!message.is_empty(), "a refusal without a message");
            return;
        }
    };
    // §12.4: at most 4 KiB, the three required strings non-empty.
    assert!(data.len() <= MAX_PROBE_BYTES);
    assert!(!req.backend.is_empty() && !req.model.is_empty() && !req.hash_scheme.is_empty());

    let state = shared_state();
    let index = state.index();
    let before = (
        index.total_keys(),
        index.storage_entries(),
        index.reserved_storage_entries(),
        index.snapshot(),
    );
    let report = run_probe(index, &req, None);
    assert_eq!(
        report,
        ProbeReport {
            backend: req.backend.clone(),
            ingest: StageResult::Ok,
            routing: StageResult::Ok,
            t2: StageResult::Skipped,
            errors: Vec::new(),
        },
        "the probe failed for {req:?}"
    );
    assert!(report.passed());
    // The response body is one JSON object naming the backend.
    let body: serde_json::Value =
        serde_json::from_str(&report.to_json()).expect("the probe report is JSON");
    assert_eq!(body["backend"].as_str(), Some(req.backend.as_str()));
    assert_eq!(
        (
            body["ingest"].as_str(),
            body["routing"].as_str(),
            body["t2"].as_str()
        ),
        (Some("ok"), Some("ok"), Some("skipped"))
    );
    assert!(
        body.get("errors").is_none(),
        "errors listed for a passing probe"
    );
    // cleanup: afterwards the index holds no probe state, and nothing else moved.
    let after = (
        index.total_keys(),
        index.storage_entries(),
        index.reserved_storage_entries(),
        index.snapshot(),
    );
    assert_eq!(after, before, "the probe left state behind");
}

fn shared_state() -> &'static AppState {
    static STATE: OnceLock<AppState> = OnceLock::new();
    STATE.get_or_init(fixture::new_state)
}
