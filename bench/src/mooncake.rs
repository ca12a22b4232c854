//! Mooncake-format traces replayed as index traffic (issue #44, part 1).
//!
//! A Mooncake trace is one JSON object per line: `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids`, the prompt's prefix blocks of [`TRACE_BLOCK_TOKENS`] tokens
//! (equal ids at equal positions are reusable prefix KV). [`Trace::load`] reads any such file.
//!
//! [`Simulation::run`] turns a trace into the operations an index sees in production: simulated
//! workers, each with an LRU prefix cache of a fixed number of blocks, serve the requests; each
//! request is first looked up (every worker's cached prefix is the expected answer), then served
//! by one worker, which evicts its least recently used blocks (a `Removed` event) and stores the
//! blocks it did not hold (a `Stored` event whose parent is the last block it did hold). The
//! trace is duplicated into `copies` disjoint hash spaces (the copy number is mixed into every
//! block's content hash) to reach tens of millions of block operations, and the run ends with a
//! drain: every worker evicts everything, so a correct index ends empty.
//!
//! Invariants the simulator keeps (and its tests check):
//! - a worker's cache is prefix-closed: a request touches its blocks leaf first and root last,
//!   so a parent is always more recently used than any child and LRU evicts leaves first (the
//!   order vLLM's free-block queue gives); a `Removed` event therefore never orphans a block;
//! - a worker never holds more than `capacity` blocks; a request longer than the cache stores
//!   only its first `capacity` blocks;
//! - block identity is the rolling hash of the prefix ([`next_prefix`]), so one content hash at
//!   two positions or after two different prefixes is two blocks, as in every index here.
//!
//! The replay driver ([`replay_single`], [`replay_dual`]) plays the operations into an index
//! through the [`Writer`] / [`Reader`] traits, closed-loop (as fast as it goes) or paced on a
//! timetable (every block of every operation counts; latency is measured from each lookup's
//! intended start, so a late index pays for its queue). [`verify`] checks every lookup's
//! per-worker score against the simulator's truth, which is how all indexes are shown to give
//! the same scores.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use inferencecache_engine::fingerprint::next_prefix;

use crate::w1m::splitmix64;

/// Tokens per Mooncake `hash_ids` block.
pub const TRACE_BLOCK_TOKENS: i32 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Arrival, ms from the trace start.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Prefix block ids (512 tokens each).
    pub hash_ids: Vec<u64>,
}

/// A parsed Mooncake-format trace, in file order (which is arrival order).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The requests.
    pub requests: Vec<Request>,
}

#[derive(serde::Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

impl Trace {
    /// Parses JSON lines (blank lines skipped); an error names the line.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requests = Vec::new();
        for (number, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let parsed: Line = serde_json::from_str(line)
                .map_err(|e| format!("trace line {}: {e}", number + 1))?;
            if !parsed.timestamp.is_finite() || parsed.timestamp < 0.0 {
                return Err(format!("trace line {}: bad timestamp", number + 1));
            }
            requests.push(Request {
                timestamp_ms: parsed.timestamp as u64,
                input_length: parsed.input_length,
                output_length: parsed.output_length,
                hash_ids: parsed.hash_ids,
            });
        }
        Ok(Self { requests })
    }

    /// Reads and parses a file.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read trace {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The first `n` requests.
    #[must_use]
    pub fn truncated(&self, n: usize) -> Self {
        Self {
            requests: self.requests.iter().take(n).cloned().collect(),
        }
    }

    /// Distinct prefix blocks (the working set, in blocks): distinct (prefix, id) paths.
    #[must_use]
    pub fn working_set_blocks(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        for r in &self.requests {
            let mut prev = 0u64;
            for (position, id) in r.hash_ids.iter().enumerate() {
                prev = if position == 0 {
                    content_hash(0, *id)
                } else {
                    next_prefix(prev, content_hash(0, *id))
                };
                seen.insert(prev);
            }
        }
        seen.len()
    }
}

