//! Block runs: the storage unit of every partition (`docs/engine.md`, "Storage: the run
//! layout"), with the registry of run ids that lets a run's successor hints name other runs
//! without keeping them alive. Loom m14a–m14d check its protocols on their own.
//!
//! # Structure
//!
//! A [`BlockRun`] is a stretch of consecutive blocks of one ingested chain that have the same
//! holders with, per holder, the same `last_seen`, tier, token count and generation. One
//! allocation, in this order:
//!
//! ```text
//! [holder entry cap−1] … [holder entry 0] [hint 0 … hint 3] [header] [key 0 … key len−1] [dead words 1…] [gone words 1…]
//!                                                           ^ run pointer
//! ```
//!
//! - **holder entries** (16 bytes, [`Holder`]'s two words), stored in reverse so that entry 0 is
//!   next to the hints whatever the capacity; the run is built with `holders` of them and room
//!   for `capacity ≥ holders` (a *spare* entry lets a holder join in place, see below);
//! - **hints** (24 bytes each): a key, the slot value of that key, the run id of the value's run
//!   and the live stretch from the value on in that run when the hint was written (see "Hints");
//! - **header** (40 bytes): `holders | capacity << 16 | len << 32`, the count of references
//!   (slots naming the run), the dead bits of offsets 0–63, the *gone* bits of holder entries
//!   0–63 whose replica holds none of the run's blocks any more, and the run's id with its
//!   token step (see "Token counts");
//! - the `len` **keys** (8 bytes each), then the dead bits of offsets 64 on, then the gone bits
//!   of entries 64 on.
//!
//! So key `o` is at a fixed distance from the run pointer whatever the holder count, and the
//! holders and hints sit in the lines just before it: a walk that reads a slot can fetch the
//! header, holder, hint and key lines at once, none waiting on another ([`BlockRun::prefetch`]).
//!
//! A slot value names a block as `run pointer | offset << 48` ([`pack`]); bit 0 is free (run
//! pointers are 8-byte aligned) and left to the index ([`FLAG`]).
//!
//! # Invariants
//!
//! Writers hold their partition's writer lock; readers take none.
//!
//! 1. Keys and the entries below the build-time holder count are written before the run is
//!    published and never again.
//! 2. **A live offset's slot names it**: for a registered run and an offset whose dead bit is
//!    clear, the slot of that offset's key names `(run, offset)` or is about to (a new run is
//!    registered before its slots are pointed at it). A writer sets an offset's dead bit
//!    *before* it repoints or removes the slot, and a dead bit is never cleared.
//! 3. Holder entries only grow (a join writes entry `holders`, then raises the count) and gone
//!    bits are only set: a holder's replica leaves a run in place by its gone bit, and a gone
//!    entry is never reused (a reader may still be reading it); a holder that comes back gets a
//!    new run.
//! 4. A run is registered in its partition's [`RunIds`] from before its first slot names it
//!    until after its last slot stops naming it; then it is deregistered and freed through the
//!    epoch.
//!
//! # Memory ordering
//!
//! - A run's contents are published by the Release store that registers it ([`RunIds::register`])
//!   and by the Release stores of the slots that name it; readers reach it through an Acquire
//!   load of either, so invariant 1's words need no ordering of their own.
//! - A join stores the new entry's words (Relaxed), then the header's count with Release; a
//!   reader loads the count with Acquire and reads only entries below it. A reader loads the
//!   gone bits before the count, so a gone bit it sees comes with every join before it.
//! - Dead and gone bits are set with a plain load and a Release store (only the writer, under
//!   the lock, writes them: no read-modify-write needed) and loaded with Acquire. A reader
//!   that does not see a bit read before it was set, and behaves as if it had read that block
//!   (or holder) before the change; C3 asks for per-entry atomicity, not a snapshot across
//!   entries.
//! - A reader pinned when it read a slot or a registry entry naming a run may use the run until
//!   it unpins: the run is deregistered and its slots changed before it is retired, so its
//!   retirement comes after the pin.
//!
//! # Keys of other lengths
//!
//! A key is named by its 64-bit digest: an 8-byte key's big-endian value, any other length's
//! XXH3-64. The digests are what slots hold and walks compare. A run with a key of another
//! length than 8 (a *long* run, flagged in the header) also keeps, after its gone words, one
//! descriptor per key (`start << 32 | length`, or a mark for an 8-byte key), the byte total and
//! the bytes; like the digests they are written once, before the run is shared. Two keys are
//! the same when their digests are equal and so are their *long parts* (the bytes of a key of
//! another length, none for an 8-byte key: [`BlockRun::is_key`]), so a long key never answers
//! for an 8-byte key of its digest's value, nor for another long key of the same digest.
//!
//! # Token counts
//!
//! A chain block's entry holds the chain's cumulative token count at that block (the index's
//! K8), so the entries of one replica along a run differ by the blocks' own counts. A run
//! keeps them affine: a holder entry's token field is the count of its entry at offset 0, and
//! the run's *step* is what each next offset adds, so the entry at offset `o` holds
//! `tokens + step · o` (wrapping, as the chain's sum wraps: [`BlockRun::tokens_at`]). Writers
//! keep every run affine: a chain's stretch continues only while its blocks' own counts equal
//! the step, a copy takes consecutive offsets and moves each holder's base to its first, and
//! a join or refresh writes the base its stretch implies. A run of one block has step 0.
//!
//! # Hints
//!
//! Each run keeps [`HINTS`] pairs `(key, slot value)` of blocks that followed its stretch in the
//! chains that built it, so a walk leaving the run can fetch the next run's lines while it is
//! still comparing this run's keys, instead of probing the key table after. A hint is never
//! trusted as it stands: [`BlockRun::hint`] answers it only if the hinted run id still names
//! the hinted pointer (so the pointer is a live run, safe to read under the caller's guard), the
//! offset is inside the run and live, and the run's key there is the key asked for; by
//! invariant 2 the key's slot then names that block. This makes a hint's words free to tear (a
//! torn hint fails a check) and a run id free to be reused at once: whatever run an id names
//! when it is read, the key comparison decides. A hint holds no reference, so a dead run is
//! never kept alive by one. A walk reads a hint ([`BlockRun::peek_hint`]) before it compares
//! the current run's keys, fetches the block it names (a prefetch touches nothing), and checks
//! it ([`HintedBlock::check`]) only after: between the read and the check the hinted run may
//! be retired and its id reused, which the check sees as above (loom m14d reads, fetches, then
//! checks).
//!
//! A hint also keeps the hinted block's *span*, the live blocks from it to its run's next dead
//! offset or end when the hint was written. A walk that follows the hint will likely land at
//! the span's end next, so it fetches the span's key lines and the key table's summary word for
//! the request's key at that landing along with the hinted run, instead of after them. The span
//! is a guess (the hinted run may have changed or gone since), used for prefetches only.
//!
//! # Reclamation
//!
//! `refs` counts what names the run: the slots of its live offsets, counted by the writer that
//! points them ([`BlockRun::add_refs`], [`BlockRun::release`]). The writer that brings it to zero
//! calls [`BlockRun::retire`]: deregister, then, through the epoch, onto the partition's
//! [`Reaper`], which its writers empty.

