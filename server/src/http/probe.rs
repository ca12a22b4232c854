//! The synthetic probe (`POST /probe`, §12.4): its strict request decoding, the reserved-tenant
//! key it writes, the per-model serialization of runs and the stages it reports. The route
//! itself (auth, method, body) is in `control.rs`.

use super::json::write_json_str;
use crate::translate::Reason;
use inferencecache_engine::{
    CacheEventInput, CacheStateUpdate, Index, LookupRequest, PROBE_TENANT, PrefixRef,
    ReplicaStatsInput, Strategy, event_type,
};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// Largest accepted `/probe` body.
pub const MAX_PROBE_BYTES: usize = 4 * 1024;

/// Tokens in the probe's single block.
pub const PROBE_BLOCK_TOKENS: i32 = 16;

/// Backend type assumed when the probe request has none.
pub const DEFAULT_BACKEND_TYPE: &str = "LMCache";

/// Optional offload-tier (T2) prober used by the probe's `t2` stage. None ships with the product;
/// tests inject doubles.
pub trait T2Prober: Send + Sync {
    /// Stores `payload` under `key` on the backend.
    fn put(&self, backend: &str, model: &str, key: &[u8], payload: &[u8]) -> Result<(), String>;
    /// Reads back the payload stored under `key`.
    fn get(&self, backend: &str, model: &str, key: &[u8]) -> Result<Vec<u8>, String>;
}

/// A `/probe` request body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    pub backend: String,
    pub model: String,
    #[serde(rename = "hashScheme")]
    pub hash_scheme: String,
    #[serde(rename = "backendType", default)]
    pub backend_type: Option<String>,
}

/// Strict decode: one JSON object, known keys only, the three required strings non-empty.
pub fn decode_probe(body: &[u8]) -> Result<ProbeRequest, String> {
    if body.len() > MAX_PROBE_BYTES {
        return Err("request body exceeds 4 KiB".into());
    }
    // A JSON array would decode positionally into the struct; strict decode wants an object.
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    if !value.is_object() {
        return Err("the body must be a JSON object".into());
    }
    let req: ProbeRequest = serde_json::from_value(value).map_err(|e| e.to_string())?;
    for (name, value) in [
        ("backend", &req.backend),
        ("model", &req.model),
        ("hashScheme", &req.hash_scheme),
    ] {
        if value.is_empty() {
            return Err(format!("{name} must be non-empty"));
        }
    }
    Ok(req)
}

/// `SHA-256("inferencecache.io/probe/v1\n" ‖ f(hashScheme) ‖ f(model) ‖ f(backend))` with
/// `f(s) = u32_be(len(s)) ‖ s`.
pub fn probe_hash(hash_scheme: &str, model: &str, backend: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"inferencecache.io/probe/v1\n");
    for s in [hash_scheme, model, backend] {
        h.update((s.len() as u32).to_be_bytes());
        h.update(s.as_bytes());
    }
    h.finalize().into()
}

/// The probe's replica id for `backend`.
pub fn probe_replica(backend: &str) -> String {
    format!("__probe-{backend}")
}

/// Result of one probe stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageResult {
    Ok,
    Failed,
    Skipped,
}

impl StageResult {
    pub fn as_str(self) -> &'static str {
        match self {
            StageResult::Ok => "ok",
            StageResult::Failed => "failed",
            StageResult::Skipped => "skipped",
        }
    }
}

/// Outcome of a probe run (the `/probe` response).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    pub backend: String,
    pub ingest: StageResult,
    pub routing: StageResult,
    pub t2: StageResult,
    /// `(stage, message)` in stage order.
    pub errors: Vec<(&'static str, String)>,
}

impl ProbeReport {
    /// Every stage `ok` or `skipped`.
    pub fn passed(&self) -> bool {
        [self.ingest, self.routing, self.t2]
            .iter()
            .all(|s| *s != StageResult::Failed)
    }

    /// `{"backend":…,"ingest":…,"routing":…,"t2":…,"errors":[…]}` + `\n`; `errors` omitted when
    /// empty.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(128);
        out.push_str("{\"backend\":");
        write_json_str(&mut out, &self.backend);
        let _ = write!(
            out,
            ",\"ingest\":\"{}\",\"routing\":\"{}\",\"t2\":\"{}\"",
            self.ingest.as_str(),
            self.routing.as_str(),
            self.t2.as_str()
        );
        if !self.errors.is_empty() {
            out.push_str(",\"errors\":[");
            for (i, (stage, message)) in self.errors.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str("{\"stage\":");
                write_json_str(&mut out, stage);
                out.push_str(",\"message\":");
                write_json_str(&mut out, message);
                out.push('}');
            }
            out.push(']');
        }
        out.push_str("}\n");
        out
    }
}

