//! The Mooncake index-throughput bench (issue #44, part 1): the measurement plan shared by the
//! workspace binary `mooncake-replay` (InferenceCache and the reference model) and the peers'
//! `mooncake-replay-peers` (kv-index 2.0, Dynamo CRTC and RadixTree beside ours, one process).
//!
//! Per index and thread count: the answers are checked against the simulator's truth
//! (`mooncake::verify`, untimed); a closed-loop replay gives the saturated rate; paced replays at
//! falling fractions of it find the sustained rate (the highest offered rate of which at least
//! 99% is achieved, every stored, removed and looked-up block counting and the drain
//! included); then every index is paced at 50% of *our* sustained rate and its lookup latency
//! taken from each lookup's intended start. After every replay the index must be empty.

use std::fmt::Write as _;

use crate::mooncake::{Pace, RunStats, Simulation, expected_checksum};

/// An index under test. Every call builds a fresh index.
pub trait Subject {
    /// Row name.
    fn name(&self) -> String;
    /// Thread counts it supports (1, and 2 when events and lookups can run concurrently).
    fn supports(&self, threads: usize) -> bool;
    /// True when a one-thread replay applies every event before the next lookup (so its
    /// answers, hence its checksum, are the truth's).
    fn synchronous(&self) -> bool;
    /// [`crate::mooncake::verify`] on a fresh index.
    fn verify(&self, sim: &Simulation) -> Result<usize, String>;
    /// One replay on a fresh index; `Err` when the index is not empty afterwards.
    fn run(&self, sim: &Simulation, threads: usize, pace: Pace) -> Result<RunStats, String>;
}

/// Plan knobs.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Thread counts to run.
    pub threads: Vec<usize>,
    /// Fractions of the saturated rate tried, in order, for the sustained rate.
    pub ladder: Vec<f64>,
    /// Row name of ours (the ratio numerator); the others are the peers.
    pub ours: String,
    /// Halvings of the gap between the first rung kept and the one above it.
    pub refine: usize,
}

/// Results of one (index, threads) cell.
#[derive(Debug, Clone, Default)]
pub struct Cell {
    /// Saturated (closed-loop) block ops/s.
    pub saturated: f64,
    /// Sustained block ops/s (0 when no rung kept 99%).
    pub sustained: f64,
    /// Lookup service time p50 / p99 (ns) at the latency rate.
    pub p50: f64,
    /// p99.
    pub p99: f64,
    /// Lookup p99 (ns) from the intended start (coordinated-omission corrected).
    pub co_p99: f64,
    /// Achieved / offered at the latency rate.
    pub latency_kept: f64,
}