use crate::raw::holder::Holder;
use crate::raw::hooks::{self, Kind};
use crate::raw::key::long_part;
use crate::raw::reaper::{Reaper, Reclaim};
use crate::raw::run_ids::{IdAllocator, Registered};
use crate::raw::slots::prefetch;
use crate::sync::{AtomicU64, Ordering};
use crossbeam_epoch::Guard;
use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::ptr::NonNull;
use std::sync::Arc;

/// Longest run: offsets are 16 bits in a slot value.
pub const MAX_LEN: usize = 1 << 16;
/// Most holder entries a run has room for (16 bits in the header).
pub const MAX_HOLDERS: usize = 0xFFFF;
/// Successor hints per run.
pub const HINTS: usize = 4;
/// The most front lines a hint records ([`HintTarget::front_lines`]; three bits).
pub const MAX_FRONT_LINES: usize = 7;
/// Key lines past the first that following a hint prefetches of the hinted span.
const SPAN_LINES: usize = 3;

/// Bit 0 of a slot value, free for the index (run pointers are 8-byte aligned).
pub const FLAG: u64 = 1;
const OFFSET_SHIFT: u32 = 48;
/// `meta`'s bits 32.. hold the length (≤ [`MAX_LEN`], 17 bits).
const LEN_MASK: u64 = 0x1_FFFF;
/// `meta`'s bit 63: the run keeps its keys' bytes (see "Keys of other lengths").
const LONG: u64 = 1 << 63;
/// A key descriptor's length marking an 8-byte key (its bytes are its digest's).
const EIGHT: u64 = u32::MAX as u64;
const PTR_MASK: u64 = (1 << OFFSET_SHIFT) - 1;

/// A successor hint (see the module docs, "Hints").
#[repr(C)]
struct Hint {
    key: AtomicU64,
    value: AtomicU64,
    /// [`HintTarget`]'s run id (bits 0–31) and span (bits 32–63).
    target: AtomicU64,
}

/// What a hint names: the slot value of the block that followed a stretch, the id of that
/// block's run, and, as a guess for a walk's prefetches, the run's live stretch from the block
/// on (see the module docs, "Hints").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HintTarget {
    /// The slot value of the block that followed the stretch.
    pub value: u64,
    /// The id of that block's run.
    pub id: u32,
    /// Kept up to [`MAX_LEN`].
    pub span: usize,
    /// Cache lines in front of the run's header line that its holders and hints occupy (what
    /// a walk's prefetch of the run fetches), kept up to `MAX_FRONT_LINES`.
    pub front_lines: usize,
}

impl HintTarget {
    /// The block `value` names in `run` (which it must name), as `run` is now.
    pub fn at(run: &BlockRun, value: u64) -> Self {
        let (_, o) = unpack(value);
        Self {
            value,
            id: run.id(),
            span: run.live_end(o) - o,
            front_lines: run.front_lines(),
        }
    }

    /// The target word: the id (bits 0–31), the span (bits 32–48, up to [`MAX_LEN`]) and the
    /// front lines (bits 49–51).
    fn pack(&self) -> u64 {
        u64::from(self.id)
            | (self.span.min(MAX_LEN) as u64) << 32
            | (self.front_lines.min(MAX_FRONT_LINES) as u64) << 49
    }

    fn unpack(value: u64, word: u64) -> Self {
        Self {
            value,
            id: word as u32,
            span: (word >> 32) as usize & (2 * MAX_LEN - 1),
            front_lines: (word >> 49) as usize & MAX_FRONT_LINES,
        }
    }
}

/// A hint read from a run and not yet checked ([`BlockRun::peek_hint`]): until
/// [`HintedBlock::check`] answers, the block it names may be any run, freed or reused, so
/// nothing but a prefetch may touch it.
#[derive(Clone, Copy, Debug)]
pub struct HintedBlock {
    key: u64,
    target: HintTarget,
}

impl HintedBlock {
    /// Fetches the hinted run's lines a walk reads at its offset: its header line, the front
    /// lines the hint recorded (its holders and hints: no more, unlike [`BlockRun::prefetch`],
    /// which must guess), key `o`'s line, the key lines of its span (up to [`SPAN_LINES`]
    /// more) and its registry entry. A prefetch never faults, so this is sound whatever the
    /// words are.
    #[inline]
    pub fn prefetch(&self, ids: &RunIds) {
        let (run, o) = unpack(self.target.value);
        let header = run.as_ptr() as *const u8;
        prefetch(header);
        for line in 1..=self.target.front_lines {
            prefetch(header.wrapping_sub(64 * line));
        }
        prefetch(header.wrapping_add(HEADER + 8 * o));
        let first = (run.as_ptr() as *const u8).wrapping_add(HEADER + 8 * o);
        let lines = (first as usize % 64 + 8 * self.target.span).div_ceil(64);
        for line in 1..lines.min(SPAN_LINES + 1) {
            prefetch(first.wrapping_add(64 * line));
        }
        ids.prefetch(u64::from(self.target.id));
    }

    /// The live stretch of the hinted run from its offset on (the block itself included) when
    /// the hint was written: where a walk that follows the hint is likely to land next. A
    /// guess only (the run may have changed since); a walk uses it for prefetches.
    #[inline]
    pub fn span(&self) -> usize {
        self.target.span
    }

    /// The hinted slot value, if it checks out (see the module docs, "Hints"): `ids` still
    /// names the hinted run, the offset is live in it and holds the key. Dereferences the run
    /// only after the registry has named it under `guard`.
    #[inline]
    pub fn check(self, ids: &RunIds, guard: &Guard) -> Option<u64> {
        let (run, o) = unpack(self.target.value);
        if ids.get(u64::from(self.target.id), guard) != Some(run) {
            return None;
        }
        // SAFETY: the registry names `run` under the caller's guard, so it is a live run
        // until the guard goes (invariant 4, "Memory ordering").
        let target = unsafe { run.as_ref() };
        let ok = o < target.len() && !target.is_dead(o) && target.key(o) == self.key;
        ok.then_some(self.target.value)
    }
}

/// A run's header; the run pointer points at it (see the module docs for the allocation).
#[repr(C)]
pub struct BlockRun {
    /// `holders | capacity << 16 | len << 32`.
    meta: AtomicU64,
    refs: AtomicU64,
    /// Dead bits of offsets 0..64.
    dead: AtomicU64,
    gone: AtomicU64,
    /// The run's id in its partition's [`RunIds`] (bits 0–31, 0 while unregistered; written by
    /// the registering writer) and its token step (bits 32–63, an `i32` written by `create`;
    /// see "Token counts").
    id_step: AtomicU64,
}

const HEADER: usize = std::mem::size_of::<BlockRun>();
const ENTRY: usize = 2 * std::mem::size_of::<AtomicU64>();
const HINT: usize = std::mem::size_of::<Hint>();
const WORD: usize = std::mem::size_of::<AtomicU64>();

/// Dead words a run of `len` blocks keeps after its keys (offsets from 64 on).
fn extra_dead_words(len: usize) -> usize {
    len.div_ceil(64).saturating_sub(1)
}

/// Gone words a run with room for `capacity` holders keeps after its dead words (entries from
/// 64 on).
fn extra_gone_words(capacity: usize) -> usize {
    capacity.div_ceil(64).saturating_sub(1)
}

