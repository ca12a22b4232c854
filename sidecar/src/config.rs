//! Command line of `inferencecache-sidecar` (spec `sidecar.md` §2): the reference
//! `kvevent-subscriber` flags plus optional credentials.

use crate::client::TlsFiles;
use crate::lora::AdapterMap;
use crate::metrics::{CacheTierSel, Profile};
use clap::Parser;
use inferencecache_cli_flags::parse_duration;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// Sidecar flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "inferencecache-sidecar",
    version,
    about = "Engine KV events and metrics into the InferenceCache index"
)]
pub struct Cli {
    /// Engine ZMQ PUB endpoint; the SUB socket connects to it.
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub engine_endpoint: String,
    /// Subscription prefix ("" = everything; vLLM's and SGLang's default topic is "").
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Engine replay ROUTER endpoint (the engines' `replay_endpoint`); fills sequence gaps and
    /// rebuilds the index after a (re)connect. Empty = none.
    #[arg(long, default_value = "")]
    pub engine_replay_endpoint: String,
    /// Tokens per index block: the server's --engine-block-size. Engine pages of another size
    /// are re-chunked.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Attention chunk size in tokens of a vLLM chunked-local-attention group (Llama 4: 8192);
    /// vLLM does not publish it. 0 = unknown: such groups are held to the full-attention rule.
    #[arg(long, default_value_t = 0)]
    pub attention_chunk_size: u64,
    /// Address of the sidecar's own /healthz and /metrics listener ("" = off).
    #[arg(long, default_value = "127.0.0.1:9091")]
    pub metrics_bind_address: String,
    /// Log level: debug, info, warn, error.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Log format: json or text.
    #[arg(long, default_value = "json")]
    pub log_format: String,
    /// Server gRPC address(es): repeat the flag or give a comma list to fail over between
    /// several servers (a replicated pair); a host name resolving to several addresses fails
    /// over between them.
    #[arg(long, default_value = "127.0.0.1:9090", action = clap::ArgAction::Append, value_delimiter = ',')]
    pub server: Vec<String>,
    /// Bound of the outbox (index entries held in order while the server is unreachable);
    /// beyond it the outbox is dropped and the replica reconciled once the server answers.
    #[arg(long, default_value_t = crate::link::DEFAULT_OUTBOX_MAX_ENTRIES)]
    pub outbox_max_entries: usize,
    /// Longest delay between two attempts to reach an unreachable server (backoff cap).
    #[arg(long, default_value = "2s")]
    pub retry_max_delay: String,
    /// Period of the anti-entropy comparison of this replica's digest with the server's
    /// ("0" = off).
    #[arg(long, default_value = "30s")]
    pub anti_entropy_interval: String,
    /// Period of the server-instance probe while the engine is idle ("0" = off).
    #[arg(long, default_value = "5s")]
    pub server_probe_interval: String,
    /// Replica identity (typically the pod name).
    #[arg(long)]
    pub replica_id: String,
    /// Index model key.
    #[arg(long)]
    pub model_id: String,
    /// Tenant (typically the pod namespace).
    #[arg(long, default_value = "")]
    pub tenant_id: String,
    /// Hash scheme; also selects the metrics profile (sglang → SGLang, else vLLM).
    #[arg(long, default_value = "vllm")]
    pub hash_scheme: String,
    /// Add-batching flush window (≤ 0 → 100ms).
    #[arg(long, default_value = "100ms", allow_hyphen_values = true)]
    pub window: String,
    /// Engine Prometheus endpoint.
    #[arg(long, default_value = "http://127.0.0.1:8000/metrics")]
    pub engine_metrics_url: String,
    /// `ip:port` of the engine's OpenAI-compatible API, reported with the stats for the
    /// server's endpoint picker (docs/epp.md); empty → the host:port of --engine-metrics-url.
    #[arg(long, default_value = "")]
    pub engine_api_address: String,
    /// PEM CA bundle trusted (besides the system's) for an https --engine-metrics-url.
    #[arg(long)]
    pub engine_metrics_ca_file: Option<PathBuf>,
    /// Stats period (≤ 0 → 10s).
    #[arg(long, default_value = "10s", allow_hyphen_values = true)]
    pub stats_interval: String,
    /// KV capacity in bytes; cache_memory_bytes = capacity × usage (0 → always 0).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub engine_cache_size_bytes: i64,
    /// Pressure denominator (≤ 0 → pressure 0).
    #[arg(long, default_value_t = 256, allow_hyphen_values = true)]
    pub max_concurrency_ceiling: i64,
    /// Usage gauge: auto, kv, gpu, cpu.
    #[arg(long, default_value = "auto")]
    pub cache_tier: String,
    /// Keep only series whose model_name label equals this.
    #[arg(long, default_value = "")]
    pub engine_model_name: String,
    /// The engine has an L2 offload tier: removals are re-reported as T2.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub ignore_block_removed: bool,
    /// `id=name,…` map from engine LoRA ids to adapter identities.
    #[arg(long, default_value = "")]
    pub lora_adapter_names: String,
    /// File whose first non-empty, non-# line is sent as `authorization: Bearer <token>`.
    #[arg(long, alias = "producer-token-file")]
    pub server_token_file: Option<PathBuf>,
    /// PEM CA bundle: use TLS and verify the server.
    #[arg(long)]
    pub server_tls_ca_file: Option<PathBuf>,
    /// Client certificate (mTLS); needs --server-tls-key-file.
    #[arg(long)]
    pub server_tls_cert_file: Option<PathBuf>,
    /// Client key (mTLS); needs --server-tls-cert-file.
    #[arg(long)]
    pub server_tls_key_file: Option<PathBuf>,
}

const BOOL_FLAGS: &[&str] = &["ignore-block-removed", "omit-token-ids", "help", "version"];

/// Rewrites single-dash long flags (`-replica-id x`) into double-dash form, as the reference's
/// Go flag syntax allows. Short flags (`-h`, `-V`) and values are left alone (the rule shared
/// with the server: [`inferencecache_cli_flags::normalize_args`]).
pub fn normalize_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    inferencecache_cli_flags::normalize_args(args, BOOL_FLAGS)
}

