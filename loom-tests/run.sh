#!/usr/bin/env bash
# Loom model checks of the engine (see loom-tests/README.md). Bounded for CI: ≤ ~10 minutes on
# 2 cores. Env overrides: LOOM_MAX_PREEMPTIONS (default 2; "none" = unbounded), LOOM_MAX_DURATION
# (seconds per model, default 30: exploration stops there and the model passes if no violation was
# found so far; "none" = no cap, i.e. exhaustive within the preemption bound), LOOM_TARGET_DIR
# (default target/loom: loom builds use other RUSTFLAGS than the workspace).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${LOOM_TARGET_DIR:-$PWD/target/loom}"
export RUSTFLAGS="--cfg loom --cfg crossbeam_loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-2}"
export LOOM_MAX_DURATION="${LOOM_MAX_DURATION:-30}"
# Loom checks LOOM_MAX_DURATION only every LOOM_CHECKPOINT_INTERVAL executions (default 20,000):
# check every 1,000 so the cap is honoured within about a second.
export LOOM_CHECKPOINT_INTERVAL="${LOOM_CHECKPOINT_INTERVAL:-1000}"
# Loom reads these as numbers; an absent variable means "no bound".
[ "$LOOM_MAX_PREEMPTIONS" = none ] && unset LOOM_MAX_PREEMPTIONS
[ "$LOOM_MAX_DURATION" = none ] && unset LOOM_MAX_DURATION
start=$(date +%s)
nice -n 10 cargo test -p inferencecache-loom-tests --profile loom --no-run
# One model at a time (each is single-threaded under loom; parallel runs only contend).
nice -n 10 cargo test -p inferencecache-loom-tests --profile loom --test models -- \
  --test-threads 1 --nocapture "$@" 2>&1 | tee /tmp/loom-run.$$ |
  grep -E "^test |^explored|^ok$|^FAILED|test result|panicked|assert"
status=${PIPESTATUS[0]}
echo "loom-tests: preemptions=${LOOM_MAX_PREEMPTIONS:-none} max_duration=${LOOM_MAX_DURATION:-none}s/model," \
  "wall $(( $(date +%s) - start ))s, $(grep -E '^test result' /tmp/loom-run.$$ || echo 'no summary')"
rm -f /tmp/loom-run.$$
exit "$status"