/// Bytes in front of the header of a run with room for `capacity` holders.
fn front_bytes(capacity: usize) -> usize {
    capacity * ENTRY + HINTS * HINT
}

/// Bytes of a run's key area of other lengths: `len` descriptors, the byte total, the bytes
/// (rounded up to words); 0 for a run of 8-byte keys (`long_bytes` is `None`).
fn long_area(len: usize, long_bytes: Option<usize>) -> usize {
    long_bytes.map_or(0, |b| (len + 1) * WORD + b.next_multiple_of(WORD))
}

/// `None` when the sizes do not fit an allocation.
fn layout(capacity: usize, len: usize, long_bytes: Option<usize>) -> Option<Layout> {
    let size = front_bytes(capacity)
        + HEADER
        + len * 8
        + (extra_dead_words(len) + extra_gone_words(capacity)) * WORD
        + long_area(len, long_bytes);
    Layout::from_size_align(size, std::mem::align_of::<BlockRun>().max(8)).ok()
}

/// Where the key descriptors of the run at `run` with room for `capacity` holders and `len`
/// keys start (after its gone words; only a long run has them). Plain address arithmetic.
fn descriptors_of(run: *const BlockRun, capacity: usize, len: usize) -> *const u64 {
    (run as *const u8).wrapping_add(
        HEADER + len * 8 + (extra_dead_words(len) + extra_gone_words(capacity)) * WORD,
    ) as *const u64
}

/// The slot value naming offset `o` of `run`.
#[inline]
pub fn pack(run: NonNull<BlockRun>, o: usize) -> u64 {
    debug_assert!(o < MAX_LEN);
    run.as_ptr() as u64 | (o as u64) << OFFSET_SHIFT
}

/// The run and offset a slot value names ([`FLAG`] ignored).
#[inline]
pub fn unpack(value: u64) -> (NonNull<BlockRun>, usize) {
    let p = (value & PTR_MASK & !FLAG) as *mut BlockRun;
    // A slot value is never 0 and never names a null run: `pack` takes a `NonNull`.
    let run = NonNull::new(p).unwrap_or(NonNull::dangling());
    (run, (value >> OFFSET_SHIFT) as usize)
}

impl BlockRun {
    /// A new, unregistered run over `keys` (1..=[`MAX_LEN`]) held by `holders` (1..=`capacity`),
    /// with room for `capacity` (≤ [`MAX_HOLDERS`]) holder entries and no hints, dead or gone
    /// bits, and no references. `None` when the arguments are out of range or the allocation's
    /// address does not fit a slot value (never on 64-bit targets whose user addresses have at
    /// most 48 bits).
    pub fn create(holders: &[Holder], capacity: usize, keys: &[u64]) -> Option<NonNull<BlockRun>> {
        Self::create_keyed::<[u8; 8]>(holders, capacity, keys, None, 0)
    }

    /// [`BlockRun::create`] over keys of any length: `digests[i]` is the digest of `bytes[i]`
    /// (an 8-byte key's big-endian value, else its XXH3-64). A run with a key of another length
    /// than 8 keeps every such key's bytes (see "Keys of other lengths"); `bytes` of `None`
    /// means every key is 8 bytes long. `None` also when `bytes` and `digests` differ in
    /// length or the bytes do not fit 32-bit offsets. `step` is the run's token step (see
    /// "Token counts").
    pub fn create_keyed<K: AsRef<[u8]>>(
        holders: &[Holder],
        capacity: usize,
        digests: &[u64],
        bytes: Option<&[K]>,
        step: i32,
    ) -> Option<NonNull<BlockRun>> {
        let len = digests.len();
        if holders.is_empty()
            || holders.len() > capacity
            || capacity > MAX_HOLDERS
            || len == 0
            || len > MAX_LEN
            || bytes.is_some_and(|b| b.len() != len)
        {
            return None;
        }
        // Only a key of another length than 8 makes the run keep bytes.
        let bytes = bytes.filter(|b| b.iter().any(|k| long_part(k.as_ref()).is_some()));
        let long_bytes = match bytes {
            Some(b) => {
                let total: usize = b
                    .iter()
                    .filter_map(|k| long_part(k.as_ref()))
                    .map(<[u8]>::len)
                    .sum();
                if total >= u32::MAX as usize {
                    return None;
                }
                Some(total)
            }
            None => None,
        };
        let lay = layout(capacity, len, long_bytes)?;
        let keys = digests;
        // SAFETY: the layout has a non-zero size (the header).
        let base = unsafe { alloc(lay) };
        if base.is_null() {
            handle_alloc_error(lay);
        }
        // SAFETY: `front_bytes(capacity)` is inside the allocation, a multiple of 8.
        let header = unsafe { base.add(front_bytes(capacity)) } as *mut BlockRun;
        // SAFETY: `base` is a fresh allocation of `lay`; every word below is inside it and
        // 8-byte aligned (every region's size is a multiple of 8 and the allocation's alignment
        // is 8), and each is initialised exactly once before anything reads it.
        unsafe {
            let front = base as *mut AtomicU64;
            for i in 0..front_bytes(capacity) / WORD {
                front.add(i).write(AtomicU64::new(0));
            }
            let long_flag = if long_bytes.is_some() { LONG } else { 0 };
            header.write(BlockRun {
                meta: AtomicU64::new(
                    holders.len() as u64 | (capacity as u64) << 16 | (len as u64) << 32 | long_flag,
                ),
                refs: AtomicU64::new(0),
                dead: AtomicU64::new(0),
                gone: AtomicU64::new(0),
                id_step: AtomicU64::new(u64::from(step as u32) << 32),
            });
            let run = &*header;
            for (i, h) in holders.iter().enumerate() {
                let (a, b) = h.words();
                run.entry(i)[0].store(a, Ordering::Relaxed);
                run.entry(i)[1].store(b, Ordering::Relaxed);
            }
            let k = (header as *mut u8).add(HEADER) as *mut u64;
            std::ptr::copy_nonoverlapping(keys.as_ptr(), k, len);
            let extra = k.add(len) as *mut AtomicU64;
            let words = extra_dead_words(len) + extra_gone_words(capacity);
            for i in 0..words {
                extra.add(i).write(AtomicU64::new(0));
            }
            if let (Some(b), Some(total)) = (bytes, long_bytes) {
                // Descriptors `start << 32 | length` (length `EIGHT` for an 8-byte key), the
                // byte total, then the bytes, zero-padded to a word.
                let descriptors = extra.add(words) as *mut u64;
                let area = descriptors.add(len + 1) as *mut u8;
                std::ptr::write_bytes(area, 0, total.next_multiple_of(WORD));
                let mut start = 0usize;
                for (i, key) in b.iter().enumerate() {
                    let descriptor = match long_part(key.as_ref()) {
                        Some(long) => {
                            std::ptr::copy_nonoverlapping(
                                long.as_ptr(),
                                area.add(start),
                                long.len(),
                            );
                            let d = (start as u64) << 32 | long.len() as u64;
                            start += long.len();
                            d
                        }
                        None => EIGHT,
                    };
                    descriptors.add(i).write(descriptor);
                }
                descriptors.add(len).write(total as u64);
            }
        }
        if header as u64 & !PTR_MASK != 0 {
            // SAFETY: just built, never shared.
            unsafe { Self::free(header) };
            return None;
        }
        hooks::created(Kind::BlockRun, header as usize);
        NonNull::new(header)
    }

