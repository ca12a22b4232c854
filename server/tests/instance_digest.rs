//! The server instance identity (`Ack.server_instance_id`, `GetCacheStateResponse`) and the
//! replica digest a producer compares with its own (`GetCacheStateRequest.replica_id`), through
//! the service's handlers.

use inferencecache_engine::replica_entry_hash;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCache;
use inferencecache_server::grpc::CacheService;
use inferencecache_server::state::{AppState, ServerOptions};
use inferencecache_server::translate::ingest;
use tonic::Request;

fn update(replica: &str, entries: &[(&[u8; 8], i32, i32, &str)]) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
        prefixes: entries
            .iter()
            .map(|(key, tokens, tier, adapter)| pb::PrefixEntry {
                prefix_hash: key.to_vec(),
                token_count: *tokens,
                tier: *tier,
                adapter_id: adapter.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

async fn state_of(service: &CacheService, replica: &str) -> pb::GetCacheStateResponse {
    service
        .get_cache_state(Request::new(pb::GetCacheStateRequest {
            model_id: "m".into(),
            tenant_id: "t".into(),
            replica_id: replica.into(),
        }))
        .await
        .expect("GetCacheState answers")
        .into_inner()
}

#[tokio::test]
async fn every_start_is_a_new_instance_and_acks_name_it() {
    let first = AppState::new(ServerOptions::default());
    let second = AppState::new(ServerOptions::default());
    assert_eq!(first.instance_id().len(), 32);
    assert!(first.instance_id().chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(first.instance_id(), second.instance_id());
    let service = CacheService::new(first.clone());
    let ack = service
        .publish_event(Request::new(pb::CacheEvent {
            r#type: pb::cache_event::Type::PrefixEvicted as i32,
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            prefix_hash: vec![1; 8],
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(ack.accepted);
    assert_eq!(ack.server_instance_id, first.instance_id());
    let answer = state_of(&service, "").await;
    assert_eq!(answer.server_instance_id, first.instance_id());
    assert_eq!(answer.replica_digest, None, "no replica named, no digest");
}

#[tokio::test]
async fn the_replica_digest_is_the_sum_of_its_entries_and_nothing_else() {
    let state = AppState::new(ServerOptions::default());
    state.start();
    let service = CacheService::new(state.clone());
    let mine: [(&[u8; 8], i32, i32, &str); 3] = [
        (&[1; 8], 16, pb::CacheTier::T1 as i32, ""),
        (&[2; 8], 32, pb::CacheTier::T2 as i32, ""),
        (&[3; 8], 16, pb::CacheTier::T1 as i32, "sql-lora"),
    ];
    ingest(state.index(), &update("r1", &mine));
    // Another replica's entries, one of them under the same key, change nothing of r1's.
    ingest(
        state.index(),
        &update("r2", &[(&[1; 8], 16, 1, ""), (&[9; 8], 16, 1, "")]),
    );
    let want: u128 = mine
        .iter()
        .map(|(key, tokens, tier, adapter)| {
            replica_entry_hash("vllm", adapter, *key, *tier, *tokens)
        })
        .fold(0u128, u128::wrapping_add);
    let digest = state_of(&service, "r1")
        .await
        .replica_digest
        .expect("a digest");
    assert_eq!(digest.entries, 3);
    assert_eq!(digest.digest, want.to_be_bytes().to_vec());
    // A tier change is a different digest; an unknown replica has the empty one.
    ingest(state.index(), &update("r1", &[(&[2; 8], 32, 1, "")]));
    let changed = state_of(&service, "r1").await.replica_digest.unwrap();
    assert_eq!(changed.entries, 3);
    assert_ne!(changed.digest, digest.digest);
    let nobody = state_of(&service, "r9").await.replica_digest.unwrap();
    assert_eq!((nobody.entries, nobody.digest), (0, vec![0; 16]));
    // ALL_CLEARED of r1 empties its digest and leaves r2's.
    service
        .publish_event(Request::new(pb::CacheEvent {
            r#type: pb::cache_event::Type::AllCleared as i32,
            replica_id: "r1".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            ..Default::default()
        }))
        .await
        .unwrap();
    let cleared = state_of(&service, "r1").await.replica_digest.unwrap();
    assert_eq!((cleared.entries, cleared.digest), (0, vec![0; 16]));
    assert_eq!(
        state_of(&service, "r2")
            .await
            .replica_digest
            .unwrap()
            .entries,
        2
    );
}