type ModelLock = Arc<tokio::sync::Mutex<()>>;

/// Serializes probe runs per model, across backends (§12.4 asks for per-(backend, model)
/// serialization; this is stricter on purpose).
///
/// Runs for different backends of one model write the same reserved-tenant partition, and the
/// index publishes a new partition in its directory before adding it to the model's partition
/// list, which is what a run's cleanup (ALL_CLEARED) walks. Two such runs in parallel on a new
/// partition could leave the second one's entry behind: it found the partition, ingested, and
/// cleared before the partition was listed
/// (`control_plane.rs::unserialized_probe_runs_of_one_model_race_on_partition_creation`).
/// Within one model the runs are sequential, so each run's partition is listed before its
/// own cleanup; runs of different models never share a partition, and nothing else writes the
/// reserved tenant (ingest and events drop it). A run is a few microseconds without a T2
/// prober, so the serialization costs nothing noticeable.
#[derive(Default)]
pub struct ProbeLocks {
    locks: parking_lot::Mutex<HashMap<String, ModelLock>>,
}

/// A model's lock taken from [`ProbeLocks`]; its map entry goes when the last user drops it
/// (also when a waiting request is cancelled).
struct ModelLockRef<'l> {
    locks: &'l ProbeLocks,
    model: &'l str,
    lock: ModelLock,
}

impl Drop for ModelLockRef<'_> {
    fn drop(&mut self) {
        let mut map = self.locks.locks.lock();
        // One reference in the map, this one: no other run of the model is pending (others
        // clone under the map's lock, which is held here).
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(self.model);
        }
    }
}

impl ProbeLocks {
    /// Runs the probe of `req` once no other run of the same model is in progress.
    pub async fn run(
        &self,
        index: &Index,
        req: &ProbeRequest,
        t2: Option<&dyn T2Prober>,
    ) -> ProbeReport {
        let entry = ModelLockRef {
            locks: self,
            model: &req.model,
            lock: self
                .locks
                .lock()
                .entry(req.model.clone())
                .or_default()
                .clone(),
        };
        // Declared after `entry`, so released before it.
        let _guard = entry.lock.lock().await;
        run_probe(index, req, t2)
    }
}

/// Runs the probe stages against `index` (§12.4). Callers serialize runs per model
/// ([`ProbeLocks::run`]).
pub fn run_probe(index: &Index, req: &ProbeRequest, t2: Option<&dyn T2Prober>) -> ProbeReport {
    let model = req.model.as_str();
    let scheme = req.hash_scheme.as_str();
    let replica = probe_replica(&req.backend);
    let hash = probe_hash(scheme, model, &req.backend);
    let hashes = [hash];
    let counts = [PROBE_BLOCK_TOKENS];
    let mut report = ProbeReport {
        backend: req.backend.clone(),
        ingest: StageResult::Ok,
        routing: StageResult::Skipped,
        t2: StageResult::Skipped,
        errors: Vec::new(),
    };

    // ingest: directly into the index under the reserved tenant, timestamp now (0).
    index.ingest(CacheStateUpdate {
        replica_id: &replica,
        model_id: model,
        tenant_id: PROBE_TENANT,
        hash_scheme: scheme,
        timestamp_us: 0,
        adapter_id: "",
        prefixes: std::iter::once(PrefixRef {
            prefix_hash: &[],
            token_count: PROBE_BLOCK_TOKENS,
            block_hashes: &hashes[..],
            block_token_counts: &counts[..],
            tier: 0,
            adapter_id: "",
        }),
        stats: Some(ReplicaStatsInput {
            hit_rate: 1.0,
            ..Default::default()
        }),
    });
    let request = LookupRequest {
        block_hashes: &hashes[..],
        block_token_counts: &counts[..],
        ..LookupRequest::new(PROBE_TENANT, model, scheme)
    };
    let held = index
        .lookup(&request)
        .iter()
        .any(|s| *s.replica_id == *replica);
    if !held {
        report.ingest = StageResult::Failed;
        report.errors.push((
            "ingest",
            format!("probe prefix not found on replica {replica} after ingest"),
        ));
    } else {
        // routing: the index's LookupRoute (no floors, no timeouts, nothing credited).
        let route = index.lookup_route(&request);
        if route.strategy != Strategy::PrefixMatch {
            report.routing = StageResult::Failed;
            report.errors.push((
                "routing",
                format!(
                    "LookupRoute returned {}, expected {}",
                    Reason::from_strategy(route.strategy).code(),
                    Reason::PrefixMatch.code()
                ),
            ));
        } else if !route.scores.iter().any(|s| *s.replica_id == *replica) {
            report.routing = StageResult::Failed;
            report.errors.push((
                "routing",
                format!("LookupRoute returned PREFIX_MATCH without the expected replica {replica}"),
            ));
        } else {
            report.routing = StageResult::Ok;
            let backend_type = req.backend_type.as_deref().unwrap_or("");
            let lmcache = backend_type.is_empty() || backend_type == DEFAULT_BACKEND_TYPE;
            if let (true, Some(prober)) = (lmcache, t2) {
                match t2_cycle(prober, &req.backend, model, &hash) {
                    Ok(()) => report.t2 = StageResult::Ok,
                    Err(e) => {
                        report.t2 = StageResult::Failed;
                        report
                            .errors
                            .push(("t2", format!("T2 put/get cycle failed: {e}")));
                    }
                }
            }
        }
    }

    // cleanup (always): no probe state remains.
    index.apply_event(CacheEventInput {
        event_type: event_type::ALL_CLEARED,
        replica_id: &replica,
        model_id: model,
        tenant_id: PROBE_TENANT,
        prefix_hash: &[],
        timestamp_us: 0,
        adapter_id: "",
    });
    report
}

