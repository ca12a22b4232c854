#!/usr/bin/env bash
# Regenerates bench/RESULTS.md. Every section lives in bench/results/<name>.md and is produced by
# one command; this script (re)runs the sections asked for and assembles the page from all of
# them, so a section not re-run keeps its last recorded run (each section carries its own date,
# machine, load and command).
#
#   bench/run-all.sh                 # every section (about 35 minutes on 2 cores)
#   bench/run-all.sh w1m eviction    # only these sections, then reassemble
#   bench/run-all.sh --assemble      # only reassemble
#
# Sections: w1m (bench/run-w1m.sh), eviction (bin `eviction`), churn (bin `churn`, 10 minutes),
# churn-fit (bin `churn --caps`: 3 caps × 3 minutes, RSS fitted against the cap),
# churn-fit-mimalloc (the same under mimalloc, the server's allocator; not part of "all"),
# checkpoint (bin `checkpoint`: warm-restart write, restore and lookups during a checkpoint),
# replication (bin `replication`: 3 release servers + nats-server, ingest rates, lag, lookups),
# layout-probe (bench/run-layout-probe.sh: the run-layout design probe beside kv-index and `w1m`;
# not part of "all"), rw (bin `rw`, P7), criterion (`cargo bench --bench engine`, table by criterion-table.awk), plus results/server.md, written by hand from the server benches
# (`e2e-lookup`, `soak.sh`; bench/README.md has their commands).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RES="$ROOT/bench/results"
TARGET="${BENCH_TARGET_DIR:-$ROOT/../target-bench}"
mkdir -p "$RES"

header() { # title, command
  local model
  model="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)"
  echo "## $1"
  echo
  echo "- Date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- Machine: ${model:-unknown}, $(nproc) cores, kernel $(uname -r)"
  echo "- Load average at the start: $(cut -d' ' -f1-3 /proc/loadavg) (shared machine: compare ratios)"
  echo "- rustc: $(rustc --version)"
  echo "- Command: \`$2\`"
  echo
}

