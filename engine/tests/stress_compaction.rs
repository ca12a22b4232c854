//! Node-arena compaction under concurrent readers: a writer grows a partition to tens of
//! thousands of keys and removes almost all of them again, round after round, so its shard
//! tables shrink and their arenas are compacted (the live nodes copied into fresh arenas) while
//! reader threads keep looking up a set of keys that are never removed. A reader must find every
//! one of them, with its exact holders and values, at every moment: a compaction moves nodes,
//! it never hides or tears one. Afterwards the index's memory is back near its size with only
//! the stable keys.

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
fn compaction_never_hides_a_live_key_from_a_reader() {
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
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("reader");
    }
    assert!(checks.load(Ordering::Relaxed) > 0);
    for k in &stable {
        assert!(ix.entry("t", "m", "vllm", "", k, "keeper").is_some());
    }
    // The shards shrank and compacted: without compaction each shard's arena would still hold
    // its 10,000 churned nodes' worth (~256 KiB of chunks); compacted at the shrink below ~600
    // live keys it keeps at most that many nodes' chunks (~60 KiB).
    let mem = ix.memory_bytes();
    assert!(
        mem < empty_mem + 16 * (128 << 10),
        "memory {mem} after churn vs {empty_mem} with only the stable keys"
    );
}

/// `memory_breakdown` accounts for every byte of `memory_bytes`, and its live-node share is
/// exact: a chain ingest's own one-holder entries are 16-byte member nodes (their keys and
/// shared holder word live in the chain's run), a two-holder node is 40 bytes, whether or not a
/// chain run names it (the second replica's ingest of a shared chain: the run word takes the
/// key's place, and the key lives in the run), and a plain one-holder node is 24 bytes.
#[test]
fn memory_breakdown_adds_up_and_counts_live_nodes_exactly() {
    let env = env_with(IndexConfig::default());
    let ix = env.ix.clone();
    let shared: Vec<[u8; 8]> = (0..3_000).map(stable_key).collect();
    let single: Vec<[u8; 8]> = (0..5_000).map(|k| churn_key(0, k)).collect();
    // The one-holder keys go first: once the epoch releases freed nodes, a later ingest
    // would reuse them and `nodes_free` would depend on reclamation timing.
    ingest(&env, "a", &single);
    ingest(&env, "a", &shared);
    ingest(&env, "b", &shared);
    let parts = |ix: &Index| {
        let b = ix.memory_breakdown();
        let sum =
            b.key_tables + b.nodes_live + b.nodes_free + b.arena_unused + b.chain_runs + b.other;
        assert_eq!(sum, ix.memory_bytes(), "{b:?}");
        assert!(b.key_tables > 0 && b.nodes_free >= 0 && b.arena_unused >= 0 && b.other > 0);
        b
    };
    let b = parts(&ix);
    // The shared keys were member nodes of "a" before "b" joined: those nodes are now carved
    // but not live (deferred or on a free list), and nothing allocated after them.
    assert_eq!(b.nodes_live, 3_000 * 40 + 5_000 * 16, "{b:?}");
    assert!(b.nodes_free >= 3_000 * 16, "{b:?}");
    // Two live runs: "a"'s over its 5,000 own blocks and "b"'s over the 3,000 shared ones, each
    // its keys plus a header and two bits per block. "a"'s run over the shared blocks went with the
    // last of its nodes.
    assert!(
        b.chain_runs >= 8_000 * 8 && b.chain_runs < 8_000 * 8 + 8_000 / 4 + 256,
        "{b:?}"
    );
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
    assert_eq!(b.nodes_live, 3_000 * 24, "{b:?}");
    // "a"'s holders are gone, so are the two-holder nodes, and the run with the last of them.
    assert_eq!(b.chain_runs, 0, "{b:?}");
}
