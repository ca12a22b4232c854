#!/usr/bin/env bash
# Issue 42: identity churn in waves against the real server binary (debug build), for tenant,
# replica-id and model churn: 4 waves of 20,000 fresh identities each (one 2-block chain per
# identity), server TTL 2 s and sweep 250 ms, each wave expired before the next. Per wave,
# `churn-waves` asserts (exit 1 otherwise):
#   - after expiry, RSS within 50 MiB of the pre-churn baseline (the issue's bar, every kind);
#   - peak RSS above the baseline per live identity at most PEAK bytes. Replica ids: 2,560.
#     The issue's bar is 2,048 and the full-size run meets it (1,277-1,672 B, bench/RESULTS.md
#     "Churn waves"), but on a loaded 2-core machine the allocator's retention between waves
#     moves the figure (1,307-2,198 B over 20 CI-sized waves, heap ~600 B an id), and a bar
#     at the edge of that noise would fail CI at random. Tenants and models: a regression bar
#     of 7,168, above the cost measured with the small key tables (3,274-5,513 B over three
#     CI-sized runs of both kinds on the loaded machine, bench/RESULTS.md "Churn waves"; ~10
#     KiB with 64-segment directories inline, which it catches): the issue's 2 KiB bar is not
#     met for them (see docs/engine.md, "What an identity costs").
# About 30 s per kind on 2 cores. The binaries are the ones `cargo test --workspace` built (the
# same command again is a no-op after the test step).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --no-run --quiet
target_dir="$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
declare -A peak=([tenant]=7168 [replica]=2560 [model]=7168)
for kind in tenant replica model; do
  "$target_dir/debug/churn-waves" \
    --server "$target_dir/debug/inferencecache-server" --server-arg=--drain-notice=0s \
    --kind "$kind" --count 20000 --waves 4 --blocks 2 \
    --ttl-ms 2000 --sweep-ms 250 --settle-ms 1500 \
    --peak-bar-bytes "${peak[$kind]}" --expiry-bar-mib 50
done