/// The content hash of block `id` in duplicate `copy` (disjoint hash spaces per copy).
#[inline]
#[must_use]
pub fn content_hash(copy: u32, id: u64) -> u64 {
    splitmix64(id ^ (u64::from(copy) << 40) ^ 0x6d6f_6f6e_6361_6b65)
}

/// An LRU prefix cache of a fixed number of blocks (keys are sequence hashes).
#[derive(Debug, Default, Clone)]
pub struct LruCache {
    capacity: usize,
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

impl LruCache {
    /// An empty cache of `capacity` blocks.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Blocks held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    /// True when empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Capacity in blocks.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `hash` is held.
    #[must_use]
    pub fn contains(&self, hash: u64) -> bool {
        self.stamp_of.contains_key(&hash)
    }

    /// Leading blocks of `seq` held.
    #[must_use]
    pub fn prefix_len(&self, seq: &[u64]) -> usize {
        seq.iter().take_while(|h| self.contains(**h)).count()
    }

    /// Marks `hash` used at `stamp` (inserting it when absent; the caller makes room first).
    pub fn touch(&mut self, hash: u64, stamp: u64) {
        if let Some(old) = self.stamp_of.insert(hash, stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(stamp, hash);
    }

    /// Removes and returns the least recently used block.
    pub fn pop_lru(&mut self) -> Option<u64> {
        let (_, hash) = self.by_stamp.pop_first()?;
        self.stamp_of.remove(&hash);
        Some(hash)
    }

    /// Iterates the held hashes, least recently used first.
    pub fn in_lru_order(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_stamp.values().copied()
    }

    /// Iterates the held hashes (any order).
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.stamp_of.keys().copied()
    }
}

/// One index operation. Ranges index [`Simulation`]'s arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Look up a request's blocks: `local[start..start+len]` / `seq[...]`; its expected scores
    /// are `expected[expected_start..expected_end]`.
    Lookup {
        /// First block in the arenas.
        start: u32,
        /// Blocks.
        len: u32,
        /// Expected (worker, blocks) pairs, by worker, non-zero only.
        expected_start: u32,
        /// End of that range.
        expected_end: u32,
    },
    /// `worker` stores blocks `start..start+len` of the arenas, at chain position `position`
    /// (the parent is `seq[start-1]` when `position > 0`).
    Store {
        /// Worker.
        worker: u32,
        /// First block in the arenas.
        start: u32,
        /// Blocks.
        len: u32,
        /// Chain position of the first block.
        position: u32,
    },
    /// `worker` evicts `removed[start..start+len]` (leaves before their parents).
    Remove {
        /// Worker.
        worker: u32,
        /// First hash in `removed`.
        start: u32,
        /// Hashes.
        len: u32,
    },
}

impl Op {
    /// Block operations this op counts for.
    #[inline]
    #[must_use]
    pub fn blocks(&self) -> u64 {
        match *self {
            Op::Lookup { len, .. } | Op::Store { len, .. } | Op::Remove { len, .. } => {
                u64::from(len)
            }
        }
    }
}

/// Simulator parameters.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    /// Simulated workers.
    pub workers: u32,
    /// LRU capacity of each, in blocks.
    pub capacity: usize,
    /// Disjoint duplicates of the trace.
    pub copies: u32,
    /// Seed of the (uniform) worker choice.
    pub seed: u64,
}

/// The operations of a replay, with the arenas they index and the expected lookup answers.
#[derive(Debug, Default)]
pub struct Simulation {
    /// Content hash per request block.
    pub local: Vec<u64>,
    /// Sequence (rolling prefix) hash per request block.
    pub seq: Vec<u64>,
    /// Evicted sequence hashes.
    pub removed: Vec<u64>,
    /// Expected (worker, matched blocks) per lookup.
    pub expected: Vec<(u32, u32)>,
    /// The operations in order.
    pub ops: Vec<Op>,
    /// `ops[drain_start..]` is the final drain.
    pub drain_start: usize,
    /// Blocks held by all workers together when the drain starts.
    pub held_before_drain: usize,
    /// Peak of blocks held by all workers together.
    pub peak_held: usize,
    /// Blocks looked up, stored and removed.
    pub lookup_blocks: u64,
    /// Stored blocks.
    pub stored_blocks: u64,
    /// Removed blocks (drain included).
    pub removed_blocks: u64,
    /// Requests replayed (all copies).
    pub requests: u64,
    /// Lookup blocks found in the serving worker's cache (its hit rate numerator).
    pub hit_blocks: u64,
    /// The workers' caches as the drain found them (kept allocated, see [`Simulation::run`]).
    pub caches: Vec<LruCache>,
}

