//! LookupRoute over real loopback gRPC: the handler pipeline H1–H13 (server.md §7, SV19–SV48).

mod common;

use common::{TestServer, lookup, manual_state};
use inferencecache_engine::fingerprint;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_server::policy::decode_push;
use inferencecache_server::state::ServerOptions;
use tonic::transport::Channel;

type Client = InferenceCacheClient<Channel>;

fn legacy(replica: &str, hash: &[u8], tokens: i32, tier: i32) -> pb::CacheStateUpdate {
    let mut update = common::legacy_update(replica, "t", hash, tokens);
    update.prefixes[0].tier = tier;
    update
}

fn chain_update(replica: &str, hashes: &[&[u8]], per_block: i32) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
            block_token_counts: vec![per_block; hashes.len()],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn with_stats(mut u: pb::CacheStateUpdate, hit_rate: f32) -> pb::CacheStateUpdate {
    u.stats = Some(pb::ReplicaStats {
        hit_rate,
        ..Default::default()
    });
    u
}

/// [`common::report`], and the Ack carries no reason (nothing in these updates is refused).
async fn report(client: &mut Client, updates: Vec<pb::CacheStateUpdate>) {
    let ack = common::report(client, updates).await;
    assert_eq!(ack.reason_code, "");
}

fn exact(
    tenant: &str,
    model: &str,
    scheme: &str,
    hash: &[u8],
    tokens: i32,
) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        model_id: model.into(),
        hash_scheme: scheme.into(),
        ..common::exact_lookup(tenant, hash, tokens)
    }
}

fn chain_req(hashes: &[&[u8]], per_block: i32) -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
        block_token_counts: vec![per_block; hashes.len()],
        ..Default::default()
    }
}

fn push(server: &TestServer, body: &str) {
    server
        .state
        .policies()
        .replace_pushed(decode_push(body.as_bytes()).expect("valid policy"));
}

