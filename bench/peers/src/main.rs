//! W1M side by side (`benchmarks.md` §1–§3): the public peers, unmodified, from the registry,
//! and InferenceCache in the same harness, with the same generator, method and checks.
//!
//! ```text
//! w1m-peers --index ours|kv-index|dynamo-crtc|dynamo-radix|all [--chains N] [--queries N]
//!           [--json] [--smoke]
//! ```
//!
//! One fresh process per index is what `bench/run-w1m.sh` runs; `all` runs them in sequence in
//! one process (a quick look only: the allocator state carries over). Exits non-zero when any
//! check fails.

use std::hint::black_box;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use inferencecache_bench::measure::{Plan, Recorder, Sums, bench_lookup, vm_rss_bytes};
use inferencecache_bench::ours;
use inferencecache_bench::w1m::{
    CHAINS_FULL, CHAINS_SMOKE, Kind, LEN, QUERIES, Queries, WORKERS, Workload, worker,
};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ALLOCATOR: &str = if cfg!(feature = "mimalloc") {
    "mimalloc"
} else {
    "system"
};

/// Expected (Σ matched blocks, workers with a match, 0) per query: the peers count blocks.
fn block_expected(kind: Kind) -> Sums {
    [kind.blocks_per_query(), kind.replicas_per_query(), 0]
}

// ------------------------------------------------------------------------------------------
// kv-index 2.0.0 ChainIndex