    /// Drops and deallocates a run.
    ///
    /// # Safety
    /// `p` was built by [`BlockRun::create`] and nothing can reach it any more.
    unsafe fn free(p: *mut BlockRun) {
        // SAFETY: per the contract; `create` initialised every atomic word of the allocation
        // (keys are plain `u64`s and need no drop).
        unsafe {
            // Not through `len()`: the ledger already counts the run as freed.
            let meta = (*p).meta.load(Ordering::Relaxed);
            let (capacity, len) = (
                (meta >> 16 & 0xFFFF) as usize,
                (meta >> 32 & LEN_MASK) as usize,
            );
            let long_bytes =
                (meta & LONG != 0).then(|| *descriptors_of(p, capacity, len).add(len) as usize);
            let base = (p as *mut u8).sub(front_bytes(capacity));
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                base as *mut AtomicU64,
                front_bytes(capacity) / WORD,
            ));
            let extra = (p as *mut u8).add(HEADER + len * 8) as *mut AtomicU64;
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                extra,
                extra_dead_words(len) + extra_gone_words(capacity),
            ));
            std::ptr::drop_in_place(p);
            // The layout `create` allocated with (it fitted then).
            if let Some(lay) = layout(capacity, len, long_bytes) {
                dealloc(base, lay);
            }
        }
    }

    /// Frees a run no reader can have reached (never registered, no slot named it): a write
    /// that built a run and then did not publish it.
    ///
    /// # Safety
    /// `run` was built by [`BlockRun::create`], never registered and never stored in a slot.
    pub unsafe fn discard(run: NonNull<BlockRun>) {
        hooks::destroyed(Kind::BlockRun, run.as_ptr() as usize);
        // SAFETY: per the contract, nothing can reach it.
        unsafe { Self::free(run.as_ptr()) }
    }

    /// Records a read of the run for the loom ledger (nothing outside loom): every accessor a
    /// reader uses calls it, so a read of a freed run fails a model.
    #[inline(always)]
    fn touch(&self) {
        hooks::read(Kind::BlockRun, self as *const BlockRun as usize);
    }

    #[inline]
    fn meta(&self) -> u64 {
        self.touch();
        // Acquire: pairs with a join's Release store of the count (module docs).
        self.meta.load(Ordering::Acquire)
    }

    /// Holder entries a reader may read (build-time holders plus joins).
    #[inline]
    pub fn holder_count(&self) -> usize {
        (self.meta() & 0xFFFF) as usize
    }

    /// Holder entries the allocation has room for.
    #[inline]
    pub fn capacity(&self) -> usize {
        (self.meta.load(Ordering::Relaxed) >> 16 & 0xFFFF) as usize
    }

    /// Blocks in the run.
    #[inline]
    pub fn len(&self) -> usize {
        self.touch();
        (self.meta.load(Ordering::Relaxed) >> 32 & LEN_MASK) as usize
    }

    /// Whether the run keeps key bytes: it has a key of another length than 8.
    #[inline]
    pub fn is_long(&self) -> bool {
        self.meta.load(Ordering::Relaxed) & LONG != 0
    }

    /// The key descriptors of a long run (`len` of them, then the byte total).
    #[inline]
    fn descriptors(&self) -> *const u64 {
        descriptors_of(self, self.capacity(), self.len())
    }

    /// Bytes of a long run's keys of other lengths than 8.
    fn long_total(&self) -> usize {
        debug_assert!(self.is_long());
        // SAFETY: entry `len` of a long run's descriptors is the byte total, written by
        // `create` and never again.
        unsafe { *self.descriptors().add(self.len()) as usize }
    }

    /// The bytes of key `o` if it is not 8 bytes long (see [`long_part`]): `None` for an
    /// 8-byte key, whose bytes are its digest's big-endian value.
    #[inline]
    pub fn long_key(&self, o: usize) -> Option<&[u8]> {
        if !self.is_long() {
            return None;
        }
        let len = self.len();
        assert!(o < len, "key offset {o} of a run of {len}");
        let descriptors = self.descriptors();
        // SAFETY: `o < len`: descriptor `o` and the bytes it names are inside the allocation,
        // written by `create` and never again (invariant 1).
        unsafe {
            let d = *descriptors.add(o);
            if d & 0xFFFF_FFFF == EIGHT {
                return None;
            }
            let area = descriptors.add(len + 1) as *const u8;
            Some(std::slice::from_raw_parts(
                area.add((d >> 32) as usize),
                (d & 0xFFFF_FFFF) as usize,
            ))
        }
    }

    /// Whether key `o` is the key with `digest` and long part `long` ([`long_part`] of its
    /// bytes): the digests are equal and so are the long parts (both absent for 8-byte keys).
    #[inline]
    pub fn is_key(&self, o: usize, digest: u64, long: Option<&[u8]>) -> bool {
        self.key(o) == digest && (!(self.is_long() || long.is_some()) || self.long_key(o) == long)
    }

    /// Always false: a run holds at least one block.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Holder entry `i`'s two words (`i < capacity`).
    #[inline]
    fn entry(&self, i: usize) -> &[AtomicU64; 2] {
        debug_assert!(i < self.capacity());
        let p = self as *const BlockRun as *const u8;
        // SAFETY: entry `i` is the `i + 1`-th 16-byte entry in front of the hints, inside the
        // allocation because `i < capacity`, and initialised by `create`.
        unsafe { &*(p.sub(HINTS * HINT + (i + 1) * ENTRY) as *const [AtomicU64; 2]) }
    }

    /// Holder entry `i` (`i < holder_count()` as loaded by the caller).
    #[inline]
    pub fn holder(&self, i: usize) -> Holder {
        self.touch();
        let e = self.entry(i);
        Holder::from_words(e[0].load(Ordering::Relaxed), e[1].load(Ordering::Relaxed))
    }

    /// Gone word `w` (entries `64 w ..`): the header's, then the words after the dead words.
    #[inline]
    fn gone_word(&self, w: usize) -> &AtomicU64 {
        self.touch();
        if w == 0 {
            return &self.gone;
        }
        let len = self.len();
        debug_assert!(w <= extra_gone_words(self.capacity()));
        // SAFETY: gone word `w − 1` after the dead words, inside the allocation
        // (`w < ⌈capacity / 64⌉`) and initialised by `create`.
        unsafe {
            &*((self as *const BlockRun as *const u8)
                .add(HEADER + len * 8 + (extra_dead_words(len) + w - 1) * WORD)
                as *const AtomicU64)
        }
    }

    /// Calls `f` with every holder entry that is not gone, in entry order.
    #[inline]
    pub fn for_each_holder(&self, mut f: impl FnMut(usize, Holder)) {
        // Per 64 entries, their gone word first, then the count: a writer marks an entry gone
        // only after the joins before it, so a reader that sees a gone bit sees every entry
        // counted before it (loom m14b). Loaded the other way round, a reader could see the
        // old count and the new gone bit: no holder at all for a block that always had one.
        let mut base = 0;
        loop {
            let gone = self.gone_word(base / 64).load(Ordering::Acquire);
            let n = self.holder_count();
            for i in base..n.min(base + 64) {
                if gone >> (i - base) & 1 == 0 {
                    f(i, self.holder(i));
                }
            }
            base += 64;
            if base >= n {
                return;
            }
        }
    }

    /// The keys (immutable, invariant 1).
    #[inline]
    pub fn keys(&self) -> &[u64] {
        self.touch();
        // SAFETY: `len` keys follow the header, written by `create` before the run was shared
        // and never written again.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const BlockRun as *const u8).add(HEADER) as *const u64,
                self.len(),
            )
        }
    }

    /// Key `o` (`o < len`).
    #[inline]
    pub fn key(&self, o: usize) -> u64 {
        self.keys()[o]
    }

    /// Dead word `w` (offsets `64 w ..`): the header's, then the words after the keys.
    #[inline]
    fn dead_word(&self, w: usize) -> &AtomicU64 {
        if w == 0 {
            return &self.dead;
        }
        debug_assert!(w <= extra_dead_words(self.len()));
        // SAFETY: word `w − 1` after the keys, inside the allocation (`w < ⌈len / 64⌉`) and
        // initialised by `create`.
        unsafe {
            &*((self as *const BlockRun as *const u8).add(HEADER + self.len() * 8 + (w - 1) * WORD)
                as *const AtomicU64)
        }
    }

    /// Whether offset `o`'s slot no longer names the run.
    #[inline]
    pub fn is_dead(&self, o: usize) -> bool {
        self.touch();
        self.dead_word(o / 64).load(Ordering::Acquire) >> (o % 64) & 1 == 1
    }

    /// The first offset after `o` whose dead bit is set, or `len`: with invariant 2, the end
    /// of the stretch a walk at `o` may step over.
    #[inline]
    pub fn live_end(&self, o: usize) -> usize {
        let len = self.len();
        let from = o + 1;
        if from >= len {
            return len;
        }
        let mut w = from / 64;
        let mut bits = self.dead_word(w).load(Ordering::Acquire) >> (from % 64) << (from % 64);
        loop {
            if bits != 0 {
                return (w * 64 + bits.trailing_zeros() as usize).min(len);
            }
            w += 1;
            if w * 64 >= len {
                return len;
            }
            bits = self.dead_word(w).load(Ordering::Acquire);
        }
    }

    /// Offsets whose dead bit is clear.
    pub fn live_count(&self) -> usize {
        let words = self.len().div_ceil(64);
        let dead: u32 = (0..words)
            .map(|w| self.dead_word(w).load(Ordering::Acquire).count_ones())
            .sum();
        self.len() - dead as usize
    }

    /// Hint `j`.
    #[inline]
    fn hint_at(&self, j: usize) -> &Hint {
        debug_assert!(j < HINTS);
        // SAFETY: hint `j` is one of the `HINTS` hints right in front of the header, inside the
        // allocation and initialised (zeroed) by `create`.
        unsafe { &*((self as *const BlockRun as *const u8).sub((HINTS - j) * HINT) as *const Hint) }
    }

    /// The slot value of `key` as one of this run's hints names it, if the hint checks out
    /// (see the module docs, "Hints"): `ids` (the run's partition's registry) still names the
    /// hinted run, the offset is live in it and holds `key`. The caller's guard keeps the run
    /// it names readable. [`BlockRun::peek_hint`] then [`HintedBlock::check`], in one step.
    #[inline]
    pub fn hint(&self, key: u64, ids: &RunIds, guard: &Guard) -> Option<u64> {
        self.peek_hint(key)?.check(ids, guard)
    }

    /// This run's hint for `key`, not yet checked: a walk fetches the block it names (and its
    /// registry entry) with [`HintedBlock::prefetch`], compares this run's keys meanwhile, and
    /// only then checks it, so the hinted run's lines are not waited for twice.
    #[inline]
    pub fn peek_hint(&self, key: u64) -> Option<HintedBlock> {
        (0..HINTS).map(|j| self.hint_at(j)).find_map(|h| {
            (h.key.load(Ordering::Relaxed) == key).then(|| HintedBlock {
                key,
                target: HintTarget::unpack(
                    h.value.load(Ordering::Relaxed),
                    h.target.load(Ordering::Relaxed),
                ),
            })
        })
    }

    /// Calls `f` with every hint's key and target: for a writer that copies a run's hints into
    /// the run that replaces it.
    pub fn for_each_hint(&self, mut f: impl FnMut(u64, HintTarget)) {
        for j in 0..HINTS {
            let h = self.hint_at(j);
            let key = h.key.load(Ordering::Relaxed);
            if key != 0 {
                f(
                    key,
                    HintTarget::unpack(
                        h.value.load(Ordering::Relaxed),
                        h.target.load(Ordering::Relaxed),
                    ),
                );
            }
        }
    }

    /// Cache lines in front of the header's line that the holders and hints occupy: what a
    /// walk reads there (a hint records it, so a walk that follows one fetches no more).
    pub fn front_lines(&self) -> usize {
        let header = std::ptr::from_ref(self) as usize;
        let start = header - front_bytes(self.capacity());
        header / 64 - start / 64
    }

    /// Fetches the lines a walk at offset `o` reads: the header, the four lines in front of it
    /// (the hints and up to ten holders: block 0's stretch reads every holder, and W1M's first
    /// runs hold eight), and key `o`'s line. Any value may be passed: a prefetch never faults.
    #[inline]
    pub fn prefetch(run: *const BlockRun, o: usize) {
        let p = run as *const u8;
        prefetch(p);
        prefetch(p.wrapping_sub(64));
        prefetch(p.wrapping_sub(128));
        prefetch(p.wrapping_sub(192));
        prefetch(p.wrapping_sub(256));
        prefetch(p.wrapping_add(HEADER + 8 * o));
    }

    // --- Writers (the caller holds the partition's writer lock). ---

    /// Adds `h` in the next spare holder entry, or returns false when the run has none. The
    /// entry is written before the count that makes readers read it (invariant 3).
    pub fn push_holder(&self, h: Holder) -> bool {
        let meta = self.meta.load(Ordering::Relaxed);
        let n = (meta & 0xFFFF) as usize;
        if n >= self.capacity() {
            return false;
        }
        let (a, b) = h.words();
        let e = self.entry(n);
        e[0].store(a, Ordering::Relaxed);
        e[1].store(b, Ordering::Relaxed);
        // Release: the entry's words before the count (module docs).
        self.meta.store(meta + 1, Ordering::Release);
        true
    }

    /// Marks holder entry `i` gone: its replica holds none of the run's blocks any more.
    pub fn set_gone(&self, i: usize) {
        debug_assert!(i < self.capacity());
        // A plain load and store, no locked instruction: only the lock's holder writes.
        let word = self.gone_word(i / 64);
        word.store(
            word.load(Ordering::Relaxed) | 1 << (i % 64),
            Ordering::Release,
        );
    }

    /// Marks offset `o` dead, before its slot is repointed or removed (invariant 2).
    pub fn set_dead(&self, o: usize) {
        debug_assert!(o < self.len());
        // A plain load and store, no locked instruction: only the lock's holder writes.
        let word = self.dead_word(o / 64);
        word.store(
            word.load(Ordering::Relaxed) | 1 << (o % 64),
            Ordering::Release,
        );
    }

    /// Records that the block keyed `key` follows one of this run's stretches at `target`:
    /// replaces the hint for that key, else takes a free one, else the one `key` picks.
    pub fn set_hint(&self, key: u64, target: HintTarget) {
        let mut pick = None;
        for j in 0..HINTS {
            let k = self.hint_at(j).key.load(Ordering::Relaxed);
            if k == key {
                pick = Some(j);
                break;
            }
            if k == 0 && pick.is_none() {
                pick = Some(j);
            }
        }
        let h = self.hint_at(pick.unwrap_or(key as usize % HINTS));
        // Relaxed: a reader checks every hint against the registry and the target's key, so a
        // torn one only fails its check, and a span is only a prefetch guess (module docs,
        // "Hints").
        h.key.store(0, Ordering::Relaxed);
        h.value.store(target.value, Ordering::Relaxed);
        h.target.store(target.pack(), Ordering::Relaxed);
        h.key.store(key, Ordering::Relaxed);
    }

    /// Adds `n` references (slots newly naming the run).
    pub fn add_refs(&self, n: u64) {
        self.refs.fetch_add(n, Ordering::Relaxed);
    }

    /// Drops `n` references; true when none is left (the caller then retires the run).
    pub fn release(&self, n: u64) -> bool {
        let old = self.refs.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(old >= n, "run references underflow");
        old == n
    }

    /// References held (slots naming the run).
    pub fn refs(&self) -> u64 {
        self.refs.load(Ordering::Relaxed)
    }

    /// The run's id in its partition's registry (0 while unregistered).
    pub fn id(&self) -> u32 {
        self.id_step.load(Ordering::Relaxed) as u32
    }

    /// The token count a block's count adds to the previous block's in this run (see "Token
    /// counts"; immutable, invariant 1).
    #[inline]
    pub fn step(&self) -> i32 {
        (self.id_step.load(Ordering::Relaxed) >> 32) as u32 as i32
    }

    /// The token count of `holder`'s entry of block `o` (see "Token counts").
    #[inline]
    pub fn tokens_at(&self, holder: &Holder, o: usize) -> i32 {
        holder
            .tokens()
            .wrapping_add(self.step().wrapping_mul(o as i32))
    }

    /// Bytes this run holds (glibc chunk sizes, see `pages::heap_chunk`).
    pub fn bytes(&self) -> usize {
        let long_bytes = self.is_long().then(|| self.long_total());
        // A live run's layout fitted when `create` allocated it.
        let size = layout(self.capacity(), self.len(), long_bytes).map_or(0, |l| l.size());
        crate::raw::pages::heap_chunk(size)
    }

    /// Bytes a copy of `len` of this run's offsets would hold, with room for as many holders
    /// (a long run's copy is counted with all of its key bytes).
    pub fn copy_bytes(&self, len: usize) -> usize {
        let long_bytes = self.is_long().then(|| self.long_total());
        let size = layout(self.capacity(), len, long_bytes).map_or(0, |l| l.size());
        crate::raw::pages::heap_chunk(size)
    }

    /// Deregisters a run no slot names any more and hands it to `reaper` once every reader
    /// pinned now has left; the reaper's owner frees it (`raw/reaper.rs` says why not the
    /// epoch's collecting thread).
    ///
    /// # Safety
    /// `run` was built by [`BlockRun::create`] and registered in `ids`, no slot names it, and
    /// it is not retired twice.
    pub unsafe fn retire(
        run: NonNull<BlockRun>,
        ids: &RunIds,
        alloc: &mut IdAllocator,
        reaper: &Arc<Reaper<BlockRun>>,
        guard: &Guard,
    ) {
        // SAFETY: live until the deferred push below and the reaper's free.
        let id = unsafe { run.as_ref() }.id();
        ids.deregister(alloc, id);
        let addr = run.as_ptr() as usize;
        let reaper = Arc::clone(reaper);
        // SAFETY: no slot and no registry entry names the run any more, so only readers pinned
        // before this point can reach it, and the deferred push runs after they unpin, once:
        // the reaper owns the run from then on.
        unsafe { guard.defer_unchecked(move || reaper.push(addr as *mut BlockRun)) };
    }
}