#[tokio::test]
async fn sv20_exact_match_and_sv21_diagnostics() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    report(&mut c, vec![legacy("r1", b"p", 128, 0)]).await;
    let r = lookup(&mut c, exact("t", "m", "vllm", b"p", 128)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(r.replica_scores.len(), 1);
    let s = &r.replica_scores[0];
    assert_eq!(
        (s.replica_id.as_str(), s.matched_tokens, s.score, s.tier),
        ("r1", 128, 128.0, pb::CacheTier::T1 as i32)
    );
    assert_eq!(s.estimated_cache_hit_prob, 1.0);
    for (req, code) in [
        (exact("t", "m", "sglang", b"p", 128), "UNKNOWN_HASH_SCHEME"),
        (exact("other", "m", "vllm", b"p", 128), "UNKNOWN_TENANT"),
        (exact("t", "m2", "vllm", b"p", 128), "UNKNOWN_MODEL"),
    ] {
        let r = lookup(&mut c, req).await;
        assert_eq!(r.reason_code, code);
        assert!(r.replica_scores.is_empty());
        assert_eq!(r.adapter_id, "");
    }
    let (_, _, metrics) = common::http_request(server.http, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(r#"inferencecache_lookup_route_calls_total{model="m",reason_code="UNKNOWN_HASH_SCHEME",hint_used="false"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"inferencecache_lookup_route_calls_total{model="m",reason_code="PREFIX_MATCH",hint_used="true"} 1"#));
    assert!(metrics.contains("inferencecache_server_up 1\n"));
    assert!(metrics.contains("inferencecache_server_grpc_tls_enabled 0\n"));
    assert!(metrics.contains(r#"inferencecache_index_entries{model="m"} 1"#));
    server.shutdown().await;
}

#[tokio::test]
async fn sv22_tenant_hot_and_disabled() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    report(
        &mut c,
        vec![with_stats(legacy("warm", b"other", 16, 0), 0.8)],
    )
    .await;
    let r = lookup(&mut c, exact("t", "m", "vllm", b"novel", 0)).await;
    assert_eq!(r.reason_code, "TENANT_HOT");
    assert_eq!(r.replica_scores.len(), 1);
    assert_eq!(r.replica_scores[0].matched_tokens, 0);
    assert_eq!(r.replica_scores[0].tier, pb::CacheTier::Unspecified as i32);
    assert_eq!(r.replica_scores[0].estimated_cache_hit_prob, 0.8);
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","affinityRouting":false,"strategy":{"enableTenantHot":false}}]}"#,
    );
    let r = lookup(&mut c, exact("t", "m", "vllm", b"novel", 0)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    // SV23: an empty scheme is NO_HINT even with warm replicas.
    let r = lookup(&mut c, exact("t", "m", "", b"novel", 0)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    server.shutdown().await;
}

#[tokio::test]
async fn sv24_chain_match_and_sv25_sv26_malformed_or_novel() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    report(
        &mut c,
        vec![with_stats(
            chain_update("r1", &[b"b1", b"b2", b"b3"], 64),
            0.9,
        )],
    )
    .await;
    let r = lookup(&mut c, chain_req(&[b"b1", b"b2", b"b3", b"x4", b"x5"], 64)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(r.replica_scores[0].matched_tokens, 192);
    // SV25: two hashes, one count → NO_HINT even for a warm tenant with affinity on.
    let mut bad = chain_req(&[b"b1", b"b2"], 64);
    bad.block_token_counts.truncate(1);
    assert_eq!(lookup(&mut c, bad).await.reason_code, "NO_HINT");
    let counts_only = pb::LookupRouteRequest {
        block_token_counts: vec![16],
        ..chain_req(&[], 16)
    };
    assert_eq!(lookup(&mut c, counts_only).await.reason_code, "NO_HINT");
    // SV26: a well-formed chain matching nothing, affinity off → NO_HINT, never TENANT_HOT.
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, chain_req(&[b"zz"], 64)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    server.shutdown().await;
}

#[tokio::test]
async fn sv30_minimum_prefix_gate() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    report(&mut c, vec![chain_update("r1", &[b"a", b"b", b"c"], 16)]).await;
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","minimumPrefixTokens":200,"affinityRouting":false}]}"#,
    );
    assert_eq!(
        lookup(&mut c, exact("t", "m", "vllm", b"a", 10))
            .await
            .reason_code,
        "NO_HINT"
    );
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","minimumPrefixTokens":32,"affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, chain_req(&[b"a", b"b", b"c"], 16)).await;
    assert_eq!(
        r.reason_code, "PREFIX_MATCH",
        "48 tokens pass a threshold of 32"
    );
    // SV31: with affinity on, a small deep match becomes AFFINITY_HINT with zeroed fields.
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","minimumPrefixTokens":1024}]}"#,
    );
    let r = lookup(&mut c, chain_req(&[b"a", b"b", b"c"], 16)).await;
    assert_eq!(r.reason_code, "AFFINITY_HINT");
    assert_eq!(r.replica_scores.len(), 1);
    let s = &r.replica_scores[0];
    assert_eq!(
        (
            s.score,
            s.matched_tokens,
            s.estimated_cache_hit_prob,
            s.tier
        ),
        (0.0, 0, 0.0, 0)
    );
    // SV32: a wrong scheme keeps its diagnostic.
    let mut wrong = chain_req(&[b"a"], 16);
    wrong.hash_scheme = "sglang".into();
    assert_eq!(
        lookup(&mut c, wrong).await.reason_code,
        "UNKNOWN_HASH_SCHEME"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn sv33_to_sv36_floors() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    // SV34: no policy, exactly 64 matched tokens → PREFIX_MATCH.
    report(
        &mut c,
        vec![
            chain_update("a", &[b"k1", b"k2", b"k3", b"k4"], 16),
            chain_update("b", &[b"k1"], 16),
        ],
    )
    .await;
    let r = lookup(&mut c, chain_req(&[b"k1", b"k2", b"k3", b"k4"], 16)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    // SV35: the default floor of 64 keeps only A.
    assert_eq!(r.replica_scores.len(), 1);
    assert_eq!(
        (
            r.replica_scores[0].replica_id.as_str(),
            r.replica_scores[0].matched_tokens
        ),
        ("a", 64)
    );
    // SV33: floor 64 restated, affinity off, a 16-token exact match → NO_HINT.
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","minimumMatchedTokens":64,"affinityRouting":false}]}"#,
    );
    report(&mut c, vec![legacy("a", b"small", 16, 0)]).await;
    let r = lookup(&mut c, exact("t", "m", "vllm", b"small", 16)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    server.shutdown().await;
}

#[tokio::test]
async fn sv36_routing_floor() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    for r in ["r1", "r2", "r3"] {
        report(&mut c, vec![legacy(r, b"big", 1500, 0)]).await;
    }
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0.1,"affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, exact("t", "m", "vllm", b"big", 1500)).await;
    assert_eq!(
        r.reason_code, "NO_HINT",
        "every replica holds it: dp 0, below the 0.1 floor"
    );
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0,"affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, exact("t", "m", "vllm", b"big", 1500)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(r.replica_scores.len(), 3);
    report(&mut c, vec![legacy("r1", b"unique", 64, 0)]).await;
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, exact("t", "m", "vllm", b"unique", 64)).await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":100,"affinityRouting":false}]}"#,
    );
    let r = lookup(&mut c, exact("t", "m", "vllm", b"unique", 64)).await;
    assert_eq!(r.reason_code, "NO_HINT");
    server.shutdown().await;
}