/// Removals per `Remove` op during the drain.
const DRAIN_BATCH: usize = 256;

impl Simulation {
    /// Runs the simulator over `trace` (see the module docs).
    #[must_use]
    pub fn run(trace: &Trace, cfg: SimConfig) -> Self {
        let workers = cfg.workers.max(1);
        let capacity = cfg.capacity.max(1);
        let mut caches: Vec<LruCache> = (0..workers).map(|_| LruCache::new(capacity)).collect();
        let mut sim = Simulation::default();
        let mut stamp = 0u64;
        let mut held = 0usize;
        let mut request_number = 0u64;
        for request in &trace.requests {
            for copy in 0..cfg.copies.max(1) {
                request_number += 1;
                let n = request.hash_ids.len();
                if n == 0 {
                    continue;
                }
                let start = sim.local.len();
                let mut prev = 0u64;
                for (position, id) in request.hash_ids.iter().enumerate() {
                    let local = content_hash(copy, *id);
                    prev = if position == 0 {
                        local
                    } else {
                        next_prefix(prev, local)
                    };
                    sim.local.push(local);
                    sim.seq.push(prev);
                }
                let seq = &sim.seq[start..start + n];
                // The lookup and its truth, before the serving worker changes anything.
                let expected_start = sim.expected.len();
                for (w, cache) in caches.iter().enumerate() {
                    let matched = cache.prefix_len(seq);
                    if matched > 0 {
                        sim.expected.push((w as u32, matched as u32));
                    }
                }
                sim.ops.push(Op::Lookup {
                    start: start as u32,
                    len: n as u32,
                    expected_start: expected_start as u32,
                    expected_end: sim.expected.len() as u32,
                });
                sim.lookup_blocks += n as u64;

                let w = (splitmix64(cfg.seed ^ request_number) % u64::from(workers)) as usize;
                let cache = &mut caches[w];
                let hit = cache.prefix_len(seq);
                sim.hit_blocks += hit as u64;
                let keep = n.min(capacity);
                // Touch leaf first, root last: parents stay more recent than children.
                for j in (0..keep).rev() {
                    if j < hit {
                        stamp += 1;
                        cache.touch(seq[j], stamp);
                    }
                }
                let misses = keep.saturating_sub(hit);
                let over = (cache.len() + misses).saturating_sub(capacity);
                if over > 0 {
                    let removed_start = sim.removed.len();
                    for _ in 0..over {
                        if let Some(h) = cache.pop_lru() {
                            sim.removed.push(h);
                        }
                    }
                    let len = sim.removed.len() - removed_start;
                    held -= len;
                    sim.removed_blocks += len as u64;
                    sim.ops.push(Op::Remove {
                        worker: w as u32,
                        start: removed_start as u32,
                        len: len as u32,
                    });
                }
                if misses > 0 {
                    // New blocks: leaf first, so the new leaf is the oldest of the request.
                    let base = stamp;
                    for j in (hit..keep).rev() {
                        stamp += 1;
                        cache.touch(seq[j], stamp);
                    }
                    // The hit prefix must stay newer than its new children.
                    for j in (0..hit).rev() {
                        stamp += 1;
                        cache.touch(seq[j], stamp);
                    }
                    debug_assert!(stamp > base);
                    held += misses;
                    sim.stored_blocks += misses as u64;
                    sim.ops.push(Op::Store {
                        worker: w as u32,
                        start: (start + hit) as u32,
                        len: misses as u32,
                        position: hit as u32,
                    });
                }
                sim.peak_held = sim.peak_held.max(held);
            }
        }
        sim.requests = request_number;
        sim.drain_start = sim.ops.len();
        sim.held_before_drain = held;
        // The drain reads the caches in LRU order without freeing them: the caches stay
        // allocated inside the simulation, so the index under test cannot reuse their memory
        // and its RSS growth is its own.
        for (w, cache) in caches.iter().enumerate() {
            let order: Vec<u64> = cache.in_lru_order().collect();
            for chunk in order.chunks(DRAIN_BATCH) {
                let removed_start = sim.removed.len();
                sim.removed.extend_from_slice(chunk);
                sim.removed_blocks += chunk.len() as u64;
                sim.ops.push(Op::Remove {
                    worker: w as u32,
                    start: removed_start as u32,
                    len: chunk.len() as u32,
                });
            }
        }
        sim.caches = caches;
        sim
    }

