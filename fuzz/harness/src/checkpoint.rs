//! `checkpoint_file`: bytes → the warm-restart checkpoint reader (`engine::checkpoint`).

use inferencecache_engine::checkpoint::{read, write};
use inferencecache_engine::{
    CacheStateUpdate, DefaultResolvers, Index, IndexConfig, ManualClock, PrefixRef,
};
use std::io::Cursor;
use std::sync::Arc;

/// Clock of the indexes the target restores into (2026-01-01T00:00:00Z).
const NOW_US: i64 = 1_767_225_600_000_000;

fn index() -> Index {
    Index::new(
        IndexConfig::default(),
        Arc::new(DefaultResolvers),
        Arc::new(ManualClock::new(NOW_US)),
    )
}

/// Checks `data` as a checkpoint. A refusal must leave the index untouched; an accepted file
/// must restore exactly what its check counted (every entry loaded, expired or dropped), and
/// the restored index must write a checkpoint that checks again.
pub fn checkpoint_file(data: &[u8]) {
    let checked = read::check(data);
    let ix = index();
    match read::restore(&ix, Cursor::new(data)) {
        Err(_) => {
            assert!(checked.is_err(), "restore refused what check accepted");
            assert_eq!(
                ix.storage_entries(),
                0,
                "a refused checkpoint loaded entries"
            );
            assert!(
                ix.dump_partitions().is_empty(),
                "a refused checkpoint made partitions"
            );
        }
        Ok(report) => {
            let checked = checked.expect("check refused what restore accepted");
            assert_eq!(report.entries, checked.entries);
            let o = report.outcome;
            assert_eq!(o.loaded + o.expired + o.dropped, report.entries);
            let mut again = Vec::new();
            write::write_checkpoint(&ix, &mut again, &write::WriteOptions::default())
                .expect("writing to memory");
            let re = read::check(again.as_slice()).expect("a written checkpoint checks");
            assert_eq!(re.entries, ix.storage_entries() as u64);
        }
    }
}

/// A valid checkpoint of a small index (chains, a long legacy key, two replicas, stats), for
/// seeds and tests.
pub fn sample() -> Vec<u8> {
    let ix = index();
    let hashes: Vec<Vec<u8>> = (0..12u64)
        .map(|i| (0xAB00 + i).to_be_bytes().to_vec())
        .collect();
    let counts = vec![16; hashes.len()];
    for (replica, n) in [("r0", 12), ("r1", 5)] {
        let refs = [
            PrefixRef {
                prefix_hash: b"",
                token_count: 0,
                block_hashes: &hashes[..n],
                block_token_counts: &counts[..n],
                tier: 1,
                adapter_id: "",
            },
            PrefixRef {
                prefix_hash: b"a-legacy-key-longer-than-eight",
                token_count: 33,
                block_hashes: &[],
                block_token_counts: &[],
                tier: 2,
                adapter_id: "lora",
            },
        ];
        ix.ingest(CacheStateUpdate {
            replica_id: replica,
            model_id: "m",
            tenant_id: "t",
            hash_scheme: "vllm",
            timestamp_us: NOW_US - 1_000,
            prefixes: refs.iter().map(|r| PrefixRef { ..*r }),
            stats: Some(inferencecache_engine::ReplicaStatsInput {
                hit_rate: 0.5,
                ..Default::default()
            }),
            adapter_id: "",
        });
    }
    let mut out = Vec::new();
    write::write_checkpoint(
        &ix,
        &mut out,
        &write::WriteOptions {
            created_ms: NOW_US / 1000,
            stream_seq: 7,
            blobs: vec![("policy.pushed", br#"{"version":7}"#)],
        },
    )
    .expect("writing to memory");
    out
}
