//! Command line and settings (spec `server.md` §2–§3).
//!
//! Flags keep the reference server's names. Besides `--name value` and `--name=value`, the
//! single-dash forms `-name value` / `-name=value` used by manifests written for the reference
//! are accepted: [`normalize_args`] rewrites them before parsing.

use anyhow::{Context, bail};
use clap::Parser;
use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// Command-line flags. Defaults are embedded: no flag is required.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "inferencecache-server",
    version,
    about = "Cache-aware routing index for LLM serving fleets"
)]
pub struct Cli {
    /// TOML configuration file (policy, quotas, index settings).
    #[arg(long)]
    pub config: Option<String>,
    /// gRPC listener address.
    #[arg(long, default_value = ":9090")]
    pub grpc_bind_address: String,
    /// Public HTTP listener: /healthz, /readyz, /metrics.
    #[arg(long, default_value = ":8080")]
    pub http_bind_address: String,
    /// Control-plane HTTP listener: /snapshot, /policy, /probe.
    #[arg(long, default_value = ":8081")]
    pub snapshot_bind_address: String,
    /// Tokens per KV block when fingerprinting token_ids / prompt_text (≤ 0 keeps 16).
    #[arg(long, default_value_t = 16, allow_hyphen_values = true)]
    pub engine_block_size: i64,
    /// PEM certificate chain for gRPC TLS.
    #[arg(long)]
    pub tls_cert_file: Option<String>,
    /// PEM private key for gRPC TLS.
    #[arg(long)]
    pub tls_key_file: Option<String>,
    /// PEM CA bundle; when set, gRPC requires and verifies client certificates.
    #[arg(long)]
    pub tls_client_ca_file: Option<String>,
    /// Tokenizer tree for prompt_text lookups.
    #[arg(long)]
    pub tokenizer_models_dir: Option<String>,
    /// Log format: json or text.
    #[arg(long, default_value = "json")]
    pub log_format: String,
    /// Log level: debug, info, warn, error.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Serve the control-plane routes without auth on any address (development only).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub insecure_disable_auth: bool,
    /// Bearer tokens accepted on /snapshot and /probe.
    #[arg(long)]
    pub controller_token_file: Option<String>,
    /// Bearer tokens accepted on /policy.
    #[arg(long)]
    pub policy_token_file: Option<String>,
    /// Bearer tokens required on ReportCacheState and PublishEvent.
    #[arg(long)]
    pub producer_token_file: Option<String>,
    /// Global cap in storage entries (≤ 0 = unbounded).
    #[arg(long, default_value_t = 1_000_000, allow_hyphen_values = true)]
    pub max_entries: i64,
    /// Global TTL of index entries (≤ 0 → 30m).
    #[arg(long, default_value = "30m", allow_hyphen_values = true)]
    pub ttl: String,
    /// TTL sweep period (≤ 0 → 60s).
    #[arg(long, default_value = "60s", allow_hyphen_values = true)]
    pub sweep_interval: String,
}

/// Rewrites single-dash long flags (`-grpc-bind-address`) into double-dash form. Short flags
/// (`-h`, `-V`) and values are left alone.
pub fn normalize_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut expect_value = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || expect_value {
            expect_value = false;
            out.push(arg);
            continue;
        }
        match arg.to_str() {
            Some(s) if s.starts_with('-') && !s.starts_with("--") && s.len() > 2 => {
                let name = s[1..].split('=').next().unwrap_or("");
                if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') && name.len() > 1 {
                    expect_value = !s.contains('=') && takes_value(name);
                    out.push(OsString::from(format!("-{s}")));
                } else {
                    out.push(arg);
                }
            }
            Some(s) if s.starts_with("--") => {
                let name = s[2..].split('=').next().unwrap_or("");
                expect_value = !s.contains('=') && takes_value(name);
                out.push(arg);
            }
            _ => out.push(arg),
        }
    }
    out
}

fn takes_value(flag: &str) -> bool {
    !matches!(flag, "insecure-disable-auth" | "help" | "version")
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Text,
}

/// Validated settings derived from the command line.
#[derive(Debug, Clone)]
pub struct Settings {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub snapshot_addr: SocketAddr,
    pub block_size: usize,
    pub log_format: LogFormat,
    pub log_level: tracing::Level,
    pub max_entries: i64,
    pub ttl: Duration,
    pub sweep_interval: Duration,
}

impl Settings {
    /// Validates the flags (exit code 2 on any error, decided by the caller).
    pub fn from_cli(cli: &Cli) -> anyhow::Result<Self> {
        for (flag, set) in [
            ("--config", cli.config.is_some()),
            ("--tls-cert-file", cli.tls_cert_file.is_some()),
            ("--tls-key-file", cli.tls_key_file.is_some()),
            ("--tls-client-ca-file", cli.tls_client_ca_file.is_some()),
            ("--tokenizer-models-dir", cli.tokenizer_models_dir.is_some()),
            (
                "--controller-token-file",
                cli.controller_token_file.is_some(),
            ),
            ("--policy-token-file", cli.policy_token_file.is_some()),
            ("--producer-token-file", cli.producer_token_file.is_some()),
        ] {
            if set {
                bail!("{flag} is not supported by this build yet");
            }
        }
        let log_format = parse_log_format(&cli.log_format)?;
        let log_level = parse_log_level(&cli.log_level)?;
        let ttl = parse_duration(&cli.ttl).context("invalid --ttl")?;
        let sweep_interval =
            parse_duration(&cli.sweep_interval).context("invalid --sweep-interval")?;
        Ok(Self {
            grpc_addr: parse_bind(&cli.grpc_bind_address, false)
                .context("invalid --grpc-bind-address")?,
            http_addr: parse_bind(&cli.http_bind_address, false)
                .context("invalid --http-bind-address")?,
            // D2: with no control-plane token, an empty host binds loopback only.
            snapshot_addr: parse_bind(&cli.snapshot_bind_address, !cli.insecure_disable_auth)
                .context("invalid --snapshot-bind-address")?,
            block_size: if cli.engine_block_size > 0 {
                cli.engine_block_size as usize
            } else {
                16
            },
            log_format,
            log_level,
            max_entries: cli.max_entries,
            ttl: positive_or(ttl, Duration::from_secs(30 * 60)),
            sweep_interval: positive_or(sweep_interval, Duration::from_secs(60)),
        })
    }
}

