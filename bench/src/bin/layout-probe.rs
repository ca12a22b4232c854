//! A design probe for the run layout (`docs/perf-log.md`, "The run layout"): the storage the
//! plan describes, reduced to what W1M exercises, measured on W1M's data and queries with the
//! same method as `w1m`, so its figures sit next to the engine's and the peers' on one host.
//!
//! ```text
//! layout-probe [--chains N] [--queries N] [--no-hints] [--no-roots] [--no-gone] [--no-join]
//!              [--key-bytes N] [--json]
//! ```
//!
//! This is not an index: one thread, one partition, keys of 8 bytes (or `--key-bytes`: each
//! value widened to that many bytes, kept by the runs and compared), replica indices below 64,
//! no LFU, TTL sweep or tiers beyond what the walk reads. Its storage is the engine's pieces of
//! the run layout (`inferencecache_engine::layout`): the key-inline `SlotTable` (atomic slots,
//! epoch-retired tables, a writer lock, taken once per stretch here) and `BlockRun` with its
//! `RunIds` (atomic header words, Release stores, hints checked against run ids, runs retired
//! through the epoch). It answers one question before the engine is rebuilt around it: how
//! fast are lookups, inserts and removals when a key table slot names `(run, offset)` directly
//! and a run holds its stretch's holders and keys in one allocation, i.e. when a probe is one
//! slot line and then the run's lines (header, holders, keys) at addresses known from the slot
//! alone. Every lookup's sums are checked against W1M's expected answers, so the probe computes
//! the same matches as the engine.
//!
//! Layout. A slot is `{key: u64, value: u64}` (16 bytes, four per line, linear probing over a
//! power-of-two table, grown at 3/4 load), with a presence summary of two bits per key in one
//! word per 32 slots. `value` is the run pointer with the block's offset in its top 16 bits and,
//! in bit 0, whether the key also has a root slot. A run's layout is `BlockRun`'s (its module
//! docs): holder entries with room for one more than it was built with, four successor hints,
//! the header, the keys, then the dead words of offsets from 64 on.
//!
//! Writes. A chain is cut into stretches by probing only each stretch's first key: the keys
//! after it are matched against the run's own keys (a live offset's slot names it, since a slot
//! is repointed or removed only after its offset is marked dead). A holder joining a run whose
//! live blocks the stretch covers takes the spare entry (`--no-join` turns that off); a holder
//! leaving such a run, when others stay, sets its gone bit (`--no-gone`); otherwise the stretch
//! is copied into a new run and its slots repointed, or removed with the last holder.
//!
//! Two lookup aids, each with a flag that turns it off for A/B runs: **successor hints**
//! (`--no-hints`; a run's `(key, value)` of the block after its stretch in the chains that
//! built it, used when the hinted offset is still live, so the walk fetches the next run while
//! it compares this one's keys) and **root slots** (`--no-roots`; a small table holding a copy
//! of the slot of every key an ingest began with, kept equal to the key table's by every write,
//! so block 0 usually costs no cold line). A hint holds no reference: it is used only if the
//! run id it names still names its run, the offset is live and holds the key.

use std::process::ExitCode;

use clap::Parser;
use clap::builder::TypedValueParser;
use crossbeam_epoch as epoch;
use inferencecache_engine::layout::{Keys, RunStore, StoreOptions, Writing, digest};
use std::time::Instant;

use inferencecache_bench::measure::{Plan, Recorder, Sums, bench_lookup, vm_rss_bytes};
use inferencecache_bench::w1m::{
    BLOCK_TOKENS, CHAINS_FULL, Chain, Kind, LEN, QUERIES, Queries, Workload, parse_chains, rolling,
    worker,
};

/// The probe's row name in tables and JSON lines; each aid turned off adds a suffix
/// (", no roots", ", no hints", ", no gone", ", no join").
const ROW: &str = "inferencecache run-layout probe";