    /// Every block operation of the run (lookups, stores, removals, drain included).
    #[must_use]
    pub fn total_blocks(&self) -> u64 {
        self.lookup_blocks + self.stored_blocks + self.removed_blocks
    }

    /// Lookup operations.
    #[must_use]
    pub fn lookups(&self) -> usize {
        self.ops
            .iter()
            .filter(|o| matches!(o, Op::Lookup { .. }))
            .count()
    }
}

/// The event side of an index under replay.
pub trait Writer {
    /// `worker` stores `seq` (content hashes `local`) at chain `position`, after `parent`.
    fn store(
        &mut self,
        worker: u32,
        position: u32,
        parent: Option<u64>,
        local: &[u64],
        seq: &[u64],
    );
    /// `worker` evicts `seq` (leaves first).
    fn remove(&mut self, worker: u32, seq: &[u64]);
    /// Waits until every event sent is applied (asynchronous indexes); a no-op otherwise.
    fn flush(&mut self);
}

/// The lookup side of an index under replay.
pub trait Reader {
    /// Scores the request (`local` content hashes, `seq` rolling hashes): pushes (worker,
    /// matched blocks) for each worker that matches at least one block, any order.
    fn lookup(&mut self, local: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>);
}

/// An index's two sides as one object, for one thread and for [`verify`]: events go to the
/// writer `.0`, lookups to the reader `.1`.
pub struct Pair<W, R>(pub W, pub R);

impl<W: Writer, R> Writer for Pair<W, R> {
    fn store(
        &mut self,
        worker: u32,
        position: u32,
        parent: Option<u64>,
        local: &[u64],
        seq: &[u64],
    ) {
        self.0.store(worker, position, parent, local, seq);
    }
    fn remove(&mut self, worker: u32, seq: &[u64]) {
        self.0.remove(worker, seq);
    }
    fn flush(&mut self) {
        self.0.flush();
    }
}

impl<W, R: Reader> Reader for Pair<W, R> {
    fn lookup(&mut self, local: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
        self.1.lookup(local, seq, out);
    }
}

/// How fast to offer the operations.
#[derive(Debug, Clone, Copy)]
pub enum Pace {
    /// As fast as the index goes.
    ClosedLoop,
    /// Block operations per second on a fixed timetable.
    Rate(f64),
}

/// What one replay measured.
#[derive(Debug, Clone)]
pub struct RunStats {
    /// Wall time from the first operation to the last one applied (drain and flush included).
    pub elapsed: Duration,
    /// Block operations.
    pub blocks: u64,
    /// Offered rate (blocks/s), `None` when closed-loop.
    pub offered: Option<f64>,
    /// Lookup latency (ns), from the intended start when paced (coordinated-omission
    /// corrected: a lookup that waits behind a late event pays for it).
    pub latency: Histogram<u64>,
    /// Lookup service time (ns): the lookup call alone.
    pub service: Histogram<u64>,
    /// `VmRSS` growth from the start to the start of the drain (bytes).
    pub rss_growth: u64,
    /// Order-independent checksum over all lookup answers.
    pub checksum: u64,
}

