//! Chain runs: a lookup shortcut over a stretch of consecutive chain blocks whose entries carry
//! the same holders.
//!
//! A longest-prefix walk costs one table probe per block (a group line, then the node's lines).
//! Along one ingested chain, consecutive nodes mostly say the same thing: on a shared prefix (a
//! system prompt every replica holds) the same replicas, with the same `last_seen` and tier; on
//! the replica's own tail (a conversation only it has seen) just that replica. A [`ChainRun`]
//! records, for the blocks of one chain ingest, the blocks' keys in one array plus which of them
//! still carry the holders this ingest gave them. A walk that reaches a block whose node names a
//! run compares the request's next hashes with the run's keys (consecutive, in cache) and steps
//! over every block that matches and is still as the ingest left it, instead of probing each
//! one: their holders are, by construction, those of the node it just read.
//!
//! # Structure
//!
//! `{refs, member, sealed, len, words: [dead bits][stop bits], keys}`, one run per chain ingest
//! of at least [`MIN_RUN`] blocks with 8-byte keys (see `Index::plan_run`), covering offsets
//! `0..len` of the chain. A node built by that ingest for offset `o` holds the *run word*
//! `run pointer | o << 48` in place of its key (a flag on its holders says so; the key is
//! `keys[o]`), so a run node is no larger than a plain one. A node whose only holder is the
//! ingest's own entry is a 16-byte *member node*: its holder's first word (replica and
//! `last_seen`, the same for the whole ingest) is the run's `member` word, so the run's key
//! costs no more than the one a plain node would hold (see `table::KeyNode`). The run is exact,
//! never a hint to verify:
//!
//! - **dead bit `o`**: the node the ingest published for offset `o` has been replaced or
//!   removed. Whoever unlinks it sets the bit under the key's shard mutex, before the change is
//!   published; a bit is never cleared.
//! - **stop bit `o`**: the ingest published no node naming `(run, o)` or `(run, o − 1)`
//!   (unchanged entry, one holder), or the two do not have the same holders (replicas,
//!   `last_seen` and tier). Written once, before the run is **sealed**.
//! - **keys**: the chain's first `len` keys, written before any node names the run.
//!
//! So for a sealed run, a node naming `(run, o)` and every offset `o < p < end`, where `end` is
//! the first offset after `o` with a stop or dead bit: the key `keys[p]` is held by exactly the
//! holders of the node at `o`, with the same `last_seen` and tier ([`ChainRun::stretch_end`]).
//! Generations and per-block token counts differ per entry and are not covered: LFU lookups
//! (which capture every node) do not use runs, and lookups read token counts from the request.
//!
//! # Memory ordering
//!
//! - The run (keys, zeroed bits) is fully written before the first node naming it is published
//!   with the table's Release lane store, so a reader that found the node through the table
//!   (Acquire) sees it.
//! - Stop bits are stored (Relaxed) after the ingest's last node is published and before the
//!   Release store of `sealed`; a reader loads `sealed` with Acquire before it reads them.
//! - A dead bit is set (Release) before the lane store that publishes the change. A reader whose
//!   Acquire load of a dead word does not see the bit read it before the set in the word's
//!   modification order: the walk behaves as if it had read that block before the change (C3
//!   asks for per-entry atomicity, not a snapshot across entries). A reader that has seen the
//!   change (it happens-before) sees the bit.
//!
//! # Reclamation
//!
//! `refs` counts the published nodes naming the run that are still linked. The ingest does not
//! count them one by one: the run starts at a bias of 2^40 (its own reference), each unlink
//! subtracts one after its lane store, and the seal subtracts the bias less the number of nodes
//! the ingest published. Whoever brings the count to zero retires the run through the epoch.
//! Every node naming it is unlinked by then, so a reader that can still reach one was pinned
//! before its unlink and therefore before the retirement. A run the ingest never published a
//! node for (an unchanged re-ingest) is freed at the seal at once: no reader could reach it.
//!
//! The epoch does not free a retired run itself: its deferred function only pushes the run onto
//! its table's [`Reaper`] (`raw/reaper.rs` says why), and the table's writers free what is there
//! each time one takes a shard's lock, and when the last reference to the reaper goes.

use crate::raw::reaper::Reclaim;
use crate::sync::{AtomicBool, AtomicU64, Ordering};
use crossbeam_epoch::Guard;
use std::alloc::{Layout, alloc, dealloc, handle_alloc_error};
use std::sync::Arc;

