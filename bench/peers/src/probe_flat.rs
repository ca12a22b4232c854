//! Design probes for issue #44, not products: what a flat map from block hash to the set of
//! workers holding it does on the Mooncake replay, against the run layout of InferenceCache and
//! kv-index's run tree (`docs/perf-log.md`, "Flat layouts on the Mooncake replay"). A stored
//! block sets its worker's bit, a removed one clears it (the entry goes with its last bit), and a
//! lookup probes the request's blocks in order, ANDing the bits, until no worker is left. None of
//! them is in the default `--index` set.
//!
//! - `probe-flat`: std's `HashMap` (one thread, no lock, no concurrent reader, no per-holder
//!   state): the least work of a flat layout on this trace.
//! - `probe-flat-state`: the same with 16 bytes of state per holder, as InferenceCache keeps
//!   (`last_seen`, tier, generation, token count).
//! - `probe-slots`: the engine's own key table (`raw/slots`) as the map, lock-free readers, one
//!   and two threads.
//! - `probe-buckets`: a concurrent table of one-line buckets (a probe reads one line), one and two
//!   threads.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use inferencecache_bench::mooncake::{
    Pace, Reader, RunStats, Simulation, Writer, replay_single, verify,
};
use inferencecache_bench::mooncake_bench::Subject;

/// The keys are block hashes already: one multiply spreads them over the table.
#[derive(Default)]
struct Spread(u64);

