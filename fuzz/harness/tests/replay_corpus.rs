//! Replays every committed fuzz input (`fuzz/corpus/<target>/`, and `fuzz/artifacts/<target>/`
//! when crashes were kept as regressions) through the target bodies, plus the generated seeds,
//! so `cargo test` re-checks everything the fuzzers ever found without nightly or libFuzzer.

use inferencecache_fuzz_harness::{TARGETS, seeds};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Files directly under `dir`, sorted; none when the directory does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Stack of the replay threads. Corpus inputs include msgpack nested up to rmpv's depth limit;
/// decoding and dropping them recurses, and unoptimized frames are several times larger than
/// the release fuzzer's (which ran them on an 8 MiB main thread), so the default 2 MiB test
/// thread is not enough in a debug build.
const REPLAY_STACK: usize = 64 << 20;

fn replay(target: &'static str) {
    let worker = std::thread::Builder::new()
        .name(format!("replay-{target}"))
        .stack_size(REPLAY_STACK)
        .spawn(move || replay_on_this_thread(target))
        .expect("spawn a replay thread");
    if let Err(panic) = worker.join() {
        std::panic::resume_unwind(panic);
    }
}

fn replay_on_this_thread(target: &str) {
    let (_, run) = TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .expect("a known target");
    let corpus = inputs(&fuzz_dir().join("corpus").join(target));
    // The committed corpus is part of the test: an empty one means it went missing.
    assert!(
        !corpus.is_empty(),
        "no committed corpus for {target} under fuzz/corpus/{target}"
    );
    let artifacts = inputs(&fuzz_dir().join("artifacts").join(target));
    for path in corpus.iter().chain(&artifacts) {
        let data = std::fs::read(path).expect("a readable corpus file");
        // A panic names the target; the input is the last file printed.
        eprintln!("{target}: {}", path.display());
        run(&data);
    }
    let (_, generated) = seeds::all()
        .into_iter()
        .find(|(name, _)| *name == target)
        .expect("seeds for every target");
    for seed in &generated {
        run(seed);
    }
}

#[test]
fn lookup_route_corpus() {
    replay("lookup_route");
}

#[test]
fn cache_state_update_corpus() {
    replay("cache_state_update");
}

#[test]
fn cache_event_corpus() {
    replay("cache_event");
}

#[test]
fn engine_ops_corpus() {
    replay("engine_ops");
}

#[test]
fn policy_body_corpus() {
    replay("policy_body");
}

#[test]
fn probe_body_corpus() {
    replay("probe_body");
}

#[test]
fn sidecar_event_corpus() {
    replay("sidecar_event");
}

#[test]
fn checkpoint_file_corpus() {
    replay("checkpoint_file");
}

/// Every target has a test above and a cargo-fuzz target file.
#[test]
fn every_target_is_wired() {
    let this = include_str!("replay_corpus.rs");
    for (target, _) in TARGETS {
        assert!(this.contains(&format!("fn {target}_corpus()")), "{target}");
        let file = fuzz_dir().join("fuzz_targets").join(format!("{target}.rs"));
        assert!(file.is_file(), "missing {}", file.display());
    }
}
