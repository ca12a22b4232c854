//! Index throughput on a Mooncake-format trace (issue #44, part 1) with the public peers in the
//! same run: InferenceCache, kv-index 2.0.0 (`ChainIndex`), dynamo-kv-router 1.6.1's CRTC
//! (production path: events through its own worker thread) and RadixTree (single-threaded),
//! plus the reference model, all driven by `inferencecache_bench::mooncake_bench`'s plan.
//!
//! ```text
//! mooncake-replay-peers [--trace FILE] [--requests N] [--copies N] [--workers N]
//!     [--capacity BLOCKS] [--threads 1,2] [--index inferencecache,kv-index,dynamo-crtc,dynamo-radix,reference,probe-flat,probe-flat-state,probe-slots,probe-buckets,probe-buckets-state]
//!     [--out FILE] [--quick]
//! ```
//!
//! Threads: "1" is one caller thread doing events and lookups in trace order; "2" is an event
//! thread and a lookup thread on the same timetable. The CRTC always applies events on its own
//! worker thread (its design: it has no synchronous apply), so at "1" it uses the caller plus
//! that thread, and at "2" an event feeder, a lookup thread and its worker. RadixTree needs
//! `&mut` for events and runs at "1" only.

mod probe_flat;

use std::process::ExitCode;
use std::sync::Arc;

use inferencecache_bench::mooncake::{
    Pace, Pair, Reader, RunStats, Simulation, Writer, replay_dual, replay_single, verify,
};
use inferencecache_bench::mooncake_bench::{self, Args, Subject};
use inferencecache_bench::mooncake_ours::{OursSubject, ReferenceSubject};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// ------------------------------------------------------------------------------------------
// kv-index 2.0.0