/// Runs the plan; returns the markdown report and the ratio line (also its last line).
pub fn run(
    sim: &Simulation,
    subjects: &[Box<dyn Subject>],
    plan: &Plan,
) -> Result<(String, String), String> {
    let truth = expected_checksum(sim);
    let mut report = String::new();
    let mut failures = Vec::new();
    let _ = writeln!(
        report,
        "Replay: {} requests, {} lookups, {} block ops ({} looked up, {} stored, {} removed); peak held {} blocks, {} before the drain; serving-worker hit rate {:.1}%",
        sim.requests,
        sim.lookups(),
        sim.total_blocks(),
        sim.lookup_blocks,
        sim.stored_blocks,
        sim.removed_blocks,
        sim.peak_held,
        sim.held_before_drain,
        100.0 * sim.hit_blocks as f64 / sim.lookup_blocks.max(1) as f64
    );
    let _ = writeln!(report);
    let _ = writeln!(report, "| Index | exact (lookups checked) |");
    let _ = writeln!(report, "|---|---|");
    for s in subjects {
        let r = s.verify(sim);
        let cell = match &r {
            Ok(n) => format!("yes ({n})"),
            Err(e) => {
                failures.push(format!("{}: {e}", s.name()));
                "**NO**".to_string()
            }
        };
        eprintln!("verify {}: {cell}", s.name());
        let _ = writeln!(report, "| {} | {cell} |", s.name());
    }

    let mut cells: Vec<Vec<Option<Cell>>> = vec![vec![None; plan.threads.len()]; subjects.len()];
    for (t_index, &threads) in plan.threads.iter().enumerate() {
        for (s_index, s) in subjects.iter().enumerate() {
            if !s.supports(threads) {
                continue;
            }
            let mut cell = Cell::default();
            let sat = s.run(sim, threads, Pace::ClosedLoop)?;
            if threads == 1 && s.synchronous() && sat.checksum != truth {
                failures.push(format!(
                    "{}: one-thread answers differ from the truth",
                    s.name()
                ));
            }
            cell.saturated = sat.rate();
            eprintln!(
                "{} t{threads}: saturated {:.2} M blk/s",
                s.name(),
                cell.saturated / 1e6
            );
            let keeps = |fraction: f64| -> Result<bool, String> {
                let offered = cell.saturated * fraction;
                let r = s.run(sim, threads, Pace::Rate(offered))?;
                eprintln!("  paced {:.2} M: kept {:.3}", offered / 1e6, r.kept());
                Ok(r.kept() >= 0.99)
            };
            // The ladder's first rung kept, then `plan.refine` halvings of the gap to the rung
            // above it (which was not kept): the rungs are 5 to 10% apart.
            let mut failed = None;
            let mut kept = None;
            for &f in &plan.ladder {
                if keeps(f)? {
                    kept = Some(f);
                    break;
                }
                failed = Some(f);
            }
            if let (Some(mut low), Some(mut high)) = (kept, failed) {
                for _ in 0..plan.refine {
                    let middle = (low + high) / 2.0;
                    if keeps(middle)? {
                        low = middle;
                    } else {
                        high = middle;
                    }
                }
                kept = Some(low);
            }
            cell.sustained = kept.map_or(0.0, |f| cell.saturated * f);
            cells[s_index][t_index] = Some(cell);
        }
        // Latency at 50% of our sustained rate, for everyone.
        let ours = subjects.iter().position(|s| s.name() == plan.ours);
        // When no rung kept 99% (a loaded host), the lowest rung offered stands in.
        let lowest = plan.ladder.iter().copied().fold(1.0, f64::min);
        let base = ours
            .and_then(|o| cells[o][t_index].as_ref())
            .map_or(0.0, |c| {
                if c.sustained > 0.0 {
                    c.sustained
                } else {
                    c.saturated * lowest
                }
            });
        if base > 0.0 {
            for (s_index, s) in subjects.iter().enumerate() {
                let Some(cell) = cells[s_index][t_index].as_mut() else {
                    continue;
                };
                let r = s.run(sim, threads, Pace::Rate(base * 0.5))?;
                cell.p50 = r.service.value_at_quantile(0.5) as f64;
                cell.p99 = r.service.value_at_quantile(0.99) as f64;
                cell.co_p99 = r.latency.value_at_quantile(0.99) as f64;
                cell.latency_kept = r.kept();
            }
        }
    }

    let _ = writeln!(report);
    let _ = writeln!(
        report,
        "| Index | threads | saturated M blk/s | sustained M blk/s (≥ 99% kept) | lookup p50 / p99 µs at 50% of ours | lookup p99 µs from intended start (kept) |"
    );
    let _ = writeln!(report, "|---|---|---|---|---|---|");
    for (s_index, s) in subjects.iter().enumerate() {
        for (t_index, threads) in plan.threads.iter().enumerate() {
            if let Some(c) = &cells[s_index][t_index] {
                let _ = writeln!(
                    report,
                    "| {} | {threads} | {:.2} | {:.2} | {:.3} / {:.3} | {:.1} ({:.3}) |",
                    s.name(),
                    c.saturated / 1e6,
                    c.sustained / 1e6,
                    c.p50 / 1e3,
                    c.p99 / 1e3,
                    c.co_p99 / 1e3,
                    c.latency_kept,
                );
            }
        }
    }

    // Ratios against the best peer, per thread count.
    let mut parts = Vec::new();
    let _ = writeln!(report);
    let _ = writeln!(
        report,
        "| Bar | threads | ours | best peer | ratio | bar | result |"
    );
    let _ = writeln!(report, "|---|---|---|---|---|---|---|");
    for (t_index, threads) in plan.threads.iter().enumerate() {
        let Some(ours_index) = subjects.iter().position(|s| s.name() == plan.ours) else {
            continue;
        };
        let Some(ours) = cells[ours_index][t_index].clone() else {
            continue;
        };
        let peers: Vec<(String, Cell)> = subjects
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ours_index)
            .filter_map(|(i, s)| cells[i][t_index].clone().map(|c| (s.name(), c)))
            .collect();
        let best_rate = peers
            .iter()
            .max_by(|a, b| a.1.sustained.total_cmp(&b.1.sustained));
        let best_p99 = peers
            .iter()
            .filter(|p| p.1.p99 > 0.0)
            .min_by(|a, b| a.1.p99.total_cmp(&b.1.p99));
        if let Some((name, c)) = best_rate {
            let ratio = ours.sustained / c.sustained.max(1.0);
            let _ = writeln!(
                report,
                "| sustained block ops/s | {threads} | {:.2} M | {:.2} M ({name}) | {ratio:.3}× | ≥ 1.3× | {} |",
                ours.sustained / 1e6,
                c.sustained / 1e6,
                if ratio >= 1.3 { "PASS" } else { "FAIL" }
            );
            parts.push(format!("t{threads} ops/s {ratio:.3}x vs {name}"));
        }
        if let Some((name, c)) = best_p99 {
            let ratio = ours.p99 / c.p99;
            let _ = writeln!(
                report,
                "| lookup p99 (service) at 50% of ours | {threads} | {:.3} µs | {:.3} µs ({name}) | {ratio:.3}× | ≤ 0.7× | {} |",
                ours.p99 / 1e3,
                c.p99 / 1e3,
                if ratio <= 0.7 { "PASS" } else { "FAIL" }
            );
            parts.push(format!("t{threads} p99 {ratio:.3}x vs {name}"));
        }
    }
    if !failures.is_empty() {
        let _ = writeln!(report);
        let _ = writeln!(report, "**Checks failed:** {}", failures.join("; "));
        return Err(report);
    }
    let line = format!(
        "mooncake-replay ratios (ours / best peer): {}",
        parts.join(", ")
    );
    Ok((report, line))
}

