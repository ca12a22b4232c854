#!/usr/bin/env bash
# Issue 28: the one-minute identity churn soak for CI (the 10-minute soak's workload with time
# scaled down 10×: the whole fleet renamed every 2 s, 1,000 tenants created and abandoned per
# minute, TTL 3 s, sweep every 250 ms). In-process, engine API only (no network, no service).
# Exits non-zero when RSS is not flat, a live chain is not answered, or a random-id lookup
# found something. A debug build: the bench crate's dependencies are already built by
# `cargo test --workspace`, and the workload is paced by the clock, not by speed.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --quiet -p inferencecache-bench --bin identity-soak -- \
  --seconds 60 --rename-every-ms 2000 --tenants-per-min 1000 --ttl-ms 3000 --sweep-ms 250
