#!/usr/bin/env bash
# Issue #44, proof on real traffic: the Mooncake traces through the index (with the peers in the
# same run) and through the fleet simulator (routing quality, the real server binary).
#
#   bench/run-mooncake.sh --quick     # CI smoke test (debug builds, seconds): ours against the
#                                     # reference model, the fleet at one size; last lines = ratios
#   bench/run-mooncake.sh             # the full runs: a new dated section at the top of
#                                     # bench/results/mooncake-replay.md and fleet-sim.md (earlier
#                                     # sections kept below it), plots, RESULTS.md reassembled.
#                                     # Measured at load 15-20 on 2 cores (2026-12-06): 11 min
#                                     # for the replay section (4 memory runs + 525 s replay),
#                                     # 7 min for the fleet; each section ends with its wall time.
#
# Env: MOONCAKE_TRACE (default: the conversation trace in ../shared/traces, else the 200-request
# sample in bench/testdata), PEERS_TARGET_DIR (default ../target-peers), REPLAY_ARGS / FLEET_ARGS
# (extra arguments for the full runs), SKIP_REPLAY=1 / SKIP_FLEET=1 (run one of the two).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}"
QUICK=0
if [ "${1:-}" = "--quick" ]; then QUICK=1; fi

TRACE="${MOONCAKE_TRACE:-}"
if [ -z "$TRACE" ]; then
  for t in "$ROOT/../shared/traces/mooncake_conversation_trace.jsonl" \
    "$ROOT/../../shared/traces/mooncake_conversation_trace.jsonl"; do
    if [ -f "$t" ]; then TRACE="$t"; break; fi
  done
fi
if [ -z "$TRACE" ]; then
  # The repository's sample: the first 200 requests of the conversation trace (Apache-2.0).
  TRACE="$ROOT/bench/testdata/mooncake_sample.jsonl"
fi
echo "== trace: $TRACE" >&2

# Debug builds: the fleet simulator runs in simulated time (the server's speed does not enter
# its figures) and the quick index replay is a correctness smoke test, not a measurement.
(cd "$ROOT" && cargo build --quiet -p inferencecache-server -p inferencecache-bench \
  --bin inferencecache-server --bin mooncake-replay --bin fleet-sim)
DEBUG="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

if [ "$QUICK" = 1 ]; then
  PLOTS="$(mktemp -d)"
  trap 'rm -rf "$PLOTS"' EXIT
  "$DEBUG/mooncake-replay" --quick --trace "$TRACE" | tail -1
  "$DEBUG/fleet-sim" --quick --sizes 0.5 --trace "$TRACE" --plots "$PLOTS" \
    --server "$DEBUG/inferencecache-server" | tail -1
  for f in fleet-hit-rate.svg fleet-ttft-cdf.svg; do
    [ -s "$PLOTS/$f" ] || { echo "plot $f missing" >&2; exit 1; }
  done
  exit 0
fi

RES="$ROOT/bench/results"
PEERS_TARGET_DIR="${PEERS_TARGET_DIR:-$ROOT/../target-peers}"
echo "== build bench/peers (opt 3, thin LTO, 4 CGU)" >&2
(cd "$ROOT/bench/peers" && CARGO_TARGET_DIR="$PEERS_TARGET_DIR" nice -n 10 cargo build --release --quiet)
PEERBIN="$PEERS_TARGET_DIR/release/mooncake-replay-peers"
MODEL="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
# Puts the new section ($1.tmp) above the earlier ones of $1.md (history stays) and prints the
# new section's last line (its ratios).
keep_history() {
  local new="$1.tmp" file="$1.md"
  tail -1 "$new"
  if [ -s "$file" ]; then
    { cat "$new"; echo; cat "$file"; } >"$1.merged" && mv "$1.merged" "$file" && rm -f "$new"
  else
    mv "$new" "$file"
  fi
}
section_header() { # title, command
  echo "## $1"
  echo
  echo "- Date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- Machine: ${MODEL:-unknown}, $(nproc) cores, kernel $(uname -r)"
  echo "- Load average at the start: $(cut -d' ' -f1-3 /proc/loadavg) (shared, loaded machine: other builds ran beside it)"
  echo "- rustc: $(rustc --version)"
  echo "- Command: \`$2\`"
}

# Index throughput: memory per held block in a fresh process per index, then the plan.
# shellcheck disable=SC2086
if [ "${SKIP_REPLAY:-0}" != 1 ]; then
{
  section_header "Mooncake trace replay: index throughput with the peers in one run (issue #44)" \
    "bench/run-mooncake.sh (mooncake-replay-peers --trace $(basename "$TRACE") ${REPLAY_ARGS:-})"
  echo "- Profiles: every index in one binary, bench/peers release (opt 3, thin LTO, 4 CGU), system malloc"
  echo
  echo "Memory per held block (VmRSS growth to the start of the drain over the blocks held then; one"
  echo "fresh process per index, one-thread closed-loop replay):"
  echo
  echo "| Index | B per held block |"
  echo "|---|---|"
  for i in inferencecache kv-index dynamo-crtc dynamo-radix; do
    "$PEERBIN" --trace "$TRACE" --index "$i" --memory ${REPLAY_ARGS:-} |
      awk '{ v = $NF; $1 = ""; $NF = ""; sub(/^ /, ""); sub(/ $/, ""); print "| " $0 " | " v " |" }'
  done
  echo
  echo "- Load average before the replay: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  start=$SECONDS
  "$PEERBIN" --trace "$TRACE" ${REPLAY_ARGS:-} | tee "$RES/mooncake-replay.last"
  echo
  echo "- Wall time: $((SECONDS - start)) s (the replay); load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  tail -1 "$RES/mooncake-replay.last"
  rm -f "$RES/mooncake-replay.last"
} >"$RES/mooncake-replay.tmp" && keep_history "$RES/mooncake-replay"
fi

# shellcheck disable=SC2086
if [ "${SKIP_FLEET:-0}" != 1 ]; then
{
  section_header "Mooncake trace: routing quality in the fleet simulator (issue #44)" \
    "bench/run-mooncake.sh (fleet-sim --trace $(basename "$TRACE") --sizes 0.1,0.25,0.5,1 --ceilings 8 ${FLEET_ARGS:-})"
  echo
  start=$SECONDS
  "$DEBUG/fleet-sim" --trace "$TRACE" --sizes 0.1,0.25,0.5,1 --ceilings 8 --plots "$RES" \
    --server "$DEBUG/inferencecache-server" ${FLEET_ARGS:-} >"$RES/fleet-sim.last"
  cat "$RES/fleet-sim.last"
  echo
  echo "- Wall time: $((SECONDS - start)) s"
  echo
  tail -1 "$RES/fleet-sim.last"
  rm -f "$RES/fleet-sim.last"
} >"$RES/fleet-sim.tmp" && keep_history "$RES/fleet-sim"
fi
"$ROOT/bench/run-all.sh" --assemble
