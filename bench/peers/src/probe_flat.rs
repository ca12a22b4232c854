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
//!   threads; `probe-buckets-state` with the per-holder state in its slots.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use inferencecache_bench::mooncake::{
    Pace, Pair, Reader, RunStats, Simulation, Writer, replay_single, verify,
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
        score(seq, out, |_, key| {
            self.holders.get(key).copied().unwrap_or(0)
        });
    }
}

/// Every probe's lookup: `holders(i, key)` gives block `i`'s holder bits; each worker scores the
/// blocks before the first it does not hold (workers that hold block 0 only).
fn score(seq: &[u64], out: &mut Vec<(u32, u32)>, mut holders: impl FnMut(usize, &u64) -> u64) {
    let mut alive = u64::MAX;
    let mut matched = 0u32;
    for (i, key) in seq.iter().enumerate() {
        let bits = holders(i, key);
        if matched > 0 {
            push_each(alive & !bits, matched, out);
        }
        alive &= bits;
        if alive == 0 {
            return;
        }
        matched += 1;
    }
    push_each(alive, matched, out);
}

fn push_each(mut workers: u64, blocks: u32, out: &mut Vec<(u32, u32)>) {
    while workers != 0 {
        out.push((workers.trailing_zeros(), blocks));
        workers &= workers - 1;
    }
}

/// A one-thread probe: a fresh map per replay, which must hold nothing after the drain.
trait OneThreadProbe: Default + Writer + Reader {
    /// Row name.
    const NAME: &'static str;
    /// Blocks still held.
    fn held(&self) -> usize;
}

/// A [`OneThreadProbe`] as a subject.
struct OneThread<M>(std::marker::PhantomData<M>);

impl<M: OneThreadProbe> OneThread<M> {
    fn check(map: &M) -> Result<(), String> {
        match map.held() {
            0 => Ok(()),
            left => Err(format!("{}: {left} blocks left after the drain", M::NAME)),
        }
    }
}

impl<M: OneThreadProbe> Subject for OneThread<M> {
    fn name(&self) -> String {
        M::NAME.into()
    }
    fn supports(&self, threads: usize) -> bool {
        threads == 1
    }
    fn synchronous(&self) -> bool {
        true
    }
    fn verify(&self, sim: &Simulation) -> Result<usize, String> {
        let mut map = M::default();
        let n = verify(sim, &mut map)?;
        Self::check(&map)?;
        Ok(n)
    }
    fn run(&self, sim: &Simulation, _: usize, pace: Pace) -> Result<RunStats, String> {
        let mut map = M::default();
        let stats = replay_single(sim, &mut map, pace);
        Self::check(&map)?;
        Ok(stats)
    }
}

impl OneThreadProbe for FlatMap {
    const NAME: &'static str = "probe: flat map";
    fn held(&self) -> usize {
        self.holders.len()
    }
}

/// `probe-flat`.
pub fn flat() -> Box<dyn Subject> {
    Box::new(OneThread::<FlatMap>(std::marker::PhantomData))
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
        // The oldest stamp seen over the match: the per-holder state a lookup reads.
        let mut oldest = u64::MAX;
        score(seq, out, |_, key| {
            let (bits, stamp) = self
                .blocks
                .get(key)
                .map_or((0, u64::MAX), |h| (h.bits, h.first.1[0]));
            oldest = oldest.min(stamp);
            bits
        });
        std::hint::black_box(oldest);
    }
}

impl OneThreadProbe for FlatStateMap {
    const NAME: &'static str = "probe: flat map, holder state";
    fn held(&self) -> usize {
        self.blocks.len()
    }
}

