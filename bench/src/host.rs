//! Notes on the machine a bench ran on, for the reports: CPU model, load averages, the date.
//! Shared by the end-to-end benches (`e2e-lookup`, `soak`) so their report headers agree.

/// The global allocator of this build's bench binaries: `mimalloc` with the `mimalloc` feature
/// (each binary that honours it declares the `#[global_allocator]`), else the system's.
pub const ALLOCATOR: &str = if cfg!(feature = "mimalloc") {
    "mimalloc"
} else {
    "system"
};

/// The 1/5/15-minute load averages from `/proc/loadavg` ("?" where unavailable).
#[must_use]
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// "`<model name>`, `<n>` CPUs" from `/proc/cpuinfo` and the available parallelism.
#[must_use]
pub fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "?".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cpus} CPUs")
}

/// The current UTC time to the minute, from `date -u` ("?" if it cannot run).
#[must_use]
pub fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "?".into())
}