/// Shortest chain worth a run.
pub(crate) const MIN_RUN: usize = 4;
/// Longest run: offsets are 16 bits in a node's run word.
pub(crate) const MAX_RUN: usize = 1 << 16;
const OFFSET_SHIFT: u32 = 48;
/// The ingest's reference while it builds the run (see "Reclamation").
const BIAS: u64 = 1 << 40;
const PTR_MASK: u64 = (1 << OFFSET_SHIFT) - 1;

/// A run over the first `len` blocks of one chain ingest (see the module docs). One allocation:
/// `2 · ⌈len / 64⌉` bit words (dead bits, then stop bits), then this header, then the `len`
/// 8-byte keys; a run pointer points at the header. A walk reaches the bits and the keys
/// without another pointer to chase, and a key's address does not depend on the run's length:
/// checking a node's key (a table probe whose fingerprint matched) reads the node and the key's
/// line, not the header.
#[repr(C)]
pub(crate) struct ChainRun {
    refs: AtomicU64,
    /// The creating ingest's holder word `a` (its replica and `last_seen`): the holder of every
    /// member node naming the run (see `table::KeyNode`).
    member: u64,
    sealed: AtomicBool,
    len: u32,
}

const HEADER: usize = std::mem::size_of::<ChainRun>();
const WORD: usize = std::mem::size_of::<AtomicU64>();

impl ChainRun {
    fn layout(len: usize) -> Layout {
        let size = Self::words_bytes(len) + HEADER + len * 8;
        let align = std::mem::align_of::<ChainRun>().max(std::mem::align_of::<AtomicU64>());
        Layout::from_size_align(size, align).expect("chain run layout")
    }

    /// Number of bit words (dead, then stop) of a run over `len` blocks.
    #[inline]
    fn n_words(len: usize) -> usize {
        2 * len.div_ceil(64)
    }

    /// Bytes of the bit words in front of the header of a run over `len` blocks.
    #[inline]
    fn words_bytes(len: usize) -> usize {
        Self::n_words(len) * WORD
    }

    /// A new, unsealed run over `keys` (at most [`MAX_RUN`]) with member word `member`,
    /// holding the ingest's reference. `None` when the allocation's address does not fit a run
    /// word (never on today's 64-bit targets, whose user addresses have at most 48 bits).
    pub(crate) fn create(
        keys: impl ExactSizeIterator<Item = [u8; 8]>,
        member: u64,
    ) -> Option<*const ChainRun> {
        let len = keys.len();
        debug_assert!(len > 0 && len <= MAX_RUN);
        let lay = Self::layout(len);
        // SAFETY: the layout has a non-zero size (the header).
        let base = unsafe { alloc(lay) };
        if base.is_null() {
            handle_alloc_error(lay);
        }
        // SAFETY: inside the allocation (the words come first).
        let p = unsafe { base.add(Self::words_bytes(len)) } as *mut ChainRun;
        // SAFETY: `base` is a fresh allocation of `lay`: the words, the header and the keys are
        // written in place, each inside it and suitably aligned (8-byte words at the start, a
        // header after a multiple of 8 bytes, keys with alignment 1).
        unsafe {
            let w = base as *mut AtomicU64;
            for i in 0..Self::n_words(len) {
                w.add(i).write(AtomicU64::new(0));
            }
            p.write(ChainRun {
                refs: AtomicU64::new(BIAS),
                member,
                sealed: AtomicBool::new(false),
                len: len as u32,
            });
            let k = (p as *mut u8).add(HEADER) as *mut [u8; 8];
            let mut keys = keys;
            for i in 0..len {
                k.add(i).write(keys.next().unwrap_or_default());
            }
        }
        if p as u64 & !PTR_MASK != 0 {
            // SAFETY: just built, never shared.
            unsafe { Self::free(p) };
            return None;
        }
        crate::raw::hooks::created(crate::raw::hooks::Kind::Run, p as usize);
        Some(p)
    }