fn t2_cycle(prober: &dyn T2Prober, backend: &str, model: &str, hash: &[u8]) -> Result<(), String> {
    let mut payload = b"probe-payload-v1\n".to_vec();
    payload.extend_from_slice(hash);
    prober
        .put(backend, model, hash, &payload)
        .map_err(|e| format!("put failed: {e}"))?;
    let got = prober
        .get(backend, model, hash)
        .map_err(|e| format!("get failed: {e}"))?;
    if got != payload {
        return Err("get failed: payload mismatch".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_hash_layout() {
        let mut manual = Vec::new();
        manual.extend_from_slice(b"inferencecache.io/probe/v1\n");
        for s in ["vllm", "m", "b1"] {
            manual.extend_from_slice(&(s.len() as u32).to_be_bytes());
            manual.extend_from_slice(s.as_bytes());
        }
        let expected: [u8; 32] = Sha256::digest(&manual).into();
        assert_eq!(probe_hash("vllm", "m", "b1"), expected);
        assert_ne!(probe_hash("vllm", "m", "b1"), probe_hash("vllm", "mb", "1"));
    }

    #[test]
    fn probe_bodies_are_strict() {
        let ok = br#"{"backend":"b","model":"m","hashScheme":"vllm"}"#;
        assert!(decode_probe(ok).is_ok());
        assert!(
            decode_probe(b" {\"backend\":\"b\",\"model\":\"m\",\"hashScheme\":\"v\"}\n").is_ok()
        );
        for bad in [
            &b"{"[..],
            br#"{"backend":"b","model":"m"}"#,
            br#"{"backend":"","model":"m","hashScheme":"v"}"#,
            br#"{"backend":"b","model":"m","hashScheme":"v","tenant":"t"}"#,
            br#"{"backend":"b","model":"m","hashScheme":"v"}{}"#,
            br#"{"backend":"b","model":"m","hashScheme":"v"}]"#,
            br#"{"backend":"b","model":"m","hashScheme":"v"}xyz"#,
            br#"{"backend":null,"model":"m","hashScheme":"v"}"#,
            br#"[]"#,
        ] {
            assert!(
                decode_probe(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let big = format!(
            r#"{{"backend":"{}","model":"m","hashScheme":"v"}}"#,
            "x".repeat(MAX_PROBE_BYTES)
        );
        assert!(decode_probe(big.as_bytes()).is_err());
    }

    #[test]
    fn probe_report_json() {
        let mut r = ProbeReport {
            backend: "b".into(),
            ingest: StageResult::Ok,
            routing: StageResult::Ok,
            t2: StageResult::Skipped,
            errors: Vec::new(),
        };
        assert!(r.passed());
        assert_eq!(
            r.to_json(),
            "{\"backend\":\"b\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}\n"
        );
        r.routing = StageResult::Failed;
        r.errors.push(("routing", "x".into()));
        assert!(!r.passed());
        assert!(
            r.to_json()
                .ends_with(",\"errors\":[{\"stage\":\"routing\",\"message\":\"x\"}]}\n")
        );
    }
}
