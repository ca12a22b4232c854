//! The run registry ([`RunIds`]): a partition's run ids, each naming its run and keeping the
//! run's age, and the writer's allocator of ids ([`IdAllocator`]). Generic over what it
//! registers ([`Registered`]: `BlockRun`), so the runs name the registry and the registry does
//! not name the runs.

use crate::sync::{AtomicPtr, AtomicU64, Ordering};
use crossbeam_epoch::Guard;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// What a `RunIds` registers.
pub trait Registered {
    /// The word a registration writes the entry's id into (bits 0–31; the high half is the
    /// entry's own and stays).
    fn id_word(&self) -> &AtomicU64;
    /// The entry's age: a lower bound of its holders' `last_seen` (ms; `i64::MAX` with none).
    fn age(&self) -> i64;
}

/// Bytes of one registry word.
const WORD: usize = std::mem::size_of::<AtomicU64>();

/// Ids of the runs of one partition: an id names its run's pointer while the run is registered
/// (`block_run.rs`, invariant 4), so a hint can check the run it names is still live. Chunks of
/// doubling size (2, 4, … entries) that never move, read lock-free: a small first chunk (id 0's
/// unused entry and id 1: 32 bytes), since most partitions (a churned tenant's) hold a run or
/// two, and 31 chunks, so that ids still reach 2^32 − 3. The pointers of the first two chunks (ids
/// up to 5) are in the registry; those of the others are in an array allocated with the first
/// chunk past them (`rest`, never replaced or freed before the registry), so a partition of a few
/// runs does not carry 31 chunk pointers (248 bytes) but 3 (issue 42). A reader of an id past the
/// inline chunks loads `rest` (Acquire) before the chunk pointer: one dependent load more, on a
/// line every such read shares. The writer stores `rest` (Release) once its null pointers are
/// written, and a chunk pointer (Release) once the chunk's zeroed words are.
///
/// Each entry also keeps its run's *age*: a lower bound of the `last_seen` of the run's holders
/// (the oldest at registration, lowered by a join; a holder leaving leaves it low). Holder entries
/// are never rewritten (`block_run.rs`, invariant 3), so a run never gets older than its age says,
/// and a scan for old runs ([`RunIds::scan`]) can pass over every younger run reading only this
/// array, never the runs. The age is written before the entry's pointer (Release), so a reader that
/// loads the pointer with Acquire and then the age sees at least the registration's value; a join's
/// lowering is Relaxed, and a scan that misses it passes a run whose newest holder it would have
/// taken — an approximate walk's miss, never a wrong answer.
pub struct RunIds<T> {
    /// Chunks `0..INLINE_CHUNKS`.
    inline: [AtomicPtr<AtomicU64>; INLINE_CHUNKS],
    /// Chunks `INLINE_CHUNKS..CHUNKS`: a boxed `[AtomicPtr<AtomicU64>; REST_CHUNKS]`, null
    /// until the writer first needs one of them.
    rest: AtomicPtr<AtomicPtr<AtomicU64>>,
    /// The entries name `T`s (as words).
    entries: PhantomData<fn() -> T>,
}

/// The writer side of a `RunIds`: free ids and the next fresh one. Kept with the partition's
/// writer state, so holding `&mut` is holding the writer lock.
#[derive(Default)]
pub struct IdAllocator {
    free: Vec<u32>,
    next: u32,
}

#[cfg(test)]
impl IdAllocator {
    /// The ids free for reuse.
    pub(crate) fn free_ids(&self) -> &[u32] {
        &self.free
    }
}

const FIRST_CHUNK: usize = 2;
const CHUNKS: usize = 31;
/// Chunks whose pointers [`RunIds`] holds inline (ids 1..=5).
const INLINE_CHUNKS: usize = 2;
/// Chunks whose pointers are in [`RunIds`]'s `rest` array.
const REST_CHUNKS: usize = CHUNKS - INLINE_CHUNKS;
/// Words per entry: the run pointer, then its age.
const ENTRY_WORDS: usize = 2;

/// A registered run met by [`RunIds::scan`].
pub enum ScanStep<'a, T> {
    /// A run whose age is at most the scan's bound.
    Old(&'a T),
    /// A younger run, not read.
    Young,
}

/// Chunk and index of id `id` (ids start at 1; entry 0 of chunk 0 is never used).
#[inline]
pub(crate) fn locate(id: usize) -> (usize, usize) {
    crate::raw::doubling::place(id, FIRST_CHUNK)
}

fn chunk_len(c: usize) -> usize {
    FIRST_CHUNK << c
}

impl<T> Default for RunIds<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> RunIds<T> {
    /// An empty registry (no chunk allocated).
    pub fn new() -> Self {
        Self {
            inline: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
            rest: AtomicPtr::new(std::ptr::null_mut()),
            entries: PhantomData,
        }
    }