    /// Drops and deallocates a run.
    ///
    /// # Safety
    /// `p` was built by `create` and nobody can reach it any more.
    unsafe fn free(p: *mut ChainRun) {
        // SAFETY: per the contract; the words were written by `create`, in front of the
        // header, at the start of the allocation.
        unsafe {
            let len = (*p).len as usize;
            let base = (p as *mut u8).sub(Self::words_bytes(len));
            let w = base as *mut AtomicU64;
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(w, Self::n_words(len)));
            std::ptr::drop_in_place(p);
            dealloc(base, Self::layout(len));
        }
    }

    /// Bytes this run holds (for `memory_bytes`; glibc chunk sizes, see `pages::heap_chunk`).
    pub(crate) fn bytes(&self) -> usize {
        crate::raw::pages::heap_chunk(Self::layout(self.len()).size())
    }

    /// The member word (see the field).
    #[inline]
    pub(crate) fn member(&self) -> u64 {
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Run,
            self as *const ChainRun as usize,
        );
        self.member
    }

    /// Blocks covered.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    #[inline]
    fn nw(&self) -> usize {
        self.len().div_ceil(64)
    }

    /// The dead words, then the stop words.
    #[inline]
    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `create` wrote `2 · nw` words right in front of the header; they live as
        // long as the run.
        unsafe {
            std::slice::from_raw_parts(
                (self as *const ChainRun as *const u8).sub(Self::words_bytes(self.len()))
                    as *const AtomicU64,
                Self::n_words(self.len()),
            )
        }
    }

    /// Block `o`'s key.
    #[inline]
    pub(crate) fn key_bytes(&self, o: usize) -> &[u8; 8] {
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Run,
            self as *const ChainRun as usize,
        );
        // Not checked in release builds: reading the length would cost a probe whose
        // fingerprint matched a run node one more cache line (see the struct docs).
        debug_assert!(o < self.len());
        // SAFETY: `create` wrote `len` keys right after the header; immutable and alive as long
        // as the run. `o < len`: every offset a caller passes is a node's own (a run word is
        // only made for an offset below its run's length, `Index::plan_run`) or lies before a
        // stretch end (`stretch_end` ≤ `len`).
        unsafe { &*((self as *const ChainRun as *const u8).add(HEADER) as *const [u8; 8]).add(o) }
    }

    /// The digest of block `o`'s key (its big-endian value, as for every 8-byte key).
    #[inline]
    pub(crate) fn key(&self, o: usize) -> u64 {
        u64::from_be_bytes(*self.key_bytes(o))
    }

    /// The offsets whose nodes are still linked (no dead bit), ascending.
    pub(crate) fn live_offsets(&self) -> impl Iterator<Item = usize> + '_ {
        let len = self.len();
        (0..self.nw()).flat_map(move |w| {
            let mut live = !self.words()[w].load(Ordering::Acquire);
            if (w + 1) * 64 > len {
                live &= (1u64 << (len - w * 64)) - 1;
            }
            std::iter::from_fn(move || {
                (live != 0).then(|| {
                    let b = live.trailing_zeros() as usize;
                    live &= live - 1;
                    w * 64 + b
                })
            })
        })
    }

    /// Block `o`'s node is being replaced or removed (under its shard mutex, before the change
    /// is published).
    pub(crate) fn unlink(&self, o: usize) {
        self.words()[o / 64].fetch_or(1 << (o % 64), Ordering::Release);
    }

    /// Seals the run: sets the stop bits (`stop(o)` for every `o` in `1..len`), publishes them,
    /// then drops the ingest's reference, given the number of nodes it published naming the
    /// run. Returns the run's bytes if that freed it (through the epoch), else 0.
    ///
    /// # Safety
    /// `p` is a live, unsealed run and the caller is the ingest that created it, done
    /// publishing nodes.
    pub(crate) unsafe fn seal(
        p: *const ChainRun,
        published: usize,
        mut stop: impl FnMut(usize) -> bool,
        reaper: &Arc<Reaper>,
        guard: &Guard,
    ) -> usize {
        // SAFETY: the ingest's reference keeps the run alive.
        let r = unsafe { &*p };
        let nw = r.nw();
        for w in 0..nw {
            let mut bits = 0u64;
            for b in 0..64 {
                let o = w * 64 + b;
                if o >= r.len() {
                    break;
                }
                if o == 0 || stop(o) {
                    bits |= 1 << b;
                }
            }
            r.words()[nw + w].store(bits, Ordering::Relaxed);
        }
        r.sealed.store(true, Ordering::Release);
        if published == 0 {
            // No node ever named the run: no reader can know it, and the ingest's reference is
            // the only one.
            debug_assert_eq!(r.refs.load(Ordering::Relaxed), BIAS);
            let bytes = r.bytes();
            crate::raw::hooks::destroyed(crate::raw::hooks::Kind::Run, p as usize);
            // SAFETY: see above: unreachable and unreferenced.
            unsafe { Self::free(p as *mut ChainRun) };
            return bytes;
        }
        // SAFETY: the ingest's reference, exchanged for its published nodes' ones.
        unsafe { Self::drop_refs(p, BIAS - published as u64, reaper, guard) }
    }

    /// Reader: the end (exclusive) of the stretch of blocks after `o` that are known to carry
    /// the holders of the node naming `(self, o)`; `o + 1` when there is none (or the run is not
    /// sealed yet).
    #[inline]
    pub(crate) fn stretch_end(&self, o: usize) -> usize {
        crate::raw::hooks::read(
            crate::raw::hooks::Kind::Run,
            self as *const ChainRun as usize,
        );
        if !self.sealed.load(Ordering::Acquire) {
            return o + 1;
        }
        let nw = self.nw();
        let mut p = o + 1;
        while p < self.len() {
            let w = p / 64;
            let dead = self.words()[w].load(Ordering::Acquire);
            let stop = self.words()[nw + w].load(Ordering::Relaxed);
            // First offset at or after `p` (in this word) that is dead or starts a new stretch.
            let bad = (dead | stop) >> (p % 64);
            if bad != 0 {
                return (p + bad.trailing_zeros() as usize).min(self.len());
            }
            p = (w + 1) * 64;
        }
        self.len()
    }

    /// Drops one reference. The last one retires the run through the epoch and returns its
    /// bytes (for accounting); otherwise 0.
    ///
    /// # Safety
    /// `p` is a live run and the caller owns one of its references; if it is a node's, that
    /// node is already unlinked (its replacement published).
    pub(crate) unsafe fn release(p: *const ChainRun, reaper: &Arc<Reaper>, guard: &Guard) -> usize {
        // SAFETY: per the contract.
        unsafe { Self::drop_refs(p, 1, reaper, guard) }
    }

    /// Drops `n` references (see [`ChainRun::release`]).
    ///
    /// # Safety
    /// As for `release`, with `n` references owned.
    unsafe fn drop_refs(p: *const ChainRun, n: u64, reaper: &Arc<Reaper>, guard: &Guard) -> usize {
        // SAFETY: the caller's references keep the run alive until this decrement.
        let r = unsafe { &*p };
        if r.refs.fetch_sub(n, Ordering::AcqRel) != n {
            return 0;
        }
        let bytes = r.bytes();
        let addr = p as usize;
        let reaper = Arc::clone(reaper);
        // SAFETY: no linked node names the run any more and the creator has sealed it, so only
        // readers pinned before the last unlink can reach it; the epoch runs this after them,
        // and the reaper frees the run (once: nothing else holds it any more).
        unsafe { guard.defer_unchecked(move || reaper.push(addr as *mut ChainRun)) };
        bytes
    }

    /// [`ChainRun::release`] when no reader can exist (the table is being dropped).
    ///
    /// # Safety
    /// As for `release`, and no other thread can reach the run.
    pub(crate) unsafe fn release_now(p: *const ChainRun) -> usize {
        // SAFETY: as for `release`.
        let r = unsafe { &*p };
        if r.refs.fetch_sub(1, Ordering::AcqRel) != 1 {
            return 0;
        }
        let bytes = r.bytes();
        crate::raw::hooks::destroyed(crate::raw::hooks::Kind::Run, p as usize);
        // SAFETY: last reference, and nobody else can reach it.
        unsafe { Self::free(p as *mut ChainRun) };
        bytes
    }
}