/// Command-line options shared by both binaries.
#[derive(Debug, Clone)]
pub struct Args {
    /// Trace file.
    pub trace: std::path::PathBuf,
    /// Requests taken from the trace (0 = all).
    pub requests: usize,
    /// Disjoint copies.
    pub copies: u32,
    /// Simulated workers.
    pub workers: u32,
    /// LRU blocks per worker.
    pub capacity: usize,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Markdown output file.
    pub out: Option<std::path::PathBuf>,
    /// Indexes to run (peers binary; empty = all).
    pub only: Vec<String>,
    /// Quick mode.
    pub quick: bool,
    /// Only measure memory per held block of the first selected index (a fresh process each).
    pub memory: bool,
    /// Only run this many rounds of closed-loop replays (every selected index and thread count
    /// in turn each round, so that load changes hit them alike) and print each rate and the
    /// medians: the quick A/B measurement of an engine change (0 = the full plan).
    pub saturated: usize,
}

/// The default trace: the conversation trace next to the repository (`../shared/traces`), or
/// `$MOONCAKE_TRACE`.
#[must_use]
pub fn default_trace() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("MOONCAKE_TRACE") {
        return p.into();
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for candidate in [
        root.join("../shared/traces/mooncake_conversation_trace.jsonl"),
        root.join("../../shared/traces/mooncake_conversation_trace.jsonl"),
        "/work/shared/traces/mooncake_conversation_trace.jsonl".into(),
    ] {
        if candidate.exists() {
            return candidate;
        }
    }
    root.join("bench/testdata/mooncake_sample.jsonl")
}