/// `probe-flat-state`.
pub fn flat_state() -> Box<dyn Subject> {
    Box::new(OneThread::<FlatStateMap>(std::marker::PhantomData))
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
            score(seq, out, |i, key| {
                if let Some(next) = seq.get(i + 4) {
                    self.0.prefetch(*next, &guard);
                }
                self.0.find(*key, &guard).map_or(0, SlotValue::get)
            });
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
            let n = verify(sim, &mut Pair(SlotsWriter(&table), SlotsReader(&table)))?;
            left(&table)?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String> {
            let table = SlotTable::new();
            let stats = if threads == 1 {
                replay_single(
                    sim,
                    &mut Pair(SlotsWriter(&table), SlotsReader(&table)),
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

/// A bucketed key table: the layout `probe-slots` suggests (`--index probe-buckets`). Each bucket
/// is a tag word (a 7-bit tag per slot, 0 for a free slot, and an overflow bit set once a key of
/// this home had to go further) and three slots; with no extra words a bucket is one 64-byte
/// line. A probe reads its home bucket and is settled there unless the bucket overflowed: one
/// line per key, where the key table reads its summary word and a slot line. Readers take no lock
/// (key, value, extra words, key loads, as the key table's readers do; tables freed through the
/// epoch); one writer at a time. `E` extra words per slot carry per-holder state
/// (`--index probe-buckets-state`: the first holder's 16 bytes inline, the others out of line).
mod buckets {
    use super::*;
    use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
    use inferencecache_bench::mooncake::replay_dual;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    const SLOTS: usize = 3;
    const OVERFLOW: u64 = 1 << 63;
    /// How far ahead a lookup fetches the request's home buckets.
    const LOOKUP_AHEAD: usize = 16;

    #[repr(C, align(64))]
    struct Bucket<const E: usize> {
        tags: AtomicU64,
        keys: [AtomicU64; SLOTS],
        values: [AtomicU64; SLOTS],
        extra: [[AtomicU64; E]; SLOTS],
    }

    impl<const E: usize> Bucket<E> {
        fn new() -> Self {
            Bucket {
                tags: AtomicU64::new(0),
                keys: Default::default(),
                values: Default::default(),
                extra: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            }
        }
    }

    fn tag_at(tags: u64, i: usize) -> u64 {
        (tags >> (8 * i)) & 0xFF
    }

    struct Table<const E: usize> {
        buckets: Box<[Bucket<E>]>,
        mask: usize,
        shift: u32,
    }

    impl<const E: usize> Table<E> {
        fn new(buckets: usize) -> Self {
            let n = buckets.next_power_of_two().max(2);
            Table {
                buckets: (0..n).map(|_| Bucket::new()).collect(),
                mask: n - 1,
                shift: 64 - n.trailing_zeros(),
            }
        }
        fn place(&self, key: u64) -> (usize, u64) {
            let h = (key ^ (key >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((h >> self.shift) as usize, (h & 0x7F) | 0x80)
        }
        /// Reader: the value of `key` and its slot's extra words.
        fn find(&self, key: u64) -> Option<(u64, [u64; E])> {
            let (mut b, tag) = self.place(key);
            for _ in 0..=self.mask {
                let bucket = &self.buckets[b];
                let tags = bucket.tags.load(Ordering::Acquire);
                for i in 0..SLOTS {
                    if tag_at(tags, i) == tag {
                        let k = bucket.keys[i].load(Ordering::Acquire);
                        let v = bucket.values[i].load(Ordering::Acquire);
                        let extra =
                            std::array::from_fn(|j| bucket.extra[i][j].load(Ordering::Acquire));
                        if k == key && v != 0 && bucket.keys[i].load(Ordering::Acquire) == key {
                            return Some((v, extra));
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
                    if tag_at(tags, i) == tag && bucket.keys[i].load(Ordering::Relaxed) == key {
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
        fn put(&self, key: u64, value: u64, extra: [u64; E]) -> usize {
            let (mut b, tag) = self.place(key);
            let mut marked = 0;
            loop {
                let bucket = &self.buckets[b];
                let tags = bucket.tags.load(Ordering::Relaxed);
                if let Some(i) = (0..SLOTS).find(|&i| tag_at(tags, i) == 0) {
                    bucket.keys[i].store(key, Ordering::Relaxed);
                    for (word, x) in bucket.extra[i].iter().zip(extra) {
                        word.store(x, Ordering::Relaxed);
                    }
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

    /// What a writer's closure does with a key's slot.
    enum Update<const E: usize> {
        /// Leave it as it is (or absent).
        Nothing,
        /// Store this value (the extra words were changed in place).
        Set(u64),
        /// Insert the absent key with this value and these extra words.
        Insert(u64, [u64; E]),
        /// Remove the key.
        Remove,
    }

    pub struct BucketTable<const E: usize> {
        table: Atomic<Table<E>>,
        writer: Mutex<Counts>,
    }

    impl<const E: usize> BucketTable<E> {
        fn new() -> Self {
            BucketTable {
                table: Atomic::new(Table::new(64)),
                writer: Mutex::new(Counts {
                    live: 0,
                    overflowed: 0,
                }),
            }
        }
        fn current<'g>(&self, guard: &'g Guard) -> &'g Table<E> {
            // SAFETY: the table is never null and is freed only through the epoch.
            unsafe { self.table.load(Ordering::Acquire, guard).deref() }
        }
        /// Writer: `f` sees the key's value and extra words (`None` when absent) and says what
        /// becomes of the slot.
        fn update(
            &self,
            counts: &mut Counts,
            key: u64,
            guard: &Guard,
            f: impl FnOnce(Option<(u64, &[AtomicU64; E])>) -> Update<E>,
        ) {
            let table = self.current(guard);
            let at = table.locate(key);
            let update = match at {
                Some((b, i)) => {
                    let bucket = &table.buckets[b];
                    f(Some((
                        bucket.values[i].load(Ordering::Relaxed),
                        &bucket.extra[i],
                    )))
                }
                None => f(None),
            };
            match (update, at) {
                (Update::Set(value), Some((b, i))) => {
                    table.buckets[b].values[i].store(value, Ordering::Release);
                }
                (Update::Remove, Some((b, i))) => {
                    let bucket = &table.buckets[b];
                    bucket.values[i].store(0, Ordering::Release);
                    let tags = bucket.tags.load(Ordering::Relaxed);
                    bucket
                        .tags
                        .store(tags & !(0xFF << (8 * i)), Ordering::Release);
                    counts.live -= 1;
                }
                (Update::Insert(value, extra), None) => {
                    let capacity = table.buckets.len() * SLOTS;
                    if (counts.live + 1) * 5 > capacity * 4
                        || counts.overflowed * 4 > table.buckets.len()
                    {
                        self.rebuild(counts, ((counts.live + 1) * 2).div_ceil(SLOTS), guard);
                    }
                    counts.overflowed += self.current(guard).put(key, value, extra);
                    counts.live += 1;
                }
                _ => {}
            }
        }
        fn rebuild(&self, counts: &mut Counts, buckets: usize, guard: &Guard) {
            let old = self.current(guard);
            let fresh = Table::new(buckets);
            let mut overflowed = 0;
            for bucket in old.buckets.iter() {
                let tags = bucket.tags.load(Ordering::Relaxed);
                for i in 0..SLOTS {
                    if tag_at(tags, i) != 0 {
                        overflowed += fresh.put(
                            bucket.keys[i].load(Ordering::Relaxed),
                            bucket.values[i].load(Ordering::Relaxed),
                            std::array::from_fn(|j| bucket.extra[i][j].load(Ordering::Relaxed)),
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

    impl<const E: usize> Drop for BucketTable<E> {
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

    /// Holder bits only.
    const PLAIN: usize = 0;
    /// The first holder's state (worker and stamp, position) and the address of the others'
    /// (a `Box<Vec<HolderState>>`, 0 when the block has one holder).
    const STATE: usize = 3;

    /// The state a store gives a worker's block: its worker and a stamp, and its position.
    fn holder_state(worker: u32, stamp: u64, position: u64) -> [u64; 2] {
        [stamp << 8 | u64::from(worker), position]
    }

    /// The other holders of a slot whose third extra word is `word` (null when it has one): the
    /// writer's own allocation (`Box::into_raw`), followed only under the writer lock; readers
    /// never follow it.
    fn rest_of(word: &AtomicU64) -> *mut Vec<HolderState> {
        word.load(Ordering::Relaxed) as *mut Vec<HolderState>
    }

    fn free_rest(word: &AtomicU64) {
        let address = word.swap(0, Ordering::Relaxed) as *mut Vec<HolderState>;
        if !address.is_null() {
            // SAFETY: as in `rest_of`; the word no longer names it.
            drop(unsafe { Box::from_raw(address) });
        }
    }

    pub struct BucketsWriter<'a, const E: usize> {
        table: &'a BucketTable<E>,
        stamp: u64,
    }
    pub struct BucketsReader<'a, const E: usize>(&'a BucketTable<E>);

    impl<const E: usize> Writer for BucketsWriter<'_, E> {
        fn store(&mut self, worker: u32, position: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
            let bit = 1u64 << (worker % 64);
            self.stamp += 1;
            let stamp = self.stamp;
            let guard = epoch::pin();
            let mut counts = self.table.writer.lock().expect("writer lock");
            for (i, key) in seq.iter().enumerate() {
                if let Some(next) = seq.get(i + 4) {
                    self.table.current(&guard).prefetch(*next);
                }
                let state = holder_state(worker, stamp, u64::from(position) + i as u64);
                self.table
                    .update(&mut counts, *key, &guard, |slot| match slot {
                        None => Update::Insert(
                            bit,
                            std::array::from_fn(|j| match j {
                                0 | 1 => state[j],
                                _ => 0,
                            }),
                        ),
                        Some((bits, _)) if E < STATE => Update::Set(bits | bit),
                        Some((bits, extra)) => {
                            if bits & bit == 0 {
                                let rest = extra[2].load(Ordering::Relaxed);
                                if rest == 0 {
                                    let vec = Box::new(vec![(worker, state)]);
                                    extra[2].store(Box::into_raw(vec) as u64, Ordering::Relaxed);
                                    // SAFETY: under the writer lock; no other reference to it.
                                } else if let Some(rest) = unsafe { rest_of(&extra[2]).as_mut() } {
                                    rest.push((worker, state));
                                }
                            } else if extra[0].load(Ordering::Relaxed) & 0xFF == u64::from(worker) {
                                extra[0].store(state[0], Ordering::Relaxed);
                                extra[1].store(state[1], Ordering::Relaxed);
                            } else {
                                // SAFETY: under the writer lock; no other reference to it.
                                let rest = unsafe { rest_of(&extra[2]).as_mut() };
                                if let Some(held) =
                                    rest.and_then(|r| r.iter_mut().find(|(w, _)| *w == worker))
                                {
                                    held.1 = state;
                                }
                            }
                            Update::Set(bits | bit)
                        }
                    });
            }
        }
        fn remove(&mut self, worker: u32, seq: &[u64]) {
            let bit = 1u64 << (worker % 64);
            let guard = epoch::pin();
            let mut counts = self.table.writer.lock().expect("writer lock");
            for (i, key) in seq.iter().enumerate() {
                if let Some(next) = seq.get(i + 4) {
                    self.table.current(&guard).prefetch(*next);
                }
                self.table
                    .update(&mut counts, *key, &guard, |slot| match slot {
                        None => Update::Nothing,
                        Some((bits, _)) if bits & bit == 0 => Update::Nothing,
                        Some((bits, extra)) if bits == bit => {
                            if E >= STATE {
                                free_rest(&extra[2]);
                            }
                            Update::Remove
                        }
                        Some((bits, _)) if E < STATE => Update::Set(bits & !bit),
                        Some((bits, extra)) => {
                            // SAFETY: under the writer lock; no other reference to it.
                            if let Some(rest) = unsafe { rest_of(&extra[2]).as_mut() } {
                                if extra[0].load(Ordering::Relaxed) & 0xFF == u64::from(worker) {
                                    if let Some((_, state)) = rest.pop() {
                                        extra[0].store(state[0], Ordering::Relaxed);
                                        extra[1].store(state[1], Ordering::Relaxed);
                                    }
                                } else if let Some(at) = rest.iter().position(|(w, _)| *w == worker)
                                {
                                    rest.swap_remove(at);
                                }
                                if rest.is_empty() {
                                    free_rest(&extra[2]);
                                }
                            }
                            Update::Set(bits & !bit)
                        }
                    });
            }
        }
        fn flush(&mut self) {}
    }

    impl<const E: usize> Reader for BucketsReader<'_, E> {
        fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
            let guard = epoch::pin();
            let table = self.0.current(&guard);
            // The oldest first-holder stamp over the match: the state a lookup reads.
            let mut oldest = u64::MAX;
            score(seq, out, |i, key| {
                if let Some(next) = seq.get(i + LOOKUP_AHEAD) {
                    table.prefetch(*next);
                }
                let (bits, extra) = table.find(*key).unwrap_or((0, [0; E]));
                if let Some(first) = extra.first() {
                    oldest = oldest.min(*first >> 8);
                }
                bits
            });
            std::hint::black_box(oldest);
        }
    }

    /// The probe as a subject: `E` extra words per slot ([`PLAIN`] or [`STATE`]).
    pub struct BucketsSubject<const E: usize>;

    /// `probe-buckets`.
    pub fn plain() -> BucketsSubject<PLAIN> {
        BucketsSubject
    }

    /// `probe-buckets-state`.
    pub fn with_state() -> BucketsSubject<STATE> {
        BucketsSubject
    }

    fn left<const E: usize>(table: &BucketTable<E>) -> Result<(), String> {
        match table.len() {
            0 => Ok(()),
            n => Err(format!("probe-buckets: {n} blocks left after the drain")),
        }
    }

    fn both<const E: usize>(
        table: &BucketTable<E>,
    ) -> Pair<BucketsWriter<'_, E>, BucketsReader<'_, E>> {
        Pair(BucketsWriter { table, stamp: 0 }, BucketsReader(table))
    }

    impl<const E: usize> Subject for BucketsSubject<E> {
        fn name(&self) -> String {
            if E >= STATE {
                "probe: bucketed table, holder state".into()
            } else {
                "probe: bucketed table as flat map".into()
            }
        }
        fn supports(&self, threads: usize) -> bool {
            threads == 1 || threads == 2
        }
        fn synchronous(&self) -> bool {
            true
        }
        fn verify(&self, sim: &Simulation) -> Result<usize, String> {
            let table = BucketTable::<E>::new();
            let n = verify(sim, &mut both(&table))?;
            left(&table)?;
            Ok(n)
        }
        fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String> {
            let table = BucketTable::<E>::new();
            let stats = if threads == 1 {
                replay_single(sim, &mut both(&table), pace)
            } else {
                replay_dual(
                    sim,
                    || BucketsWriter {
                        table: &table,
                        stamp: 0,
                    },
                    || BucketsReader(&table),
                    pace,
                )
            };
            left(&table)?;
            Ok(stats)
        }
    }
}

pub use buckets::{plain as buckets_plain, with_state as buckets_with_state};
