#!/usr/bin/env bash
# Issue 28: the one-minute identity churn soak for CI (the 10-minute soak's workload with time
# scaled down 10×: the whole fleet renamed every 2 s, 1,000 tenants created and abandoned per
# minute, TTL 3 s, sweep every 250 ms). In-process, engine API only (no network, no service).
# Exits non-zero when RSS is not flat, a live chain is not answered, or a random-id lookup
# found something. A debug build, and the very binary `cargo test --workspace` built: the same
# command again is a no-op after the test step (`cargo run -p inferencecache-bench` would
# resolve other dependency features and rebuild the bench crate, ~2.5 min on 2 cores). The
# workload is paced by the clock, not by speed.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --no-run --quiet
target_dir="$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
"$target_dir/debug/identity-soak" \
  --seconds 60 --rename-every-ms 2000 --tenants-per-min 1000 --ttl-ms 3000 --sweep-ms 250