/// Usage text.
pub const USAGE: &str = "usage: mooncake-replay [--trace FILE] [--requests N] [--copies N] [--workers N] \
[--capacity BLOCKS] [--threads 1,2] [--index a,b] [--out FILE] [--quick] [--memory] [--saturated ROUNDS]";

impl Args {
    /// Parses `std::env::args`.
    pub fn parse() -> Result<Self, String> {
        let mut a = Args {
            trace: default_trace(),
            requests: 0,
            copies: 16,
            workers: 16,
            capacity: 16_384,
            threads: vec![1, 2],
            out: None,
            only: Vec::new(),
            quick: false,
            memory: false,
            saturated: 0,
        };
        let (mut copies_set, mut requests_set, mut capacity_set) = (false, false, false);
        let mut it = std::env::args().skip(1);
        let num = |v: Option<String>, what: &str| -> Result<usize, String> {
            v.and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{what} needs a number\n{USAGE}"))
        };
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--trace" => a.trace = it.next().ok_or("--trace needs a file")?.into(),
                "--requests" => {
                    a.requests = num(it.next(), "--requests")?;
                    requests_set = true;
                }
                "--copies" => {
                    a.copies = u32::try_from(num(it.next(), "--copies")?.max(1))
                        .map_err(|e| e.to_string())?;
                    copies_set = true;
                }
                "--workers" => {
                    a.workers = u32::try_from(num(it.next(), "--workers")?.clamp(1, 64))
                        .map_err(|e| e.to_string())?;
                }
                "--capacity" => {
                    a.capacity = num(it.next(), "--capacity")?.max(1);
                    capacity_set = true;
                }
                "--threads" => {
                    a.threads = it
                        .next()
                        .ok_or("--threads needs a list")?
                        .split(',')
                        .map(|t| t.trim().parse::<usize>().map_err(|e| e.to_string()))
                        .collect::<Result<_, _>>()?;
                }
                "--index" => {
                    a.only = it
                        .next()
                        .ok_or("--index needs a list")?
                        .split(',')
                        .map(str::to_string)
                        .collect();
                }
                "--out" => a.out = Some(it.next().ok_or("--out needs a file")?.into()),
                "--quick" => a.quick = true,
                "--memory" => a.memory = true,
                "--saturated" => a.saturated = num(it.next(), "--saturated")?,
                "-h" | "--help" => return Err(USAGE.to_string()),
                other => return Err(format!("unknown argument {other}\n{USAGE}")),
            }
        }
        if a.quick {
            if !requests_set {
                a.requests = 1_500;
            }
            if !copies_set {
                a.copies = 2;
            }
            if !capacity_set {
                a.capacity = 1_024;
            }
        }
        Ok(a)
    }

    /// The rungs of the sustained-rate search.
    #[must_use]
    pub fn ladder(&self) -> Vec<f64> {
        if self.quick {
            vec![0.9, 0.5, 0.2]
        } else {
            vec![1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
        }
    }

    /// Loads the trace and runs the simulator.
    pub fn simulate(&self) -> Result<(crate::mooncake::Trace, Simulation), String> {
        let mut trace = crate::mooncake::Trace::load(&self.trace)?;
        if self.requests > 0 {
            trace = trace.truncated(self.requests);
        }
        let sim = Simulation::run(
            &trace,
            crate::mooncake::SimConfig {
                workers: self.workers,
                capacity: self.capacity,
                copies: self.copies,
                seed: 44,
            },
        );
        Ok((trace, sim))
    }

    /// The header of a report: command, trace, simulator.
    #[must_use]
    pub fn header(&self, trace: &crate::mooncake::Trace) -> String {
        format!(
            "- Command: `{}`\n- Trace: `{}` ({} requests used, working set {} blocks of {} tokens)\n- Simulator: {} workers × {} LRU blocks, {} disjoint copies, uniform worker choice (seed 44)\n",
            std::env::args().collect::<Vec<_>>().join(" "),
            self.trace.display(),
            trace.requests.len(),
            trace.working_set_blocks(),
            crate::mooncake::TRACE_BLOCK_TOKENS,
            self.workers,
            self.capacity,
            self.copies
        )
    }
}