impl RunStats {
    /// Achieved block operations per second.
    #[must_use]
    pub fn rate(&self) -> f64 {
        self.blocks as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Achieved over offered (1 when closed-loop).
    #[must_use]
    pub fn kept(&self) -> f64 {
        self.offered.map_or(1.0, |o| self.rate() / o)
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static histogram bounds")
}

/// Answer checksum of one lookup (order independent).
#[inline]
fn answer_sum(out: &[(u32, u32)]) -> u64 {
    out.iter().fold(0u64, |acc, (w, b)| {
        acc.wrapping_add(splitmix64((u64::from(*w) << 32) | u64::from(*b)))
    })
}

/// Intended start of the op that begins after `blocks_before` block operations.
#[inline]
fn wait_until(start: Instant, pace: Pace, blocks_before: u64) -> Instant {
    match pace {
        Pace::ClosedLoop => Instant::now(),
        Pace::Rate(rate) => {
            let due = start + Duration::from_secs_f64(blocks_before as f64 / rate);
            loop {
                let now = Instant::now();
                if now >= due {
                    return due;
                }
                if due - now > Duration::from_micros(200) {
                    std::thread::sleep(due - now - Duration::from_micros(100));
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

#[inline]
fn apply<W: Writer>(sim: &Simulation, op: &Op, w: &mut W) {
    match *op {
        Op::Store {
            worker,
            start,
            len,
            position,
        } => {
            let (s, e) = (start as usize, (start + len) as usize);
            let parent = (position > 0).then(|| sim.seq[s - 1]);
            w.store(worker, position, parent, &sim.local[s..e], &sim.seq[s..e]);
        }
        Op::Remove { worker, start, len } => {
            w.remove(worker, &sim.removed[start as usize..(start + len) as usize]);
        }
        Op::Lookup { .. } => {}
    }
}

/// One thread does everything in trace order. `index` is both sides.
pub fn replay_single<I: Writer + Reader>(sim: &Simulation, index: &mut I, pace: Pace) -> RunStats {
    let mut latency = histogram();
    let mut service = histogram();
    let mut out = Vec::with_capacity(64);
    let mut checksum = 0u64;
    let rss0 = crate::measure::vm_rss_bytes();
    let mut rss_growth = 0;
    let mut blocks_before = 0u64;
    let start = Instant::now();
    for (i, op) in sim.ops.iter().enumerate() {
        if i == sim.drain_start {
            index.flush();
            rss_growth = crate::measure::vm_rss_bytes().saturating_sub(rss0);
        }
        let due = wait_until(start, pace, blocks_before);
        blocks_before += op.blocks();
        if let Op::Lookup { start: s, len, .. } = *op {
            let (s, e) = (s as usize, (s + len) as usize);
            out.clear();
            let begun = Instant::now();
            index.lookup(&sim.local[s..e], &sim.seq[s..e], &mut out);
            let done = Instant::now();
            checksum = checksum.wrapping_add(answer_sum(&out));
            service.saturating_record(((done - begun).as_nanos() as u64).max(1));
            latency.saturating_record(((done - due.min(begun)).as_nanos() as u64).max(1));
        } else {
            apply(sim, op, index);
        }
    }
    index.flush();
    RunStats {
        elapsed: start.elapsed(),
        blocks: sim.total_blocks(),
        offered: match pace {
            Pace::ClosedLoop => None,
            Pace::Rate(r) => Some(r),
        },
        latency,
        service,
        rss_growth,
        checksum,
    }
}

/// Two threads: one applies the events, the other runs the lookups, both on the same
/// timetable (each op keeps its place in the trace's block count). Each side is built on its
/// own thread (a lookup scratch need not be `Send`).
pub fn replay_dual<W: Writer, R: Reader>(
    sim: &Simulation,
    make_writer: impl FnOnce() -> W + Send,
    make_reader: impl FnOnce() -> R + Send,
    pace: Pace,
) -> RunStats {
    let rss0 = crate::measure::vm_rss_bytes();
    let start = Instant::now();
    let (events_done, rss_growth, (latency, service, checksum, lookups_done)) =
        std::thread::scope(|s| {
            let events = s.spawn(move || {
                let mut writer = make_writer();
                let mut blocks_before = 0u64;
                let mut rss_growth = 0;
                for (i, op) in sim.ops.iter().enumerate() {
                    if i == sim.drain_start {
                        writer.flush();
                        rss_growth = crate::measure::vm_rss_bytes().saturating_sub(rss0);
                    }
                    if !matches!(op, Op::Lookup { .. }) {
                        wait_until(start, pace, blocks_before);
                        apply(sim, op, &mut writer);
                    }
                    blocks_before += op.blocks();
                }
                writer.flush();
                (start.elapsed(), rss_growth)
            });
            let lookups = s.spawn(move || {
                let mut reader = make_reader();
                let mut latency = histogram();
                let mut service = histogram();
                let mut out = Vec::with_capacity(64);
                let mut checksum = 0u64;
                let mut blocks_before = 0u64;
                for op in &sim.ops {
                    if let Op::Lookup { start: st, len, .. } = *op {
                        let due = wait_until(start, pace, blocks_before);
                        let (a, e) = (st as usize, (st + len) as usize);
                        out.clear();
                        let begun = Instant::now();
                        reader.lookup(&sim.local[a..e], &sim.seq[a..e], &mut out);
                        let done = Instant::now();
                        checksum = checksum.wrapping_add(answer_sum(&out));
                        service.saturating_record(((done - begun).as_nanos() as u64).max(1));
                        latency
                            .saturating_record(((done - due.min(begun)).as_nanos() as u64).max(1));
                    }
                    blocks_before += op.blocks();
                }
                (latency, service, checksum, start.elapsed())
            });
            let (done, rss) = events.join().expect("event thread panicked");
            (done, rss, lookups.join().expect("lookup thread panicked"))
        });
    RunStats {
        elapsed: events_done.max(lookups_done),
        blocks: sim.total_blocks(),
        offered: match pace {
            Pace::ClosedLoop => None,
            Pace::Rate(r) => Some(r),
        },
        latency,
        service,
        rss_growth,
        checksum,
    }
}

/// Plays every operation in order with a flush before each lookup and checks each answer
/// against the simulator's truth; returns the number of lookups checked, or the first
/// mismatch.
pub fn verify<I: Writer + Reader>(sim: &Simulation, index: &mut I) -> Result<usize, String> {
    let mut out = Vec::with_capacity(64);
    let mut checked = 0;
    let mut pending = false;
    for (i, op) in sim.ops.iter().enumerate() {
        if let Op::Lookup {
            start,
            len,
            expected_start,
            expected_end,
        } = *op
        {
            if pending {
                index.flush();
                pending = false;
            }
            let (s, e) = (start as usize, (start + len) as usize);
            out.clear();
            index.lookup(&sim.local[s..e], &sim.seq[s..e], &mut out);
            out.sort_unstable();
            let want = &sim.expected[expected_start as usize..expected_end as usize];
            if out != want {
                return Err(format!(
                    "op {i}: lookup of {len} blocks answered {out:?}, the workers hold {want:?}"
                ));
            }
            checked += 1;
        } else {
            apply(sim, op, index);
            pending = true;
        }
    }
    Ok(checked)
}

/// The expected checksum of a sequential replay (every answer as the truth gives it).
#[must_use]
pub fn expected_checksum(sim: &Simulation) -> u64 {
    sim.ops.iter().fold(0u64, |acc, op| match *op {
        Op::Lookup {
            expected_start,
            expected_end,
            ..
        } => acc.wrapping_add(answer_sum(
            &sim.expected[expected_start as usize..expected_end as usize],
        )),
        _ => acc,
    })
}

/// A plain reference index (per-worker hash sets): the model the indexes are checked against
/// when no peer is built.
#[derive(Debug, Default)]
pub struct Reference {
    held: Vec<std::collections::HashSet<u64>>,
}

impl Reference {
    /// Empty, for `workers` workers.
    #[must_use]
    pub fn new(workers: u32) -> Self {
        Self {
            held: (0..workers).map(|_| Default::default()).collect(),
        }
    }

    /// Blocks held in total.
    #[must_use]
    pub fn len(&self) -> usize {
        self.held.iter().map(std::collections::HashSet::len).sum()
    }

    /// True when nothing is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Writer for Reference {
    fn store(&mut self, worker: u32, _: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
        if let Some(set) = self.held.get_mut(worker as usize) {
            set.extend(seq.iter().copied());
        }
    }
    fn remove(&mut self, worker: u32, seq: &[u64]) {
        if let Some(set) = self.held.get_mut(worker as usize) {
            for h in seq {
                set.remove(h);
            }
        }
    }
    fn flush(&mut self) {}
}

impl Reader for Reference {
    fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
        for (w, set) in self.held.iter().enumerate() {
            let n = seq.iter().take_while(|h| set.contains(h)).count();
            if n > 0 {
                out.push((w as u32, n as u32));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> Trace {
        Trace::parse(
            r#"{"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3]}
{"timestamp": 1, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 4]}

{"timestamp": 2.5, "input_length": 3000, "output_length": 5, "hash_ids": [0, 1, 2, 3, 5, 6]}
{"timestamp": 3, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}
{"timestamp": 4, "input_length": 900, "output_length": 5, "hash_ids": [0, 9]}"#,
        )
        .expect("valid trace")
    }

    #[test]
    fn parses_and_rejects_bad_lines() {
        let t = trace();
        assert_eq!(t.requests.len(), 5);
        assert_eq!(t.requests[2].timestamp_ms, 2);
        assert_eq!(t.requests[2].hash_ids, vec![0, 1, 2, 3, 5, 6]);
        assert_eq!(t.working_set_blocks(), 10);
        let e = Trace::parse("{\"timestamp\": 0}\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn lru_evicts_least_recent() {
        let mut c = LruCache::new(2);
        c.touch(1, 1);
        c.touch(2, 2);
        c.touch(1, 3);
        assert_eq!(c.pop_lru(), Some(2));
        assert_eq!(c.pop_lru(), Some(1));
        assert_eq!(c.pop_lru(), None);
    }

    /// Replays the ops into the reference and checks every invariant the module docs state.
    fn check_invariants(sim: &Simulation, cfg: SimConfig) {
        let mut model: Vec<std::collections::HashSet<u64>> =
            (0..cfg.workers).map(|_| Default::default()).collect();
        let mut stored = 0u64;
        let mut removed = 0u64;
        for op in &sim.ops {
            match *op {
                Op::Store {
                    worker,
                    start,
                    len,
                    position,
                } => {
                    let set = &mut model[worker as usize];
                    if position > 0 {
                        assert!(set.contains(&sim.seq[start as usize - 1]), "parent held");
                    }
                    for h in &sim.seq[start as usize..(start + len) as usize] {
                        assert!(set.insert(*h), "a stored block was not held before");
                    }
                    stored += u64::from(len);
                    assert!(set.len() <= cfg.capacity, "capacity");
                }
                Op::Remove { worker, start, len } => {
                    let set = &mut model[worker as usize];
                    for h in &sim.removed[start as usize..(start + len) as usize] {
                        assert!(set.remove(h), "a removed block was held");
                    }
                    removed += u64::from(len);
                }
                Op::Lookup { .. } => {}
            }
            // Prefix closure: every held block's parent is held (checked on the request arena:
            // a held seq at position > 0 has its predecessor held).
        }
        assert!(
            model.iter().all(std::collections::HashSet::is_empty),
            "drained"
        );
        assert_eq!(stored, sim.stored_blocks);
        assert_eq!(removed, sim.removed_blocks);
        assert_eq!(stored, removed, "everything stored is removed by the end");
    }

    /// Prefix closure after every op: a held block at position p > 0 of some request has its
    /// parent (position p - 1 of that request) held by the same worker.
    fn check_prefix_closure(sim: &Simulation, workers: u32) {
        let mut parent_of: HashMap<u64, u64> = HashMap::new();
        let mut position_start = Vec::new();
        for op in &sim.ops {
            if let Op::Lookup { start, len, .. } = *op {
                position_start.push((start, len));
                for j in 1..len as usize {
                    let s = start as usize + j;
                    parent_of.insert(sim.seq[s], sim.seq[s - 1]);
                }
            }
        }
        let mut model: Vec<std::collections::HashSet<u64>> =
            (0..workers).map(|_| Default::default()).collect();
        for op in &sim.ops {
            match *op {
                Op::Store {
                    worker, start, len, ..
                } => {
                    model[worker as usize]
                        .extend(sim.seq[start as usize..(start + len) as usize].iter());
                }
                Op::Remove { worker, start, len } => {
                    for h in &sim.removed[start as usize..(start + len) as usize] {
                        model[worker as usize].remove(h);
                    }
                }
                Op::Lookup { .. } => {}
            }
            for set in &model {
                for h in set {
                    if let Some(p) = parent_of.get(h) {
                        assert!(set.contains(p), "orphaned block {h:#x}");
                    }
                }
            }
        }
    }

    #[test]
    fn simulator_invariants_small_caches() {
        for capacity in [1, 2, 3, 5, 8, 100] {
            for workers in [1, 2, 3] {
                let cfg = SimConfig {
                    workers,
                    capacity,
                    copies: 2,
                    seed: 7,
                };
                let sim = Simulation::run(&trace(), cfg);
                check_invariants(&sim, cfg);
                check_prefix_closure(&sim, workers);
                let mut reference = Reference::new(workers);
                let checked = verify(&sim, &mut reference).expect("reference is exact");
                assert_eq!(checked, 10);
                assert!(reference.is_empty());
            }
        }
    }

    #[test]
    fn expected_scores_by_hand() {
        // One worker, room for everything, one copy: request 2 matches [0, 1] of request 1,
        // request 3 matches [0, 1, 2, 3], request 4 nothing, request 5 matches [0].
        let cfg = SimConfig {
            workers: 1,
            capacity: 100,
            copies: 1,
            seed: 0,
        };
        let sim = Simulation::run(&trace(), cfg);
        let answers: Vec<Vec<(u32, u32)>> = sim
            .ops
            .iter()
            .filter_map(|op| match *op {
                Op::Lookup {
                    expected_start,
                    expected_end,
                    ..
                } => Some(sim.expected[expected_start as usize..expected_end as usize].to_vec()),
                _ => None,
            })
            .collect();
        assert_eq!(
            answers,
            vec![vec![], vec![(0, 2)], vec![(0, 4)], vec![], vec![(0, 1)]]
        );
        assert_eq!(sim.stored_blocks, 10);
        assert_eq!(sim.held_before_drain, 10);
        assert_eq!(sim.lookup_blocks, 17);
        assert_eq!(sim.total_blocks(), 17 + 10 + 10);
        assert_eq!(expected_checksum(&sim), {
            let mut r = Reference::new(1);
            replay_single(&sim, &mut r, Pace::ClosedLoop).checksum
        });
    }

    #[test]
    fn copies_are_disjoint() {
        let cfg = SimConfig {
            workers: 1,
            capacity: 100,
            copies: 2,
            seed: 0,
        };
        let sim = Simulation::run(&trace(), cfg);
        // Copy 1 of request 1 matches nothing although copy 0 stored the same ids.
        let second = sim
            .ops
            .iter()
            .filter(|o| matches!(o, Op::Lookup { .. }))
            .nth(1);
        match second {
            Some(Op::Lookup {
                expected_start,
                expected_end,
                ..
            }) => assert_eq!(expected_start, expected_end),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(sim.held_before_drain, 20);
    }
}
