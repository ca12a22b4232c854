//! A design probe for issue #44, not a product: the least work a flat map from block hash to
//! the set of workers holding it does on the Mooncake replay (one thread). A stored block sets
//! its worker's bit, a removed one clears it (the entry goes with its last bit), and a lookup
//! probes the request's blocks in order, ANDing the bits, until no worker is left. It keeps no
//! per-holder state (InferenceCache keeps each holder's `last_seen`, tier, generation and token
//! count), takes no lock and allows no concurrent reader, so it bounds from below what a flat
//! layout costs on this trace. `--index probe-flat` runs it; it is not in the default set.

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

/// Block hash → bit set of its holders (workers < 64).
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
