//! F03 (`fingerprint.md` §4): independent cross-check of the fingerprint against
//! `engine/testdata/crosscheck.py`, a separate Python implementation built directly on
//! `xxhash.xxh3_64`.
//!
//! The test generates deterministic pseudo-random token sequences (lengths 0–300, ids over the
//! full `u32` range, block sizes 1, 2, 16, 32 and 128, with and without a random parent), writes
//! them to a temporary JSON file, runs `python3 engine/testdata/crosscheck.py <file>` and requires
//! identical content hashes, prefix hashes and wire forms.
//!
//! Needs Python 3 with the `xxhash` package (`pip install -r engine/testdata/requirements.txt`).
//! When either is missing the test fails if the `CI` environment variable is set (to anything but
//! empty, `0` or `false`) and is skipped with a notice otherwise. The interpreter can be
//! overridden with `FINGERPRINT_PYTHON` (default `python3`).

use std::path::PathBuf;
use std::process::Command;

use inferencecache_engine::fingerprint::{
    chain, content_hash, for_each_prefix, prefix_hashes_from, to_wire,
};
use serde_json::{Value, json};

const CASES: usize = 1_500;
const BLOCK_SIZES: [usize; 5] = [1, 2, 16, 32, 128];
const MAX_LEN: u64 = 300;

/// SplitMix64: small, deterministic, good enough to spread ids over the whole `u32` range.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max` (the modulo bias is irrelevant here).
    fn below_eq(&mut self, max: u64) -> u64 {
        self.next() % (max + 1)
    }

    fn token(&mut self) -> u32 {
        // Mostly uniform over all of u32 (so most ids are above 2^16), plus realistic small
        // vocabulary ids and the edges.
        match self.below_eq(9) {
            0..=5 => self.next() as u32,
            6 | 7 => self.below_eq(200_000) as u32,
            8 => [0, 1, 0xFFFF, 0x1_0000, 0x7FFF_FFFF, 0x8000_0000, u32::MAX]
                [self.below_eq(6) as usize],
            _ => u32::MAX - self.below_eq(1_000) as u32,
        }
    }

    fn parent(&mut self) -> Option<u64> {
        match self.below_eq(9) {
            0..=4 => None,
            5 => Some([0, 1, u64::MAX, 0xDEAD_BEEF][self.below_eq(3) as usize]),
            _ => Some(self.next()),
        }
    }
}

struct Case {
    tokens: Vec<u32>,
    bs: usize,
    parent: Option<u64>,
}

fn generate() -> Vec<Case> {
    let mut rng = SplitMix64(0x1337_F1A6_E2C4_0003);
    (0..CASES)
        .map(|i| {
            let bs = BLOCK_SIZES[i % BLOCK_SIZES.len()];
            // Every 10th case uses a length that is an exact multiple of the block size.
            let len = if i % 10 == 0 {
                (rng.below_eq(MAX_LEN) as usize / bs) * bs
            } else {
                rng.below_eq(MAX_LEN) as usize
            };
            let tokens = (0..len).map(|_| rng.token()).collect();
            Case {
                tokens,
                bs,
                parent: rng.parent(),
            }
        })
        .collect()
}

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false" | "FALSE" | "False"))
}

/// Fails under CI, otherwise prints a notice; the caller then returns (skips).
fn unavailable(why: &str) {
    let msg = format!(
        "fingerprint cross-check needs Python 3 with the `xxhash` package: {why}. \
         Install it with `pip install -r engine/testdata/requirements.txt`."
    );
    assert!(!ci(), "{msg} (CI is set, so this is a failure)");
    eprintln!("NOTICE: skipping the fingerprint cross-check. {msg}");
}

