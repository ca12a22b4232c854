#!/usr/bin/env bash
# Regenerate the committed flamegraphs (flamegraphs/*.svg) of the current checkout.
#
#   flamegraphs/profile.sh            # everything: W1M lookups + ingest + server under load
#   SERVER=0 flamegraphs/profile.sh   # skip the server/loadgen profile
#   W1M=0 flamegraphs/profile.sh      # server profile only (server.svg, server-lookup.svg)
#   W1M=0 SERVER=0 PROBE=0 flamegraphs/profile.sh   # the cap-eviction profile only (eviction-cap.svg)
#   W1M=0 SERVER=0 EVICTION=0 flamegraphs/profile.sh   # the run-layout probe only (probe-*.svg)
#
# What it does:
#   1. installs perf (Debian `linux-perf`) and inferno when they are missing;
#   2. builds the W1M bench binary (and the server + ic-loadgen) with the release profile
#      (fat LTO, line-tables debug info);
#   3. records `perf record -e cpu-clock` with DWARF call graphs (the release profile has no
#      frame pointers, so `--call-graph fp` gives broken Rust stacks):
#        a. one full W1M run (16,384 chains, 100,000 queries/set): lookup hot path;
#        b. W1M_REPEAT short W1M runs (full index, 1,000 queries/set): the ingest (insert) and
#           remove phases take ~70 ms per run, so they need several runs to get samples;
#        c. EVICTION_REPEAT runs of the T86 eviction bench (N = 100,000, LRU): ingest at the cap;
#        d. the run-layout design probe (`layout-probe`, the engine's RunStore on W1M): its
#           walk over PROBE_QUERIES queries per set, and PROBE_REPEAT short runs for its
#           ingest and removal;
#        e. the server while ic-loadgen drives it for SERVER_SECS seconds (optional);
#   4. collapses the stacks (perf script | inferno-collapse-perf), splits the W1M profile into
#      phases by grepping the folded stacks on function names (w1m has no flag to run a single
#      phase), and draws the SVGs with inferno-flamegraph --minwidth (small enough to commit).
#
# Only `cpu-clock` (a software event) works on these VMs: there are no hardware counters.
# perf.data, folded stacks and top-frame tables go to $CARGO_TARGET_DIR/flamegraphs/ (not git).
set -euo pipefail

cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
OUT=flamegraphs
WORK="$CARGO_TARGET_DIR/flamegraphs"
BIN="$CARGO_TARGET_DIR/release"

FREQ="${FREQ:-999}"                          # W1M sampling rate (Hz)
CALLGRAPH="${CALLGRAPH:-dwarf,8192}"         # W1M call-graph mode
W1M_ARGS="${W1M_ARGS:-}"                     # lookup profile: default = the full W1M run
W1M_REPEAT="${W1M_REPEAT:-20}"               # ingest profile: number of short runs
SERVER="${SERVER:-1}"                        # 0 = skip the server profile
W1M="${W1M:-1}"                              # 0 = skip the W1M profiles (server only)
EVICTION="${EVICTION:-1}"                    # 0 = skip the cap-eviction profile
PROBE="${PROBE:-1}"                          # 0 = skip the run-layout probe profiles
PROBE_QUERIES="${PROBE_QUERIES:-400000}"     # queries per set of the probe's lookup profile
PROBE_REPEAT="${PROBE_REPEAT:-12}"           # short probe runs for its ingest and removal
EVICTION_REPEAT="${EVICTION_REPEAT:-20}"     # T86 runs (each spends ~0.1 s at the cap)
EVICTION_FREQ="${EVICTION_FREQ:-4999}"       # short runs: sample faster than the W1M profile
LOADGEN_BIN="${LOADGEN_BIN:-}"               # prebuilt ic-loadgen (it is not profiled)
LOADGEN_ARGS="${LOADGEN_ARGS:-}"             # extra ic-loadgen flags (e.g. a lookup-heavy mix)
SERVER_FREQ="${SERVER_FREQ:-499}"            # the server profile has deeper, larger stacks
SERVER_CALLGRAPH="${SERVER_CALLGRAPH:-dwarf,16384}"
SERVER_SECS="${SERVER_SECS:-15}"
GRPC_PORT="${GRPC_PORT:-19190}"
HTTP_PORT="${HTTP_PORT:-19180}"
CTRL_PORT="${CTRL_PORT:-19181}"
MINWIDTH="${MINWIDTH:-0.25}"                 # px; frames narrower than this are pruned
PERF_INLINE="${PERF_INLINE:---inline}"       # show inlined frames (fat LTO inlines the engine)