impl Hasher for Spread {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = (value ^ (value >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// `probe-flat`: block hash → bit set of its holders (workers < 64).
#[derive(Default)]
struct FlatMap {
    holders: HashMap<u64, u64, BuildHasherDefault<Spread>>,
}

impl Writer for FlatMap {
    fn store(&mut self, worker: u32, _: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
        let bit = 1u64 << (worker % 64);
        for key in seq {
            *self.holders.entry(*key).or_insert(0) |= bit;
        }
    }
    fn remove(&mut self, worker: u32, seq: &[u64]) {
        let bit = 1u64 << (worker % 64);
        for key in seq {
            if let Some(bits) = self.holders.get_mut(key) {
                *bits &= !bit;
                if *bits == 0 {
                    self.holders.remove(key);
                }
            }
        }
    }
    fn flush(&mut self) {}
}

impl Reader for FlatMap {
    fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
        let mut alive = u64::MAX;
        let mut matched = 0u32;
        for key in seq {
            let bits = self.holders.get(key).copied().unwrap_or(0);
            let dropped = alive & !bits;
            if matched > 0 {
                push_each(dropped, matched, out);
            }
            alive &= bits;
            if alive == 0 {
                return;
            }
            matched += 1;
        }
        push_each(alive, matched, out);
    }
}

fn push_each(mut workers: u64, blocks: u32, out: &mut Vec<(u32, u32)>) {
    while workers != 0 {
        out.push((workers.trailing_zeros(), blocks));
        workers &= workers - 1;
    }
}

/// The probe as a subject (one thread, up to 64 workers).
pub struct FlatSubject;

impl Subject for FlatSubject {
    fn name(&self) -> String {
        "probe: flat map".into()
    }
    fn supports(&self, threads: usize) -> bool {
        threads == 1
    }
    fn synchronous(&self) -> bool {
        true
    }
    fn verify(&self, sim: &Simulation) -> Result<usize, String> {
        let mut map = FlatMap::default();
        let n = verify(sim, &mut map)?;
        empty(&map)?;
        Ok(n)
    }
    fn run(&self, sim: &Simulation, _: usize, pace: Pace) -> Result<RunStats, String> {
        let mut map = FlatMap::default();
        let stats = replay_single(sim, &mut map, pace);
        empty(&map)?;
        Ok(stats)
    }
}

fn empty(map: &FlatMap) -> Result<(), String> {
    match map.holders.len() {
        0 => Ok(()),
        left => Err(format!("probe-flat: {left} blocks left after the drain")),
    }
}

/// One block's holders with 16 bytes of state each (what InferenceCache keeps per holder: its
/// `last_seen`, tier, generation and token count): the first holder inline, the others in a
/// vector allocated when a second worker stores the block.
struct Held {
    bits: u64,
    first: HolderState,
    // Boxed: a block of one holder (most of them here) keeps its entry 16 bytes smaller.
    #[allow(clippy::box_collection)]
    rest: Option<Box<Vec<HolderState>>>,
}

/// A worker and its 16 bytes of state.
type HolderState = (u32, [u64; 2]);

/// [`FlatMap`] with per-holder state: `--index probe-flat-state`.
#[derive(Default)]
struct FlatStateMap {
    blocks: HashMap<u64, Held, BuildHasherDefault<Spread>>,
    stamp: u64,
}

impl Writer for FlatStateMap {
    fn store(&mut self, worker: u32, position: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
        let bit = 1u64 << (worker % 64);
        self.stamp += 1;
        for (i, key) in seq.iter().enumerate() {
            let state = [self.stamp, u64::from(position) + i as u64];
            match self.blocks.entry(*key) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Held {
                        bits: bit,
                        first: (worker, state),
                        rest: None,
                    });
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    let held = o.get_mut();
                    if held.bits & bit != 0 {
                        if held.first.0 == worker {
                            held.first.1 = state;
                        } else if let Some(entry) = held
                            .rest
                            .as_mut()
                            .and_then(|r| r.iter_mut().find(|(w, _)| *w == worker))
                        {
                            entry.1 = state;
                        }
                    } else {
                        held.bits |= bit;
                        held.rest
                            .get_or_insert_with(Default::default)
                            .push((worker, state));
                    }
                }
            }
        }
    }
    fn remove(&mut self, worker: u32, seq: &[u64]) {
        let bit = 1u64 << (worker % 64);
        for key in seq {
            let Some(held) = self.blocks.get_mut(key) else {
                continue;
            };
            if held.bits & bit == 0 {
                continue;
            }
            held.bits &= !bit;
            if held.bits == 0 {
                self.blocks.remove(key);
                continue;
            }
            let rest = held.rest.as_mut().expect("a second holder is in the rest");
            if held.first.0 == worker {
                held.first = rest.pop().expect("a second holder");
            } else if let Some(at) = rest.iter().position(|(w, _)| *w == worker) {
                rest.swap_remove(at);
            }
            if rest.is_empty() {
                held.rest = None;
            }
        }
    }
    fn flush(&mut self) {}
}

impl Reader for FlatStateMap {
    fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
        let mut alive = u64::MAX;
        let mut matched = 0u32;
        // The oldest stamp seen over the match: the per-holder state a lookup reads.
        let mut oldest = u64::MAX;
        for key in seq {
            let (bits, stamp) = self
                .blocks
                .get(key)
                .map_or((0, u64::MAX), |h| (h.bits, h.first.1[0]));
            oldest = oldest.min(stamp);
            let dropped = alive & !bits;
            if matched > 0 {
                push_each(dropped, matched, out);
            }
            alive &= bits;
            if alive == 0 {
                break;
            }
            matched += 1;
        }
        if alive != 0 {
            push_each(alive, matched, out);
        }
        std::hint::black_box(oldest);
    }
}

/// The probe with per-holder state as a subject.
pub struct FlatStateSubject;

impl Subject for FlatStateSubject {
    fn name(&self) -> String {
        "probe: flat map, holder state".into()
    }
    fn supports(&self, threads: usize) -> bool {
        threads == 1
    }
    fn synchronous(&self) -> bool {
        true
    }
    fn verify(&self, sim: &Simulation) -> Result<usize, String> {
        let mut map = FlatStateMap::default();
        let n = verify(sim, &mut map)?;
        state_empty(&map)?;
        Ok(n)
    }
    fn run(&self, sim: &Simulation, _: usize, pace: Pace) -> Result<RunStats, String> {
        let mut map = FlatStateMap::default();
        let stats = replay_single(sim, &mut map, pace);
        state_empty(&map)?;
        Ok(stats)
    }
}

