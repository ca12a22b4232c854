//! `lookup_route`: protobuf bytes → `LookupRouteRequest` → the gRPC handler (server.md §7).

use crate::fixture;
use inferencecache_engine::PROBE_TENANT;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCache;
use inferencecache_server::translate::Reason;
use prost::Message;

/// Decodes `data` as a `LookupRouteRequest`; if it decodes, calls the service's `LookupRoute`
/// on the seeded fixture twice and checks the answer against the contract.
pub fn lookup_route(data: &[u8]) {
    let Ok(req) = pb::LookupRouteRequest::decode(data) else {
        return;
    };
    let first = call(&req);
    check_contract(&req, &first);
    // L8: the lookup changed nothing a second lookup could see (the clock is frozen, and LFU
    // credit moves only access counts, which no score reads).
    let second = call(&req);
    assert_eq!(
        comparable(&first),
        comparable(&second),
        "the same lookup answered differently"
    );
}

fn call(req: &pb::LookupRouteRequest) -> pb::LookupRouteResponse {
    let service = fixture::shared_service();
    let result =
        fixture::runtime().block_on(service.lookup_route(tonic::Request::new(req.clone())));
    match result {
        Ok(response) => response.into_inner(),
        // Contract §5: a consumer RPC never turns request content into a gRPC error.
        Err(status) => panic!("LookupRoute returned a gRPC error: {status:?}"),
    }
}

/// One score with its floats as bits: (replica, score, matched, probability, tier).
type ScoreRow = (String, u32, i32, u32, i32);

/// The response without its latency, floats as bits.
fn comparable(r: &pb::LookupRouteResponse) -> (String, Vec<ScoreRow>, String) {
    (
        r.reason_code.clone(),
        r.replica_scores
            .iter()
            .map(|s| {
                (
                    s.replica_id.clone(),
                    s.score.to_bits(),
                    s.matched_tokens,
                    s.estimated_cache_hit_prob.to_bits(),
                    s.tier,
                )
            })
            .collect(),
        r.adapter_id.clone(),
    )
}