#[tokio::test]
async fn sv37_affinity_is_stable_and_sv38_preconditions() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    for r in ["r-1", "r-2", "r-3"] {
        report(
            &mut c,
            vec![legacy(r, format!("own-{r}").as_bytes(), 16, 0)],
        )
        .await;
    }
    let first = lookup(&mut c, chain_req(&[b"b1", b"b2"], 16)).await;
    assert_eq!(first.reason_code, "AFFINITY_HINT");
    assert_eq!(first.replica_scores.len(), 1);
    // Golden pick: chain [b1, b2] over r-1..r-3 → r-3.
    assert_eq!(first.replica_scores[0].replica_id, "r-3");
    for _ in 0..10 {
        let again = lookup(&mut c, chain_req(&[b"b1", b"b2"], 16)).await;
        assert_eq!(again.replica_scores, first.replica_scores);
    }
    // Golden pick: seed "seed" → r-1; "any-fingerprint" → r-3.
    assert_eq!(
        lookup(&mut c, exact("t", "m", "vllm", b"seed", 0))
            .await
            .replica_scores[0]
            .replica_id,
        "r-1"
    );
    assert_eq!(
        lookup(&mut c, exact("t", "m", "vllm", b"any-fingerprint", 0))
            .await
            .replica_scores[0]
            .replica_id,
        "r-3"
    );
    // SV38: no seed, or a missing tenant/model/scheme → not AFFINITY_HINT.
    assert_eq!(
        lookup(&mut c, exact("t", "m", "vllm", b"", 0))
            .await
            .reason_code,
        "NO_HINT"
    );
    assert_ne!(
        lookup(&mut c, exact("", "m", "vllm", b"x", 0))
            .await
            .reason_code,
        "AFFINITY_HINT"
    );
    assert_ne!(
        lookup(&mut c, exact("t", "", "vllm", b"x", 0))
            .await
            .reason_code,
        "AFFINITY_HINT"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn sv39_require_chain_and_sv40_chain_matching_disabled() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let tokens: Vec<u32> = (0..48).collect();
    let (wire, _) = fingerprint::chain(&tokens, 16);
    let hashes: Vec<&[u8]> = wire.iter().map(|h| h.as_slice()).collect();
    report(
        &mut c,
        vec![
            chain_update("r1", &hashes, 16),
            legacy("r1", b"legacy", 100, 0),
        ],
    )
    .await;
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","strategy":{"requireChain":true}}]}"#,
    );
    for req in [
        exact("t", "m", "vllm", b"legacy", 100),
        pb::LookupRouteRequest {
            token_ids: tokens.clone(),
            ..exact("t", "m", "vllm", b"", 0)
        },
        pb::LookupRouteRequest {
            prompt_text: "hello".into(),
            ..exact("t", "m", "vllm", b"", 0)
        },
    ] {
        assert_eq!(
            lookup(&mut c, req).await.reason_code,
            "POLICY_REQUIRES_CHAIN"
        );
    }
    assert_eq!(
        lookup(&mut c, chain_req(&hashes, 16)).await.reason_code,
        "PREFIX_MATCH"
    );
    // SV40: chain matching off: prefix_hash wins over a chain; chain alone → NO_HINT;
    // token_ids → the exact key is the last derived hash with tokens = sum.
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","affinityRouting":false,"minimumMatchedTokens":0,"strategy":{"enableChainMatching":false}}]}"#,
    );
    let mut both = chain_req(&hashes, 16);
    both.prefix_hash = b"legacy".to_vec();
    let r = lookup(&mut c, both).await;
    assert_eq!(
        (r.reason_code.as_str(), r.replica_scores[0].matched_tokens),
        ("PREFIX_MATCH", 100)
    );
    assert_eq!(
        lookup(&mut c, chain_req(&hashes, 16)).await.reason_code,
        "NO_HINT"
    );
    let r = lookup(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: tokens.clone(),
            ..exact("t", "m", "vllm", b"", 0)
        },
    )
    .await;
    assert_eq!(r.reason_code, "PREFIX_MATCH");
    assert_eq!(
        r.replica_scores[0].matched_tokens, 48,
        "stored cumulative count of the last block"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn sv41_probe_tenant_and_sv44_tiers() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let r = lookup(
        &mut c,
        exact("inferencecache.io/probe", "m", "vllm", b"p", 0),
    )
    .await;
    assert_eq!(r.reason_code, "NO_HINT");
    push(
        &server,
        r#"{"version":7,"policies":[{"namespace":"t","routingFloorScore":0,"minimumMatchedTokens":0}]}"#,
    );
    for (i, (tier, want)) in [(1, 1), (2, 2), (0, 1), (99, 0), (-1, 0)]
        .into_iter()
        .enumerate()
    {
        let key = format!("tier-{i}");
        report(&mut c, vec![legacy("r1", key.as_bytes(), 16, tier)]).await;
        let r = lookup(&mut c, exact("t", "m", "vllm", key.as_bytes(), 16)).await;
        assert_eq!(r.replica_scores[0].tier, want, "reported tier {tier}");
    }
    server.shutdown().await;
}

