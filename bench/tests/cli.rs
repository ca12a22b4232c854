//! The bench binaries behave like tools: `--help` exits 0 and names every flag, a bad flag or
//! value exits 2 with an error pointing to `--help`, and a small eviction run prints its tables
//! (no bar without a terminal, so stdout holds only the report).

use std::process::Command;

const BINARIES: [(&str, &str, &[&str]); 5] = [
    (
        "churn",
        env!("CARGO_BIN_EXE_churn"),
        &[
            "--minutes",
            "--cap",
            "--caps",
            "--warmup-s",
            "--ttl-ms",
            "--clear-every",
            "--quiet",
        ],
    ),
    (
        "w1m",
        env!("CARGO_BIN_EXE_w1m"),
        &[
            "--chains",
            "--queries",
            "--json",
            "--smoke",
            "--report",
            "--quiet",
        ],
    ),
    (
        "eviction",
        env!("CARGO_BIN_EXE_eviction"),
        &["--n", "--seed", "--repeat", "--alg", "--no-t94", "--quiet"],
    ),
    (
        "rw",
        env!("CARGO_BIN_EXE_rw"),
        &["--seconds", "--rate", "--chains", "--quiet"],
    ),
    (
        "layout-probe",
        env!("CARGO_BIN_EXE_layout-probe"),
        &[
            "--chains",
            "--queries",
            "--no-hints",
            "--no-roots",
            "--no-gone",
            "--no-join",
            "--key-bytes",
            "--json",
        ],
    ),
];

#[test]
fn help_exits_0_and_lists_every_flag() {
    for (name, path, flags) in BINARIES {
        let out = Command::new(path).arg("--help").output().expect(name);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{name} --help: {text}");
        assert!(text.contains(&format!("Usage: {name}")), "{text}");
        for flag in flags {
            assert!(text.contains(flag), "{name} --help lacks {flag}:\n{text}");
        }
    }
}

#[test]
fn bad_flags_and_values_exit_2() {
    for (name, path, args) in [
        ("churn", BINARIES[0].1, &["--bogus"][..]),
        ("churn", BINARIES[0].1, &["--caps", "5"][..]),
        ("churn", BINARIES[0].1, &["--minutes", "0"][..]),
        ("w1m", BINARIES[1].1, &["--chains", "3"][..]),
        ("eviction", BINARIES[2].1, &["--n", "10"][..]),
        ("eviction", BINARIES[2].1, &["--alg", "fifo"][..]),
        ("rw", BINARIES[3].1, &["--chains", "8"][..]),
        ("layout-probe", BINARIES[4].1, &["--chains", "3"][..]),
        ("layout-probe", BINARIES[4].1, &["--queries", "0"][..]),
        ("layout-probe", BINARIES[4].1, &["--key-bytes", "7"][..]),
        ("layout-probe", BINARIES[4].1, &["--key-bytes", "65"][..]),
    ] {
        let out = Command::new(path).args(args).output().expect(name);
        assert_eq!(out.status.code(), Some(2), "{name} {args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: ") && stderr.contains("--help"),
            "{name} {args:?}: {stderr}"
        );
    }
}

#[test]
fn a_small_eviction_run_prints_its_table() {
    let out = Command::new(BINARIES[2].1)
        .args(["--n", "20000", "--repeat", "1", "--alg", "lru", "--no-t94"])
        .output()
        .expect("eviction");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("| 20000 | LRU (T86) |")),
        "{text}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains('['),
        "no bar without a terminal"
    );
}

/// The design probe's lookups give W1M's expected answers (it exits 1 when a round's sums
/// differ), with and without its lookup aids, with keys of other lengths than 8 (kept as
/// bytes and compared), and its removals leave nothing behind.
#[test]
fn a_small_layout_probe_run_checks_its_answers() {
    for flags in [
        &[][..],
        &["--no-hints", "--no-roots"][..],
        &["--no-gone", "--no-join"][..],
        &["--key-bytes", "32"][..],
        &["--key-bytes", "13"][..],
    ] {
        let out = Command::new(BINARIES[4].1)
            .args(["--chains", "64", "--queries", "300", "--json"])
            .args(flags)
            .output()
            .expect("layout-probe");
        let text = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{flags:?}: {stderr}");
        for metric in [
            "insert_mblk_s",
            "remove_mblk_s",
            "q50_mean",
            "q100_mean",
            "q0_mean",
        ] {
            assert!(
                text.contains(&format!("\"metric\":\"{metric}\"")),
                "{flags:?} lacks {metric}: {text}"
            );
        }
    }
}