/// A duration flag where ≤ 0 means the default.
pub fn duration_or_default(s: &str, default: Duration) -> Result<Duration, String> {
    let parsed = parse_duration(s).map_err(|e| e.to_string())?;
    Ok(parsed.positive().unwrap_or(default))
}

/// A duration flag where `0` means off; negative is an error.
pub fn duration_or_off(s: &str) -> Result<Duration, String> {
    let parsed = parse_duration(s).map_err(|e| e.to_string())?;
    if parsed.negative && !parsed.magnitude.is_zero() {
        return Err(format!("negative duration {s:?}"));
    }
    Ok(parsed.magnitude)
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub engine_endpoint: String,
    pub topic: String,
    pub replay_endpoint: Option<String>,
    pub block_size: usize,
    pub attention_chunk_size: u64,
    pub metrics_bind_address: Option<String>,
    pub log_level: tracing::Level,
    pub log_format: crate::logging::LogFormat,
    /// Every `--server` entry, in order (for the logs: [`Settings::server`] joins them).
    pub servers: Vec<String>,
    pub server: String,
    pub outbox_max_entries: usize,
    pub retry_max_delay: Duration,
    pub anti_entropy_interval: Duration,
    pub probe_interval: Duration,
    pub replica_id: String,
    pub model_id: String,
    pub tenant_id: String,
    pub hash_scheme: String,
    pub window: Duration,
    pub engine_metrics_url: String,
    pub engine_metrics_ca_file: Option<PathBuf>,
    /// The engine's API address reported in `ReplicaStats.endpoint` (empty: not reported).
    pub engine_api_address: String,
    pub stats_interval: Duration,
    pub capacity_bytes: i64,
    pub ceiling: i64,
    pub cache_tier: CacheTierSel,
    pub profile: Profile,
    pub engine_model_name: String,
    pub l2_mode: bool,
    pub adapters: AdapterMap,
    pub token_file: Option<PathBuf>,
    pub tls: TlsFiles,
}