#[tokio::test]
async fn sv46_token_ids_equal_explicit_chain_and_sv47_sv48_limits() {
    let (state, _clock) = manual_state(ServerOptions::default());
    let server = TestServer::start_with(state).await;
    let mut c = server.client().await;
    let tokens: Vec<u32> = (1000..1100).collect();
    let (wire, counts) = fingerprint::chain(&tokens, 16);
    let hashes: Vec<&[u8]> = wire.iter().map(|h| h.as_slice()).collect();
    report(
        &mut c,
        vec![
            chain_update("r1", &hashes[..4], 16),
            chain_update("r2", &hashes, 16),
        ],
    )
    .await;
    let by_chain = lookup(&mut c, chain_req(&hashes, counts[0])).await;
    let by_tokens = lookup(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: tokens.clone(),
            ..chain_req(&[], 16)
        },
    )
    .await;
    assert_eq!(by_chain.reason_code, "PREFIX_MATCH");
    assert_eq!(by_tokens.replica_scores, by_chain.replica_scores);
    assert!(by_tokens.token_ids.is_empty(), "token_ids are never echoed");
    // SV47: fewer tokens than one block, warm tenant → NO_HINT.
    report(&mut c, vec![with_stats(legacy("r1", b"x", 16, 0), 0.9)]).await;
    let r = lookup(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: vec![1, 2, 3],
            ..chain_req(&[], 16)
        },
    )
    .await;
    assert_eq!(r.reason_code, "NO_HINT");
    // SV48: over the limits → NO_HINT without work.
    let r = lookup(
        &mut c,
        pb::LookupRouteRequest {
            token_ids: vec![7; (1 << 20) + 1],
            ..chain_req(&[], 16)
        },
    )
    .await;
    assert_eq!(r.reason_code, "NO_HINT");
    server.shutdown().await;
}

