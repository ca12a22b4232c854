//! Chain runs under concurrency (`engine/src/runs.rs`): three replicas hold one chain, two of
//! them keep re-ingesting it (each ingest builds a new run over the blocks the others hold), and
//! a third writer keeps removing and restoring its own holder of one block in the middle of those
//! runs. Readers walk the chain all the while. A walk may step over a run's blocks only while
//! they still carry the holders the run recorded, so whenever the block was absent (or present)
//! for the whole of a lookup, the lookup must say so exactly: a replica's match never runs over
//! a block it does not hold, and never stops short at one it does.

use inferencecache_engine::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const T0: i64 = 1_700_000_000_000_000;
const LEN: usize = 24;
/// The block whose holder `w0` keeps removing and restoring.
const HOLE: usize = 11;
const TOGGLES: u64 = 3_000;

fn chain() -> Vec<[u8; 8]> {
    (0..LEN as u64)
        .map(|i| (0x0C4A_1000 + i).to_be_bytes())
        .collect()
}

fn ingest_chain(ix: &Index, replica: &str, ts_us: i64) {
    let keys = chain();
    let counts = [16; LEN];
    ix.ingest(CacheStateUpdate {
        replica_id: replica,
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: ts_us,
        adapter_id: "",
        stats: None,
        prefixes: std::iter::once(PrefixRef {
            prefix_hash: &[],
            token_count: 0,
            block_hashes: &keys,
            block_token_counts: &counts,
            tier: 1,
            adapter_id: "",
        }),
    });
}

/// `w0`'s holder of block HOLE, restored as a single-key ingest with the chain's values.
fn restore_hole(ix: &Index) {
    let k = chain()[HOLE];
    let none: &[[u8; 8]] = &[];
    ix.ingest(CacheStateUpdate {
        replica_id: "w0",
        model_id: "m",
        tenant_id: "t",
        hash_scheme: "vllm",
        timestamp_us: T0,
        adapter_id: "",
        stats: None,
        prefixes: std::iter::once(PrefixRef {
            prefix_hash: &k,
            token_count: 16 * (HOLE as i32 + 1),
            block_hashes: none,
            block_token_counts: &[],
            tier: 1,
            adapter_id: "",
        }),
    });
}

/// Matched blocks of `w0`, `w1`, `w2` for the whole chain.
fn walk(ix: &Index, scratch: &mut MatchScratch) -> [u32; 3] {
    let part = ix.partition("t", "m", "vllm", "").expect("partition");
    let mut got = [0u32; 3];
    ix.match_chain_into(part, &chain(), &[16; LEN], T0 + 1_000_000, scratch, |m| {
        let r = match m.replica_id {
            "w0" => 0,
            "w1" => 1,
            "w2" => 2,
            other => panic!("unknown replica {other}"),
        };
        assert_eq!(m.matched_tokens, 16 * m.blocks as i32, "{m:?}");
        got[r] = m.blocks;
    });
    got
}

#[test]
fn walks_never_step_over_a_changed_block_of_a_run() {
    let clock = Arc::new(ManualClock::new(T0 + 1_000_000));
    let ix = Arc::new(Index::new(
        IndexConfig {
            max_entries: 0,
            ..IndexConfig::default()
        },
        Arc::new(DefaultResolvers),
        clock,
    ));
    for r in ["w0", "w1", "w2"] {
        ingest_chain(&ix, r, T0);
    }
    assert_eq!(walk(&ix, &mut MatchScratch::default()), [LEN as u32; 3]);
    assert!(
        ix.memory_breakdown().runs > 0,
        "the later ingests built runs"
    );

    // w0's phase: 4k = present (stable), 4k+1 = removing, 4k+2 = absent (stable), 4k+3 =
    // restoring.
    let phase = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Lookups the readers completed within a stable absent / present phase. The toggler goes on
    // past TOGGLES until both were seen (a loaded 2-core CI machine may not schedule the
    // readers during the first toggles), for at most a minute.
    let seen = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let toggler = {
        let (ix, phase, seen) = (ix.clone(), phase.clone(), seen.clone());
        std::thread::spawn(move || {
            let k = chain()[HOLE];
            let start = std::time::Instant::now();
            let mut round = 0;
            while round < TOGGLES
                || (seen.iter().any(|c| c.load(Ordering::Relaxed) == 0)
                    && start.elapsed() < std::time::Duration::from_secs(60))
            {
                round += 1;
                phase.fetch_add(1, Ordering::SeqCst);
                ix.apply_event(CacheEventInput {
                    event_type: event_type::PREFIX_EVICTED,
                    replica_id: "w0",
                    model_id: "m",
                    tenant_id: "t",
                    prefix_hash: &k,
                    timestamp_us: 0,
                    adapter_id: "",
                });
                phase.fetch_add(1, Ordering::SeqCst);
                std::thread::yield_now();
                phase.fetch_add(1, Ordering::SeqCst);
                restore_hole(&ix);
                phase.fetch_add(1, Ordering::SeqCst);
                std::thread::yield_now();
            }
        })
    };
    let churners: Vec<_> = ["w1", "w2"]
        .into_iter()
        .map(|r| {
            let (ix, stop) = (ix.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut ts = T0;
                while !stop.load(Ordering::Relaxed) {
                    ts += 1_000;
                    ingest_chain(&ix, r, ts);
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (ix, phase, stop, seen) = (ix.clone(), phase.clone(), stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut scratch = MatchScratch::default();
                let (mut absent, mut present) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let before = phase.load(Ordering::SeqCst);
                    let got = walk(&ix, &mut scratch);
                    let after = phase.load(Ordering::SeqCst);
                    assert_eq!(&got[1..], &[LEN as u32; 2], "w1 and w2 hold every block");
                    assert!(
                        got[0] == HOLE as u32 || got[0] == LEN as u32,
                        "w0 matched {} blocks",
                        got[0]
                    );
                    if before == after && before % 4 == 2 {
                        assert_eq!(got[0], HOLE as u32, "w0 stepped over its missing block");
                        absent += 1;
                        seen[0].fetch_add(1, Ordering::Relaxed);
                    }
                    if before == after && before % 4 == 0 {
                        assert_eq!(got[0], LEN as u32, "w0 stopped at a block it holds");
                        present += 1;
                        seen[1].fetch_add(1, Ordering::Relaxed);
                    }
                }
                (absent, present)
            })
        })
        .collect();
    toggler.join().expect("toggler");
    stop.store(true, Ordering::Relaxed);
    for c in churners {
        c.join().expect("churner");
    }
    let (mut absent, mut present) = (0, 0);
    for r in readers {
        let (a, p) = r.join().expect("reader");
        absent += a;
        present += p;
    }
    // Both stable states were observed (the checks above did run).
    assert!(
        absent > 0 && present > 0,
        "absent {absent}, present {present}"
    );
    assert_eq!(walk(&ix, &mut MatchScratch::default()), [LEN as u32; 3]);
}