fn positive_or(d: Option<Duration>, default: Duration) -> Duration {
    match d {
        Some(d) if !d.is_zero() => d,
        _ => default,
    }
}

/// Parses `host:port`; an empty host (`:9090`) means every interface, or loopback when
/// `empty_host_is_loopback`.
pub fn parse_bind(addr: &str, empty_host_is_loopback: bool) -> anyhow::Result<SocketAddr> {
    let (host, port) = addr
        .rsplit_once(':')
        .with_context(|| format!("{addr:?} has no port"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("{addr:?} has an invalid port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = if host.is_empty() {
        if empty_host_is_loopback {
            Ipv4Addr::LOCALHOST.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        }
    } else if host == "localhost" {
        Ipv4Addr::LOCALHOST.into()
    } else {
        host.parse()
            .with_context(|| format!("{addr:?} has an invalid host"))?
    };
    Ok(SocketAddr::new(ip, port))
}

/// Parses a Go-style duration (`500ms`, `90s`, `1h30m`; units ns, us, µs, ms, s, m, h). A
/// leading `-` gives `None` (a non-positive duration); `0` alone is accepted.
pub fn parse_duration(s: &str) -> anyhow::Result<Option<Duration>> {
    let s = s.trim();
    if s == "0" {
        return Ok(None);
    }
    let (negative, mut rest) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if rest.is_empty() {
        bail!("empty duration");
    }
    let mut total_ns: u128 = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            bail!("invalid duration {s:?}");
        }
        let value: f64 = rest[..digits]
            .parse()
            .with_context(|| format!("invalid duration {s:?}"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit_ns: f64 = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            "" => bail!("missing unit in duration {s:?}"),
            other => bail!("unknown unit {other:?} in duration {s:?}"),
        };
        rest = &rest[unit_len..];
        total_ns = total_ns.saturating_add((value * unit_ns) as u128);
    }
    if negative || total_ns == 0 {
        return Ok(None);
    }
    Ok(Some(Duration::from_nanos(
        u64::try_from(total_ns).unwrap_or(u64::MAX),
    )))
}

fn parse_log_format(s: &str) -> anyhow::Result<LogFormat> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "json" => Ok(LogFormat::Json),
        "text" => Ok(LogFormat::Text),
        other => bail!("invalid --log-format {other:?}: expected json or text"),
    }
}

fn parse_log_level(s: &str) -> anyhow::Result<tracing::Level> {
    match s.trim().to_ascii_lowercase().as_str() {
        "debug" => Ok(tracing::Level::DEBUG),
        "" | "info" => Ok(tracing::Level::INFO),
        "warn" | "warning" => Ok(tracing::Level::WARN),
        "error" => Ok(tracing::Level::ERROR),
        other => bail!("invalid --log-level {other:?}: expected debug, info, warn or error"),
    }
}

/// Installs the global log subscriber on stderr.
pub fn init_logging(settings: &Settings) -> anyhow::Result<()> {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(settings.log_level)
        .with_target(false);
    let result = match settings.log_format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
    result.map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_follow_go_syntax() {
        assert_eq!(
            parse_duration("30m").unwrap(),
            Some(Duration::from_secs(1800))
        );
        assert_eq!(
            parse_duration("1h30m").unwrap(),
            Some(Duration::from_secs(5400))
        );
        assert_eq!(
            parse_duration("500ms").unwrap(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(
            parse_duration("1.5s").unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(parse_duration("-5s").unwrap(), None);
        assert_eq!(parse_duration("0").unwrap(), None);
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(
            parse_bind(":9090", false).unwrap().to_string(),
            "0.0.0.0:9090"
        );
        assert_eq!(
            parse_bind(":8081", true).unwrap().to_string(),
            "127.0.0.1:8081"
        );
        assert_eq!(
            parse_bind("[::1]:80", false).unwrap().to_string(),
            "[::1]:80"
        );
        assert!(parse_bind("nope", false).is_err());
    }

    #[test]
    fn single_dash_flags_are_accepted() {
        let args = normalize_args(
            [
                "bin",
                "-grpc-bind-address",
                ":1",
                "-log-level=debug",
                "-insecure-disable-auth",
                "--ttl",
                "-1s",
            ]
            .map(OsString::from),
        );
        let cli = Cli::try_parse_from(args).unwrap();
        assert_eq!(cli.grpc_bind_address, ":1");
        assert_eq!(cli.log_level, "debug");
        assert!(cli.insecure_disable_auth);
        assert_eq!(cli.ttl, "-1s");
    }

    #[test]
    fn bad_log_settings_are_rejected() {
        let cli = Cli::try_parse_from(["bin", "--log-format", "yaml"]).unwrap();
        assert!(Settings::from_cli(&cli).is_err());
        let cli = Cli::try_parse_from(["bin", "--log-level", "trace"]).unwrap();
        assert!(Settings::from_cli(&cli).is_err());
        let cli = Cli::try_parse_from(["bin", "--log-format", " Text ", "--log-level", "warning"])
            .unwrap();
        assert!(Settings::from_cli(&cli).is_ok());
    }
}