impl Reclaim for ChainRun {
    fn link(&self) -> &AtomicU64 {
        &self.refs
    }

    unsafe fn reclaim(p: *mut ChainRun) {
        crate::raw::hooks::destroyed(crate::raw::hooks::Kind::Run, p as usize);
        // SAFETY: per the contract, nothing else holds the run.
        unsafe { ChainRun::free(p) }
    }
}

/// The reaper of a key table's chain runs.
pub(crate) type Reaper = crate::raw::reaper::Reaper<ChainRun>;

/// The run word of a node built for offset `o` of run `p`.
#[inline]
pub(crate) fn run_word(p: *const ChainRun, o: usize) -> u64 {
    debug_assert!(o < MAX_RUN);
    p as u64 | (o as u64) << OFFSET_SHIFT
}

/// The run and offset a run word names.
#[inline]
pub(crate) fn unpack(w: u64) -> (*const ChainRun, usize) {
    (
        (w & PTR_MASK) as usize as *const ChainRun,
        (w >> OFFSET_SHIFT) as usize,
    )
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crossbeam_epoch as epoch;

    fn run(len: usize) -> *const ChainRun {
        ChainRun::create((0..len).map(|k| (k as u64 * 7 + 1).to_be_bytes()), 0).unwrap()
    }

    #[test]
    fn an_unsealed_run_covers_nothing() {
        let p = run(8);
        // SAFETY: `p` is live until the seal frees it (no node holds a reference).
        let r = unsafe { &*p };
        assert_eq!(r.stretch_end(0), 1);
        assert_eq!(r.key(3), 22);
        let guard = epoch::pin();
        let reaper = Arc::new(Reaper::default());
        // SAFETY: our own run; 0 nodes published, so the seal frees it, at once.
        assert!(unsafe { ChainRun::seal(p, 0, |_| false, &reaper, &guard) } > 0);
        assert!(reaper.is_empty(), "not through the reaper");
    }

    /// A run retired through the epoch reaches its reaper, which frees it (and only it) once.
    #[test]
    fn retired_runs_wait_on_the_reaper_until_a_writer_frees_them() {
        let reaper = Arc::new(Reaper::default());
        let runs: Vec<_> = (0..3).map(|_| run(4)).collect();
        {
            let guard = epoch::pin();
            for &p in &runs {
                // SAFETY: our runs; one published node each, released after the seal.
                unsafe {
                    assert_eq!(ChainRun::seal(p, 1, |_| false, &reaper, &guard), 0);
                    assert!(ChainRun::release(p, &reaper, &guard) > 0);
                }
            }
        }
        // Wait for the grace period (other tests' threads may hold pins for a while): every
        // deferred push has run once the stack holds three.
        let mut seen = 0;
        let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < until {
            epoch::pin().flush();
            std::thread::sleep(std::time::Duration::from_micros(100));
            let n = reaper.waiting();
            seen = n;
            if n == 3 {
                break;
            }
        }
        assert_eq!(seen, 3, "the epoch handed every retired run to the reaper");
        assert_eq!(reaper.free_all(), 3);
        assert_eq!(reaper.free_all(), 0, "freed once");
    }

    #[test]
    fn stretches_end_at_stop_bits_and_dead_blocks_across_words() {
        let p = run(200);
        // SAFETY: 200 published nodes keep the run alive (leaked at the end).
        let r = unsafe { &*p };
        r.unlink(150);
        let guard = epoch::pin();
        // SAFETY: our own run.
        let freed = unsafe {
            ChainRun::seal(
                p,
                200,
                |o| o == 70 || o == 130,
                &Arc::new(Reaper::default()),
                &guard,
            )
        };
        assert_eq!(freed, 0);
        assert_eq!(r.stretch_end(0), 70, "stop bit");
        assert_eq!(r.stretch_end(69), 70);
        assert_eq!(r.stretch_end(70), 130, "across a word boundary");
        assert_eq!(r.stretch_end(130), 150, "unlinked before the seal");
        r.unlink(100);
        assert_eq!(r.stretch_end(70), 100, "unlinked after the seal");
        assert_eq!(r.stretch_end(64), 70);
        assert_eq!(r.stretch_end(150), 200, "the end");
        assert_eq!(r.stretch_end(199), 200);
    }

    #[test]
    fn the_last_reference_frees_the_run() {
        let p = run(4);
        let guard = epoch::pin();
        let reaper = Arc::new(Reaper::default());
        // SAFETY: two published nodes; one is unlinked before the seal, one after.
        unsafe {
            assert_eq!(ChainRun::release(p, &reaper, &guard), 0);
            assert_eq!(ChainRun::seal(p, 2, |_| false, &reaper, &guard), 0);
            assert!(ChainRun::release(p, &reaper, &guard) > 4 * 8);
        }
        let (q, o) = unpack(run_word(p, 77));
        assert_eq!((q, o), (p, 77));
    }
}