fn state_empty(map: &FlatStateMap) -> Result<(), String> {
    match map.blocks.len() {
        0 => Ok(()),
        left => Err(format!(
            "probe-flat-state: {left} blocks left after the drain"
        )),
    }
}

/// The engine's own key table ([`SlotTable`]: lock-free readers, one writer lock, epoch
/// reclamation) as the flat map of block hash → holder bits: the concurrent version of
/// [`FlatMap`], at one and two threads (`--index probe-slots`). Holder bits are never 0 in the
/// table (a block goes with its last holder), so they are a slot's non-zero value.
mod slots {
    use super::*;
    use crossbeam_epoch as epoch;
    use inferencecache_bench::mooncake::replay_dual;
    use inferencecache_engine::layout::{SlotTable, SlotValue};

    pub struct SlotsWriter<'a>(pub &'a SlotTable);
    pub struct SlotsReader<'a>(pub &'a SlotTable);

    impl Writer for SlotsWriter<'_> {
        fn store(&mut self, worker: u32, _: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
            let bit = 1u64 << (worker % 64);
            let guard = epoch::pin();
            let mut w = self.0.lock();
            for key in seq {
                let bits = w.get(*key, &guard).map_or(0, SlotValue::get) | bit;
                w.insert(*key, SlotValue::new(bits).expect("a bit is set"), &guard);
            }
        }
        fn remove(&mut self, worker: u32, seq: &[u64]) {
            let bit = 1u64 << (worker % 64);
            let guard = epoch::pin();
            let mut w = self.0.lock();
            for key in seq {
                let Some(bits) = w.get(*key, &guard) else {
                    continue;
                };
                match SlotValue::new(bits.get() & !bit) {
                    Some(left) => {
                        w.insert(*key, left, &guard);
                    }
                    None => {
                        w.remove(*key, &guard);
                    }
                }
            }
        }
        fn flush(&mut self) {}
    }

    impl Reader for SlotsReader<'_> {
        fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
            let guard = epoch::pin();
            let mut alive = u64::MAX;
            let mut matched = 0u32;
            for (i, key) in seq.iter().enumerate() {
                if let Some(next) = seq.get(i + 4) {
                    self.0.prefetch(*next, &guard);
                }
                let bits = self.0.find(*key, &guard).map_or(0, SlotValue::get);
                let dropped = alive & !bits;
                if matched > 0 {
                    push_each(dropped, matched, out);
                }
                alive &= bits;
                if alive == 0 {
                    return;
                }
                matched += 1;
            }
            push_each(alive, matched, out);
        }
    }

    struct Both<'a>(SlotsWriter<'a>, SlotsReader<'a>);
    impl Writer for Both<'_> {
        fn store(&mut self, w: u32, p: u32, parent: Option<u64>, l: &[u64], s: &[u64]) {
            self.0.store(w, p, parent, l, s);
        }
        fn remove(&mut self, w: u32, s: &[u64]) {
            self.0.remove(w, s);
        }
        fn flush(&mut self) {}
    }
    impl Reader for Both<'_> {
        fn lookup(&mut self, l: &[u64], s: &[u64], out: &mut Vec<(u32, u32)>) {
            self.1.lookup(l, s, out);
        }
    }

    /// The probe as a subject.
    pub struct SlotsSubject;

    fn left(table: &SlotTable) -> Result<(), String> {
        match table.len() {
            0 => Ok(()),
            n => Err(format!("probe-slots: {n} blocks left after the drain")),
        }
    }

    impl Subject for SlotsSubject {
        fn name(&self) -> String {
            "probe: key table as flat map".into()
        }
        fn supports(&self, threads: usize) -> bool {
            threads == 1 || threads == 2
        }
        fn synchronous(&self) -> bool {
            true
        }
        fn verify(&self, sim: &Simulation) -> Result<usize, String> {
            let table = SlotTable::new();
            let n = verify(sim, &mut Both(SlotsWriter(&table), SlotsReader(&table)))?;
            left(&table)?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String> {
            let table = SlotTable::new();
            let stats = if threads == 1 {
                replay_single(
                    sim,
                    &mut Both(SlotsWriter(&table), SlotsReader(&table)),
                    pace,
                )
            } else {
                replay_dual(sim, || SlotsWriter(&table), || SlotsReader(&table), pace)
            };
            left(&table)?;
            Ok(stats)
        }
    }
}

