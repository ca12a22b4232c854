//! Page-granular memory for the index's large arrays: the key tables' slot and summary arrays.
//!
//! # Why not the global allocator
//!
//! Under churn the index keeps replacing multi-page blocks: a table rebuild frees the old slot
//! array a grace period later. Through `malloc`, those blocks
//! land in the heap (glibc raises its mmap threshold to the size of the largest block freed, up
//! to 32 MiB), where they fragment the heap and the per-thread arenas: freed memory stays
//! resident and RSS drifts above what the engine holds. Here every block of at least `MAP_MIN`
//! (64 KiB) is its own anonymous mapping, unmapped when freed, so the process's RSS follows
//! [`Index::memory_bytes`](crate::Index::memory_bytes) (measured: churn bench, `bench/RESULTS.md`).
//!
//! Smaller blocks (a small partition's table, the segments of a table below ~4 M keys) come
//! from the global allocator, as does everything in loom and Miri builds, which cannot model
//! `mmap`.
//!
//! # Contract
//!
//! [`alloc_zeroed`] returns memory aligned to [`ALIGN`], valid for `bytes` bytes, every byte
//! zero; [`free`] takes back exactly what `alloc_zeroed` returned, with the same `bytes`.
//! [`footprint`] is what a block of `bytes` costs, for the engine's accounting.

use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of every block (a cache line).
pub(crate) const ALIGN: usize = 64;

/// Blocks at least this large are mapped directly. Smaller ones (a small partition's table, a
/// segment of fewer than 4,096 slots: a table below ~130 K keys) come from the global
/// allocator: a mapping costs two system calls and the zeroing of its pages, which dominated
/// the rebuilds of a growing or shrinking table's many small segments, and blocks this small do
/// not fragment the heap the way the multi-megabyte ones did.
#[cfg(all(unix, not(loom), not(miri)))]
const MAP_MIN: usize = 64 * 1024;

/// Whether a block of `bytes` is mapped rather than taken from the global allocator.
#[inline]
fn mapped(bytes: usize) -> bool {
    #[cfg(all(unix, not(loom), not(miri)))]
    {
        bytes >= MAP_MIN
    }
    #[cfg(not(all(unix, not(loom), not(miri))))]
    {
        let _ = bytes;
        false
    }
}

/// Bytes a block of `bytes` costs: whole pages when mapped, else [`heap_chunk`].
pub(crate) fn footprint(bytes: usize) -> usize {
    if mapped(bytes) {
        bytes.next_multiple_of(page_size())
    } else {
        heap_chunk(bytes)
    }
}

/// Estimated cost of a global-allocator block of `n` bytes (glibc-like: an 8-byte header,
/// 16-byte rounding, 32 bytes at least); the engine's byte accounting for small allocations.
#[inline]
pub(crate) fn heap_chunk(n: usize) -> usize {
    const HEADER: usize = 8;
    ((n + HEADER + 15) & !15).max(32)
}

#[cfg(all(unix, not(loom), not(miri)))]
fn page_size() -> usize {
    use std::sync::OnceLock;
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 { p as usize } else { 4096 }
    })
}

#[cfg(not(all(unix, not(loom), not(miri))))]
fn page_size() -> usize {
    4096
}

/// Allocates a block of `bytes` (> 0) bytes aligned to [`ALIGN`], every byte zero; aborts on
/// exhaustion, like the global allocator's `handle_alloc_error`. A mapped block has its pages
/// faulted in by the `mmap` call itself (the kernel zeroes them), rather than one fault per
/// page as the caller first writes each: the index writes a table's whole block soon after
/// allocating it (a rebuild fills it), and faults taken one by one cost more than that.
pub(crate) fn alloc_zeroed(bytes: usize) -> NonNull<u8> {
    debug_assert!(bytes > 0);
    if mapped(bytes) {
        #[cfg(all(unix, not(loom), not(miri)))]
        {
            #[cfg(target_os = "linux")]
            let populate = libc::MAP_POPULATE;
            #[cfg(not(target_os = "linux"))]
            let populate = 0;
            // SAFETY: an anonymous private mapping with no address hint has no preconditions;
            // the result is checked against MAP_FAILED. Its pages read as zero.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | populate,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED
                && let Some(p) = NonNull::new(p.cast::<u8>())
            {
                return p;
            }
            std::alloc::handle_alloc_error(layout(bytes));
        }
    }
    let lay = layout(bytes);
    // SAFETY: non-zero size (debug-asserted; `layout` rounds 0 up to 1 byte anyway).
    match NonNull::new(unsafe { std::alloc::alloc_zeroed(lay) }) {
        Some(p) => p,
        None => std::alloc::handle_alloc_error(lay),
    }
}

/// Frees a block returned by [`alloc_zeroed`].
///
/// # Safety
/// `p` came from `alloc_zeroed(bytes)` with this `bytes`, is not used afterwards and is freed
/// once.
pub(crate) unsafe fn free(p: NonNull<u8>, bytes: usize) {
    if mapped(bytes) {
        #[cfg(all(unix, not(loom), not(miri)))]
        {
            // SAFETY: (caller) `p .. p + bytes` is exactly one mapping made by `alloc`. munmap
            // only fails for invalid ranges, which that rules out; nothing useful can be done
            // about a failure in a destructor, so its result is ignored.
            unsafe { libc::munmap(p.as_ptr().cast(), bytes) };
            return;
        }
    }
    // SAFETY: (caller) allocated by the global allocator with this layout.
    unsafe { std::alloc::dealloc(p.as_ptr(), layout(bytes)) }
}