impl Reclaim for BlockRun {
    /// The reference word: a retired run has no references left.
    fn link(&self) -> &AtomicU64 {
        &self.refs
    }

    unsafe fn reclaim(p: *mut BlockRun) {
        hooks::destroyed(Kind::BlockRun, p as usize);
        // SAFETY: per the contract, nothing else holds the run.
        unsafe { BlockRun::free(p) }
    }
}

/// The registry of a partition's runs (`run_ids.rs`).
pub type RunIds = crate::raw::run_ids::RunIds<BlockRun>;
/// A registered run met by `RunIds::scan`.
pub type ScanStep<'a> = crate::raw::run_ids::ScanStep<'a, BlockRun>;

impl Registered for BlockRun {
    #[inline]
    fn id_word(&self) -> &AtomicU64 {
        &self.id_step
    }

    #[inline]
    fn age(&self) -> i64 {
        let mut age = i64::MAX;
        self.for_each_holder(|_, h| age = age.min(h.last_seen_ms()));
        age
    }
}

// SAFETY: every field a reader shares is atomic; writers are serialized by the caller.
unsafe impl Send for BlockRun {}
// SAFETY: as above.
unsafe impl Sync for BlockRun {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn holder(rep: u32, ts: i64) -> Holder {
        Holder::new(rep, 1, 16, ts, 7)
    }