impl Settings {
    /// Validates the flags (the caller exits 2 on error).
    pub fn from_cli(cli: Cli) -> Result<Self, String> {
        if cli.replica_id.is_empty() {
            return Err("--replica-id is required".into());
        }
        if cli.model_id.is_empty() {
            return Err("--model-id is required".into());
        }
        if cli.hash_scheme.is_empty() {
            return Err("--hash-scheme must not be empty".into());
        }
        let window = duration_or_default(&cli.window, crate::reporter::DEFAULT_WINDOW)
            .map_err(|e| format!("--window: {e}"))?;
        let stats_interval = duration_or_default(&cli.stats_interval, Duration::from_secs(10))
            .map_err(|e| format!("--stats-interval: {e}"))?;
        let cache_tier =
            CacheTierSel::parse(&cli.cache_tier).map_err(|e| format!("--cache-tier: {e}"))?;
        let adapters = AdapterMap::parse(&cli.lora_adapter_names)
            .map_err(|e| format!("--lora-adapter-names: {e}"))?;
        if cli.block_size == 0 || cli.block_size > i32::MAX as usize {
            return Err("--block-size must be between 1 and 2^31-1".into());
        }
        let servers: Vec<String> = cli
            .server
            .iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if servers.is_empty() {
            return Err("--server must name at least one server".into());
        }
        let retry_max_delay =
            duration_or_default(&cli.retry_max_delay, crate::link::DEFAULT_RETRY_MAX)
                .map_err(|e| format!("--retry-max-delay: {e}"))?;
        let anti_entropy_interval = duration_or_off(&cli.anti_entropy_interval)
            .map_err(|e| format!("--anti-entropy-interval: {e}"))?;
        let probe_interval = duration_or_off(&cli.server_probe_interval)
            .map_err(|e| format!("--server-probe-interval: {e}"))?;
        let log_level = crate::logging::parse_level(&cli.log_level)?;
        let log_format = crate::logging::parse_format(&cli.log_format)?;
        let non_empty = |s: String| {
            let t = s.trim().to_string();
            (!t.is_empty()).then_some(t)
        };
        if cli.server_tls_cert_file.is_some() != cli.server_tls_key_file.is_some() {
            return Err(
                "--server-tls-cert-file and --server-tls-key-file must be given together".into(),
            );
        }
        let engine_api_address = match cli.engine_api_address.trim() {
            "" => url_host_port(&cli.engine_metrics_url).unwrap_or_default(),
            given => given.to_owned(),
        };
        Ok(Self {
            engine_api_address,
            engine_endpoint: cli.engine_endpoint,
            topic: cli.topic,
            replay_endpoint: non_empty(cli.engine_replay_endpoint),
            block_size: cli.block_size,
            attention_chunk_size: cli.attention_chunk_size,
            metrics_bind_address: non_empty(cli.metrics_bind_address),
            log_level,
            log_format,
            server: servers.join(","),
            servers,
            outbox_max_entries: cli.outbox_max_entries,
            retry_max_delay,
            anti_entropy_interval,
            probe_interval,
            replica_id: cli.replica_id,
            model_id: cli.model_id,
            tenant_id: cli.tenant_id,
            profile: Profile::for_scheme(&cli.hash_scheme),
            hash_scheme: cli.hash_scheme,
            window,
            engine_metrics_url: cli.engine_metrics_url,
            engine_metrics_ca_file: cli.engine_metrics_ca_file,
            stats_interval,
            capacity_bytes: cli.engine_cache_size_bytes,
            ceiling: cli.max_concurrency_ceiling,
            cache_tier,
            engine_model_name: cli.engine_model_name,
            l2_mode: cli.ignore_block_removed,
            adapters,
            token_file: cli.server_token_file,
            tls: TlsFiles {
                ca_file: cli.server_tls_ca_file,
                cert_file: cli.server_tls_cert_file,
                key_file: cli.server_tls_key_file,
            },
        })
    }
}