    /// The pointer of chunk `c`, if `c < CHUNKS` and its place exists (reader side: `None`
    /// for a chunk past the inline ones before `rest` is allocated, like a null chunk).
    #[inline]
    fn chunk(&self, c: usize) -> Option<&AtomicPtr<AtomicU64>> {
        if c < INLINE_CHUNKS {
            return Some(&self.inline[c]);
        }
        if c >= CHUNKS {
            return None;
        }
        // Acquire: the array's null pointers before their use.
        let rest = self.rest.load(Ordering::Acquire);
        if rest.is_null() {
            return None;
        }
        // SAFETY: a non-null `rest` is a boxed array of `REST_CHUNKS` initialised pointers,
        // freed only with the registry; `c - INLINE_CHUNKS < REST_CHUNKS`.
        Some(unsafe { &*rest.add(c - INLINE_CHUNKS) })
    }

    /// The pointer of chunk `c < CHUNKS`, allocating `rest` if needed (writer side).
    fn chunk_or_make(&self, c: usize) -> &AtomicPtr<AtomicU64> {
        if c >= INLINE_CHUNKS && self.rest.load(Ordering::Relaxed).is_null() {
            let pointers: Box<[AtomicPtr<AtomicU64>]> = (0..REST_CHUNKS)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect();
            // Release: the null pointers before the array's address.
            self.rest.store(
                Box::into_raw(pointers) as *mut AtomicPtr<AtomicU64>,
                Ordering::Release,
            );
        }
        self.chunk(c)
            .expect("a chunk below CHUNKS has a place once rest is allocated")
    }