fn check_contract(req: &pb::LookupRouteRequest, resp: &pb::LookupRouteResponse) {
    let code = resp.reason_code.as_str();
    // Every reason code `LookupRoute` may emit (contract §4.1).
    let Some(reason) = Reason::from_code(code) else {
        panic!("unknown reason code {code:?}");
    };
    let scores = &resp.replica_scores;
    // Contract §4.1: how many scores each code carries.
    match reason {
        Reason::PrefixMatch | Reason::TenantHot => {
            assert!(!scores.is_empty(), "{code} without scores")
        }
        Reason::AffinityHint => {
            assert_eq!(scores.len(), 1, "AFFINITY_HINT carries exactly one replica");
            let s = &scores[0];
            // §7.5: all numeric fields 0, tier UNSPECIFIED.
            assert_eq!(
                (
                    s.score,
                    s.matched_tokens,
                    s.estimated_cache_hit_prob,
                    s.tier
                ),
                (0.0, 0, 0.0, 0),
                "AFFINITY_HINT with non-zero fields"
            );
        }
        _ => assert!(scores.is_empty(), "{code} with scores"),
    }
    for s in scores {
        assert!(!s.replica_id.is_empty(), "a score without a replica");
        assert!(!s.score.is_nan(), "NaN score");
        // The fixture stores only positive token counts and a chain run with matched ≤ 0 is
        // dropped (L4 step 4), so no emitted match is negative.
        assert!(
            s.matched_tokens >= 0,
            "negative matched_tokens {}",
            s.matched_tokens
        );
        // K6 index-to-wire: only T1–T3, anything else UNSPECIFIED.
        assert!(
            (0..=3).contains(&s.tier),
            "tier {} outside the enum",
            s.tier
        );
        assert!(
            (0.0..=1.0).contains(&s.estimated_cache_hit_prob),
            "probability {} outside [0, 1]",
            s.estimated_cache_hit_prob
        );
    }
    if reason == Reason::TenantHot {
        // R7: matched_tokens 0, tier UNSPECIFIED (§7.4).
        assert!(scores.iter().all(|s| s.matched_tokens == 0 && s.tier == 0));
    }
    if reason == Reason::PrefixMatch {
        // L3/L4: a prefix match is fresh (f > 0).
        assert!(scores.iter().all(|s| s.estimated_cache_hit_prob > 0.0));
    }
    // R5 / O2: score desc, then replica_id asc, no replica twice.
    for pair in scores.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let ordered = a.score > b.score || (a.score == b.score && a.replica_id < b.replica_id);
        assert!(
            ordered,
            "scores out of order: ({}, {}) before ({}, {})",
            a.replica_id, a.score, b.replica_id, b.score
        );
    }
    // §7.4: no tokenizer is configured, so nothing is ever echoed.
    assert!(
        resp.token_ids.is_empty(),
        "token_ids echoed without tokenizing"
    );
    // §7.4: adapter_id is the request's on answers built after the index was consulted, empty on
    // earlier envelopes.
    match reason {
        Reason::PrefixMatch
        | Reason::TenantHot
        | Reason::AffinityHint
        | Reason::UnknownTenant
        | Reason::UnknownModel
        | Reason::UnknownHashScheme => {
            assert_eq!(resp.adapter_id, req.adapter_id, "adapter_id not echoed")
        }
        Reason::Timeout | Reason::PolicyRequiresChain => {
            assert!(
                resp.adapter_id.is_empty(),
                "adapter_id on an early envelope"
            )
        }
        _ => assert!(resp.adapter_id.is_empty() || resp.adapter_id == req.adapter_id),
    }
    assert!(resp.lookup_latency_us >= 0);
    // H1: the reserved tenant never touches the index.
    if req.tenant_id == PROBE_TENANT {
        assert_eq!(reason, Reason::NoHint, "reserved tenant answered {code}");
        assert!(resp.adapter_id.is_empty());
    }
    // O1 step 1: an empty tenant, model or scheme cannot match anything.
    if req.tenant_id.is_empty() || req.model_id.is_empty() || req.hash_scheme.is_empty() {
        assert!(
            !matches!(
                reason,
                Reason::PrefixMatch | Reason::TenantHot | Reason::AffinityHint
            ),
            "{code} for a request without tenant, model or scheme"
        );
    }
    // The contract's malformed chain (§3.4): NO_HINT, never a fallback to `prefix_hash`. Under a
    // requireChain policy H3 answers first; with chain matching off the chain is ignored (§7.2).
    if req.block_hashes.len() != req.block_token_counts.len()
        && req.tenant_id != "req"
        && req.tenant_id != "nochain"
    {
        assert_eq!(reason, Reason::NoHint, "a malformed chain answered {code}");
    }
    // H3 for the fixture's requireChain tenant.
    if req.tenant_id == "req"
        && (req.block_hashes.is_empty() || req.block_hashes.len() != req.block_token_counts.len())
    {
        assert_eq!(reason, Reason::PolicyRequiresChain);
    }
    // H8 for the fixture's tenant with TENANT_HOT disabled.
    if req.tenant_id == "nohot" {
        assert_ne!(reason, Reason::TenantHot);
        assert_ne!(reason, Reason::AffinityHint, "affinity is off for nohot");
    }
    // H10/H11 for the fixture's floored tenant: every match ≥ 64 tokens, top score ≥ 50.
    if req.tenant_id == "floor" && reason == Reason::PrefixMatch {
        assert!(scores.iter().all(|s| s.matched_tokens >= 64));
        assert!(scores[0].score >= 50.0);
    }
    // The "no policy" floors (§6.1): matched ≥ 64 and top score ≥ 0.1.
    if req.tenant_id == "t" && reason == Reason::PrefixMatch {
        assert!(scores.iter().all(|s| s.matched_tokens >= 64));
        assert!(scores[0].score >= 0.1);
    }
}