log() { printf '== %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# ---- 1. tools ------------------------------------------------------------------------------
if ! command -v perf >/dev/null 2>&1; then
    log "installing linux-perf"
    as_root apt-get install -y linux-perf ||
        { as_root apt-get update && as_root apt-get install -y linux-perf; }
fi
export PATH="$PATH:${CARGO_HOME:-$HOME/.cargo}/bin"
if ! command -v inferno-flamegraph >/dev/null 2>&1; then
    log "installing inferno"
    cargo install inferno
fi

# ---- 2. build ------------------------------------------------------------------------------
if [ "$W1M" != 0 ]; then
    log "build w1m (release profile, CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
    cargo build --release -p inferencecache-bench --bin w1m
fi
if [ "$SERVER" != 0 ]; then
    if [ -n "$LOADGEN_BIN" ]; then
        log "build inferencecache-server (release profile); ic-loadgen: $LOADGEN_BIN"
        cargo build --release -p inferencecache-server --bin inferencecache-server
    else
        log "build inferencecache-server and ic-loadgen (release profile)"
        cargo build --release -p inferencecache-server --bin inferencecache-server \
            -p inferencecache-bench --bin ic-loadgen
        LOADGEN_BIN="$BIN/ic-loadgen"
    fi
fi
if [ "$EVICTION" != 0 ]; then
    log "build eviction (release profile)"
    cargo build --release -p inferencecache-bench --bin eviction
fi
if [ "$PROBE" != 0 ]; then
    log "build layout-probe (release profile)"
    cargo build --release -p inferencecache-bench --bin layout-probe
fi
mkdir -p "$WORK" "$OUT"

# ---- helpers -------------------------------------------------------------------------------
# collapse DATA FOLDED: perf.data -> folded stacks ("frame;frame;... count")
collapse() {
    perf script $PERF_INLINE -i "$1" 2>/dev/null | inferno-collapse-perf --all >"$2"
}

# record_runs DATA LOG REPEAT FREQ BINARY ARGS...: perf record of REPEAT runs of BINARY ARGS
# (short runs whose phase of interest is too brief for one run to give enough samples)
record_runs() {
    local data=$1 out=$2 repeat=$3 freq=$4
    shift 4
    perf record -e cpu-clock -F "$freq" -g --call-graph "$CALLGRAPH" -o "$data" \
        -- bash -c 'n=$1; shift; for _ in $(seq "$n"); do "$@" || exit 1; done' _ "$repeat" "$@" \
        >"$out" 2>&1
}

# svg FOLDED NAME TITLE: draws flamegraphs/NAME.svg and writes $WORK/NAME.top.txt
svg() {
    local folded=$1 name=$2 title=$3 total
    # %.0f: with cpu-clock the folded weights are periods in ns, past awk's integer print range
    total=$(awk '{s += $NF} END {printf "%.0f\n", s}' "$folded")
    if [ "$total" -eq 0 ]; then
        log "no samples for $name (filter matched nothing); skipped"
        return
    fi
    inferno-flamegraph --minwidth "$MINWIDTH" --title "$title" \
        --subtitle "$total samples of cpu-clock, $(date -u +%Y-%m-%d), $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
        <"$folded" >"$OUT/$name.svg"
    top_frames "$folded" >"$WORK/$name.top.txt"
    log "$OUT/$name.svg: $total samples, $(du -k "$OUT/$name.svg" | cut -f1) KiB"
}

# top_frames FOLDED: self time by leaf frame, then inclusive time of the named engine frames.
top_frames() {
    awk '
    {
        n = $NF; total += n
        line = $0; sub(/ [0-9]+$/, "", line)
        k = split(line, f, ";")
        leaf = f[k]; sub(/_\[[a-z]\]$/, "", leaf)
        self[leaf] += n
        delete seen
        for (i = 1; i <= k; i++) {
            g = f[i]; sub(/_\[[a-z]\]$/, "", g)
            if (!(g in seen)) { seen[g] = 1; incl[g] += n }
        }
    }
    END {
        printf "total %d samples\n\n## self (leaf frame)\n", total
        for (l in self) printf "%6.2f%%  %7d  %s\n", 100 * self[l] / total, self[l], l | "sort -rn | head -25"
        close("sort -rn | head -25")
        printf "\n## inclusive (frame anywhere on the stack)\n"
        for (l in incl) printf "%6.2f%%  %7d  %s\n", 100 * incl[l] / total, incl[l], l | "sort -rn | head -60"
        close("sort -rn | head -60")
    }' "$1"
}

# phase FOLDED OUT REGEX [EXCLUDE]: the stacks of one phase of a W1M run
phase() {
    if [ -n "${4:-}" ]; then
        grep -E -- "$3" "$1" | grep -vE -- "$4" >"$2" || true
    else
        grep -E -- "$3" "$1" >"$2" || true
    fi
}

if [ "$W1M" != 0 ]; then
# ---- 3a. W1M lookup profile ----------------------------------------------------------------
# shellcheck disable=SC2086 # W1M_ARGS is a word list on purpose
{
    log "perf record: w1m $W1M_ARGS (full run)"
    perf record -e cpu-clock -F "$FREQ" -g --call-graph "$CALLGRAPH" -o "$WORK/w1m.perf.data" \
        -- "$BIN/w1m" $W1M_ARGS >"$WORK/w1m.out" 2>&1
}
tail -n 30 "$WORK/w1m.out" >&2
log "collapse w1m (perf script $PERF_INLINE, may take a while)"
collapse "$WORK/w1m.perf.data" "$WORK/w1m.folded"

# Phases (the bench drives the engine from bench/src/ours.rs):
#   core match  = Index::match_chain_into (ours::core_op / bench_core)
#   full route  = Index::lookup_route / lookup_route_into (ours::route_op, route_into_op)
phase "$WORK/w1m.folded" "$WORK/lookup-core.folded" 'match_chain_into'
phase "$WORK/w1m.folded" "$WORK/lookup-route.folded" 'lookup_route' 'match_chain_into'
svg "$WORK/w1m.folded" w1m-all "W1M (16,384 chains): whole run"
svg "$WORK/lookup-core.folded" lookup-core "W1M core match: Index::match_chain_into"
svg "$WORK/lookup-route.folded" lookup-route "W1M full LookupRoute: Index::lookup_route(_into)"

# ---- 3b. W1M ingest / remove profile -------------------------------------------------------
log "perf record: $W1M_REPEAT x w1m --smoke --chains 16384 --queries 1000 (ingest + remove)"
record_runs "$WORK/ingest.perf.data" "$WORK/ingest.out" "$W1M_REPEAT" "$FREQ" \
    "$BIN/w1m" --smoke --chains 16384 --queries 1000
log "collapse ingest"
collapse "$WORK/ingest.perf.data" "$WORK/ingest-all.folded"
phase "$WORK/ingest-all.folded" "$WORK/ingest.folded" 'ours::insert|Index::ingest|Index>::ingest' 'ours::remove'
phase "$WORK/ingest-all.folded" "$WORK/remove.folded" 'ours::remove'
svg "$WORK/ingest.folded" ingest "W1M insert: Index::ingest of 16,384 x 64-block chains ($W1M_REPEAT runs)"
svg "$WORK/remove.folded" remove "W1M remove: PREFIX_EVICTED of every chain ($W1M_REPEAT runs)"
fi

# ---- 3c. cap eviction (T86) ----------------------------------------------------------------
if [ "$EVICTION" != 0 ]; then
    log "perf record: $EVICTION_REPEAT x eviction --n 100000 --no-t94 --alg lru (T86)"
    record_runs "$WORK/eviction.perf.data" "$WORK/eviction.out" "$EVICTION_REPEAT" \
        "$EVICTION_FREQ" "$BIN/eviction" --n 100000 --no-t94 --alg lru
    log "collapse eviction"
    collapse "$WORK/eviction.perf.data" "$WORK/eviction-all.folded"
    phase "$WORK/eviction-all.folded" "$WORK/eviction-cap.folded" 'enforce_cap'
    svg "$WORK/eviction-cap.folded" eviction-cap \
        "T86 at the cap: Index::enforce_cap (LRU, N = 100,000, $EVICTION_REPEAT runs)"
fi

# ---- 3d. run-layout probe (RunStore) -------------------------------------------------------
if [ "$PROBE" != 0 ]; then
    log "perf record: layout-probe --queries $PROBE_QUERIES (lookups)"
    perf record -e cpu-clock -F "$EVICTION_FREQ" -g --call-graph "$CALLGRAPH" \
        -o "$WORK/probe.perf.data" -- "$BIN/layout-probe" --queries "$PROBE_QUERIES" \
        >"$WORK/probe.out" 2>&1
    log "collapse probe lookups"
    collapse "$WORK/probe.perf.data" "$WORK/probe-all.folded"
    # Inlined frames carry no module path: the store's entry points are matched by name.
    phase "$WORK/probe-all.folded" "$WORK/probe-lookup.folded" ';walk<|layout_probe::lookup' \
        'ingest_with|evict_with'
    svg "$WORK/probe-lookup.folded" probe-lookup \
        "Run-layout probe lookups (Q50, Q100, Q0): RunStore::walk ($PROBE_QUERIES queries per set)"
    log "perf record: $PROBE_REPEAT x layout-probe --queries 1000 (ingest + removal)"
    record_runs "$WORK/probe-writes.perf.data" "$WORK/probe-writes.out" "$PROBE_REPEAT" \
        "$EVICTION_FREQ" "$BIN/layout-probe" --queries 1000
    log "collapse probe writes"
    collapse "$WORK/probe-writes.perf.data" "$WORK/probe-writes.folded"
    phase "$WORK/probe-writes.folded" "$WORK/probe-ingest.folded" 'ingest_with'
    phase "$WORK/probe-writes.folded" "$WORK/probe-remove.folded" 'evict_with'
    svg "$WORK/probe-ingest.folded" probe-ingest \
        "Run-layout probe insert: RunStore::ingest of 16,384 x 64-block chains ($PROBE_REPEAT runs)"
    svg "$WORK/probe-remove.folded" probe-remove \
        "Run-layout probe remove: RunStore::evict of every chain, tail first ($PROBE_REPEAT runs)"
fi

# ---- 3e. server under load -----------------------------------------------------------------
if [ "$SERVER" != 0 ]; then
    for p in "$GRPC_PORT" "$HTTP_PORT" "$CTRL_PORT"; do
        if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "port $p is in use; set GRPC_PORT/HTTP_PORT/CTRL_PORT" >&2
            exit 1
        fi
    done
    log "start inferencecache-server on 127.0.0.1:$GRPC_PORT"
    "$BIN/inferencecache-server" --grpc-bind-address "127.0.0.1:$GRPC_PORT" \
        --http-bind-address "127.0.0.1:$HTTP_PORT" --snapshot-bind-address "127.0.0.1:$CTRL_PORT" \
        --log-level warn >"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    LOADGEN_PID=
    cleanup() {
        [ -n "$LOADGEN_PID" ] && kill "$LOADGEN_PID" 2>/dev/null
        kill "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
    }
    trap cleanup EXIT
    for _ in $(seq 100); do
        curl -fsS "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null 2>&1 && break
        sleep 0.1
    done
    curl -fsS "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null
    log "ic-loadgen for ${SERVER_SECS}s (+3 s warm-up), perf record -p $SERVER_PID"
    # shellcheck disable=SC2086 # LOADGEN_ARGS is a word list on purpose
    "$LOADGEN_BIN" --target "http://127.0.0.1:$GRPC_PORT" --duration "${SERVER_SECS}s" \
        --quiet --out "$WORK/loadgen/report.json" $LOADGEN_ARGS >"$WORK/loadgen.out" 2>&1 &
    LOADGEN_PID=$!
    sleep 3 # the load generator's warm-up fills the index
    perf record -e cpu-clock -F "$SERVER_FREQ" -g --call-graph "$SERVER_CALLGRAPH" \
        -p "$SERVER_PID" -o "$WORK/server.perf.data" -- sleep "$SERVER_SECS" 2>"$WORK/server.perf.log"
    wait "$LOADGEN_PID" || log "ic-loadgen exited non-zero (see $WORK/loadgen.out)"
    LOADGEN_PID=
    cleanup
    trap - EXIT
    tail -n 25 "$WORK/loadgen.out" >&2
    log "collapse server"
    collapse "$WORK/server.perf.data" "$WORK/server.folded"
    svg "$WORK/server.folded" server "inferencecache-server under ic-loadgen (${SERVER_SECS} s)"
    phase "$WORK/server.folded" "$WORK/server-lookup.folded" 'lookup_route|LookupRoute|lookup::'
    svg "$WORK/server-lookup.folded" server-lookup "inferencecache-server: LookupRoute handler stacks"
fi

log "done: $(ls "$OUT"/*.svg | tr '\n' ' ')"
log "top frames: $WORK/*.top.txt"
