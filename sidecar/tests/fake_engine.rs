//! The fake engine's batch (spec `sidecar.md` §10) decodes and re-keys to its EXPECT lines.

use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
use inferencecache_sidecar::fake_engine::{BASE_ENGINE_HASH, Plan};
use inferencecache_sidecar::positional::ReverseMap;
use inferencecache_sidecar::wire::{Event, decode_batch};

#[test]
fn validation() {
    assert!(Plan::new(0, 1, 1, 0, false).is_err());
    assert!(Plan::new(128, 0, 1, 0, false).is_err());
    assert!(Plan::new(128, 2, 3, 0, false).is_err(), "events > blocks");
    assert!(Plan::new(128, 2, 0, 0, false).is_err());
    assert!(
        Plan::new(1 << 12, (1 << 12) + 1, 1, 0, false).is_err(),
        "over 2^24 tokens"
    );
    assert!(Plan::new(1 << 12, 1 << 12, 1, 0, false).is_ok());
    assert!(Plan::new(16, 1, 1, i64::from(u32::MAX) - 14, false).is_err());
    assert!(Plan::new(16, 1, 1, i64::from(u32::MAX) - 15, false).is_ok());
    assert!(Plan::new(16, 1, 1, -1, false).is_err());
}

#[test]
fn split_gives_extra_blocks_to_the_first_events() {
    assert_eq!(Plan::new(4, 5, 2, 0, false).unwrap().split(), vec![3, 2]);
    assert_eq!(Plan::new(4, 7, 3, 0, false).unwrap().split(), vec![3, 2, 2]);
    assert_eq!(Plan::new(4, 2, 2, 0, false).unwrap().split(), vec![1, 1]);
}

#[test]
fn batch_is_one_chained_tuple_batch_matching_expect() {
    let plan = Plan::new(8, 5, 2, 1000, false).unwrap();
    let batch = decode_batch(&plan.payload()).unwrap();
    assert_eq!(batch.ts, 0.0);
    assert_eq!(batch.events.len(), 2);
    let mut m = ReverseMap::new(8);
    let mut got = Vec::new();
    for (i, ev) in batch.events.iter().enumerate() {
        let Event::BlockStored(st) = ev else { panic!() };
        assert_eq!(st.block_size, 8);
        assert_eq!(st.lora_id, None);
        if i == 0 {
            assert_eq!(st.parent_block_hash, None);
            assert_eq!(st.block_hashes[0], BASE_ENGINE_HASH.to_be_bytes().to_vec());
        } else {
            assert_eq!(
                st.parent_block_hash,
                Some((BASE_ENGINE_HASH + 2).to_be_bytes().to_vec())
            );
        }
        got.extend(
            m.store(st, "")
                .entries
                .into_iter()
                .map(|e| (e.prefix_hash, e.token_count)),
        );
    }
    assert_eq!(got, plan.expected());
    let tokens: Vec<u32> = (1000..1040).collect();
    let want: Vec<[u8; 8]> = prefix_hashes(&tokens, 8).into_iter().map(to_wire).collect();
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), want);
    assert_eq!(plan.expect_lines().len(), 5);
    assert!(plan.expect_lines()[4].ends_with("token_count=40"));
}

#[test]
fn omit_token_ids_sends_nil_and_expects_nothing() {
    let plan = Plan::new(8, 2, 1, 0, true).unwrap();
    let batch = decode_batch(&plan.payload()).unwrap();
    let Event::BlockStored(st) = &batch.events[0] else {
        panic!()
    };
    assert!(st.token_ids.is_empty());
    let stored = ReverseMap::new(8).store(st, "");
    assert!(stored.entries.is_empty());
    assert!(stored.mismatched);
    assert!(plan.expected().is_empty());
    assert!(plan.expect_lines()[0].starts_with("EXPECT no index entries"));
}