mod kv {
    use super::*;
    use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};

    pub struct KvWriter<'a> {
        index: &'a ChainIndex,
        ids: Vec<u32>,
        maps: Vec<ChainBlockMap>,
        blocks: Vec<StoredBlock>,
        hashes: Vec<SequenceHash>,
        pub errors: usize,
    }

    impl<'a> KvWriter<'a> {
        pub fn new(index: &'a ChainIndex, ids: &[u32]) -> Self {
            Self {
                index,
                ids: ids.to_vec(),
                maps: ids.iter().map(|_| ChainBlockMap::new()).collect(),
                blocks: Vec::new(),
                hashes: Vec::new(),
                errors: 0,
            }
        }
    }

    impl Writer for KvWriter<'_> {
        fn store(&mut self, worker: u32, _: u32, parent: Option<u64>, local: &[u64], seq: &[u64]) {
            let w = worker as usize;
            self.blocks.clear();
            self.blocks
                .extend(local.iter().zip(seq).map(|(l, s)| StoredBlock {
                    seq_hash: SequenceHash(*s),
                    content_hash: ContentHash(*l),
                }));
            if self
                .index
                .apply_stored(
                    self.ids[w],
                    &self.blocks,
                    parent.map(SequenceHash),
                    &mut self.maps[w],
                )
                .is_err()
            {
                self.errors += 1;
            }
        }
        fn remove(&mut self, worker: u32, seq: &[u64]) {
            let w = worker as usize;
            self.hashes.clear();
            self.hashes.extend(seq.iter().map(|h| SequenceHash(*h)));
            self.index
                .apply_removed(self.ids[w], &self.hashes, &mut self.maps[w]);
        }
        fn flush(&mut self) {}
    }

    pub struct KvReader<'a> {
        index: &'a ChainIndex,
        worker_of_id: Vec<u32>,
    }

    impl<'a> KvReader<'a> {
        pub fn new(index: &'a ChainIndex, ids: &[u32]) -> Self {
            let max = ids.iter().copied().max().unwrap_or(0) as usize;
            let mut worker_of_id = vec![u32::MAX; max + 1];
            for (w, id) in ids.iter().enumerate() {
                worker_of_id[*id as usize] = w as u32;
            }
            Self {
                index,
                worker_of_id,
            }
        }
    }

    impl Reader for KvReader<'_> {
        fn lookup(&mut self, local: &[u64], _: &[u64], out: &mut Vec<(u32, u32)>) {
            let map = &self.worker_of_id;
            self.index.score_into(
                local,
                |c: &u64| *c,
                false,
                |id, score| {
                    if let Some(w) = map.get(id as usize) {
                        out.push((*w, score));
                    }
                },
            );
        }
    }

    pub struct KvSubject {
        pub workers: u32,
    }

    fn fresh(workers: u32) -> Result<(ChainIndex, Vec<u32>), String> {
        let index = ChainIndex::with_max_workers(64);
        let ids = (0..workers)
            .map(|w| {
                index
                    .intern_worker(&format!("w{w}"))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        Ok((index, ids))
    }

    fn check(index: &ChainIndex, errors: usize) -> Result<(), String> {
        if errors > 0 {
            return Err(format!("kv-index: {errors} stored events refused"));
        }
        if index.current_size() != 0 {
            return Err(format!(
                "kv-index: {} blocks left after the drain",
                index.current_size()
            ));
        }
        Ok(())
    }

    impl Subject for KvSubject {
        fn name(&self) -> String {
            "kv-index 2.0 score_into".into()
        }
        fn supports(&self, threads: usize) -> bool {
            threads == 1 || threads == 2
        }
        fn synchronous(&self) -> bool {
            true
        }
        fn verify(&self, sim: &Simulation) -> Result<usize, String> {
            let (index, ids) = fresh(self.workers)?;
            let mut single = Pair(KvWriter::new(&index, &ids), KvReader::new(&index, &ids));
            let n = verify(sim, &mut single)?;
            check(&index, single.0.errors)?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String> {
            let (index, ids) = fresh(self.workers)?;
            if threads == 1 {
                let mut single = Pair(KvWriter::new(&index, &ids), KvReader::new(&index, &ids));
                let stats = replay_single(sim, &mut single, pace);
                check(&index, single.0.errors)?;
                Ok(stats)
            } else {
                let errors = std::sync::atomic::AtomicUsize::new(0);
                struct Counting<'a, 'b>(KvWriter<'a>, &'b std::sync::atomic::AtomicUsize);
                impl Writer for Counting<'_, '_> {
                    fn store(&mut self, w: u32, p: u32, parent: Option<u64>, l: &[u64], s: &[u64]) {
                        self.0.store(w, p, parent, l, s);
                    }
                    fn remove(&mut self, w: u32, s: &[u64]) {
                        self.0.remove(w, s);
                    }
                    fn flush(&mut self) {
                        self.1
                            .store(self.0.errors, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                let stats = replay_dual(
                    sim,
                    || Counting(KvWriter::new(&index, &ids), &errors),
                    || KvReader::new(&index, &ids),
                    pace,
                );
                check(&index, errors.load(std::sync::atomic::Ordering::Relaxed))?;
                Ok(stats)
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// dynamo-kv-router 1.6.1

mod dynamo {
    use super::*;
    use dynamo_kv_router::ConcurrentRadixTreeCompressed;
    use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, WorkerTask};
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
        KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
    };

    fn stored(
        id: u64,
        worker: u32,
        parent: Option<u64>,
        local: &[u64],
        seq: &[u64],
    ) -> RouterEvent {
        RouterEvent::new(
            u64::from(worker),
            KvCacheEvent {
                event_id: id,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: local
                        .iter()
                        .zip(seq)
                        .map(|(l, s)| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(*s),
                            tokens_hash: LocalBlockHash(*l),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
                dp_rank: 0,
            },
        )
    }

    fn removed(id: u64, worker: u32, seq: &[u64]) -> RouterEvent {
        RouterEvent::new(
            u64::from(worker),
            KvCacheEvent {
                event_id: id,
                data: KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: seq.iter().map(|h| ExternalSequenceBlockHash(*h)).collect(),
                }),
                dp_rank: 0,
            },
        )
    }

    fn push_scores(m: &OverlapScores, out: &mut Vec<(u32, u32)>) {
        for (w, score) in &m.scores {
            if *score > 0 {
                out.push((w.worker_id as u32, *score));
            }
        }
    }

    // --- CRTC -----------------------------------------------------------------------------

    pub struct CrtcWriter {
        tx: flume::Sender<WorkerTask>,
        next_id: u64,
        pub failed: bool,
    }

    impl Writer for CrtcWriter {
        fn store(&mut self, worker: u32, _: u32, parent: Option<u64>, local: &[u64], seq: &[u64]) {
            self.next_id += 1;
            if self
                .tx
                .send(WorkerTask::Event(stored(
                    self.next_id,
                    worker,
                    parent,
                    local,
                    seq,
                )))
                .is_err()
            {
                self.failed = true;
            }
        }
        fn remove(&mut self, worker: u32, seq: &[u64]) {
            self.next_id += 1;
            if self
                .tx
                .send(WorkerTask::Event(removed(self.next_id, worker, seq)))
                .is_err()
            {
                self.failed = true;
            }
        }
        /// An empty removal with an ack: everything sent before it is applied when it returns.
        fn flush(&mut self) {
            self.next_id += 1;
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            let event = RouterEvent::new(
                0,
                KvCacheEvent {
                    event_id: self.next_id,
                    data: KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: Vec::new(),
                    }),
                    dp_rank: 0,
                },
            );
            if self
                .tx
                .send(WorkerTask::EventWithAck { event, resp: rtx })
                .is_err()
                || rrx.blocking_recv().is_err()
            {
                self.failed = true;
            }
        }
    }

    pub struct CrtcReader {
        tree: Arc<ConcurrentRadixTreeCompressed>,
        query: Vec<LocalBlockHash>,
    }

    impl Reader for CrtcReader {
        fn lookup(&mut self, local: &[u64], _: &[u64], out: &mut Vec<(u32, u32)>) {
            self.query.clear();
            self.query.extend(local.iter().map(|h| LocalBlockHash(*h)));
            push_scores(&self.tree.find_matches_impl(&self.query, false), out);
        }
    }

    pub struct CrtcSingle(pub CrtcWriter, pub CrtcReader);
    impl Writer for CrtcSingle {
        fn store(&mut self, w: u32, p: u32, parent: Option<u64>, l: &[u64], s: &[u64]) {
            self.0.store(w, p, parent, l, s);
        }
        fn remove(&mut self, w: u32, s: &[u64]) {
            self.0.remove(w, s);
        }
        fn flush(&mut self) {
            self.0.flush();
        }
    }
    impl Reader for CrtcSingle {
        fn lookup(&mut self, l: &[u64], s: &[u64], out: &mut Vec<(u32, u32)>) {
            self.1.lookup(l, s, out);
        }
    }

    struct Crtc {
        tree: Arc<ConcurrentRadixTreeCompressed>,
        tx: flume::Sender<WorkerTask>,
        handle: std::thread::JoinHandle<anyhow_result::Result>,
    }

    mod anyhow_result {
        pub type Result = std::result::Result<(), String>;
    }

    fn start() -> Result<Crtc, String> {
        let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
        let (tx, rx) = flume::unbounded::<WorkerTask>();
        let worker_tree = tree.clone();
        let handle = std::thread::Builder::new()
            .name("crtc-events".into())
            .spawn(move || worker_tree.worker(rx, None).map_err(|e| e.to_string()))
            .map_err(|e| e.to_string())?;
        Ok(Crtc { tree, tx, handle })
    }

    fn finish(c: Crtc, failed: bool) -> Result<(), String> {
        if failed {
            return Err("CRTC: its worker thread went away".into());
        }
        let left = c.tree.dump_events().map(|e| {
            e.iter()
                .map(|e| match &e.event.data {
                    KvCacheEventData::Stored(s) => s.blocks.len(),
                    _ => 0,
                })
                .sum::<usize>()
        });
        drop(c.tx);
        c.handle.join().map_err(|_| "CRTC worker panicked")??;
        if left != Some(0) {
            return Err(format!("CRTC: {left:?} blocks left after the drain"));
        }
        Ok(())
    }

    pub struct CrtcSubject;

    impl Subject for CrtcSubject {
        fn name(&self) -> String {
            "dynamo crtc".into()
        }
        fn supports(&self, threads: usize) -> bool {
            threads == 1 || threads == 2
        }
        fn synchronous(&self) -> bool {
            false
        }
        fn verify(&self, sim: &Simulation) -> Result<usize, String> {
            let c = start()?;
            let mut single = CrtcSingle(
                CrtcWriter {
                    tx: c.tx.clone(),
                    next_id: 0,
                    failed: false,
                },
                CrtcReader {
                    tree: c.tree.clone(),
                    query: Vec::new(),
                },
            );
            let n = verify(sim, &mut single);
            single.0.flush();
            let failed = single.0.failed;
            // The writer's sender must go before `finish` joins the worker.
            drop(single);
            finish(c, failed)?;
            let n = n?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String> {
            let c = start()?;
            let failed = std::sync::atomic::AtomicBool::new(false);
            let stats = if threads == 1 {
                let mut single = CrtcSingle(
                    CrtcWriter {
                        tx: c.tx.clone(),
                        next_id: 0,
                        failed: false,
                    },
                    CrtcReader {
                        tree: c.tree.clone(),
                        query: Vec::new(),
                    },
                );
                let stats = replay_single(sim, &mut single, pace);
                failed.store(single.0.failed, std::sync::atomic::Ordering::Relaxed);
                stats
            } else {
                struct Flagging<'b>(CrtcWriter, &'b std::sync::atomic::AtomicBool);
                impl Writer for Flagging<'_> {
                    fn store(&mut self, w: u32, p: u32, parent: Option<u64>, l: &[u64], s: &[u64]) {
                        self.0.store(w, p, parent, l, s);
                    }
                    fn remove(&mut self, w: u32, s: &[u64]) {
                        self.0.remove(w, s);
                    }
                    fn flush(&mut self) {
                        self.0.flush();
                        if self.0.failed {
                            self.1.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
                let (tx, tree) = (c.tx.clone(), c.tree.clone());
                replay_dual(
                    sim,
                    || {
                        Flagging(
                            CrtcWriter {
                                tx,
                                next_id: 0,
                                failed: false,
                            },
                            &failed,
                        )
                    },
                    || CrtcReader {
                        tree,
                        query: Vec::new(),
                    },
                    pace,
                )
            };
            finish(c, failed.load(std::sync::atomic::Ordering::Relaxed))?;
            Ok(stats)
        }
    }

    // --- RadixTree ------------------------------------------------------------------------

    pub struct Radix {
        tree: RadixTree,
        next_id: u64,
        errors: usize,
    }

    impl Writer for Radix {
        fn store(&mut self, worker: u32, _: u32, parent: Option<u64>, local: &[u64], seq: &[u64]) {
            self.next_id += 1;
            if self
                .tree
                .apply_event(stored(self.next_id, worker, parent, local, seq))
                .is_err()
            {
                self.errors += 1;
            }
        }
        fn remove(&mut self, worker: u32, seq: &[u64]) {
            self.next_id += 1;
            if self
                .tree
                .apply_event(removed(self.next_id, worker, seq))
                .is_err()
            {
                self.errors += 1;
            }
        }
        fn flush(&mut self) {}
    }

    impl Reader for Radix {
        fn lookup(&mut self, local: &[u64], _: &[u64], out: &mut Vec<(u32, u32)>) {
            // The tree takes the query by value: building it is part of the op.
            let query = local.iter().map(|h| LocalBlockHash(*h)).collect();
            push_scores(&self.tree.find_matches(query, false), out);
        }
    }

    pub struct RadixSubject;

    fn radix_check(r: &Radix) -> Result<(), String> {
        if r.errors > 0 {
            return Err(format!("RadixTree: {} events refused", r.errors));
        }
        if r.tree.current_size() != 0 {
            return Err(format!(
                "RadixTree: {} blocks left after the drain",
                r.tree.current_size()
            ));
        }
        Ok(())
    }

    impl Subject for RadixSubject {
        fn name(&self) -> String {
            "dynamo radixtree".into()
        }
        fn supports(&self, threads: usize) -> bool {
            threads == 1
        }
        fn synchronous(&self) -> bool {
            true
        }
        fn verify(&self, sim: &Simulation) -> Result<usize, String> {
            let mut r = Radix {
                tree: RadixTree::new(),
                next_id: 0,
                errors: 0,
            };
            let n = verify(sim, &mut r)?;
            radix_check(&r)?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, _: usize, pace: Pace) -> Result<RunStats, String> {
            let mut r = Radix {
                tree: RadixTree::new(),
                next_id: 0,
                errors: 0,
            };
            let stats = replay_single(sim, &mut r, pace);
            radix_check(&r)?;
            Ok(stats)
        }
    }
}

fn main() -> ExitCode {
    let args = match Args::parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let (trace, sim) = match args.simulate() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let all: Vec<(&str, Box<dyn Subject>)> = vec![
        (
            "inferencecache",
            Box::new(OursSubject {
                workers: args.workers,
            }),
        ),
        (
            "kv-index",
            Box::new(kv::KvSubject {
                workers: args.workers,
            }),
        ),
        ("dynamo-crtc", Box::new(dynamo::CrtcSubject)),
        ("dynamo-radix", Box::new(dynamo::RadixSubject)),
        ("probe-flat", probe_flat::flat()),
        ("probe-flat-state", probe_flat::flat_state()),
        ("probe-slots", Box::new(probe_flat::SlotsSubject)),
        ("probe-buckets", Box::new(probe_flat::buckets_plain())),
        (
            "probe-buckets-state",
            Box::new(probe_flat::buckets_with_state()),
        ),
        (
            "reference",
            Box::new(ReferenceSubject {
                workers: args.workers,
            }),
        ),
    ];
    let default = ["inferencecache", "kv-index", "dynamo-crtc", "dynamo-radix"];
    let subjects: Vec<Box<dyn Subject>> = all
        .into_iter()
        .filter(|(key, _)| {
            if args.only.is_empty() {
                default.contains(key)
            } else {
                args.only.iter().any(|o| o == key)
            }
        })
        .map(|(_, s)| s)
        .collect();
    mooncake_bench::main_with(&args, &trace, &sim, &subjects, "")
}