    /// The run id `id` names, if any.
    #[inline]
    pub fn get(&self, id: u64, _guard: &Guard) -> Option<NonNull<T>> {
        let id = usize::try_from(id).ok().filter(|&i| i > 0)?;
        let (c, i) = locate(id);
        let chunk = self.chunk(c)?.load(Ordering::Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: chunk `c` holds `chunk_len(c)` initialised entries and lives as long as the
        // registry; `i < chunk_len(c)` by `locate`.
        let word = unsafe { &*chunk.add(ENTRY_WORDS * i) }.load(Ordering::Acquire);
        NonNull::new(word as *mut T)
    }

    /// Positions a [`RunIds::scan`] covers: one per id the allocated chunks can hold (id 0's
    /// position included, never registered).
    pub fn scan_len(&self) -> usize {
        (0..CHUNKS)
            .take_while(|&c| {
                self.chunk(c)
                    .is_some_and(|p| !p.load(Ordering::Acquire).is_null())
            })
            .map(chunk_len)
            .sum()
    }

    /// Calls `f` for every run registered at positions (ids) `first..end`: with
    /// [`ScanStep::Old`] and the run if its age is at most `max_age`, else with
    /// [`ScanStep::Young`] (reading nothing of the run), until `f` returns `false`. Returns
    /// where the scan stopped: after an old run, at a young one (`end` if `f` never stopped
    /// it). The runs are live while `guard` is pinned (invariant 4). Positions past
    /// [`RunIds::scan_len`] are empty.
    pub fn scan(
        &self,
        first: usize,
        end: usize,
        max_age: i64,
        _guard: &Guard,
        mut f: impl FnMut(ScanStep<'_, T>) -> bool,
    ) -> usize {
        let mut at = first;
        while at < end {
            let (c, i) = locate(at);
            let Some(chunk) = self.chunk(c) else {
                return end;
            };
            let chunk = chunk.load(Ordering::Acquire);
            if chunk.is_null() {
                return end;
            }
            let here = (chunk_len(c) - i).min(end - at);
            for (position, i) in (at..).zip(i..i + here) {
                // SAFETY: `i < chunk_len(c)`, within the chunk's initialised entries, which
                // live as long as the registry.
                let (pointer, age) = unsafe {
                    (
                        &*chunk.add(ENTRY_WORDS * i),
                        &*chunk.add(ENTRY_WORDS * i + 1),
                    )
                };
                // Acquire: the run's contents (and its age) before its use.
                let run = pointer.load(Ordering::Acquire);
                if run == 0 {
                    continue;
                }
                if age.load(Ordering::Relaxed) as i64 > max_age {
                    if !f(ScanStep::Young) {
                        return position;
                    }
                    continue;
                }
                // SAFETY: a registered run, live while the caller's guard is pinned: it is
                // deregistered before it is retired through the epoch (invariant 4).
                if !f(ScanStep::Old(unsafe { &*(run as *const T) })) {
                    return position + 1;
                }
            }
            at += here;
        }
        end
    }

    /// Lowers the age of registered id `id` to `last_seen_ms` if that is older (a holder
    /// joined the run). Writer side.
    pub fn lower_age(&self, id: u32, last_seen_ms: i64) {
        if id == 0 {
            return;
        }
        let word = self.age(id);
        if last_seen_ms < word.load(Ordering::Relaxed) as i64 {
            word.store(last_seen_ms as u64, Ordering::Relaxed);
        }
    }

    /// Fetches the registry entry of `id` (any value: a prefetch never faults, and an id
    /// outside the registry fetches nothing). Under loom it does nothing, so the models see
    /// only the loads that decide something.
    #[inline]
    pub fn prefetch(&self, id: u64) {
        #[cfg(not(loom))]
        if let Some((c, i)) = usize::try_from(id).ok().filter(|&i| i > 0).map(locate)
            && let Some(chunk) = self.chunk(c)
        {
            // Relaxed: the address is only prefetched, never read through.
            let chunk = chunk.load(Ordering::Relaxed);
            if !chunk.is_null() {
                crate::raw::slots::prefetch(chunk.wrapping_add(ENTRY_WORDS * i));
            }
        }
        #[cfg(loom)]
        let _ = id;
    }

    /// Registers `run`, writing its id into it; `None` when every id is taken (2^32 runs).
    pub fn register(&self, alloc: &mut IdAllocator, run: NonNull<T>) -> Option<u32>
    where
        T: Registered,
    {
        let id = match alloc.free.pop() {
            Some(id) => id,
            None => {
                let id = alloc.next.checked_add(1)?;
                let (c, _) = locate(id as usize);
                if c >= CHUNKS {
                    return None;
                }
                let chunk = self.chunk_or_make(c);
                if chunk.load(Ordering::Relaxed).is_null() {
                    let words: Box<[AtomicU64]> = (0..ENTRY_WORDS * chunk_len(c))
                        .map(|_| AtomicU64::new(0))
                        .collect();
                    // Release: the zeroed words before the chunk pointer.
                    chunk.store(Box::into_raw(words) as *mut AtomicU64, Ordering::Release);
                }
                alloc.next = id;
                id
            }
        };
        // SAFETY: live, the caller's own run.
        let word = unsafe { run.as_ref() }.id_word();
        // The step in the high half stays; only the registering writer writes the id.
        let step = word.load(Ordering::Relaxed) & !u64::from(u32::MAX);
        word.store(step | u64::from(id), Ordering::Relaxed);
        // SAFETY: as above.
        let age = unsafe { run.as_ref() }.age();
        self.age(id).store(age as u64, Ordering::Relaxed);
        // Release: the run's contents and its age before the entry that names it (module
        // docs).
        self.entry(id).store(run.as_ptr() as u64, Ordering::Release);
        Some(id)
    }

    /// Clears id `id` and makes it free for reuse.
    pub fn deregister(&self, alloc: &mut IdAllocator, id: u32) {
        if id == 0 {
            return;
        }
        self.entry(id).store(0, Ordering::Release);
        alloc.free.push(id);
    }

    /// The entry of a registered or just-allocated id (its chunk exists).
    fn entry(&self, id: u32) -> &AtomicU64 {
        let (c, i) = locate(id as usize);
        let chunk = self
            .chunk(c)
            .map_or(std::ptr::null_mut(), |p| p.load(Ordering::Acquire));
        debug_assert!(!chunk.is_null());
        // SAFETY: the chunk of an id handed out exists (allocated before the id) and holds
        // `chunk_len(c) > i` entries.
        unsafe { &*chunk.add(ENTRY_WORDS * i) }
    }

    /// The age word of a registered or just-allocated id.
    fn age(&self, id: u32) -> &AtomicU64 {
        let (c, i) = locate(id as usize);
        let chunk = self
            .chunk(c)
            .map_or(std::ptr::null_mut(), |p| p.load(Ordering::Acquire));
        debug_assert!(!chunk.is_null());
        // SAFETY: as in `entry`; the age is the entry's second word.
        unsafe { &*chunk.add(ENTRY_WORDS * i + 1) }
    }

    /// Bytes the registry's chunks hold.
    pub fn bytes(&self) -> usize {
        let rest = if self.rest.load(Ordering::Relaxed).is_null() {
            0
        } else {
            crate::raw::pages::heap_chunk(REST_CHUNKS * std::mem::size_of::<AtomicPtr<AtomicU64>>())
        };
        (0..CHUNKS)
            .filter(|&c| {
                self.chunk(c)
                    .is_some_and(|p| !p.load(Ordering::Relaxed).is_null())
            })
            .map(|c| crate::raw::pages::heap_chunk(ENTRY_WORDS * chunk_len(c) * WORD))
            .sum::<usize>()
            + rest
    }
}

impl<T> Drop for RunIds<T> {
    fn drop(&mut self) {
        for c in 0..CHUNKS {
            let Some(chunk) = self.chunk(c) else {
                break; // no `rest`: no chunk past the inline ones
            };
            let p = chunk.load(Ordering::Relaxed);
            if !p.is_null() {
                let words = std::ptr::slice_from_raw_parts_mut(p, ENTRY_WORDS * chunk_len(c));
                // SAFETY: built by `register` from a boxed slice of `ENTRY_WORDS * chunk_len(c)`
                // words, and the registry is being dropped, so no reader holds it.
                drop(unsafe { Box::from_raw(words) });
            }
        }
        let rest = self.rest.load(Ordering::Relaxed);
        if !rest.is_null() {
            // SAFETY: built by `chunk_or_make` from a boxed slice of `REST_CHUNKS` pointers,
            // freed once, here; the chunks it named were freed above.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(rest, REST_CHUNKS)) });
        }
    }
}
