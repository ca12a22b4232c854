//! What a key-table segment's slot block costs under the server's allocator (issue 42).
//!
//! The key tables take their small slot blocks from the global allocator
//! (`engine/src/raw/pages.rs`), which in the server is mimalloc, aligned to 64 bytes (the view
//! word keeps a table's log2 in the address's low 6 bits). mimalloc serves a block aligned beyond
//! 16 bytes from its size class only when the class's next free block happens to be aligned
//! (blocks of a power-of-two class always are); otherwise it over-allocates by the alignment,
//! into a larger class. This test measures that cost as the process sees it (resident bytes per
//! block over many blocks, the allocator's own `mi_usable_size` beside it) for the slot blocks'
//! layouts, and checks what `engine/src/raw/slots` relies on: the smallest segment's block
//! padded to 128 bytes costs 128 bytes, less than an unpadded 80-byte block (4 slots and the
//! summary) and about half the 8-slot segment's 144-byte block.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::alloc::Layout;

/// Resident bytes of this process (`/proc/self/statm`, second field, in pages).
fn resident_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * usize::try_from(page).ok()?)
}

/// Resident bytes per block (over `count` blocks of `layout`, each written) and the allocator's
/// usable size of the last block. The blocks stay allocated, listed in `keep` (whose pages the
/// caller faulted in beforehand): freed pages would stay resident and serve the next layout's
/// blocks, hiding their cost.
fn cost(layout: Layout, count: usize, keep: &mut Vec<(*mut u8, Layout)>) -> (f64, usize) {
    assert!(
        keep.capacity() - keep.len() >= count,
        "room listed beforehand"
    );
    let before = resident_bytes().expect("/proc/self/statm is readable");
    let mut last = std::ptr::null_mut();
    for _ in 0..count {
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!p.is_null(), "allocation of {layout:?}");
        assert_eq!(p as usize % layout.align(), 0, "{layout:?} aligned");
        keep.push((p, layout));
        last = p;
    }
    let after = resident_bytes().expect("/proc/self/statm is readable");
    // SAFETY: the last block is live and came from mimalloc.
    let usable = unsafe { libmimalloc_sys::mi_usable_size(last.cast()) };
    (after.saturating_sub(before) as f64 / count as f64, usable)
}

#[test]
fn a_64_byte_aligned_slot_block_costs_its_class_only_at_a_power_of_two_size() {
    const COUNT: usize = 50_000;
    let mut measured = Vec::new();
    let mut keep = Vec::with_capacity(5 * COUNT);
    // Fault the list's pages in now, so that they do not count as the blocks' cost.
    keep.resize(5 * COUNT, (std::ptr::null_mut(), Layout::new::<u8>()));
    keep.clear();
    for (size, align) in [(144, 64), (128, 64), (80, 64), (144, 16), (80, 16)] {
        let layout = Layout::from_size_align(size, align).expect("valid layout");
        let (per_block, usable) = cost(layout, COUNT, &mut keep);
        println!(
            "{size:>4} B aligned {align:>2}: {per_block:7.1} resident B a block, usable {usable} B"
        );
        measured.push(((size, align), per_block));
    }
    for (p, layout) in keep {
        // SAFETY: allocated by `cost` with this layout, freed once.
        unsafe { std::alloc::dealloc(p, layout) };
    }
    let of = |key| {
        measured
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .unwrap_or(0.0)
    };
    // A power-of-two block takes its own class (a few percent for page headers) ...
    assert!(of((128, 64)) < 136.0, "128 B @64: {:.1}", of((128, 64)));
    // ... where 64-byte alignment of other sizes over-allocates into a larger class.
    assert!(
        of((80, 64)) > of((128, 64)) + 16.0,
        "80 B @64: {:.1}",
        of((80, 64))
    );
    assert!(
        of((144, 64)) > of((128, 64)) + 64.0,
        "144 B @64: {:.1}",
        of((144, 64))
    );
}