/// The longest-prefix match (L4) over `hashes` with `counts`, live holders only: per replica
/// (index < 64) the matched tokens and blocks; returns the check sums
/// `[Σ blocks, Σ tokens, replicas]`. Each stretch the walk visits is held by exactly its run's
/// live holders: the open replicas it lacks close at the tokens before it and, at block 0, the
/// live ones open.
fn lookup(
    store: &RunStore,
    keys: Keys<'_, KeyBytes>,
    counts: &[i32],
    now_ms: i64,
    ttl_ms: i64,
) -> Sums {
    debug_assert!(keys.len() <= counts.len());
    let guard = epoch::pin();
    let mut open = 0u64;
    let mut sums = [0u64; 3];
    let mut tokens = 0i64;
    let close = |set: u64, at: usize, tokens: i64, sums: &mut Sums| {
        let c = u64::from(set.count_ones());
        sums[0] += c * at as u64;
        sums[1] += c * tokens as u64;
        sums[2] += c;
    };
    let matched = store.walk(keys, &guard, |run, from, to| {
        let mut here = 0u64;
        run.for_each_holder(|_, h| {
            if now_ms - h.last_seen_ms() < ttl_ms {
                here |= 1 << h.rep();
            }
        });
        if from == 0 {
            open = here;
        }
        let closing = open & !here;
        if closing != 0 {
            close(closing, from, tokens, &mut sums);
            open &= here;
        }
        if open == 0 {
            return false;
        }
        tokens += counts[from..to].iter().map(|&c| i64::from(c)).sum::<i64>();
        true
    });
    if open != 0 {
        close(open, matched, tokens, &mut sums);
    }
    sums
}

/// A key of `--key-bytes` bytes (at most [`MAX_KEY_BYTES`]).
#[derive(Clone, Copy)]
struct KeyBytes {
    bytes: [u8; MAX_KEY_BYTES],
    len: usize,
}

const MAX_KEY_BYTES: usize = 64;

impl AsRef<[u8]> for KeyBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A chain's keys as the store takes them: 8-byte keys are W1M's values themselves (no bytes);
/// with longer keys each value becomes `len` bytes (its 8 big-endian bytes, then the value
/// rotated, so distinct values stay distinct) and its digest is computed here, as an index
/// computes it for every block it is given. Scratch: `digests`, `bytes`.
struct ChainKeys {
    len: usize,
    digests: Vec<u64>,
    bytes: Vec<KeyBytes>,
}

impl ChainKeys {
    fn new(len: usize) -> Self {
        ChainKeys {
            len,
            digests: Vec::with_capacity(LEN),
            bytes: Vec::with_capacity(LEN),
        }
    }

    fn of<'a>(&'a mut self, values: &'a [u64]) -> Keys<'a, KeyBytes> {
        if self.len == 8 {
            return Keys::eight(values);
        }
        self.bytes.clear();
        self.digests.clear();
        for &v in values {
            let mut key = KeyBytes {
                bytes: [0; MAX_KEY_BYTES],
                len: self.len,
            };
            for (i, chunk) in key.bytes[..self.len].chunks_mut(8).enumerate() {
                let word = v.rotate_left(8 * i as u32).to_be_bytes();
                chunk.copy_from_slice(&word[..chunk.len()]);
            }
            self.digests.push(digest(key.as_ref()));
            self.bytes.push(key);
        }
        Keys::with_bytes(&self.digests, &self.bytes).expect("a digest per key")
    }
}

fn expected(kind: Kind) -> Sums {
    [
        kind.blocks_per_query(),
        kind.tokens_per_query(),
        kind.replicas_per_query(),
    ]
}

