#!/usr/bin/env bash
# The Mooncake replay profiles (issue #44): InferenceCache and kv-index 2.0 in the peers binary
# (bench/peers, release: opt 3, thin LTO, line-tables debug info), at one and two threads.
#
#   flamegraphs/mooncake.sh     # writes flamegraphs/mooncake-{ours,kv-index}-t{1,2}.svg
#
# t1: one closed-loop one-thread replay (`--memory`: a fresh process, one run of the 13.3 M block
# operations), stacks under the subject's `run`. t2: `--threads 2 --copies 4` (the saturated run,
# the paced rungs and the latency run; 3.3 M block operations each), stacks under `replay_dual`
# (the paced runs' waiting included: the harness spins in `wait_until` within 200 µs of a due
# time). perf.data and folded stacks go to $WORK (default target/flamegraphs-mooncake, not git).
# Env: PEERS_TARGET_DIR (default ../target-peers), MOONCAKE_TRACE, FREQ1 (999), FREQ2 (499).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_TARGET_DIR="${PEERS_TARGET_DIR:-$PWD/../target-peers}"
TRACE="${MOONCAKE_TRACE:-$PWD/../../shared/traces/mooncake_conversation_trace.jsonl}"
WORK="${WORK:-target/flamegraphs-mooncake}"
mkdir -p "$WORK"
(cd bench/peers && CARGO_TARGET_DIR="$PEERS_TARGET_DIR" cargo build --release --quiet --bin mooncake-replay-peers)
cp "$PEERS_TARGET_DIR/release/mooncake-replay-peers" "$WORK/"
BIN="$WORK/mooncake-replay-peers"
record() { # name, frequency, args...
  local name="$1" freq="$2"
  shift 2
  perf record -e cpu-clock -F "$freq" --call-graph dwarf,8192 -o "$WORK/$name.data" \
    "$BIN" --trace "$TRACE" "$@" >"$WORK/$name.out" 2>&1
  perf script -i "$WORK/$name.data" --inline 2>/dev/null | inferno-collapse-perf >"$WORK/$name.folded"
}
draw() { # name, filter, title
  grep -F "$2" "$WORK/$1.folded" | inferno-flamegraph --minwidth 0.25 --title "$3" >"flamegraphs/mooncake-$1.svg"
}
record ours-t1 "${FREQ1:-999}" --index inferencecache --memory
record kv-index-t1 "${FREQ1:-999}" --index kv-index --memory
record ours-t2 "${FREQ2:-499}" --index inferencecache --threads 2 --copies 4
record kv-index-t2 "${FREQ2:-499}" --index kv-index --threads 2 --copies 4
draw ours-t1 "OursSubject as inferencecache_bench::mooncake_bench::Subject>::run" \
  "Mooncake replay, InferenceCache, 1 thread (closed loop)"
draw kv-index-t1 "KvSubject as inferencecache_bench::mooncake_bench::Subject>::run" \
  "Mooncake replay, kv-index 2.0, 1 thread (closed loop)"
draw ours-t2 replay_dual "Mooncake replay, InferenceCache, 2 threads (saturated + paced runs, 4 copies)"
draw kv-index-t2 replay_dual "Mooncake replay, kv-index 2.0, 2 threads (saturated + paced runs, 4 copies)"
ls -la flamegraphs/mooncake-*.svg