pub use slots::SlotsSubject;

/// A bucketed key table: the layout `probe-slots` suggests (`--index probe-buckets`). Each
/// 64-byte line is one bucket: a tag word (a 7-bit tag per slot, 0 for a free slot, and an
/// overflow bit set once a key of this home had to go further) and three 16-byte slots. A probe
/// reads its home line and is settled there unless the bucket overflowed: one line per key, where
/// the key table reads its summary word and a slot line. Readers take no lock (key, value, key
/// loads as the key table's readers do; tables freed through the epoch); one writer at a time.
mod buckets {
    use super::*;
    use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
    use inferencecache_bench::mooncake::replay_dual;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    const SLOTS: usize = 3;
    const OVERFLOW: u64 = 1 << 63;

    #[repr(C, align(64))]
    #[derive(Default)]
    struct Bucket {
        tags: AtomicU64,
        keys: [AtomicU64; SLOTS],
        values: [AtomicU64; SLOTS],
    }

    struct Table {
        buckets: Box<[Bucket]>,
        mask: usize,
        shift: u32,
    }

    impl Table {
        fn new(buckets: usize) -> Self {
            let n = buckets.next_power_of_two().max(2);
            Table {
                buckets: (0..n).map(|_| Bucket::default()).collect(),
                mask: n - 1,
                shift: 64 - n.trailing_zeros(),
            }
        }
        fn place(&self, key: u64) -> (usize, u64) {
            let h = (key ^ (key >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((h >> self.shift) as usize, (h & 0x7F) | 0x80)
        }
        fn find(&self, key: u64) -> Option<u64> {
            let (mut b, tag) = self.place(key);
            for _ in 0..=self.mask {
                let bucket = &self.buckets[b];
                let tags = bucket.tags.load(Ordering::Acquire);
                for i in 0..SLOTS {
                    if (tags >> (8 * i)) & 0xFF == tag {
                        let k = bucket.keys[i].load(Ordering::Acquire);
                        let v = bucket.values[i].load(Ordering::Acquire);
                        if k == key && v != 0 && bucket.keys[i].load(Ordering::Acquire) == key {
                            return Some(v);
                        }
                    }
                }
                if tags & OVERFLOW == 0 {
                    return None;
                }
                b = (b + 1) & self.mask;
            }
            None
        }
        fn prefetch(&self, key: u64) {
            let (b, _) = self.place(key);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a prefetch is a hint: it never faults, whatever the address.
            unsafe {
                core::arch::x86_64::_mm_prefetch(
                    std::ptr::from_ref(&self.buckets[b]).cast::<i8>(),
                    core::arch::x86_64::_MM_HINT_T0,
                );
            }
        }
        /// Writer: the bucket and slot holding `key`.
        fn locate(&self, key: u64) -> Option<(usize, usize)> {
            let (mut b, tag) = self.place(key);
            for _ in 0..=self.mask {
                let bucket = &self.buckets[b];
                let tags = bucket.tags.load(Ordering::Relaxed);
                for i in 0..SLOTS {
                    if (tags >> (8 * i)) & 0xFF == tag
                        && bucket.keys[i].load(Ordering::Relaxed) == key
                    {
                        return Some((b, i));
                    }
                }
                if tags & OVERFLOW == 0 {
                    return None;
                }
                b = (b + 1) & self.mask;
            }
            None
        }
        /// Writer: puts an absent key in the first free slot from its home, marking the full
        /// buckets it passes; returns how many buckets it newly marked.
        fn put(&self, key: u64, value: u64) -> usize {
            let (mut b, tag) = self.place(key);
            let mut marked = 0;
            loop {
                let bucket = &self.buckets[b];
                let tags = bucket.tags.load(Ordering::Relaxed);
                if let Some(i) = (0..SLOTS).find(|i| (tags >> (8 * i)) & 0xFF == 0) {
                    bucket.keys[i].store(key, Ordering::Relaxed);
                    bucket.values[i].store(value, Ordering::Release);
                    bucket.tags.store(tags | tag << (8 * i), Ordering::Release);
                    return marked;
                }
                if tags & OVERFLOW == 0 {
                    bucket.tags.store(tags | OVERFLOW, Ordering::Release);
                    marked += 1;
                }
                b = (b + 1) & self.mask;
            }
        }
    }

    struct Counts {
        live: usize,
        overflowed: usize,
    }

    pub struct BucketTable {
        table: Atomic<Table>,
        writer: Mutex<Counts>,
    }

    impl BucketTable {
        fn new() -> Self {
            BucketTable {
                table: Atomic::new(Table::new(64)),
                writer: Mutex::new(Counts {
                    live: 0,
                    overflowed: 0,
                }),
            }
        }
        fn current<'g>(&self, guard: &'g Guard) -> &'g Table {
            // SAFETY: the table is never null and is freed only through the epoch.
            unsafe { self.table.load(Ordering::Acquire, guard).deref() }
        }
        /// Writer: applies `f` to the value of `key` (0 when absent); a result of 0 removes it.
        fn update(&self, counts: &mut Counts, key: u64, f: impl Fn(u64) -> u64, guard: &Guard) {
            let table = self.current(guard);
            match table.locate(key) {
                Some((b, i)) => {
                    let bucket = &table.buckets[b];
                    let new = f(bucket.values[i].load(Ordering::Relaxed));
                    bucket.values[i].store(new, Ordering::Release);
                    if new == 0 {
                        let tags = bucket.tags.load(Ordering::Relaxed);
                        bucket
                            .tags
                            .store(tags & !(0xFF << (8 * i)), Ordering::Release);
                        counts.live -= 1;
                    }
                }
                None => {
                    let new = f(0);
                    if new == 0 {
                        return;
                    }
                    let capacity = table.buckets.len() * SLOTS;
                    if (counts.live + 1) * 5 > capacity * 4
                        || counts.overflowed * 4 > table.buckets.len()
                    {
                        self.rebuild(counts, ((counts.live + 1) * 2).div_ceil(SLOTS), guard);
                    }
                    counts.overflowed += self.current(guard).put(key, new);
                    counts.live += 1;
                }
            }
        }
        fn rebuild(&self, counts: &mut Counts, buckets: usize, guard: &Guard) {
            let old = self.current(guard);
            let fresh = Table::new(buckets);
            let mut overflowed = 0;
            for bucket in old.buckets.iter() {
                let tags = bucket.tags.load(Ordering::Relaxed);
                for i in 0..SLOTS {
                    if (tags >> (8 * i)) & 0xFF != 0 {
                        overflowed += fresh.put(
                            bucket.keys[i].load(Ordering::Relaxed),
                            bucket.values[i].load(Ordering::Relaxed),
                        );
                    }
                }
            }
            counts.overflowed = overflowed;
            let previous = self.table.swap(Owned::new(fresh), Ordering::AcqRel, guard);
            // SAFETY: unreachable from the table now; readers that loaded it are pinned.
            unsafe { guard.defer_destroy(previous) };
        }
        fn len(&self) -> usize {
            self.writer.lock().map_or(0, |c| c.live)
        }
    }