/// The run-layout design probe on W1M: load the workload, time the query sets and removals,
/// check every answer (exit 1 when a check fails).
#[derive(Debug, Parser)]
#[command(name = "layout-probe", version)]
struct Args {
    /// Chains of the workload (default: the full W1M size).
    #[arg(long, default_value_t = CHAINS_FULL, value_parser = parse_chains)]
    chains: usize,
    /// Queries per query set (default: W1M's).
    #[arg(long, default_value_t = QUERIES, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    queries: usize,
    /// Lookups do not use the successor hints.
    #[arg(long)]
    no_hints: bool,
    /// Lookups do not try the root slots for block 0.
    #[arg(long)]
    no_roots: bool,
    /// A holder leaving a run whole is removed by copying the run without it, not marked gone
    /// in place.
    #[arg(long)]
    no_gone: bool,
    /// Runs keep no spare holder entry: a holder joining a run is added by copying the run.
    #[arg(long)]
    no_join: bool,
    /// Bytes per block key, 8 to 64 (8: W1M's 8-byte values; more: each value widened, so the
    /// store keeps the keys' bytes and compares them). The timed loops then also build every
    /// block's key and digest, a request's whole chain before its walk (Q0 included): a check
    /// of that path at W1M's size and an upper bound of its cost, not a figure to set beside
    /// the peers'.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(8..=MAX_KEY_BYTES as u64).map(|v| v as usize))]
    key_bytes: usize,
    /// Print one JSON line per figure instead of the table.
    #[arg(long)]
    json: bool,
}

fn run(args: &Args) -> Result<(), String> {
    let (chains, queries) = (args.chains, args.queries);
    let w = Workload::new(chains);
    let q = Queries::generate(chains, queries);
    let counts = [BLOCK_TOKENS; LEN];
    let now_ms = 1_700_000_000_000i64;
    let ttl_ms = 1_800_000i64;

    let rss0 = vm_rss_bytes();
    let store = RunStore::new(StoreOptions {
        hints: !args.no_hints,
        roots: !args.no_roots,
        gone: !args.no_gone,
        join: !args.no_join,
    });
    let mut chain_keys = ChainKeys::new(args.key_bytes);
    let t = Instant::now();
    for (c, s) in w.seq.iter().enumerate() {
        let writing = Writing {
            rep: worker(c) as u32,
            tier: 1,
            ts_ms: now_ms,
        };
        store.ingest(chain_keys.of(s), &counts, writing, &epoch::pin());
    }
    let insert = t.elapsed();
    let rss = vm_rss_bytes().saturating_sub(rss0);
    let entries = w.entries() as f64;
    let accounted = store.memory_bytes(&epoch::pin());

    let mut rows = Vec::new();
    for set in [&q.q50, &q.q100, &q.q0] {
        let qs: Vec<Chain> = set.blocks.iter().map(rolling).collect();
        let st = bench_lookup(
            set.kind.label(),
            qs.len(),
            Plan::FULL,
            expected(set.kind),
            |i| lookup(&store, chain_keys.of(&qs[i]), &counts, now_ms, ttl_ms),
        )?;
        rows.push((set.kind.label(), st));
    }

    let t = Instant::now();
    for (c, s) in w.seq.iter().enumerate() {
        let mut rev = *s;
        rev.reverse();
        store.evict(chain_keys.of(&rev), worker(c) as u32, &epoch::pin());
    }
    let remove = t.elapsed();
    if !store.is_empty() || store.root_count() != 0 || store.run_bytes() != 0 {
        return Err(format!(
            "remove left {} keys, {} root slots and {} run bytes",
            store.len(),
            store.root_count(),
            store.run_bytes()
        ));
    }

    let mut row = ROW.to_string();
    for (off, suffix) in [
        (args.no_roots, ", no roots"),
        (args.no_hints, ", no hints"),
        (args.no_gone, ", no gone"),
        (args.no_join, ", no join"),
    ] {
        if off {
            row.push_str(suffix);
        }
    }
    if args.key_bytes != 8 {
        row.push_str(&format!(", {}-byte keys", args.key_bytes));
    }
    let row = row.as_str();
    let mut rec = Recorder::default();
    rec.put_write(row, "insert", w.entries(), insert);
    rec.put_write(row, "remove", w.entries(), remove);
    rec.put(row, "rss_b_entry", rss as f64 / entries, "B");
    rec.put(row, "mem_b_entry", accounted as f64 / entries, "B");
    for (label, st) in &rows {
        rec.put_lookup(row, label, st);
    }
    if args.json {
        rec.print_json(&format!(",\"chains\":{chains},\"queries\":{queries}"));
    } else {
        println!(
            "layout-probe: {chains} chains, {} entries, {queries} queries/set",
            w.entries()
        );
        rec.print_table();
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layout-probe: {e}");
            ExitCode::FAILURE
        }
    }
}
