#!/usr/bin/env bash
# Miri run of the lock-free storage's unit tests (`engine/src/raw/`): undefined behaviour, data
# races and leaks in the pointer code (arena, nodes, tables, runs, LFU cells, pages).
#
#   bash engine/miri.sh            # installs nightly + miri when missing, then runs raw::
#   bash engine/miri.sh raw::lfu   # a subset
#
# Flags: tree borrows (crossbeam-epoch's intrusive list is reported under stacked borrows, a
# known limitation of that model, not of this crate); permissive provenance (chain-run words
# pack a pointer and an offset in one u64 of node memory); no spurious weak compare-and-swap
# failures (the LFU unit tests assert which path an uncontended credit takes; a spurious failure
# takes the contended path, which the loom models check); leaks ignored (garbage still queued in
# crossbeam-epoch's global collector when the test process exits is never freed, by design; the
# engine's own leak checks are tests/drop_frees.rs and the loom models' ledger).
#
# Miri builds map no pages (`raw/pages.rs` uses the global allocator under `cfg(miri)`), and the
# two unit tests whose bounds depend on 60,000 keys are ignored under Miri. Not part of
# `.ci/run`: on 2 cores the tests take about a minute after a build of several minutes (the
# first run also builds Miri's sysroot).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  rustup toolchain install nightly --profile minimal --component miri
fi
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-tree-borrows -Zmiri-permissive-provenance -Zmiri-compare-exchange-weak-failure-rate=0.0 -Zmiri-ignore-leaks}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/miri}"
exec cargo +nightly miri test -p inferencecache-engine --lib "${1:-raw::}"