    impl Drop for BucketTable {
        fn drop(&mut self) {
            // SAFETY: dropped by its only owner: no reader is left.
            unsafe {
                drop(
                    self.table
                        .load(Ordering::Relaxed, epoch::unprotected())
                        .into_owned(),
                );
            }
        }
    }

    pub struct BucketsWriter<'a>(pub &'a BucketTable);
    pub struct BucketsReader<'a>(pub &'a BucketTable);

    impl Writer for BucketsWriter<'_> {
        fn store(&mut self, worker: u32, _: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
            let bit = 1u64 << (worker % 64);
            let guard = epoch::pin();
            let mut counts = self.0.writer.lock().expect("writer lock");
            for (i, key) in seq.iter().enumerate() {
                if let Some(next) = seq.get(i + 4) {
                    self.0.current(&guard).prefetch(*next);
                }
                self.0.update(&mut counts, *key, |bits| bits | bit, &guard);
            }
        }
        fn remove(&mut self, worker: u32, seq: &[u64]) {
            let bit = 1u64 << (worker % 64);
            let guard = epoch::pin();
            let mut counts = self.0.writer.lock().expect("writer lock");
            for (i, key) in seq.iter().enumerate() {
                if let Some(next) = seq.get(i + 4) {
                    self.0.current(&guard).prefetch(*next);
                }
                self.0.update(&mut counts, *key, |bits| bits & !bit, &guard);
            }
        }
        fn flush(&mut self) {}
    }

    impl Reader for BucketsReader<'_> {
        fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
            let guard = epoch::pin();
            let table = self.0.current(&guard);
            let mut alive = u64::MAX;
            let mut matched = 0u32;
            for (i, key) in seq.iter().enumerate() {
                if let Some(next) = seq.get(i + 4) {
                    table.prefetch(*next);
                }
                let bits = table.find(*key).unwrap_or(0);
                let dropped = alive & !bits;
                if matched > 0 {
                    push_each(dropped, matched, out);
                }
                alive &= bits;
                if alive == 0 {
                    return;
                }
                matched += 1;
            }
            push_each(alive, matched, out);
        }
    }

    struct Both<'a>(BucketsWriter<'a>, BucketsReader<'a>);
    impl Writer for Both<'_> {
        fn store(&mut self, w: u32, p: u32, parent: Option<u64>, l: &[u64], s: &[u64]) {
            self.0.store(w, p, parent, l, s);
        }
        fn remove(&mut self, w: u32, s: &[u64]) {
            self.0.remove(w, s);
        }
        fn flush(&mut self) {}
    }
    impl Reader for Both<'_> {
        fn lookup(&mut self, l: &[u64], s: &[u64], out: &mut Vec<(u32, u32)>) {
            self.1.lookup(l, s, out);
        }
    }

    /// The probe as a subject.
    pub struct BucketsSubject;

    fn left(table: &BucketTable) -> Result<(), String> {
        match table.len() {
            0 => Ok(()),
            n => Err(format!("probe-buckets: {n} blocks left after the drain")),
        }
    }

    impl Subject for BucketsSubject {
        fn name(&self) -> String {
            "probe: bucketed table as flat map".into()
        }
        fn supports(&self, threads: usize) -> bool {
            threads == 1 || threads == 2
        }
        fn synchronous(&self) -> bool {
            true
        }
        fn verify(&self, sim: &Simulation) -> Result<usize, String> {
            let table = BucketTable::new();
            let n = verify(sim, &mut Both(BucketsWriter(&table), BucketsReader(&table)))?;
            left(&table)?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String> {
            let table = BucketTable::new();
            let stats = if threads == 1 {
                replay_single(
                    sim,
                    &mut Both(BucketsWriter(&table), BucketsReader(&table)),
                    pace,
                )
            } else {
                replay_dual(
                    sim,
                    || BucketsWriter(&table),
                    || BucketsReader(&table),
                    pace,
                )
            };
            left(&table)?;
            Ok(stats)
        }
    }
}

pub use buckets::BucketsSubject;