mod kv {
    use super::*;
    use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};

    pub const ROW_FIND: &str = "kv-index find_matches";
    pub const ROW_SCORE: &str = "kv-index score_into";

    pub fn run(w: &Workload, q: &Queries, plan: Plan, rec: &mut Recorder) -> Result<(), String> {
        // Events built beforehand: content_hash = local, seq_hash = seq.
        let events: Vec<[StoredBlock; LEN]> = (0..w.chains)
            .map(|c| {
                std::array::from_fn(|i| StoredBlock {
                    seq_hash: SequenceHash(w.seq[c][i]),
                    content_hash: ContentHash(w.local[c][i]),
                })
            })
            .collect();
        let queries: Vec<Vec<[ContentHash; LEN]>> = Kind::ALL
            .iter()
            .map(|k| {
                q.set(*k)
                    .blocks
                    .iter()
                    .map(|b| std::array::from_fn(|i| ContentHash(b[i])))
                    .collect()
            })
            .collect();

        let ix = ChainIndex::with_max_workers(64);
        let ids: Vec<u32> = (0..WORKERS)
            .map(|i| {
                ix.intern_worker(&format!("w{i}"))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        let mut maps: Vec<ChainBlockMap> = (0..WORKERS).map(|_| ChainBlockMap::new()).collect();

        let rss0 = vm_rss_bytes();
        let t = Instant::now();
        for (c, ev) in events.iter().enumerate() {
            let wk = worker(c);
            ix.apply_stored(ids[wk], ev, None, &mut maps[wk])
                .map_err(|e| format!("kv-index apply_stored chain {c}: {e:?}"))?;
        }
        let el = t.elapsed();
        let rss1 = vm_rss_bytes();
        if ix.current_size() != w.entries() {
            return Err(format!(
                "kv-index current_size {} != {}",
                ix.current_size(),
                w.entries()
            ));
        }
        rec.put_write(ROW_FIND, "insert", w.entries(), el);
        rec.put(
            ROW_FIND,
            "rss_b_entry",
            rss1.saturating_sub(rss0) as f64 / w.entries() as f64,
            "B",
        );

        for (k, kind) in Kind::ALL.iter().enumerate() {
            let qs = &queries[k];
            let s = bench_lookup(
                &format!("{ROW_FIND} {}", kind.label()),
                qs.len(),
                plan,
                block_expected(*kind),
                |i| {
                    let m = ix.find_matches(&qs[i], false);
                    let mut s = [0u64; 3];
                    for v in m.scores.values() {
                        s[0] += u64::from(*v);
                        s[1] += 1;
                    }
                    s
                },
            )?;
            rec.put_lookup(ROW_FIND, kind.label(), &s);
        }
        for kind in Kind::ALL {
            let qs = &q.set(kind).blocks;
            let s = bench_lookup(
                &format!("{ROW_SCORE} {}", kind.label()),
                qs.len(),
                plan,
                block_expected(kind),
                |i| {
                    let mut s = [0u64; 3];
                    ix.score_into(
                        &qs[i][..],
                        |c: &u64| *c,
                        false,
                        |_, score| {
                            s[0] += u64::from(score);
                            s[1] += 1;
                        },
                    );
                    s
                },
            )?;
            rec.put_lookup(ROW_SCORE, kind.label(), &s);
        }

        let t = Instant::now();
        for c in 0..w.chains {
            let wk = worker(c);
            let mut hashes = [SequenceHash(0); LEN];
            for (h, v) in hashes.iter_mut().zip(w.seq[c].iter().rev()) {
                *h = SequenceHash(*v);
            }
            ix.apply_removed(ids[wk], &hashes, &mut maps[wk]);
        }
        let el = t.elapsed();
        if !ix.is_empty() || ix.current_size() != 0 {
            return Err(format!(
                "kv-index not empty after removal ({} blocks)",
                ix.current_size()
            ));
        }
        rec.put_write(ROW_FIND, "remove", w.entries(), el);
        rec.copy_row(ROW_FIND, ROW_SCORE, &["insert", "remove", "rss"]);
        black_box(&maps);
        Ok(())
    }
}

// ------------------------------------------------------------------------------------------
// dynamo-kv-router 1.6.1: CRTC (production path) and RadixTree

mod dynamo {
    use super::*;
    use dynamo_kv_router::ConcurrentRadixTreeCompressed;
    use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, WorkerTask};
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
        KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
    };

    pub const ROW_CRTC: &str = "dynamo crtc";
    pub const ROW_RADIX: &str = "dynamo radixtree";

    fn store_event(w: &Workload, c: usize, id: u64) -> RouterEvent {
        let blocks = (0..LEN)
            .map(|i| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(w.seq[c][i]),
                tokens_hash: LocalBlockHash(w.local[c][i]),
                mm_extra_info: None,
            })
            .collect();
        RouterEvent::new(
            worker(c) as u64,
            KvCacheEvent {
                event_id: id,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    start_position: None,
                    blocks,
                }),
                dp_rank: 0,
            },
        )
    }

    /// Built inside the timed loop (the hash list of a removal, as for every index).
    #[inline]
    fn remove_event(w: &Workload, c: usize, id: u64) -> RouterEvent {
        let block_hashes = w.seq[c]
            .iter()
            .rev()
            .map(|h| ExternalSequenceBlockHash(*h))
            .collect();
        RouterEvent::new(
            worker(c) as u64,
            KvCacheEvent {
                event_id: id,
                data: KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }),
                dp_rank: 0,
            },
        )
    }

    fn put_rss(rec: &mut Recorder, row: &str, w: &Workload, pre: u64, before: u64, after: u64) {
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / w.entries() as f64;
        rec.put(row, "rss_b_entry", per(after, before), "B");
        rec.put(row, "rss_b_entry_pre_events", per(after, pre), "B");
    }

    fn sums(m: &OverlapScores) -> Sums {
        let mut s = [0u64; 3];
        for v in m.scores.values() {
            s[0] += u64::from(*v);
            s[1] += 1;
        }
        s
    }

    fn local_queries(q: &Queries) -> Vec<Vec<[LocalBlockHash; LEN]>> {
        Kind::ALL
            .iter()
            .map(|k| {
                q.set(*k)
                    .blocks
                    .iter()
                    .map(|b| std::array::from_fn(|i| LocalBlockHash(b[i])))
                    .collect()
            })
            .collect()
    }

    /// Sends every event but the last, then the last with an ack, and waits for the ack.
    fn feed(tx: &flume::Sender<WorkerTask>, events: Vec<RouterEvent>) -> Result<(), String> {
        let n = events.len();
        let mut it = events.into_iter();
        for ev in it.by_ref().take(n.saturating_sub(1)) {
            tx.send(WorkerTask::Event(ev))
                .map_err(|_| "CRTC worker gone")?;
        }
        if let Some(last) = it.next() {
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            tx.send(WorkerTask::EventWithAck {
                event: last,
                resp: rtx,
            })
            .map_err(|_| "CRTC worker gone")?;
            let ok = rrx.blocking_recv().map_err(|_| "CRTC ack dropped")?;
            if !ok {
                return Err("CRTC: last event not applied".into());
            }
        }
        Ok(())
    }

    fn count_stored(events: &[RouterEvent]) -> usize {
        events
            .iter()
            .map(|e| match &e.event.data {
                KvCacheEventData::Stored(s) => s.blocks.len(),
                _ => 0,
            })
            .sum()
    }

    pub fn run_crtc(
        w: &Workload,
        q: &Queries,
        plan: Plan,
        rec: &mut Recorder,
    ) -> Result<(), String> {
        let queries = local_queries(q);
        let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
        let (tx, rx) = flume::unbounded::<WorkerTask>();
        let worker_tree = tree.clone();
        let handle = std::thread::Builder::new()
            .name("crtc-events".into())
            .spawn(move || worker_tree.worker(rx, None))
            .map_err(|e| e.to_string())?;

        // The events are moved into the index's channel and freed by its worker, so the tree
        // may reuse their memory: `rss_b_entry` is measured from just before the timed insert
        // (as for every index), `rss_b_entry_pre_events` from before the events were built.
        let rss_pre = vm_rss_bytes();
        let events: Vec<RouterEvent> = (0..w.chains)
            .map(|c| store_event(w, c, c as u64 + 1))
            .collect();
        let rss0 = vm_rss_bytes();
        let t = Instant::now();
        feed(&tx, events)?;
        let el = t.elapsed();
        let rss1 = vm_rss_bytes();
        rec.put_write(ROW_CRTC, "insert", w.entries(), el);
        put_rss(rec, ROW_CRTC, w, rss_pre, rss0, rss1);
        let dumped = tree.dump_events().map(|e| count_stored(&e));
        if dumped != Some(w.entries()) {
            return Err(format!(
                "CRTC holds {dumped:?} blocks, expected {}",
                w.entries()
            ));
        }

        for (k, kind) in Kind::ALL.iter().enumerate() {
            let qs = &queries[k];
            let s = bench_lookup(
                &format!("{ROW_CRTC} {}", kind.label()),
                qs.len(),
                plan,
                block_expected(*kind),
                |i| sums(&tree.find_matches_impl(&qs[i], false)),
            )?;
            rec.put_lookup(ROW_CRTC, kind.label(), &s);
        }

        // Removal: the hash lists are built inside the timed loop, sent on the same channel.
        let base = w.chains as u64 + 1;
        let t = Instant::now();
        for c in 0..w.chains - 1 {
            tx.send(WorkerTask::Event(remove_event(w, c, base + c as u64)))
                .map_err(|_| "CRTC worker gone")?;
        }
        feed(
            &tx,
            vec![remove_event(w, w.chains - 1, base + w.chains as u64)],
        )?;
        let el = t.elapsed();
        rec.put_write(ROW_CRTC, "remove", w.entries(), el);
        let left = tree.dump_events().map(|e| count_stored(&e));
        if left != Some(0) {
            return Err(format!("CRTC not empty after removal: {left:?} blocks"));
        }
        drop(tx);
        handle
            .join()
            .map_err(|_| "CRTC worker panicked")?
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    pub fn run_radix(
        w: &Workload,
        q: &Queries,
        plan: Plan,
        rec: &mut Recorder,
    ) -> Result<(), String> {
        let queries = local_queries(q);
        let mut tree = RadixTree::new();
        // Same RSS rules as the CRTC: `apply_event` takes the event by value.
        let rss_pre = vm_rss_bytes();
        let events: Vec<RouterEvent> = (0..w.chains)
            .map(|c| store_event(w, c, c as u64 + 1))
            .collect();
        let rss0 = vm_rss_bytes();
        let t = Instant::now();
        for (c, ev) in events.into_iter().enumerate() {
            tree.apply_event(ev)
                .map_err(|e| format!("RadixTree store chain {c}: {e:?}"))?;
        }
        let el = t.elapsed();
        let rss1 = vm_rss_bytes();
        if tree.current_size() != w.entries() {
            return Err(format!(
                "RadixTree current_size {} != {}",
                tree.current_size(),
                w.entries()
            ));
        }
        rec.put_write(ROW_RADIX, "insert", w.entries(), el);
        put_rss(rec, ROW_RADIX, w, rss_pre, rss0, rss1);

        for (k, kind) in Kind::ALL.iter().enumerate() {
            let qs = &queries[k];
            let s = bench_lookup(
                &format!("{ROW_RADIX} {}", kind.label()),
                qs.len(),
                plan,
                block_expected(*kind),
                // The query is taken by value: the clone is part of the op.
                |i| sums(&tree.find_matches(qs[i].to_vec(), false)),
            )?;
            rec.put_lookup(ROW_RADIX, kind.label(), &s);
        }

        let base = w.chains as u64 + 1;
        let t = Instant::now();
        for c in 0..w.chains {
            tree.apply_event(remove_event(w, c, base + c as u64))
                .map_err(|e| format!("RadixTree remove chain {c}: {e:?}"))?;
        }
        let el = t.elapsed();
        rec.put_write(ROW_RADIX, "remove", w.entries(), el);
        if tree.current_size() != 0 {
            return Err(format!(
                "RadixTree not empty after removal ({} blocks)",
                tree.current_size()
            ));
        }
        Ok(())
    }
}

