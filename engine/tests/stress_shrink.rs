//! Key-table growth and shrinking under concurrent readers: a writer grows a partition to tens
//! of thousands of keys and removes almost all of them again, round after round, so its key
//! table is rebuilt larger and then, by the sweep, smaller (the live slots copied into fresh
//! tables) and its runs are trimmed and retired, while reader threads keep looking up a set of
//! keys that are never removed. A reader must find every one of them, with its exact values,
//! at every moment: a rebuild moves slots, it never hides or tears one. Afterwards the index's
//! memory is back near its size with only the stable keys.

mod common;
use common::{Env, Put, T0, env_with};
use inferencecache_engine::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const STABLE: u64 = 256;
const CHURN: u64 = 160_000;
const ROUNDS: u64 = 3;

fn stable_key(k: u64) -> [u8; 8] {
    (0x5AB1_E000_0000 + k).to_be_bytes()
}

fn churn_key(round: u64, k: u64) -> [u8; 8] {
    (0xC4_0000_0000 + (round << 24) + k).to_be_bytes()
}

/// One chain of `keys` for `replica`, tier 2, at T0.
fn ingest(env: &Env, replica: &str, keys: &[[u8; 8]]) {
    let hashes: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let put = Put {
        replica,
        ts: T0,
        tier: 2,
        ..Put::default()
    };
    env.chain_with(&put, &hashes, &vec![16; keys.len()], b"", 0);
}

#[test]
fn table_rebuilds_never_hide_a_live_key_from_a_reader() {
    let env = env_with(IndexConfig {
        max_entries: 0,
        ..IndexConfig::default()
    });
    let ix = env.ix.clone();
    let stable: Vec<[u8; 8]> = (0..STABLE).map(stable_key).collect();
    // Each stable key is one single-key chain so its token count is 16 (K2: cumulative counts
    // restart per chain).
    for k in &stable {
        ingest(&env, "keeper", std::slice::from_ref(k));
    }
    let empty_mem = ix.memory_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let checks = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (ix, stop, checks, stable) =
                (ix.clone(), stop.clone(), checks.clone(), stable.clone());
            std::thread::spawn(move || {
                let mut i = r as usize;
                while !stop.load(Ordering::Relaxed) {
                    let k = &stable[i % stable.len()];
                    let got = ix.entry("t", "m", "vllm", "", k, "keeper");
                    let e = got.unwrap_or_else(|| panic!("stable key {i} vanished"));
                    assert_eq!(
                        (e.token_count, e.last_seen_us, e.tier),
                        (16, T0, 2),
                        "key {i} torn"
                    );
                    checks.fetch_add(1, Ordering::Relaxed);
                    i += 7;
                }
            })
        })
        .collect();
    for round in 0..ROUNDS {
        let keys: Vec<[u8; 8]> = (0..CHURN).map(|k| churn_key(round, k)).collect();
        for chunk in keys.chunks(64) {
            ingest(&env, "churner", chunk);
        }
        assert_eq!(ix.storage_entries(), (STABLE + CHURN) as i64);
        for chunk in keys.chunks(64) {
            ix.evict_prefixes("t", "m", "churner", "", chunk, 0);
        }
        assert_eq!(ix.storage_entries(), STABLE as i64, "round {round}");
        // Removals leave shrinking to the sweep: its rebuilds run under the readers too.
        let swept = ix.sweep_now();
        assert!(swept.segments_shrunk > 0, "round {round}: {swept:?}");
        assert_eq!(swept.entries_removed, 0, "round {round}: {swept:?}");
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader");
    }
    assert!(checks.load(Ordering::Relaxed) > 0);
    for k in &stable {
        assert!(ix.entry("t", "m", "vllm", "", k, "keeper").is_some());
    }
    // The key table shrank back (160,000 keys took 4 MiB of slots) and the churned runs are
    // gone.
    let mem = ix.memory_bytes();
    assert!(
        mem < empty_mem + (64 << 10),
        "memory {mem} after churn vs {empty_mem} with only the stable keys"
    );
}

/// Bytes the engine counts for a block of `n` bytes from the global allocator (glibc-like).
fn heap_chunk(n: i64) -> i64 {
    ((n + 8 + 15) & !15).max(32)
}

/// Bytes of a run of `len` 8-byte keys with room for two holders (one spare): the holder
/// entries and four hints in front of the 40-byte header, the keys, and the dead words of
/// offsets from 64 on.
fn run_bytes(len: i64) -> i64 {
    heap_chunk(2 * 16 + 4 * 24 + 40 + len * 8 + ((len + 63) / 64 - 1) * 8)
}

/// `memory_breakdown` accounts for every byte of `memory_bytes`, and its runs' share is exact:
/// a chain ingest writes one run over its blocks; a second replica ingesting the same chain
/// joins that run in its spare holder entry; and when the first replica is cleared it leaves
/// the shared run by its gone bit, while its own run goes whole.
#[test]
fn memory_breakdown_adds_up_and_counts_runs_exactly() {
    let env = env_with(IndexConfig::default());
    let ix = env.ix.clone();
    let shared: Vec<[u8; 8]> = (0..3_000).map(stable_key).collect();
    let single: Vec<[u8; 8]> = (0..5_000).map(|k| churn_key(0, k)).collect();
    ingest(&env, "a", &single);
    ingest(&env, "a", &shared);
    ingest(&env, "b", &shared);
    let parts = |ix: &Index| {
        let b = ix.memory_breakdown();
        let sum = b.slot_tables + b.runs + b.run_ids + b.lfu + b.other;
        assert_eq!(sum, ix.memory_bytes(), "{b:?}");
        assert!(b.slot_tables > 0 && b.run_ids > 0 && b.other > 0, "{b:?}");
        assert_eq!(b.lfu, 0, "nothing was credited: {b:?}");
        b
    };
    let b = parts(&ix);
    assert_eq!(b.runs, run_bytes(5_000) + run_bytes(3_000), "{b:?}");
    env.ix.apply_event(CacheEventInput {
        event_type: event_type::ALL_CLEARED,
        replica_id: "a",
        model_id: "m",
        tenant_id: "t",
        prefix_hash: &[],
        timestamp_us: 0,
        adapter_id: "",
    });
    let b = parts(&ix);
    assert_eq!(b.runs, run_bytes(3_000), "{b:?}");
    assert_eq!(ix.storage_entries(), 3_000);
}