    fn run(holders: &[Holder], capacity: usize, keys: &[u64]) -> NonNull<BlockRun> {
        BlockRun::create(holders, capacity, keys).expect("a valid run")
    }

    #[test]
    fn front_lines_cover_the_holders_and_hints_exactly() {
        for capacity in [1, 2, 3, 8, 20] {
            let r = run(&[holder(1, 10)], capacity, &[1, 2, 3]);
            // SAFETY: live until discarded below.
            let x = unsafe { r.as_ref() };
            // The header's offset in its line, plus the lines in front, reach the first front
            // byte; one line fewer would not.
            let within = r.as_ptr() as usize % 64;
            let (lines, front) = (x.front_lines(), front_bytes(capacity));
            assert!(within + 64 * lines >= front, "capacity {capacity}");
            assert!(
                lines == 0 || within + 64 * (lines - 1) < front,
                "capacity {capacity}"
            );
            // SAFETY: never registered, never in a slot.
            unsafe { BlockRun::discard(r) };
        }
    }

    #[test]
    fn long_runs_keep_their_keys_bytes_and_compare_them() {
        use crate::raw::key::digest;
        let long = b"a key of twenty-four bytes".as_slice();
        let keys: [&[u8]; 5] = [b"12345678", b"", long, &[7u8; 8], b"abc"];
        let digests: Vec<u64> = keys.iter().map(|k| digest(k)).collect();
        let r = BlockRun::create_keyed(&[holder(1, 10)], 2, &digests, Some(&keys[..]), 0)
            .expect("a valid long run");
        // SAFETY: just built; freed at the end of the test.
        let x = unsafe { r.as_ref() };
        assert!(x.is_long());
        assert_eq!(x.keys(), &digests[..]);
        let parts: Vec<Option<&[u8]>> = (0..keys.len()).map(|o| x.long_key(o)).collect();
        assert_eq!(
            parts,
            [None, Some(&b""[..]), Some(long), None, Some(&b"abc"[..])]
        );
        for (o, k) in keys.iter().enumerate() {
            assert!(x.is_key(o, digest(k), long_part(k)), "key {o} is itself");
        }
        // The same digest with another long part, or an 8-byte key of a long key's digest.
        assert!(!x.is_key(2, digests[2], Some(b"another key, same digest")));
        assert!(
            !x.is_key(2, digests[2], None),
            "an 8-byte key of the long key's digest"
        );
        assert!(!x.is_key(0, digests[0], Some(b"12345678-and-more")));
        assert!(!x.is_key(1, digests[1], None));
        // A run of 8-byte keys compares digests alone, and refuses a long key of its digest.
        let short = BlockRun::create_keyed(&[holder(1, 10)], 1, &digests[..1], Some(&keys[..1]), 0)
            .expect("a valid run");
        // SAFETY: just built; freed at the end of the test.
        let y = unsafe { short.as_ref() };
        assert!(!y.is_long());
        assert_eq!(y.long_key(0), None);
        assert!(y.is_key(0, digests[0], None));
        assert!(!y.is_key(0, digests[0], Some(long)));
        // Bytes beside the keys: the run is larger than the same run of 8-byte keys.
        let plain = run(&[holder(1, 10)], 2, &digests);
        // SAFETY: just built; freed below.
        assert!(x.bytes() > unsafe { plain.as_ref() }.bytes());
        assert!(
            BlockRun::create_keyed(&[holder(1, 10)], 1, &digests, Some(&keys[..2]), 0).is_none(),
            "bytes and digests differ in length"
        );
        // SAFETY: none of them was ever shared.
        unsafe {
            BlockRun::discard(r);
            BlockRun::discard(short);
            BlockRun::discard(plain);
        }
    }