/// Memory per held block: one closed-loop, one-thread replay in this (fresh) process, `VmRSS`
/// growth up to the start of the drain over the blocks held then. Meaningful only as the first
/// index a process builds (freed memory is reused by the next).
pub fn memory(sim: &Simulation, subject: &dyn Subject) -> Result<f64, String> {
    let stats = subject.run(sim, 1, Pace::ClosedLoop)?;
    Ok(stats.rss_growth as f64 / sim.held_before_drain.max(1) as f64)
}

/// `rounds` rounds of closed-loop replays of every subject at every thread count it supports
/// (interleaved, so load changes during the run hit every index alike): one line per replay,
/// then the median per (index, threads). Returns the medians' report.
pub fn saturated(
    sim: &Simulation,
    subjects: &[Box<dyn Subject>],
    threads: &[usize],
    rounds: usize,
) -> Result<String, String> {
    let mut rates: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); threads.len()]; subjects.len()];
    for round in 0..rounds {
        for (t_index, &t) in threads.iter().enumerate() {
            for (s_index, s) in subjects.iter().enumerate() {
                if !s.supports(t) {
                    continue;
                }
                let stats = s.run(sim, t, Pace::ClosedLoop)?;
                let rate = stats.rate() / 1e6;
                eprintln!("round {round} {} t{t}: {rate:.3} M blk/s", s.name());
                rates[s_index][t_index].push(rate);
            }
        }
    }
    let mut report = String::new();
    for (s_index, s) in subjects.iter().enumerate() {
        for (t_index, &t) in threads.iter().enumerate() {
            let r = &mut rates[s_index][t_index];
            if r.is_empty() {
                continue;
            }
            r.sort_by(f64::total_cmp);
            let _ = writeln!(
                report,
                "saturated {} t{t}: median {:.3} M blk/s (min {:.3}, max {:.3}, {} runs)",
                s.name(),
                r[r.len() / 2],
                r[0],
                r[r.len() - 1],
                r.len()
            );
        }
    }
    Ok(report)
}

/// The whole binary: `--saturated N` prints the closed-loop rates only ([`saturated`]);
/// `--memory` prints `memory <index> <bytes per held block>` for the first
/// subject; otherwise runs the plan, prints the report (and writes `--out`) and the ratio line
/// last (with `note` appended). Exit 1 when a check fails, 2 on bad input.
pub fn main_with(
    args: &Args,
    trace: &crate::mooncake::Trace,
    sim: &Simulation,
    subjects: &[Box<dyn Subject>],
    note: &str,
) -> std::process::ExitCode {
    use std::process::ExitCode;
    if args.memory {
        let Some(first) = subjects.first() else {
            eprintln!("no index selected");
            return ExitCode::from(2);
        };
        return match memory(sim, first.as_ref()) {
            Ok(bytes) => {
                println!("memory {} {bytes:.1}", first.name());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("MOONCAKE REPLAY CHECK FAILED: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.saturated > 0 {
        return match saturated(sim, subjects, &args.threads, args.saturated) {
            Ok(report) => {
                print!("{report}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("MOONCAKE REPLAY CHECK FAILED: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let plan = Plan {
        threads: args.threads.clone(),
        ladder: args.ladder(),
        ours: "inferencecache".into(),
        refine: if args.quick { 0 } else { 2 },
    };
    let header = args.header(trace);
    match run(sim, subjects, &plan) {
        Ok((report, line)) => {
            let text = format!("{header}\n{report}");
            println!("{text}");
            if let Some(out) = &args.out
                && let Err(e) = std::fs::write(out, &text)
            {
                eprintln!("cannot write {}: {e}", out.display());
                return ExitCode::from(2);
            }
            println!("{line}{note}");
            ExitCode::SUCCESS
        }
        Err(report) => {
            println!("{header}\n{report}");
            eprintln!("MOONCAKE REPLAY CHECK FAILED");
            ExitCode::FAILURE
        }
    }
}
