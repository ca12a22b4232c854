//! Identity churn soak (issue 28): a fleet whose pods get new names at every rolling restart
//! and tenants that come and go, for minutes, through the engine API; memory must stay flat and
//! every live entry answerable.
//!
//! ```text
//! identity-soak [--minutes M] [--seconds S] [--pods 64] [--rename-every-ms 20000]
//!               [--tenants-per-min 100] [--ttl-ms 30000] [--sweep-ms 1000]
//! ```
//!
//! One index (real clock, its own sweep thread every `--sweep-ms`, TTL `--ttl-ms`, no cap).
//! The writer thread drives:
//! - **the fleet**: tenant `fleet`, model `m`, `--pods` pods, each holding 8 chains of 16
//!   blocks (its own keys) and reporting stats, refreshed every TTL/6. Rolling restarts: every
//!   `--rename-every-ms / --pods` one pod gets a new name (generation + 1), so the whole fleet
//!   is renamed once per `--rename-every-ms`; the old name stops reporting and its entries
//!   and stats expire.
//! - **tenants**: `--tenants-per-min` new tenants per minute, each with one model, 4 entries
//!   and a stats report, then abandoned (they expire).
//! - **the check**: every 2 s, every live pod's every chain is looked up and must come back
//!   with that pod matching the whole chain (a miss or a wrong match is counted).
//!
//! A reader thread runs LookupRoute all along, half with ids that exist (fleet chains), half
//! with random tenant / model ids (which must answer UNKNOWN_TENANT and create nothing).
//! `VmRSS`, `memory_bytes` and the record counts are sampled every 10 s (every second for
//! runs under 3 minutes). Verdict: max RSS in the second half of the run ≤ 1.05 × max RSS from
//! 1/10 of the run to its half (minutes 5–10 vs 1–5 of a 10-minute run) plus [`RSS_SLACK`];
//! the same halves' maxima of the index's records (tenants, model pairs, partitions, scope
//! replicas), the interned replica ids, entries and `memory_bytes` ≤ 1.25 × (a leak of what the run churns grows them
//! by its churn: ~1,000 renamed pods or tenants per minute against ~200 and ~50 live); no
//! failed check, no random-id lookup that found anything; exit 1 otherwise.

use clap::Parser;
use inferencecache_bench::measure::vm_rss_bytes;
use inferencecache_engine::*;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser, Clone)]
#[command(about = "Identity churn soak: renamed pods and abandoned tenants, RSS must stay flat")]
struct Args {
    /// Run length in minutes (ignored when --seconds is given).
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// Run length in seconds (overrides --minutes).
    #[arg(long)]
    seconds: Option<u64>,
    /// Pods of the fleet.
    #[arg(long, default_value_t = 64)]
    pods: usize,
    /// The whole fleet is renamed once per this period (a rolling restart).
    #[arg(long, default_value_t = 20_000)]
    rename_every_ms: u64,
    /// New (then abandoned) tenants per minute.
    #[arg(long, default_value_t = 100)]
    tenants_per_min: u64,
    /// Entry and stats TTL.
    #[arg(long, default_value_t = 30_000)]
    ttl_ms: i64,
    /// Sweep interval.
    #[arg(long, default_value_t = 1_000)]
    sweep_ms: i64,
}

const CHAINS: usize = 8;
const BLOCKS: usize = 16;
const COUNTS: [i32; BLOCKS] = [16; BLOCKS];

struct Pod {
    name: String,
    /// Chain keys (8-byte big-endian), unique to this pod name.
    chains: Vec<Vec<[u8; 8]>>,
    refreshed: Instant,
}

fn pod(generation: u64, slot: usize) -> Pod {
    let id = generation << 16 | slot as u64;
    Pod {
        name: format!("vllm-decode-7f9c{generation:06}-{slot:02}"),
        chains: (0..CHAINS as u64)
            .map(|c| {
                (0..BLOCKS as u64)
                    .map(|b| (id << 16 | c << 8 | b).to_be_bytes())
                    .collect()
            })
            .collect(),
        refreshed: Instant::now() - Duration::from_secs(3600),
    }
}

fn report(ix: &Index, tenant: &str, model: &str, replica: &str, chains: &[Vec<[u8; 8]>]) {
    ix.ingest(CacheStateUpdate {
        replica_id: replica,
        model_id: model,
        tenant_id: tenant,
        hash_scheme: "vllm",
        timestamp_us: 0,
        prefixes: chains.iter().map(|c| PrefixRef {
            prefix_hash: &[],
            token_count: 0,
            block_hashes: &c[..],
            block_token_counts: &COUNTS[..c.len()],
            tier: tier::T1,
            adapter_id: "",
        }),
        stats: Some(ReplicaStatsInput {
            cache_memory_bytes: 1 << 30,
            hit_rate: 0.5,
            pressure: 0.2,
            t2_hit_tokens: 0,
            t2_query_tokens: 0,
        }),
        adapter_id: "",
    });
}