    #[test]
    fn create_reads_back_holders_and_keys() {
        let keys: Vec<u64> = (100..170).collect();
        let r = run(&[holder(3, 1_000), holder(5, 2_000)], 3, &keys);
        // SAFETY: just built; freed at the end of the test.
        let x = unsafe { r.as_ref() };
        assert_eq!((x.holder_count(), x.capacity(), x.len()), (2, 3, 70));
        assert_eq!(x.holder(0), holder(3, 1_000));
        assert_eq!(x.holder(1), holder(5, 2_000));
        assert_eq!(x.keys(), &keys[..]);
        assert_eq!(x.live_count(), 70);
        assert_eq!(x.live_end(0), 70);
        // SAFETY: never shared.
        unsafe { BlockRun::discard(r) };
    }

    #[test]
    fn create_refuses_out_of_range_arguments() {
        let h = [holder(1, 1)];
        assert!(BlockRun::create(&[], 1, &[1]).is_none());
        assert!(BlockRun::create(&h, 0, &[1]).is_none());
        assert!(BlockRun::create(&h, MAX_HOLDERS + 1, &[1]).is_none());
        assert!(BlockRun::create(&h, 1, &[]).is_none());
        assert!(BlockRun::create(&h, 1, &vec![1; MAX_LEN + 1]).is_none());
    }

    #[test]
    fn joins_fill_spare_entries_then_refuse() {
        let r = run(&[holder(1, 10)], 2, &[7, 8]);
        // SAFETY: as above.
        let x = unsafe { r.as_ref() };
        assert!(x.push_holder(holder(2, 20)));
        assert!(!x.push_holder(holder(3, 30)), "no spare entry left");
        let mut seen = Vec::new();
        x.for_each_holder(|i, h| seen.push((i, h.rep())));
        assert_eq!(seen, [(0, 1), (1, 2)]);
        x.set_gone(0);
        seen.clear();
        x.for_each_holder(|i, h| seen.push((i, h.rep())));
        assert_eq!(seen, [(1, 2)], "a gone entry is skipped");
        // SAFETY: never shared.
        unsafe { BlockRun::discard(r) };
    }

    #[test]
    fn gone_bits_span_words_for_many_holders() {
        let holders: Vec<Holder> = (0..70).map(|r| holder(r, 10)).collect();
        let r = run(&holders, 140, &[1, 2]);
        // SAFETY: as above.
        let x = unsafe { r.as_ref() };
        for rep in 70..130 {
            assert!(x.push_holder(holder(rep, 10)));
        }
        for i in [3, 63, 64, 100, 129] {
            x.set_gone(i);
        }
        let mut seen = Vec::new();
        x.for_each_holder(|i, h| {
            assert_eq!(h.rep() as usize, i);
            seen.push(i);
        });
        let want: Vec<usize> = (0..130)
            .filter(|i| ![3, 63, 64, 100, 129].contains(i))
            .collect();
        assert_eq!(seen, want);
        // SAFETY: never shared.
        unsafe { BlockRun::discard(r) };
    }

    #[test]
    fn dead_bits_end_stretches_across_words() {
        let keys: Vec<u64> = (1..=200).collect();
        let r = run(&[holder(1, 10)], 1, &keys);
        // SAFETY: as above.
        let x = unsafe { r.as_ref() };
        for o in [5, 63, 64, 130, 199] {
            x.set_dead(o);
        }
        assert_eq!(x.live_end(0), 5);
        assert_eq!(x.live_end(5), 63);
        assert_eq!(x.live_end(6), 63);
        assert_eq!(x.live_end(63), 64);
        assert_eq!(x.live_end(64), 130);
        assert_eq!(x.live_end(131), 199);
        assert_eq!(x.live_end(199), 200);
        assert!(x.is_dead(64) && !x.is_dead(65));
        assert_eq!(x.live_count(), 195);
        // SAFETY: never shared.
        unsafe { BlockRun::discard(r) };
    }