build() {
  (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" nice -n 10 \
    cargo build --release --quiet -p inferencecache-bench --bin "$1")
}

section() {
  case "$1" in
    w1m)
      "$ROOT/bench/run-w1m.sh" -n 3 --out "$RES/w1m.md" >/dev/null ;;
    layout-probe)
      "$ROOT/bench/run-layout-probe.sh" -n 5 >/dev/null ;;
    eviction)
      build eviction
      { header "Eviction quality and cost at the cap (T86, T87, T94)" \
          "cargo run --release -p inferencecache-bench --bin eviction"
        "$TARGET/release/eviction"
      } >"$RES/eviction.tmp" && mv "$RES/eviction.tmp" "$RES/eviction.md" ;;
    criterion)
      local log="$RES/criterion.log.tmp"
      (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" nice -n 10 cargo bench -p inferencecache-bench \
        --bench engine -- --warm-up-time 1 --measurement-time 3) >"$log" 2>&1
      { header "Engine micro-benchmarks (criterion)" \
          "cargo bench -p inferencecache-bench --bench engine -- --warm-up-time 1 --measurement-time 3"
        awk -f "$ROOT/bench/criterion-table.awk" "$log"
      } >"$RES/criterion.tmp" && mv "$RES/criterion.tmp" "$RES/criterion.md"
      rm -f "$log" ;;
    rw)
      build rw
      { header "Concurrent read/write (P7)" "cargo run --release -p inferencecache-bench --bin rw"
        "$TARGET/release/rw" || true
      } >"$RES/rw.tmp" && mv "$RES/rw.tmp" "$RES/rw.md" ;;
    churn)
      build churn
      { header "Churn at the cap (P8, 10 minutes)" \
          "cargo run --release -p inferencecache-bench --bin churn -- --minutes 10"
        "$TARGET/release/churn" --minutes 10 || true
      } >"$RES/churn.tmp" && mv "$RES/churn.tmp" "$RES/churn.md" ;;
    churn-fit)
      build churn
      { header "Churn at the cap: RSS per entry, fitted over caps (issue #4)" \
          "cargo run --release -p inferencecache-bench --bin churn -- --caps 250000,500000,1000000 --minutes 3"
        "$TARGET/release/churn" --caps 250000,500000,1000000 --minutes 3 || true
      } >"$RES/churn-fit.tmp" && mv "$RES/churn-fit.tmp" "$RES/churn-fit.md" ;;
    churn-fit-mimalloc)
      (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" nice -n 10 \
        cargo build --release --quiet -p inferencecache-bench --features mimalloc --bin churn)
      { header "Churn at the cap under mimalloc (the server's allocator): RSS per entry" \
          "cargo run --release -p inferencecache-bench --features mimalloc --bin churn -- --caps 250000,500000,1000000 --minutes 3"
        "$TARGET/release/churn" --caps 250000,500000,1000000 --minutes 3 || true
      } >"$RES/churn-fit-mimalloc.tmp" && mv "$RES/churn-fit-mimalloc.tmp" "$RES/churn-fit-mimalloc.md" ;;
    checkpoint)
      (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" nice -n 10 \
        cargo build --release --quiet -p inferencecache-bench --features mimalloc --bin checkpoint)
      { header "Warm restart: checkpoint and restore of 10,485,760 entries (W1M generator, 163,840 chains)" \
          "cargo run --release -p inferencecache-bench --features mimalloc --bin checkpoint -- --chains 163840"
        echo '```text'
        "$TARGET/release/checkpoint" --chains 163840 || true
        echo '```'
        echo
        echo "The disk's own limit here (512 MiB written and fdatasync'ed, then read back uncached):"
        echo
        echo '```text'
        local dd="${TMPDIR:-/tmp}/ic-dd-$$"
        dd if=/dev/zero of="$dd" bs=1M count=512 conv=fdatasync 2>&1 | tail -1
        sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
        dd if="$dd" of=/dev/null bs=1M 2>&1 | tail -1
        rm -f "$dd"
        echo '```'
      } >"$RES/checkpoint.tmp" && mv "$RES/checkpoint.tmp" "$RES/checkpoint.md" ;;
    replication)
      (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" nice -n 10 cargo build --release --quiet \
        -p inferencecache-server -p inferencecache-bench --bin inferencecache-server --bin replication)
      { header "Replicated mode: 3 servers and nats-server on loopback, ingest, lag, LookupRoute on vs off" \
          "target/release/replication --rates 100000,300000,1000000 --seconds 10"
        "$TARGET/release/replication" --server-bin "$TARGET/release/inferencecache-server" \
          --rates 100000,300000,1000000 --seconds 10 || true
        echo
        echo "Marker lag: a one-block update every 100 ms through the servers in turn, from its Ack to the"
        echo "last server answering it. Backlog left at the stop: records the producers had sent (and were"
        echo "acked) that some server had not applied when the producers stopped, as the time until every"
        echo "server had; it is the lag of the end of an overloaded phase. All processes share the 2 cores:"
        echo "each server applies every block, so 3 servers at 1 M blocks/s are 3 M applied blocks/s."
      } >"$RES/replication.tmp" && mv "$RES/replication.tmp" "$RES/replication.md" ;;
    epp-latency)
      { header "Endpoint picker: latency Envoy adds with the picker (issue 43)" "bench/epp-latency.sh"
        echo "Open loop at 1,000 req/s for 20 s per gateway (details: the script's header)."
        echo
        (cd "$ROOT" && bash bench/epp-latency.sh) || true
      } >"$RES/epp-latency.tmp" && mv "$RES/epp-latency.tmp" "$RES/epp-latency.md" ;;
    *)
      echo "unknown section: $1 (w1m, layout-probe, eviction, rw, criterion, churn, churn-fit, churn-fit-mimalloc, checkpoint, replication, epp-latency)" >&2; exit 2 ;;
  esac
}

assemble() {
  {
    echo "# Benchmark results"
    echo
    echo "Assembled by \`bench/run-all.sh\` from \`bench/results/*.md\`; each section states the"
    echo "command that produced it, its date, the machine and its load. Workloads, methods and pass"
    echo "bars: \`benchmarks.md\` of the spec, summarized in \`bench/README.md\`."
    echo
    for f in "$RES"/w1m.md "$RES"/criterion.md "$RES"/eviction.md "$RES"/rw.md "$RES"/churn.md \
      "$RES"/churn-fit.md; do
      [ -f "$f" ] && { cat "$f"; echo; }
    done
    for f in "$RES"/*.md; do
      case "$(basename "$f")" in
        w1m.md|criterion.md|eviction.md|rw.md|churn.md|churn-fit.md) continue ;;
      esac
      cat "$f"; echo
    done
  } >"$ROOT/bench/RESULTS.md"
}

if [ "${1:-}" = "--assemble" ]; then
  assemble
  exit 0
fi
if [ $# -eq 0 ]; then
  set -- w1m criterion eviction rw churn churn-fit
fi
for s in "$@"; do
  echo "== section $s" >&2
  section "$s"
done
assemble
echo "bench/RESULTS.md assembled" >&2
