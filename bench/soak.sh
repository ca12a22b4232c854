#!/usr/bin/env bash
# Issue #9 soak: build the release server, ic-loadgen and soak once, then run the soak.
# Extra arguments go to `soak` (e.g. `bench/soak.sh --duration 2m`).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
cargo build --release -p inferencecache-server --bin inferencecache-server \
    -p inferencecache-bench --bin ic-loadgen --bin soak
exec "$CARGO_TARGET_DIR/release/soak" --out-dir "$CARGO_TARGET_DIR/soak" "$@"
