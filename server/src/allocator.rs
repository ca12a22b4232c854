//! The server binary's allocator settings (mimalloc v3, the binary's global allocator).
//!
//! mimalloc gives freed memory back to the OS ("purges" it) only once it has stayed free for
//! its purge delay, 1,000 ms by default in v3. While a burst of producers' updates arrives,
//! the index grows its directories and lists by reallocation and retires the old arrays; they
//! are freed within the burst, but their pages stayed resident for that second beside their
//! successors, and each `/metrics` scrape's per-model lists (tens of bytes a held model) did the
//! same. So the process's peak RSS carried memory already freed. The server sets the delay to
//! 10 ms: a churn wave's peak RSS per live model fell from 2,321-2,593 B to 2,225-2,368 B, per
//! live tenant from 2,238-2,526 B to 2,238-2,340 B, with the same server CPU per ingested block
//! (issue 42, `bench/results/churn-waves.md`, "server and allocator"). 0 ms gained another
//! ~110 B a model but spent up to 15% more CPU a block on a saturated host (a purge per freed
//! range, and its pages faulted in again when reused).
//!
//! The operator keeps the last word: `MIMALLOC_PURGE_DELAY` in the environment (read by
//! mimalloc when it starts) wins over [`set_purge_delay`], which only changes the default.

use libmimalloc_sys::mi_option_t;
use std::ffi::c_long;

/// mimalloc v3's `mi_option_purge_delay` (its position in `mi_option_e` of the vendored
/// `mimalloc.h`; `libmimalloc-sys` names no constant for it). A different position in a future
/// version fails `server/tests/allocator_options.rs`, which reads the option's documented
/// default (1,000 ms) through this number.
pub const PURGE_DELAY_OPTION: mi_option_t = 15;

/// The server's purge delay in milliseconds: freed memory goes back to the OS within a burst.
pub const PURGE_DELAY_MS: c_long = 10;

/// Sets mimalloc's purge delay to [`PURGE_DELAY_MS`] unless `MIMALLOC_PURGE_DELAY` set it.
/// Called first in the binary's `main`, before the runtime's threads allocate; harmless (an
/// option nobody reads) where mimalloc is not the global allocator.
pub fn set_purge_delay() {
    // SAFETY: `mi_option_set_default` takes integers and writes mimalloc's option table, which
    // mimalloc reads with plain loads at every purge decision; any thread may call it.
    unsafe { libmimalloc_sys::mi_option_set_default(PURGE_DELAY_OPTION, PURGE_DELAY_MS) };
}

/// The purge delay in force, in milliseconds (after [`set_purge_delay`] and the environment).
pub fn purge_delay_ms() -> c_long {
    // SAFETY: `mi_option_get` takes an integer and reads mimalloc's option table.
    unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY_OPTION) }
}
