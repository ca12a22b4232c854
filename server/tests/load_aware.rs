//! The opt-in load-aware ranking (R10) through the real binary: the flag changes the pick, the
//! default answer stays the reference's, and a half-configured flag refuses to start.

mod common;

use common::{SERVER_BIN, ServerProcess, lookup, report, temp_dir};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use tonic::transport::Channel;

const BLOCK: i32 = 512;

fn chain(prefix: &str, blocks: usize) -> Vec<Vec<u8>> {
    (0..blocks)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect()
}

fn update(replica: &str, hashes: Vec<Vec<u8>>, memory_bytes: i64) -> pb::CacheStateUpdate {
    let counts = vec![BLOCK; hashes.len()];
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: hashes,
            block_token_counts: counts,
            ..Default::default()
        }],
        stats: Some(pb::ReplicaStats {
            cache_memory_bytes: memory_bytes,
            pressure: 0.1,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// "busy" holds the prompt's 4 blocks (2048 tokens) and 100,000 active KV tokens (200,000
/// bytes at 2 bytes per token); "idle" holds an unrelated block and no load.
async fn fleet(client: &mut InferenceCacheClient<Channel>) {
    report(
        client,
        vec![
            update("busy", chain("prompt", 4), 200_000),
            update("idle", chain("other", 1), 0),
        ],
    )
    .await;
}

fn prompt_lookup() -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        block_hashes: chain("prompt", 4),
        block_token_counts: vec![BLOCK; 4],
        ..Default::default()
    }
}

fn picks(answer: &pb::LookupRouteResponse) -> Vec<(&str, i32)> {
    answer
        .replica_scores
        .iter()
        .map(|s| (s.replica_id.as_str(), s.matched_tokens))
        .collect()
}

#[tokio::test]
async fn the_default_is_the_reference_ranking() {
    let dir = temp_dir("load-aware-default");
    let server = ServerProcess::start(&dir, &[]);
    server.wait_ready().await;
    let mut client = server.client().await;
    fleet(&mut client).await;
    let answer = lookup(&mut client, prompt_lookup()).await;
    assert_eq!(answer.reason_code, "PREFIX_MATCH");
    // Only the holder, scored by R1–R4: 2048 × fresh (≈ 1) × (1 − 0.1) × dp(1, 2) = ≈ 921.6.
    assert_eq!(picks(&answer), vec![("busy", 2048)]);
    let score = answer.replica_scores[0].score;
    assert!((score - 921.6).abs() < 0.5, "{score}");
}

#[tokio::test]
async fn the_knob_sends_the_request_to_the_idle_replica() {
    let dir = temp_dir("load-aware-on");
    let server = ServerProcess::start(
        &dir,
        &[
            "--load-aware-overlap-weight",
            "1",
            "--load-aware-kv-bytes-per-token",
            "2",
        ],
    );
    server.wait_ready().await;
    let mut client = server.client().await;
    fleet(&mut client).await;
    let answer = lookup(&mut client, prompt_lookup()).await;
    assert_eq!(answer.reason_code, "PREFIX_MATCH");
    // idle: 1 × 2048 uncached + 0 = 2048; busy: 0 + 100,000 active tokens.
    assert_eq!(picks(&answer), vec![("idle", 0), ("busy", 2048)]);
    assert_eq!(answer.replica_scores[0].score, 0.5);
    assert_eq!(
        answer.replica_scores[1].score,
        (2048.0 / (2048.0 + 100_000.0)) as f32
    );
    // A lookup that matches nothing is answered as before (no PREFIX_MATCH to re-rank).
    let mut miss = prompt_lookup();
    miss.block_hashes = chain("nobody", 4);
    let answer = lookup(&mut client, miss).await;
    assert_eq!(answer.reason_code, "AFFINITY_HINT");
}

#[tokio::test]
async fn a_heavy_overlap_weight_keeps_the_holder_first() {
    let dir = temp_dir("load-aware-heavy");
    let server = ServerProcess::start(
        &dir,
        &[
            "--load-aware-overlap-weight",
            "100",
            "--load-aware-kv-bytes-per-token",
            "2",
        ],
    );
    server.wait_ready().await;
    let mut client = server.client().await;
    fleet(&mut client).await;
    let answer = lookup(&mut client, prompt_lookup()).await;
    // busy: 100,000; idle: 100 × 2048 = 204,800.
    assert_eq!(picks(&answer), vec![("busy", 2048), ("idle", 0)]);
}

#[test]
fn a_weight_without_bytes_per_token_refuses_to_start() {
    let out = std::process::Command::new(SERVER_BIN)
        .args(["--load-aware-overlap-weight", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--load-aware-kv-bytes-per-token"), "{err}");
}

/// Both replicas hold the whole prompt: distinguishing power 0 makes every reference score 0,
/// so the reference's routing floor drops the match (an affinity hint remains); the load-aware
/// ranking skips that floor and puts the less loaded holder first.
#[tokio::test]
async fn a_prefix_every_replica_holds_goes_to_the_less_loaded_holder() {
    for load_aware in [false, true] {
        let dir = temp_dir(&format!("load-aware-shared-{load_aware}"));
        let flags: &[&str] = if load_aware {
            &[
                "--load-aware-overlap-weight",
                "4",
                "--load-aware-kv-bytes-per-token",
                "2",
            ]
        } else {
            &[]
        };
        let server = ServerProcess::start(&dir, flags);
        server.wait_ready().await;
        let mut client = server.client().await;
        report(
            &mut client,
            vec![
                update("a", chain("prompt", 4), 20_000),
                update("b", chain("prompt", 4), 2_000),
            ],
        )
        .await;
        let answer = lookup(&mut client, prompt_lookup()).await;
        if load_aware {
            assert_eq!(answer.reason_code, "PREFIX_MATCH");
            // Nothing uncached: a costs 10,000 active tokens, b 1,000.
            assert_eq!(picks(&answer), vec![("b", 2048), ("a", 2048)]);
            assert_eq!(
                answer.replica_scores[0].score,
                (2048.0 / (2048.0 + 1_000.0)) as f32
            );
        } else {
            assert_eq!(answer.reason_code, "AFFINITY_HINT");
            assert_eq!(answer.replica_scores.len(), 1);
        }
    }
}