fn python() -> String {
    std::env::var("FINGERPRINT_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Removes the temporary input file on every exit path.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn strings(v: &Value, what: &str) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what}: not an array"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("{what}: not a string"))
                .to_owned()
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn f03_rust_matches_independent_python_implementation() {
    let py = python();
    match Command::new(&py).args(["-c", "import xxhash"]).output() {
        Err(e) => return unavailable(&format!("cannot run `{py}`: {e}")),
        Ok(out) if !out.status.success() => {
            return unavailable(&format!(
                "`{py} -c 'import xxhash'` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(_) => {}
    }

    let cases = generate();
    let input = json!({
        "cases": cases.iter().map(|c| json!({
            "tokens": c.tokens,
            "block_size": c.bs,
            "parent": c.parent.map(|p| p.to_string()),
        })).collect::<Vec<_>>(),
    });
    let file = TempFile(std::env::temp_dir().join(format!(
        "inferencecache_fp_crosscheck_{}_{:?}.json",
        std::process::id(),
        std::thread::current().id()
    )));
    std::fs::write(&file.0, serde_json::to_vec(&input).unwrap()).expect("write the cases file");

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/crosscheck.py");
    let out = Command::new(&py)
        .arg(script)
        .arg(&file.0)
        .output()
        .unwrap_or_else(|e| panic!("running `{py} {script}`: {e}"));
    assert!(
        out.status.success(),
        "crosscheck.py failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let output: Value = serde_json::from_slice(&out.stdout).expect("crosscheck.py prints JSON");
    let results = output["results"].as_array().expect("`results` array");
    assert_eq!(results.len(), cases.len(), "one result per case");

    let (mut blocks, mut with_parent, mut empty, mut big_ids) = (0usize, 0usize, 0usize, 0usize);
    for (i, (case, res)) in cases.iter().zip(results).enumerate() {
        let what = format!(
            "case {i} (len {}, bs {}, parent {:?})",
            case.tokens.len(),
            case.bs,
            case.parent
        );

        let content: Vec<String> = case
            .tokens
            .chunks_exact(case.bs)
            .map(|b| content_hash(b).to_string())
            .collect();
        assert_eq!(
            content,
            strings(&res["content"], &what),
            "{what}: content hashes"
        );

        let prefix = prefix_hashes_from(&case.tokens, case.bs, case.parent);
        let prefix_dec: Vec<String> = prefix.iter().map(u64::to_string).collect();
        assert_eq!(
            prefix_dec,
            strings(&res["prefix"], &what),
            "{what}: prefix hashes"
        );

        let wire_hex: Vec<String> = prefix.iter().map(|&h| hex(&to_wire(h))).collect();
        assert_eq!(
            wire_hex,
            strings(&res["wire_hex"], &what),
            "{what}: wire form"
        );

        let mut streamed = Vec::with_capacity(prefix.len());
        for_each_prefix(&case.tokens, case.bs, case.parent, |h| streamed.push(h));
        assert_eq!(streamed, prefix, "{what}: for_each_prefix");

        if case.parent.is_none() {
            let (wire, counts) = chain(&case.tokens, case.bs);
            let chain_hex: Vec<String> = wire.iter().map(|w| hex(w)).collect();
            assert_eq!(chain_hex, wire_hex, "{what}: chain wire form");
            assert_eq!(
                counts,
                vec![i32::try_from(case.bs).unwrap(); prefix.len()],
                "{what}: counts"
            );
        } else {
            with_parent += 1;
        }
        blocks += prefix.len();
        empty += usize::from(prefix.is_empty());
        big_ids += case.tokens.iter().filter(|&&t| t > 0xFFFF).count();
    }

    // The sample really exercises what the anchors do not.
    assert!(cases.len() >= 1_000);
    assert!(
        with_parent >= 100 && cases.len() - with_parent >= 100,
        "parent mix: {with_parent}"
    );
    assert!(empty >= 10, "empty results: {empty}");
    assert!(big_ids >= 10_000, "ids above 2^16: {big_ids}");
    assert!(
        cases.iter().any(|c| c.bs == 1 && c.tokens.len() >= 250),
        "long chains"
    );
    eprintln!(
        "fingerprint cross-check: {} cases, {blocks} blocks, {with_parent} with a parent, \
         {empty} empty: identical",
        cases.len()
    );
}