fn route<'a>(ix: &Index, tenant: &'a str, model: &'a str, chain: &'a [[u8; 8]]) -> RouteResult {
    ix.lookup_route(&LookupRequest {
        block_hashes: chain,
        block_token_counts: &COUNTS[..chain.len()],
        ..LookupRequest::new(tenant, model, "vllm")
    })
}

/// What the RSS verdict allows beyond 5%: the step in which this process's heap grows (glibc
/// grows an arena by 128 KiB or more at a time, and three threads allocate here). At ~7 MiB a
/// one-minute run cannot tell such a step from 5%: unchanged code measured 1.000–1.071 ×
/// with one 0.4 MiB step. A leak of the identities the run churns shows in the record counts,
/// which have no such step.
const RSS_SLACK: u64 = 512 * 1024;

/// One sampled quantity the verdict bounds.
type Measure = fn(&Sample) -> u64;

struct Sample {
    t_s: f64,
    rss: u64,
    mem: i64,
    counts: RecordCounts,
    entries: i64,
    /// Replica ids interned process-wide.
    ids: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let run = Duration::from_secs(args.seconds.unwrap_or(args.minutes * 60));
    let ix = Arc::new(Index::new(
        IndexConfig {
            global_ttl_ms: args.ttl_ms,
            sweep_interval_ms: args.sweep_ms,
            max_entries: 0,
            ..IndexConfig::default()
        },
        Arc::new(DefaultResolvers),
        Arc::new(SystemClock),
    ));
    ix.start();
    let stop = Arc::new(AtomicBool::new(false));
    // Fleet chains the reader may look up (a snapshot refreshed by the writer).
    let shared: Arc<std::sync::Mutex<Vec<Vec<[u8; 8]>>>> = Arc::default();
    let random_found = Arc::new(AtomicU64::new(0));
    let lookups = Arc::new(AtomicU64::new(0));
    let reader = {
        let (ix, stop, shared, random_found, lookups) = (
            ix.clone(),
            stop.clone(),
            shared.clone(),
            random_found.clone(),
            lookups.clone(),
        );
        std::thread::spawn(move || {
            let mut n = 0u64;
            let mut name = String::new();
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                if n.is_multiple_of(2) {
                    let chain = {
                        let s = shared.lock().unwrap_or_else(|p| p.into_inner());
                        if s.is_empty() {
                            continue;
                        }
                        s[(n / 2) as usize % s.len()].clone()
                    };
                    std::hint::black_box(route(&ix, "fleet", "m", &chain));
                } else {
                    use std::fmt::Write;
                    name.clear();
                    let _ = write!(name, "random-{:x}", n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    let key = [n.to_be_bytes()];
                    let r = route(&ix, &name, &name, &key);
                    // NO_HINT only before the first ingest (an empty index).
                    if !r.scores.is_empty()
                        || !matches!(r.strategy, Strategy::UnknownTenant | Strategy::None)
                    {
                        random_found.fetch_add(1, Ordering::Relaxed);
                    }
                }
                lookups.fetch_add(1, Ordering::Relaxed);
                if n.is_multiple_of(64) {
                    // Leave the writer most of the second core.
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        })
    };

    let t0 = Instant::now();
    let sample_every = if run < Duration::from_secs(180) {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(10)
    };
    let refresh = Duration::from_millis((args.ttl_ms / 6).max(1) as u64);
    let rename_step = Duration::from_millis(args.rename_every_ms / args.pods.max(1) as u64);
    let tenant_step = Duration::from_secs_f64(60.0 / args.tenants_per_min.max(1) as f64);
    let mut fleet: Vec<Pod> = (0..args.pods).map(|s| pod(0, s)).collect();
    let mut generations = vec![0u64; args.pods];
    let (mut next_rename, mut next_tenant, mut next_check, mut next_sample) =
        (t0 + rename_step, t0, t0 + Duration::from_secs(2), t0);
    let (mut renamed, mut tenants, mut checks, mut failed) = (0u64, 0u64, 0u64, 0u64);
    let mut rename_slot = 0;
    let mut samples: Vec<Sample> = Vec::new();
    println!(
        "identity-soak: {} s, {} pods renamed every {} ms, {} tenants/min, TTL {} ms, sweep {} ms",
        run.as_secs(),
        args.pods,
        args.rename_every_ms,
        args.tenants_per_min,
        args.ttl_ms,
        args.sweep_ms
    );
    while t0.elapsed() < run {
        let now = Instant::now();
        if now >= next_rename {
            next_rename += rename_step;
            let s = rename_slot;
            rename_slot = (rename_slot + 1) % args.pods;
            generations[s] += 1;
            fleet[s] = pod(generations[s] * args.pods as u64 + s as u64, s);
            renamed += 1;
        }
        for p in fleet.iter_mut() {
            if p.refreshed.elapsed() >= refresh {
                report(&ix, "fleet", "m", &p.name, &p.chains);
                p.refreshed = Instant::now();
            }
        }
        if now >= next_tenant {
            next_tenant += tenant_step;
            let t = format!("tenant-{tenants:08}");
            let chains: Vec<Vec<[u8; 8]>> = (0..4u64)
                .map(|k| vec![(tenants << 8 | k).to_be_bytes()])
                .collect();
            report(&ix, &t, "m", "pod-0", &chains);
            tenants += 1;
        }
        if now >= next_check {
            next_check += Duration::from_secs(2);
            let mut all = Vec::new();
            // Every pod reported within the last refresh period (the loop above runs first).
            for p in &fleet {
                for c in &p.chains {
                    checks += 1;
                    let r = route(&ix, "fleet", "m", c);
                    let hit = r.scores.iter().any(|s| {
                        *s.replica_id == p.name && s.matched_tokens == (16 * BLOCKS) as i32
                    });
                    if !hit {
                        failed += 1;
                    }
                    all.push(c.clone());
                }
            }
            *shared.lock().unwrap_or_else(|p| p.into_inner()) = all;
        }
        if now >= next_sample {
            next_sample += sample_every;
            samples.push(Sample {
                t_s: t0.elapsed().as_secs_f64(),
                rss: vm_rss_bytes(),
                mem: ix.memory_bytes(),
                counts: ix.record_counts(),
                entries: ix.storage_entries(),
                ids: ReplicaId::interned(),
            });
            let s = samples.last().expect("just pushed");
            if sample_every >= Duration::from_secs(10) || samples.len() % 10 == 1 {
                println!(
                    "t={:>5.0}s rss={:>6.1} MiB mem={:>6.1} MiB entries={:>6} tenants={:>4} pairs={:>4} partitions={:>4} scope_replicas={:>4} renamed={renamed} tenants_created={tenants} checks={checks} failed={failed}",
                    s.t_s,
                    s.rss as f64 / (1 << 20) as f64,
                    s.mem as f64 / (1 << 20) as f64,
                    s.entries,
                    s.counts.tenants,
                    s.counts.models,
                    s.counts.partitions,
                    s.counts.scope_replicas,
                );
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().expect("reader");
    ix.stop();
    let secs = run.as_secs_f64();
    // The maximum of `value` over the samples from `a` to `b` seconds.
    let max_in = |a: f64, b: f64, value: Measure| {
        samples
            .iter()
            .filter(|s| s.t_s >= a && s.t_s <= b)
            .map(value)
            .max()
            .unwrap_or(0)
    };
    let halves = |value: Measure| {
        (
            max_in(secs / 10.0, secs / 2.0, value),
            max_in(secs / 2.0, secs, value),
        )
    };
    let (first, second) = halves(|s| s.rss);
    let ratio = second as f64 / first.max(1) as f64;
    let rss_ok = second as f64 <= 1.05 * first as f64 + RSS_SLACK as f64;
    let records: [(&str, Measure); 7] = [
        ("memory_bytes", |s| s.mem.max(0) as u64),
        ("entries", |s| s.entries.max(0) as u64),
        ("tenants", |s| s.counts.tenants as u64),
        ("model pairs", |s| s.counts.models as u64),
        ("partitions", |s| s.counts.partitions as u64),
        ("scope replicas", |s| s.counts.scope_replicas as u64),
        ("interned replica ids", |s| s.ids as u64),
    ];
    let mut records_ok = true;
    for (name, value) in records {
        let (first, second) = halves(value);
        let grew = second as f64 > 1.25 * first as f64;
        records_ok &= !grew;
        println!(
            "identity-soak: {name} max {second} (second half) / {first} (1/10 to half){}",
            if grew { ": grew more than 25%" } else { "" }
        );
    }
    let last = samples.last();
    println!(
        "identity-soak: RSS max {:.1} MiB (second half) / {:.1} MiB (1/10 to half) = {ratio:.3}; \
         {renamed} pods renamed, {tenants} tenants created, {} lookups ({} random-id lookups found something), \
         {checks} live chains checked, {failed} not answered; last: {} tenants, {} scope replicas, {} entries",
        second as f64 / (1 << 20) as f64,
        first as f64 / (1 << 20) as f64,
        lookups.load(Ordering::Relaxed),
        random_found.load(Ordering::Relaxed),
        last.map_or(0, |s| s.counts.tenants),
        last.map_or(0, |s| s.counts.scope_replicas),
        last.map_or(0, |s| s.entries),
    );
    let ok = rss_ok
        && records_ok
        && failed == 0
        && checks > 0
        && random_found.load(Ordering::Relaxed) == 0;
    println!("identity-soak: {}", if ok { "PASS" } else { "FAIL" });
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