/// The `host:port` of an `http(s)://host[:port]/path` URL (vLLM and SGLang serve `/metrics` on
/// their API port, so the metrics URL names the API's address). A URL without an explicit port
/// gives `None`: the scheme's default port is rarely where an engine listens.
fn url_host_port(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit('@').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    if host.is_empty() || port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(authority.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Settings, String> {
        let argv = std::iter::once("sidecar")
            .chain(args.iter().copied())
            .map(OsString::from);
        let cli = Cli::try_parse_from(normalize_args(argv)).map_err(|e| e.to_string())?;
        Settings::from_cli(cli)
    }

    #[test]
    fn durations() {
        let ten = Duration::from_secs(10);
        assert_eq!(
            duration_or_default("100ms", ten),
            Ok(Duration::from_millis(100))
        );
        assert_eq!(
            duration_or_default("1m30s", ten),
            Ok(Duration::from_secs(90))
        );
        assert_eq!(duration_or_default("-1s", ten), Ok(ten));
        assert_eq!(duration_or_default("0", ten), Ok(ten));
        assert!(duration_or_default("10", ten).is_err());
        assert!(duration_or_default("", ten).is_err());
        assert!(duration_or_default("5x", ten).is_err());
        assert_eq!(duration_or_off("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(duration_or_off("0"), Ok(Duration::ZERO));
        assert_eq!(
            duration_or_off("-2s"),
            Err("negative duration \"-2s\"".to_string())
        );
    }

    #[test]
    fn engine_api_address_defaults_to_the_metrics_url_authority() {
        let s = parse(&["--replica-id", "r", "--model-id=m"]).unwrap();
        assert_eq!(s.engine_api_address, "127.0.0.1:8000");
        let s = parse(&[
            "--replica-id=r",
            "--model-id=m",
            "--engine-metrics-url=https://10.1.2.3:31000/metrics?x=1",
        ])
        .unwrap();
        assert_eq!(s.engine_api_address, "10.1.2.3:31000");
        // No explicit port: nothing is reported rather than a guessed one.
        let s = parse(&[
            "--replica-id=r",
            "--model-id=m",
            "--engine-metrics-url=http://e/m",
        ])
        .unwrap();
        assert_eq!(s.engine_api_address, "");
        let s = parse(&[
            "--replica-id=r",
            "--model-id=m",
            "--engine-api-address",
            "10.9.9.9:8001",
        ])
        .unwrap();
        assert_eq!(s.engine_api_address, "10.9.9.9:8001");
    }

    #[test]
    fn defaults_and_forms() {
        let s = parse(&["--replica-id", "r", "--model-id=m"]).unwrap();
        assert_eq!(s.engine_endpoint, "tcp://127.0.0.1:5557");
        assert_eq!(s.topic, "");
        assert_eq!(s.block_size, 16);
        assert_eq!(s.replay_endpoint, None);
        assert_eq!(s.metrics_bind_address.as_deref(), Some("127.0.0.1:9091"));
        assert_eq!(s.log_level, tracing::Level::INFO);
        assert_eq!(s.server, "127.0.0.1:9090");
        assert_eq!(s.servers, ["127.0.0.1:9090"]);
        assert_eq!(s.outbox_max_entries, 100_000);
        assert_eq!(s.retry_max_delay, Duration::from_secs(2));
        assert_eq!(s.anti_entropy_interval, Duration::from_secs(30));
        assert_eq!(s.probe_interval, Duration::from_secs(5));
        assert_eq!(s.window, Duration::from_millis(100));
        assert_eq!(s.stats_interval, Duration::from_secs(10));
        assert_eq!(s.ceiling, 256);
        assert!(!s.l2_mode);
        assert_eq!(s.profile, Profile::Vllm);

        let s = parse(&[
            "-replica-id",
            "r",
            "-model-id=m",
            "-ignore-block-removed",
            "-hash-scheme",
            "sglang",
            "--window",
            "0",
            "--topic",
            "kv-events",
            "--lora-adapter-names",
            "1=a",
            "--engine-replay-endpoint",
            "tcp://127.0.0.1:5558",
            "--block-size",
            "1",
            "--metrics-bind-address",
            "",
        ])
        .unwrap();
        assert!(s.l2_mode);
        assert_eq!(s.profile, Profile::Sglang);
        assert_eq!(s.window, Duration::from_millis(100));
        assert_eq!(s.topic, "kv-events");
        assert_eq!(s.adapters.resolve(Some(1)), Some("a"));
        assert_eq!(s.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(s.block_size, 1);
        assert_eq!(s.metrics_bind_address, None);
        let s = parse(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--ignore-block-removed=false",
        ])
        .unwrap();
        assert!(!s.l2_mode);
        let s = parse(&[
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--server",
            "a:1,b:2",
            "--server",
            "c:3",
            "--anti-entropy-interval",
            "0",
            "--server-probe-interval",
            "250ms",
        ])
        .unwrap();
        assert_eq!(s.servers, ["a:1", "b:2", "c:3"]);
        assert_eq!(s.server, "a:1,b:2,c:3");
        assert_eq!(s.anti_entropy_interval, Duration::ZERO);
        assert_eq!(s.probe_interval, Duration::from_millis(250));
    }

    #[test]
    fn invalid_configurations() {
        assert!(parse(&["--replica-id", "r", "--model-id", "m", "--server", ","]).is_err());
        assert!(
            parse(&[
                "--replica-id",
                "r",
                "--model-id",
                "m",
                "--anti-entropy-interval",
                "-1s"
            ])
            .is_err()
        );
        assert!(parse(&["--model-id", "m"]).is_err());
        assert!(parse(&["--replica-id", "", "--model-id", "m"]).is_err());
        assert!(parse(&["--replica-id", "r", "--model-id", "m", "--hash-scheme", ""]).is_err());
        assert!(
            parse(&[
                "--replica-id",
                "r",
                "--model-id",
                "m",
                "--cache-tier",
                "hbm"
            ])
            .is_err()
        );
        assert!(
            parse(&[
                "--replica-id",
                "r",
                "--model-id",
                "m",
                "--lora-adapter-names",
                "x=y"
            ])
            .is_err()
        );
        assert!(parse(&["--replica-id", "r", "--model-id", "m", "--window", "fast"]).is_err());
        assert!(parse(&["--replica-id", "r", "--model-id", "m", "--block-size", "0"]).is_err());
        assert!(parse(&["--replica-id", "r", "--model-id", "m", "--log-level", "x"]).is_err());
        assert!(
            parse(&[
                "--replica-id",
                "r",
                "--model-id",
                "m",
                "--server-tls-cert-file",
                "c"
            ])
            .is_err()
        );
    }
}
