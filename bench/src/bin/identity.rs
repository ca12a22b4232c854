//! Identity creation rates through the engine API (issue 28): how fast an index takes new
//! tenants, new (tenant, model) pairs and new replica ids into one scope, and what each costs.
//!
//! ```text
//! identity [--count N] [--step N] [--phase tenants|models|schemes|adapters|replicas] [--min-rate R]
//! ```
//!
//! Each phase ingests `--count` updates of one 8-byte key, each naming one identity the index
//! has not seen, and prints the rate of every `--step` of them, so an O(n) cost per new
//! identity shows as a falling rate. The RSS growth per identity (`VmRSS` after the phase minus
//! before, divided by the count) is printed with each phase's total; the index lives until the
//! end of its phase. What one update creates, by phase:
//!
//! | phase | new records per update |
//! |---|---|
//! | `tenants` | tenant + (tenant, model) pair + scope + partition + replica slot + entry |
//! | `models` | (tenant, model) pair + scope + partition + replica slot + entry |
//! | `schemes` | scope (a new hash scheme of one pair) + partition + replica slot + entry |
//! | `adapters` | partition (a new adapter of one scope) + entry |
//! | `replicas` | replica slot (a new id in one partition) + entry |
//!
//! So each record's own cost is the difference of two neighbouring rows (a tenant: `tenants`
//! − `models`; a pair: `models` − `schemes`; a scope: `schemes` − `adapters`), a partition
//! with its first entry is `adapters`, a replica id with its first entry `replicas`.

use clap::Parser;
use inferencecache_bench::measure::vm_rss_bytes;
use inferencecache_engine::*;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// `--features mimalloc`: the server's allocator (system malloc by default).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(about = "New tenants / models / replica ids per second through the engine API")]
struct Args {
    /// New identities per phase.
    #[arg(long, default_value_t = 100_000)]
    count: usize,
    /// Report the rate every this many identities.
    #[arg(long, default_value_t = 10_000)]
    step: usize,
    /// Run only this phase (`tenants`, `models`, `schemes`, `adapters` or `replicas`;
    /// default: all five, each with its own index).
    #[arg(long)]
    phase: Option<String>,
    /// Remove each update's entry right after it (PREFIX_EVICTED; no sweep runs), so every
    /// record is measured empty but live: what a record costs between its last entry's
    /// removal and the sweep that reclaims it.
    #[arg(long)]
    empty: bool,
    /// Fail (exit 1) when a phase's slowest step is below this many identities per second.
    #[arg(long, default_value_t = 0.0)]
    min_rate: f64,
}

#[derive(Clone, Copy)]
enum Phase {
    Tenants,
    Models,
    Schemes,
    Adapters,
    Replicas,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Tenants => "tenants",
            Phase::Models => "models",
            Phase::Schemes => "schemes",
            Phase::Adapters => "adapters",
            Phase::Replicas => "replicas",
        }
    }
}

/// One update's names.
struct Names<'a> {
    tenant: &'a str,
    model: &'a str,
    scheme: &'a str,
    adapter: &'a str,
    replica: &'a str,
}

fn ingest(ix: &Index, n: &Names<'_>, key: u64) {
    let hash = key.to_be_bytes();
    let r = PrefixRef {
        prefix_hash: &hash[..],
        token_count: 16,
        block_hashes: &[] as &[[u8; 8]],
        block_token_counts: &[],
        tier: tier::T1,
        adapter_id: "",
    };
    ix.ingest(CacheStateUpdate {
        replica_id: n.replica,
        model_id: n.model,
        tenant_id: n.tenant,
        hash_scheme: n.scheme,
        timestamp_us: 0,
        prefixes: std::iter::once(r),
        stats: None,
        adapter_id: n.adapter,
    });
}

/// Runs one phase; returns its slowest step's rate (identities per second).
fn phase(p: Phase, args: &Args) -> f64 {
    let ix = Index::new(
        IndexConfig {
            max_entries: 0,
            ..IndexConfig::default()
        },
        Arc::new(DefaultResolvers),
        Arc::new(SystemClock),
    );
    let rss0 = vm_rss_bytes();
    let mut slowest = f64::INFINITY;
    let t_all = Instant::now();
    let mut name = String::new();
    let mut k = 0;
    while k < args.count {
        let n = args.step.min(args.count - k);
        let t = Instant::now();
        for j in k..k + n {
            name.clear();
            // Pod-like ids of realistic length (a deployment name, a hash, a suffix).
            use std::fmt::Write;
            let _ = write!(name, "inference-deploy-7f9c{j:08x}-pod");
            let mut names = Names {
                tenant: "t",
                model: "m",
                scheme: "vllm",
                adapter: "",
                replica: "r0",
            };
            match p {
                Phase::Tenants => names.tenant = &name,
                Phase::Models => names.model = &name,
                Phase::Schemes => names.scheme = &name,
                Phase::Adapters => names.adapter = &name,
                Phase::Replicas => names.replica = &name,
            }
            ingest(&ix, &names, j as u64);
            if args.empty {
                ix.apply_event(CacheEventInput {
                    event_type: event_type::PREFIX_EVICTED,
                    replica_id: names.replica,
                    model_id: names.model,
                    tenant_id: names.tenant,
                    prefix_hash: &(j as u64).to_be_bytes(),
                    timestamp_us: 0,
                    adapter_id: names.adapter,
                });
            }
        }
        let rate = n as f64 / t.elapsed().as_secs_f64();
        slowest = slowest.min(rate);
        println!("{:<8} {:>7}..{:<7} {:>10.0} /s", p.name(), k, k + n, rate);
        k += n;
    }
    let total = args.count as f64 / t_all.elapsed().as_secs_f64();
    let rss = vm_rss_bytes().saturating_sub(rss0);
    if args.empty {
        assert_eq!(ix.storage_entries(), 0, "every entry was removed");
    }
    println!(
        "{:<8} total {} in {:.2} s: {:.0} /s, slowest step {:.0} /s, RSS +{:.1} MiB ({:.0} B per identity, {})",
        p.name(),
        args.count,
        t_all.elapsed().as_secs_f64(),
        total,
        slowest,
        rss as f64 / (1 << 20) as f64,
        rss as f64 / args.count as f64,
        if args.empty {
            "each empty but live"
        } else {
            "one entry each"
        }
    );
    slowest
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut ok = true;
    for p in [
        Phase::Tenants,
        Phase::Models,
        Phase::Schemes,
        Phase::Adapters,
        Phase::Replicas,
    ] {
        if args.phase.as_deref().is_some_and(|only| only != p.name()) {
            continue;
        }
        let slowest = phase(p, &args);
        if slowest < args.min_rate {
            println!(
                "FAIL: {} slowest step {slowest:.0} /s < {:.0} /s",
                p.name(),
                args.min_rate
            );
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