#[tokio::test]
async fn sv29_expired_caller_deadline_is_timeout() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let mut req = tonic::Request::new(exact("t", "m", "vllm", b"p", 0));
    req.metadata_mut()
        .insert("grpc-timeout", "0n".parse().unwrap());
    match c.lookup_route(req).await {
        Ok(r) => assert_eq!(r.into_inner().reason_code, "TIMEOUT"),
        // The transport may refuse a zero deadline before the handler runs; that is not ours.
        Err(status) => assert!(matches!(
            status.code(),
            tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
        )),
    }
    server.shutdown().await;
}

#[tokio::test]
async fn events_and_cache_state_round_trip() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let mut u = with_stats(legacy("r1", b"p1", 16, 0), 0.5);
    u.stats.as_mut().unwrap().cache_memory_bytes = 1234;
    u.stats.as_mut().unwrap().replica_id = "mismatched".into();
    report(
        &mut c,
        vec![u, legacy("r2", b"p1", 16, 0), legacy("r1", b"p2", 16, 0)],
    )
    .await;
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(state.summary.unwrap().total_prefixes, 2);
    assert_eq!(state.replicas.len(), 1);
    assert_eq!(
        (
            state.replicas[0].replica_id.as_str(),
            state.replicas[0].cache_memory_bytes
        ),
        ("r1", 1234)
    );
    let evict = pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixEvicted as i32,
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        prefix_hash: b"p1".to_vec(),
        ..Default::default()
    };
    assert!(c.publish_event(evict).await.unwrap().into_inner().accepted);
    let r = lookup(&mut c, exact("t", "m", "vllm", b"p1", 16)).await;
    let holders: Vec<_> = r
        .replica_scores
        .iter()
        .map(|s| s.replica_id.as_str())
        .collect();
    assert_eq!(holders, ["r2"]);
    let clear = pb::CacheEvent {
        r#type: pb::cache_event::Type::AllCleared as i32,
        replica_id: "r1".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        ..Default::default()
    };
    assert!(c.publish_event(clear).await.unwrap().into_inner().accepted);
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(state.summary.unwrap().total_prefixes, 1);
    assert!(
        state.replicas.is_empty(),
        "ALL_CLEARED deletes the replica's stats"
    );
    // Unknown event types are acknowledged; the reserved tenant is dropped.
    let odd = pb::CacheEvent {
        r#type: 42,
        tenant_id: "inferencecache.io/probe".into(),
        ..Default::default()
    };
    assert!(c.publish_event(odd).await.unwrap().into_inner().accepted);
    let (_, _, metrics) = common::http_request(server.http, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(r#"inferencecache_events_total{type="PREFIX_EVICTED"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"inferencecache_events_total{type="ALL_CLEARED"} 1"#));
    server.shutdown().await;
}

#[tokio::test]
async fn quota_evictions_are_exported() {
    let server = TestServer::start().await;
    push(
        &server,
        r#"{"version":7,"policies":[],"tenants":[{"tenantID":"t","maxIndexEntries":1}]}"#,
    );
    let mut c = server.client().await;
    report(
        &mut c,
        vec![legacy("r1", b"a", 16, 0), legacy("r1", b"b", 16, 0)],
    )
    .await;
    let state = c
        .get_cache_state(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        state.summary.unwrap().total_prefixes,
        1,
        "quota 1 keeps one key"
    );
    let (_, _, metrics) = common::http_request(server.http, "GET", "/metrics", "").await;
    assert!(
        metrics.contains(
            r#"inferencecache_tenant_evictions_total{tenant_id="t",reason="over_entries"} 1"#
        ),
        "{metrics}"
    );
    server.shutdown().await;
}