fn layout(bytes: usize) -> Layout {
    match Layout::from_size_align(bytes.max(1), ALIGN) {
        Ok(l) => l,
        // Only for sizes near isize::MAX, which no index reaches (chunks are ≤ 256 KiB, tables
        // are bounded by the 2^32 lane limit).
        Err(_) => std::alloc::handle_alloc_error(Layout::new::<u8>()),
    }
}

/// A fixed-length array of `T` in a block from [`alloc_zeroed`] (the slot arrays and presence
/// summaries of the key tables).
pub(crate) struct PageArray<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: a `PageArray<T>` owns its elements like a `Box<[T]>`.
unsafe impl<T: Send> Send for PageArray<T> {}
// SAFETY: shared access only hands out `&T`, like a `Box<[T]>`.
unsafe impl<T: Sync> Sync for PageArray<T> {}

impl<T> PageArray<T> {
    /// An array of `len` (> 0) elements equal to `zero()`, a value whose bytes are all zero,
    /// in a block from [`alloc_zeroed`]: the block is not written again. Under loom, whose
    /// atomics are not plain bytes, each element is written from `zero()`.
    ///
    /// # Safety
    /// Outside loom, the all-zero byte pattern is a valid `T`, equal to what `zero()` returns.
    pub(crate) unsafe fn zeroed(len: usize, mut zero: impl FnMut() -> T) -> Self {
        const { assert!(std::mem::align_of::<T>() <= ALIGN && std::mem::size_of::<T>() > 0) };
        let len = len.max(1);
        let ptr = alloc_zeroed(Self::bytes_for(len)).cast::<T>();
        // Outside loom the zeroed block holds `len` valid elements already (caller).
        #[cfg(loom)]
        for i in 0..len {
            // SAFETY: `i < len`, inside the block (`bytes_for`), aligned (ALIGN ≥ align_of T).
            unsafe { ptr.as_ptr().add(i).write(zero()) };
        }
        #[cfg(not(loom))]
        let _ = &mut zero;
        Self { ptr, len }
    }

    /// The array whose block `ptr` is, of `len` elements: the inverse of forgetting an array
    /// (`std::mem::forget`) whose block a word keeps (a key table's single segment, named by
    /// its view word alone).
    ///
    /// # Safety
    /// `ptr` and `len` are those of an array made by [`PageArray::zeroed`] and forgotten, and
    /// this is the one array made from them.
    pub(crate) unsafe fn from_raw(ptr: NonNull<T>, len: usize) -> Self {
        Self { ptr, len }
    }

    fn bytes_for(len: usize) -> usize {
        match len.checked_mul(std::mem::size_of::<T>()) {
            Some(b) => b,
            None => std::alloc::handle_alloc_error(Layout::new::<T>()),
        }
    }

    /// Bytes this array costs (see [`footprint`]).
    pub(crate) fn footprint(&self) -> usize {
        footprint(Self::bytes_for(self.len))
    }
}

impl<T> std::ops::Deref for PageArray<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        // SAFETY: `len` elements were initialized in `new` and live until `drop`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for PageArray<T> {
    fn drop(&mut self) {
        // SAFETY: the elements are initialized and dropped once, here; the block came from
        // `alloc_zeroed(bytes_for(len))` in `zeroed`.
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ));
            free(self.ptr.cast(), Self::bytes_for(self.len));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn small_and_mapped_blocks_round_trip() {
        for bytes in [8, 100, 4095, 4096, 5000, 1 << 20] {
            let p = alloc_zeroed(bytes);
            assert_eq!(p.as_ptr() as usize % ALIGN, 0, "{bytes} bytes aligned");
            // SAFETY: the block is `bytes` long and ours.
            unsafe {
                assert_eq!(*p.as_ptr().add(bytes - 1), 0, "{bytes} bytes zeroed");
                p.as_ptr().write_bytes(0xa5, bytes);
                assert_eq!(*p.as_ptr().add(bytes - 1), 0xa5);
                free(p, bytes);
            }
        }
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri builds map no pages: every block comes from the global allocator"
    )]
    fn footprint_is_whole_pages_for_mapped_blocks() {
        assert_eq!(footprint(MAP_MIN), MAP_MIN);
        assert_eq!(footprint(MAP_MIN + 1), MAP_MIN + page_size());
        assert!(footprint(40) >= 40 && footprint(40) < 4096);
        assert_eq!(
            footprint(4097),
            heap_chunk(4097),
            "below MAP_MIN: a heap block"
        );
    }

    #[test]
    fn a_zeroed_page_array_reads_zero_and_holds_what_is_stored() {
        for n in [3, 5000] {
            // 3 × 8 bytes: a heap block; 5000 × 8 bytes: a mapped one.
            // SAFETY: an `AtomicU64` of value 0 is all zero bytes.
            let a = unsafe { PageArray::zeroed(n, || AtomicU64::new(0)) };
            assert_eq!(a.len(), n);
            assert!(a.iter().all(|x| x.load(Ordering::Relaxed) == 0));
            a[n - 1].store(7, Ordering::Relaxed);
            assert_eq!(a[n - 1].load(Ordering::Relaxed), 7);
            assert_eq!(a.footprint(), footprint(n * 8));
        }
    }
}