// ------------------------------------------------------------------------------------------

struct Args {
    index: String,
    chains: usize,
    queries: usize,
    json: bool,
    smoke: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        index: "all".into(),
        chains: CHAINS_FULL,
        queries: QUERIES,
        json: false,
        smoke: false,
    };
    let (mut chains_set, mut queries_set) = (false, false);
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--index" => a.index = it.next().ok_or("--index needs a name")?,
            "--chains" => {
                a.chains = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n: &usize| n >= 8)
                    .ok_or("--chains needs a number ≥ 8")?;
                chains_set = true;
            }
            "--queries" => {
                a.queries = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n: &usize| n > 0)
                    .ok_or("--queries needs a positive number")?;
                queries_set = true;
            }
            "--json" => a.json = true,
            "--smoke" => a.smoke = true,
            other => {
                return Err(format!(
                    "unknown argument {other}\nusage: w1m-peers --index ours|kv-index|dynamo-crtc|dynamo-radix|all [--chains N] [--queries N] [--json] [--smoke]"
                ));
            }
        }
    }
    if a.smoke {
        if !chains_set {
            a.chains = CHAINS_SMOKE;
        }
        if !queries_set {
            a.queries = 10_000;
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let plan = if args.smoke {
        Plan {
            warmup: 1_000,
            rounds: 3,
        }
    } else {
        Plan::FULL
    };
    let w = Workload::new(args.chains);
    let q = Queries::generate(args.chains, args.queries);
    let mut rec = Recorder::default();
    let names: Vec<&str> = match args.index.as_str() {
        "all" => vec!["ours", "kv-index", "dynamo-crtc", "dynamo-radix"],
        one => vec![one],
    };
    let mut failed = false;
    for name in names {
        let r = match name {
            "ours" => ours::run(&w, &q, plan, &mut rec),
            "kv-index" => kv::run(&w, &q, plan, &mut rec),
            "dynamo-crtc" => dynamo::run_crtc(&w, &q, plan, &mut rec),
            "dynamo-radix" => dynamo::run_radix(&w, &q, plan, &mut rec),
            other => Err(format!("unknown index {other}")),
        };
        if let Err(e) = r {
            eprintln!("W1M CHECK FAILED ({name}): {e}");
            failed = true;
        }
    }
    let extra = format!(
        ",\"allocator\":\"{ALLOCATOR}\",\"chains\":{},\"queries\":{},\"profile\":\"peers (opt 3, thin LTO, 4 CGU)\"",
        args.chains, args.queries
    );
    if args.json {
        rec.print_json(&extra);
    } else {
        println!(
            "W1M peers: {} chains, {} entries, {} queries/set, warm-up {}, {} rounds, allocator {ALLOCATOR}",
            args.chains,
            w.entries(),
            args.queries,
            plan.warmup,
            plan.rounds
        );
        rec.print_table();
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
