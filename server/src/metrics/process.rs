//! Build and process metrics: `inferencecache_build_info` and the conventional `process_*`
//! family (resident and virtual memory, CPU seconds, open and maximum file descriptors,
//! threads, start time), as Prometheus client libraries name them.
//!
//! Read from `/proc/self` at scrape time, never on a request path. On a system without
//! `/proc` (or when a file cannot be read or parsed) the affected family is left out rather
//! than reported as 0: an absent sample is honest, a zero would be a false value.

use inferencecache_exposition::{Family, Sample};

/// Version and commit labels of `inferencecache_build_info` (value always 1).
pub fn build_info() -> Family {
    let labels = vec![
        ("version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        (
            "commit".to_string(),
            option_env!("INFERENCECACHE_COMMIT")
                .unwrap_or("unknown")
                .to_string(),
        ),
    ];
    family(
        "inferencecache_build_info",
        "gauge",
        "build of the running server (value 1)",
        labels,
        1.0,
    )
}

/// Every `process_*` family that could be read now.
pub fn process_families() -> Vec<Family> {
    let mut out = Vec::new();
    let status = std::fs::read_to_string("/proc/self/status").ok();
    let stat = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| ProcStat::parse(&s));
    let ticks = clock_ticks_per_second();
    if let (Some(stat), Some(ticks)) = (&stat, ticks) {
        out.push(family(
            "process_cpu_seconds_total",
            "counter",
            "user and system CPU time spent, in seconds",
            Vec::new(),
            (stat.user_ticks + stat.system_ticks) as f64 / ticks,
        ));
    }
    if let Some(kib) = status.as_deref().and_then(|s| status_field(s, "VmRSS:")) {
        out.push(family(
            "process_resident_memory_bytes",
            "gauge",
            "resident set size, in bytes",
            Vec::new(),
            (kib * 1024) as f64,
        ));
    }
    if let Some(kib) = status.as_deref().and_then(|s| status_field(s, "VmSize:")) {
        out.push(family(
            "process_virtual_memory_bytes",
            "gauge",
            "virtual memory size, in bytes",
            Vec::new(),
            (kib * 1024) as f64,
        ));
    }
    if let Some(threads) = status.as_deref().and_then(|s| status_field(s, "Threads:")) {
        out.push(family(
            "process_threads",
            "gauge",
            "OS threads of the process",
            Vec::new(),
            threads as f64,
        ));
    }
    if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
        // The directory handle being read is itself one open descriptor; it is not the
        // server's, so it is not counted.
        let open = entries.count().saturating_sub(1);
        out.push(family(
            "process_open_fds",
            "gauge",
            "open file descriptors",
            Vec::new(),
            open as f64,
        ));
    }
    if let Some(max) = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| max_open_files(&s))
    {
        out.push(family(
            "process_max_fds",
            "gauge",
            "soft limit of open file descriptors",
            Vec::new(),
            max as f64,
        ));
    }
    if let (Some(stat), Some(ticks), Some(boot)) = (&stat, ticks, boot_time_seconds()) {
        out.push(family(
            "process_start_time_seconds",
            "gauge",
            "start time of the process since the Unix epoch, in seconds",
            Vec::new(),
            boot as f64 + stat.start_ticks as f64 / ticks,
        ));
    }
    out
}

fn family(
    name: &str,
    kind: &'static str,
    help: &'static str,
    labels: Vec<(String, String)>,
    value: f64,
) -> Family {
    Family {
        name: name.to_string(),
        kind,
        help,
        samples: vec![Sample {
            name: name.to_string(),
            labels,
            value,
        }],
    }
}

/// The fields of `/proc/self/stat` used here (proc(5): utime 14, stime 15, starttime 22).
#[derive(Debug, PartialEq, Eq)]
struct ProcStat {
    user_ticks: u64,
    system_ticks: u64,
    start_ticks: u64,
}

impl ProcStat {
    fn parse(text: &str) -> Option<Self> {
        // Field 2 (the command name) is parenthesized and may contain spaces or ')': the
        // fields that follow start after the last ')'.
        let rest = &text[text.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // `rest` starts at field 3 (state), so field N is at index N - 3.
        let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
        Some(Self {
            user_ticks: field(14)?,
            system_ticks: field(15)?,
            start_ticks: field(22)?,
        })
    }
}

/// A numeric `/proc/self/status` field (`VmRSS:   1234 kB` → 1234).
fn status_field(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The soft "Max open files" limit of `/proc/self/limits` (`None` when unlimited).
fn max_open_files(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|line| line.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Boot time (`btime` of `/proc/stat`), seconds since the Unix epoch.
fn boot_time_seconds() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// `sysconf(_SC_CLK_TCK)`: the unit of the tick counts in `/proc/self/stat`.
fn clock_ticks_per_second() -> Option<f64> {
    // SAFETY: sysconf only reads a configuration value; it takes no pointer and has no
    // precondition.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then_some(ticks as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_the_command_name() {
        // A command name with spaces and a ')' must not shift the fields.
        let line = "4242 (odd) name) S 1 2 3 4 5 6 7 8 9 10 111 222 13 14 15 16 17 18 9999 20 21";
        assert_eq!(
            ProcStat::parse(line),
            Some(ProcStat {
                user_ticks: 111,
                system_ticks: 222,
                start_ticks: 9999,
            })
        );
        assert_eq!(ProcStat::parse("4242 (x) S 1 2"), None);
    }

    #[test]
    fn status_and_limits_fields() {
        let status = "Name:\tx\nVmSize:\t  2048 kB\nVmRSS:\t   512 kB\nThreads:\t7\n";
        assert_eq!(status_field(status, "VmRSS:"), Some(512));
        assert_eq!(status_field(status, "Threads:"), Some(7));
        assert_eq!(status_field(status, "VmSwap:"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(max_open_files(limits), Some(1024));
        assert_eq!(
            max_open_files("Max open files  unlimited  unlimited  files\n"),
            None
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_reports_every_family() {
        let names: Vec<String> = process_families().into_iter().map(|f| f.name).collect();
        for want in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_threads",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
        }
        let threads = process_families()
            .into_iter()
            .find(|f| f.name == "process_threads")
            .map(|f| f.samples[0].value);
        assert!(threads.is_some_and(|t| t >= 1.0));
    }
}