    #[test]
    fn hints_check_registry_liveness_and_key() {
        let guard = crossbeam_epoch::pin();
        let ids = RunIds::new();
        let mut alloc = IdAllocator::default();
        let a = run(&[holder(1, 10)], 1, &[1, 2, 3]);
        let b = run(&[holder(2, 10)], 1, &[4, 5]);
        let id_b = ids.register(&mut alloc, b).expect("an id");
        // SAFETY: live until the end of the test.
        let (xa, xb) = unsafe { (a.as_ref(), b.as_ref()) };
        assert_eq!(xb.id(), id_b);
        xa.set_hint(
            4,
            HintTarget {
                value: pack(b, 0),
                id: id_b,
                span: 2,
                front_lines: 4,
            },
        );
        xa.set_hint(
            5,
            HintTarget {
                value: pack(b, 1),
                id: id_b,
                span: 1,
                front_lines: 4,
            },
        );
        xa.set_hint(
            6,
            HintTarget {
                value: pack(b, 1),
                id: id_b,
                span: 1,
                front_lines: 4,
            },
        );
        assert_eq!(xa.hint(4, &ids, &guard), Some(pack(b, 0)));
        assert_eq!(xa.hint(5, &ids, &guard), Some(pack(b, 1)));
        assert_eq!(xa.hint(6, &ids, &guard), None, "the target's key differs");
        assert_eq!(xa.hint(9, &ids, &guard), None, "no hint for the key");
        let spans: Vec<(u64, usize)> = {
            let mut v = Vec::new();
            xa.for_each_hint(|k, target| {
                assert_eq!(target.id, id_b);
                v.push((k, target.span));
            });
            v
        };
        assert_eq!(spans, [(4, 2), (5, 1), (6, 1)], "each hint keeps its span");
        xa.for_each_hint(|_, target| assert_eq!(target.front_lines, 4, "and its front lines"));
        assert_eq!(xa.peek_hint(4).map(|h| h.span()), Some(2));
        assert_eq!(
            HintTarget::at(xb, pack(b, 0)),
            HintTarget {
                value: pack(b, 0),
                id: id_b,
                span: 2,
                front_lines: xb.front_lines(),
            },
            "a target as its run is now"
        );
        xb.set_dead(1);
        assert_eq!(xa.hint(5, &ids, &guard), None, "a dead offset");
        // Replacing a key's hint keeps one hint per key.
        xa.set_hint(
            4,
            HintTarget {
                value: pack(b, 0) | FLAG,
                id: id_b,
                span: 2,
                front_lines: 4,
            },
        );
        assert_eq!(xa.hint(4, &ids, &guard), Some(pack(b, 0) | FLAG));
        assert_eq!(unpack(pack(b, 0) | FLAG), (b, 0));
        // A hint read before its run went is refused when checked after: the walk's order
        // (peek, prefetch, compare, check).
        let early = xa.peek_hint(4).expect("a hint for key 4");
        early.prefetch(&ids);
        // A deregistered run's hints are refused, and its id is reused by the next run.
        ids.deregister(&mut alloc, id_b);
        assert_eq!(xa.hint(4, &ids, &guard), None);
        assert_eq!(
            early.check(&ids, &guard),
            None,
            "checked after the run went"
        );
        assert!(xa.peek_hint(9).is_none(), "no hint for the key");
        // Prefetching ids the registry never handed out fetches nothing and faults never.
        for id in [0, 1, u64::from(u32::MAX), u64::MAX] {
            ids.prefetch(id);
        }
        let c = run(&[holder(3, 10)], 1, &[4]);
        assert_eq!(ids.register(&mut alloc, c), Some(id_b));
        assert_eq!(
            xa.hint(4, &ids, &guard),
            None,
            "the id names another pointer"
        );
        // SAFETY: none of them was ever in a slot; `c`'s registration is cleared first.
        unsafe {
            ids.deregister(&mut alloc, id_b);
            BlockRun::discard(a);
            BlockRun::discard(b);
            BlockRun::discard(c);
        }
    }

    #[test]
    fn ids_span_chunks_and_are_reused() {
        let guard = crossbeam_epoch::pin();
        let ids = RunIds::new();
        let mut alloc = IdAllocator::default();
        let r = run(&[holder(1, 10)], 1, &[1]);
        let mut taken = Vec::new();
        for _ in 0..500 {
            taken.push(ids.register(&mut alloc, r).expect("an id"));
        }
        assert_eq!(taken, (1..=500).collect::<Vec<u32>>());
        assert!(
            taken
                .iter()
                .all(|&id| ids.get(u64::from(id), &guard) == Some(r))
        );
        assert_eq!(ids.get(0, &guard), None);
        assert_eq!(ids.get(501, &guard), None);
        assert_eq!(ids.get(u64::MAX, &guard), None);
        ids.deregister(&mut alloc, 200);
        assert_eq!(ids.get(200, &guard), None);
        assert_eq!(ids.register(&mut alloc, r), Some(200));
        assert!(ids.bytes() >= 512 * 8);
        for (c, i) in [(1, 0), (2, 1), (5, 1), (6, 2), (13, 2), (509, 7), (510, 8)]
            .map(|(id, c)| (crate::raw::run_ids::locate(id).0, c))
        {
            assert_eq!(c, i);
        }
        // SAFETY: never in a slot.
        unsafe { BlockRun::discard(r) };
    }

    #[test]
    fn a_scan_reads_only_runs_as_old_as_its_bound_and_stops_where_told() {
        let guard = crossbeam_epoch::pin();
        let ids = RunIds::new();
        let mut alloc = IdAllocator::default();
        // Ages: the oldest holder at registration.
        let runs = [
            run(&[holder(1, 50), holder(2, 20)], 3, &[1]),
            run(&[holder(1, 40)], 2, &[2]),
            run(&[holder(1, 10)], 1, &[3]),
            run(&[holder(1, 60)], 2, &[4]),
        ];
        for r in runs {
            ids.register(&mut alloc, r).expect("an id");
        }
        ids.deregister(&mut alloc, 3);
        assert_eq!(ids.scan_len(), 2 + 4);
        let seen = |first: usize, end: usize, max_age: i64, stop_young: bool| {
            let (mut old, mut young) = (Vec::new(), 0);
            let stopped = ids.scan(first, end, max_age, &guard, |step| match step {
                ScanStep::Old(r) => {
                    old.push(r.key(0));
                    true
                }
                ScanStep::Young => {
                    young += 1;
                    !stop_young
                }
            });
            (old, young, stopped)
        };
        // Id 3 is free: neither old nor young.
        assert_eq!(seen(0, 64, 20, false), (vec![1], 2, 64));
        assert_eq!(seen(0, 64, 40, false), (vec![1, 2], 1, 64));
        assert_eq!(seen(2, 64, i64::MAX, false), (vec![2, 4], 0, 64));
        // A young run stops the scan in front of it; an old one, after it.
        assert_eq!(seen(1, 64, 20, true), (vec![1], 1, 2));
        let stopped = ids.scan(0, 64, i64::MAX, &guard, |_| false);
        assert_eq!(stopped, 2, "after id 1, the first registered");
        // A join lowers the age; a younger one leaves it.
        ids.lower_age(4, 30);
        ids.lower_age(2, 45);
        assert_eq!(seen(0, 64, 35, false), (vec![1, 4], 1, 64));
        // Past the allocated chunks there is nothing.
        assert_eq!(seen(64, 10_000, i64::MAX, false), (vec![], 0, 10_000));
        // SAFETY: never in a slot; deregistered first.
        unsafe {
            for (id, r) in [(1, runs[0]), (2, runs[1]), (4, runs[3])] {
                ids.deregister(&mut alloc, id);
                BlockRun::discard(r);
            }
            BlockRun::discard(runs[2]);
        }
    }

    #[test]
    fn retire_frees_through_the_epoch() {
        let ids = RunIds::new();
        let mut alloc = IdAllocator::default();
        let r = run(&[holder(1, 10)], 1, &[1, 2]);
        let id = ids.register(&mut alloc, r).expect("an id");
        // SAFETY: live.
        let x = unsafe { r.as_ref() };
        x.add_refs(2);
        assert!(!x.release(1));
        assert!(x.release(1));
        let guard = crossbeam_epoch::pin();
        let reaper = Arc::new(Reaper::default());
        // SAFETY: registered, no slot names it, retired once.
        unsafe { BlockRun::retire(r, &ids, &mut alloc, &reaper, &guard) };
        assert_eq!(ids.get(u64::from(id), &guard), None);
        assert_eq!(alloc.free_ids(), [id]);
        drop(guard);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while reaper.is_empty() && std::time::Instant::now() < until {
            crossbeam_epoch::pin().flush();
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        assert_eq!(
            reaper.free_all(),
            1,
            "the epoch handed the run to the reaper"
        );
    }
}
