//! Command line and settings (spec `server.md` §2–§3).
//!
//! Flags keep the reference server's names. Besides `--name value` and `--name=value`, the
//! single-dash forms `-name value` / `-name=value` used by manifests written for the reference
//! are accepted: [`normalize_args`] rewrites them before parsing.

use anyhow::{Context, bail};
use clap::{CommandFactory, FromArgMatches, Parser, parser::ValueSource};
use inferencecache_cli_flags::parse_duration;
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
    /// Bytes of the tokenizer's segment cache (ids of the text between special tokens, shared
    /// by the models; 0 = off).
    #[arg(long, default_value_t = DEFAULT_TOKENIZER_SEGMENT_CACHE_BYTES)]
    pub tokenizer_segment_cache_bytes: u64,
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
    /// Not supported (the reference's Kubernetes TokenReview settings); rejected at startup.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "")]
    pub allowed_controller_sa: Option<String>,
    /// Not supported; rejected at startup.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "")]
    pub controller_audience: Option<String>,
    /// Not supported; rejected at startup.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "")]
    pub policy_audience: Option<String>,
    /// Global cap in storage entries (≤ 0 = unbounded).
    #[arg(long, default_value_t = 1_000_000, allow_hyphen_values = true)]
    pub max_entries: i64,
    /// Global TTL of index entries (≤ 0 → 30m).
    #[arg(long, default_value = "30m", allow_hyphen_values = true)]
    pub ttl: String,
    /// TTL sweep period (≤ 0 → 60s).
    #[arg(long, default_value = "60s", allow_hyphen_values = true)]
    pub sweep_interval: String,
    /// Blocks kept per ingested chain (longer chains are cut); a longer lookup chain fails
    /// open (0 = no limit).
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_CHAIN_LENGTH)]
    pub max_chain_length: u64,
    /// Longest block hash or prefix_hash ingested; a ref with a longer one is left out
    /// (0 = no limit).
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_HASH_BYTES)]
    pub max_hash_bytes: u64,
    /// Longest tenant, model, hash-scheme, adapter or replica id ingested; an update with a
    /// longer one is left out (0 = no limit).
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_ID_BYTES)]
    pub max_id_bytes: u64,
    /// Prefix refs applied per CacheStateUpdate; the rest are left out (0 = no limit).
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_PREFIXES_PER_UPDATE)]
    pub max_prefixes_per_update: u64,
    /// Largest gRPC request message in bytes; larger → RESOURCE_EXHAUSTED (must be ≥ 1).
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: u64,
    /// Key upserts per second per producer connection; over it the server reads more slowly
    /// (0 = no limit).
    #[arg(long, default_value_t = crate::limits::DEFAULT_PRODUCER_MAX_BLOCKS_PER_SEC)]
    pub producer_max_blocks_per_sec: u64,
    /// Directory for warm-restart checkpoints (off when unset: a pure in-memory index).
    #[arg(long)]
    pub state_dir: Option<String>,
    /// Time between periodic checkpoints into --state-dir (≤ 0 → 60s; one is also written at
    /// shutdown).
    #[arg(long, default_value = "60s")]
    pub checkpoint_interval: String,
    /// Concurrent gRPC connections; more are closed at accept and counted (0 = no limit).
    #[arg(long, default_value_t = crate::connections::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: u64,
    /// Models with their own per-model metric series; the rest are `model="_other"`.
    #[arg(long, default_value_t = crate::metrics::DEFAULT_MAX_METRIC_MODELS as u64)]
    pub max_metric_models: u64,
    /// At SIGTERM, how long gRPC health answers NOT_SERVING and /readyz 503 before the drain.
    #[arg(long, default_value = "2s")]
    pub drain_notice: String,
    /// The opt-in load-aware ranking (off by default: the reference ranking).
    #[command(flatten)]
    pub load_aware: crate::load_aware::LoadAwareFlags,
    /// NATS server of replicated mode (`nats://HOST:PORT`; off when unset: docs/scale-out.md).
    #[arg(long)]
    pub nats_url: Option<String>,
    /// JetStream stream of replicated mode (its buckets are named after it).
    #[arg(long, default_value = "inferencecache")]
    pub nats_stream: String,
    /// NATS credentials file (JWT + nkey seed) for replicated mode.
    #[arg(long)]
    pub nats_creds_file: Option<String>,
    /// File holding a NATS token for replicated mode.
    #[arg(long)]
    pub nats_token_file: Option<String>,
    /// CA bundle (PEM) that the NATS server's TLS certificate must chain to (turns TLS on).
    #[arg(long)]
    pub nats_tls_ca_file: Option<String>,
    /// Records waiting for NATS at most (an outage fills it; more are dropped and counted).
    #[arg(long, default_value_t = crate::replication::DEFAULT_BUFFER_RECORDS)]
    pub nats_buffer: u64,
    /// Oldest record the stream keeps (created with it; ≥ 2 × --checkpoint-interval).
    #[arg(long, default_value = "15m")]
    pub nats_max_age: String,
    /// Bytes the stream keeps at most (0 = no limit: trimmed by age alone; a limit must hold
    /// two checkpoint intervals of ingest).
    #[arg(long, default_value_t = crate::replication::DEFAULT_STREAM_MAX_BYTES)]
    pub nats_max_bytes: u64,
    /// This server's name in the stream (record ids, the leader lease); default: a random one.
    #[arg(long)]
    pub nats_server_id: Option<String>,
    // --- the endpoint picker (docs/epp.md) ---
    /// Endpoint-picker listener: Envoy ext_proc per the Gateway API Inference Extension's
    /// protocol (off when unset).
    #[arg(long)]
    pub epp_bind_address: Option<String>,
    /// JSON list of {replica_id, endpoint, models} for replicas whose sidecars report no
    /// address (re-read when it changes).
    #[arg(long)]
    pub epp_endpoints_file: Option<String>,
    /// Hash scheme of the picker's lookups (the sidecars' --hash-scheme).
    #[arg(long, default_value = "vllm")]
    pub epp_hash_scheme: String,
    /// Tenant of picker requests without an x-inferencecache-tenant header.
    #[arg(long, default_value = "")]
    pub epp_tenant: String,
    /// Request body bytes the picker reads; past it the pick goes by load.
    #[arg(long, default_value_t = DEFAULT_EPP_MAX_BODY_BYTES)]
    pub epp_max_body_bytes: u64,
    /// Weight of load against the cached fraction of the prompt in the pick.
    #[arg(long, default_value_t = 1.0)]
    pub epp_load_weight: f64,
    /// In-flight requests that weigh as much as a fully loaded engine in the pick.
    #[arg(long, default_value_t = 8.0)]
    pub epp_inflight_capacity: f64,
    /// With every candidate at this many in flight the picker answers 429 (0 = never).
    #[arg(long, default_value_t = 0)]
    pub epp_shed_in_flight: u32,
    /// Endpoints in the picker's list at most (the first is picked, the rest are fallbacks).
    #[arg(long, default_value_t = 4)]
    pub epp_max_endpoints: u32,
}

/// Long flags of this command line that take no value.
/// Default `--epp-max-body-bytes`: the endpoint picker's request body limit.
pub const DEFAULT_EPP_MAX_BODY_BYTES: u64 = 4 << 20;

/// Default of `--tokenizer-segment-cache-bytes`: 64 MiB, about 100,000 pieces of a few hundred
/// tokens (a fleet's system prompts and recent conversations' turns).
pub const DEFAULT_TOKENIZER_SEGMENT_CACHE_BYTES: u64 = 64 << 20;

const BOOL_FLAGS: &[&str] = &["insecure-disable-auth", "help", "version"];

/// Rewrites single-dash long flags (`-grpc-bind-address`) into double-dash form. Short flags
/// (`-h`, `-V`) and values are left alone (the rule shared with the sidecar:
/// [`inferencecache_cli_flags::normalize_args`]).
pub fn normalize_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    inferencecache_cli_flags::normalize_args(args, BOOL_FLAGS)
}

pub use inferencecache_logging::LogFormat;

/// Validated settings derived from the command line.
#[derive(Debug, Clone)]
pub struct Settings {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub snapshot_addr: SocketAddr,
    /// The snapshot address had an empty host and was bound to loopback (no control-plane token).
    pub snapshot_loopback_forced: bool,
    /// Token files and the insecure flag (validated: every configured file holds a token).
    pub auth: crate::auth::AuthConfig,
    pub block_size: usize,
    pub log_format: LogFormat,
    pub log_level: tracing::Level,
    pub max_entries: i64,
    pub ttl: Duration,
    pub sweep_interval: Duration,
    /// gRPC TLS files (cert and key both set, optional client CA).
    pub tls: Option<crate::tls::TlsFiles>,
    /// Tokenizer tree for `prompt_text` lookups.
    pub tokenizer_models_dir: Option<std::path::PathBuf>,
    /// Bound of the tokenizer's segment cache in bytes (0: none).
    pub tokenizer_segment_cache_bytes: u64,
    /// The configuration file, when one was given (its policy layer is reloaded).
    pub config_file: Option<(std::path::PathBuf, crate::config_file::ConfigFile)>,
    /// Memory and rate limits (`docs/robustness.md`).
    pub limits: crate::limits::Limits,
    /// Warm-restart checkpoints (`--state-dir`), if configured.
    pub state: Option<crate::checkpoint::StateSettings>,
    /// Concurrent gRPC connections (`0` = no limit).
    pub max_connections: u64,
    /// Models with per-model metric series.
    pub max_metric_models: usize,
    /// Notice of a graceful stop before its drain (`0s` = none).
    pub drain_notice: Duration,
    /// Replicated mode (`--nats-url`), if configured.
    pub replication: Option<crate::replication::Settings>,
    /// The opt-in load-aware ranking (`None`: the reference ranking).
    pub load_aware: Option<crate::load_aware::LoadAwareRanking>,
}

impl Settings {
    /// Validates the flags (exit code 2 on any error, decided by the caller).
    pub fn from_cli(cli: &Cli) -> anyhow::Result<Self> {
        // §2: the reference's TokenReview flags do not exist here (unknown-flag error).
        for (flag, set) in [
            (
                "--allowed-controller-sa",
                cli.allowed_controller_sa.is_some(),
            ),
            ("--controller-audience", cli.controller_audience.is_some()),
            ("--policy-audience", cli.policy_audience.is_some()),
        ] {
            if set {
                bail!(
                    "unknown flag {flag}: there is no Kubernetes TokenReview; use \
                     --controller-token-file, --policy-token-file and --producer-token-file"
                );
            }
        }
        let log_format = parse_log_format(&cli.log_format)?;
        let log_level = parse_log_level(&cli.log_level)?;
        let ttl = parse_duration(&cli.ttl)
            .context("invalid --ttl")?
            .positive();
        let sweep_interval = parse_duration(&cli.sweep_interval)
            .context("invalid --sweep-interval")?
            .positive();
        let auth = validate_auth(cli)?;
        let checkpoint_interval = positive_or(
            parse_duration(&cli.checkpoint_interval)
                .context("invalid --checkpoint-interval")?
                .positive(),
            Duration::from_secs(60),
        );
        let state = match cli.state_dir.as_deref() {
            Some("") => bail!("--state-dir must not be empty"),
            Some(dir) => Some(crate::checkpoint::StateSettings {
                dir: dir.into(),
                interval: checkpoint_interval,
            }),
            None => None,
        };
        let drain_notice = parse_duration(&cli.drain_notice)
            .context("invalid --drain-notice")?
            .positive();
        let replication = replication_settings(cli, checkpoint_interval)?;
        if replication.is_some() && state.is_some() {
            bail!(
                "--state-dir and --nats-url are exclusive: a replicated server restarts from the \
                 stream's checkpoints (docs/scale-out.md)"
            );
        }
        if cli.max_message_bytes == 0 {
            bail!("--max-message-bytes must be at least 1");
        }
        // §3 step 6 (the exit-2 part): cert and key come together; a client CA needs both.
        let tls = match (&cli.tls_cert_file, &cli.tls_key_file) {
            (Some(cert), Some(key)) => Some(crate::tls::TlsFiles {
                cert: cert.into(),
                key: key.into(),
                client_ca: cli.tls_client_ca_file.as_ref().map(Into::into),
            }),
            (None, None) => {
                if cli.tls_client_ca_file.is_some() {
                    bail!("--tls-client-ca-file requires --tls-cert-file and --tls-key-file");
                }
                None
            }
            _ => bail!("--tls-cert-file and --tls-key-file must be set together"),
        };
        let config_file = match &cli.config {
            Some(path) => {
                let file = crate::config_file::ConfigFile::load(std::path::Path::new(path))?;
                Some((std::path::PathBuf::from(path), file))
            }
            None => None,
        };
        // §3 step 5: with no control-plane token and auth enabled, an empty host binds loopback.
        let snapshot_loopback_only = !auth.insecure_disable_auth
            && auth.controller_token_file.is_none()
            && auth.policy_token_file.is_none();
        let snapshot_addr = parse_bind(&cli.snapshot_bind_address, snapshot_loopback_only)
            .context("invalid --snapshot-bind-address")?;
        let snapshot_loopback_forced =
            snapshot_loopback_only && bind_host(&cli.snapshot_bind_address).is_empty();
        Ok(Self {
            grpc_addr: parse_bind(&cli.grpc_bind_address, false)
                .context("invalid --grpc-bind-address")?,
            http_addr: parse_bind(&cli.http_bind_address, false)
                .context("invalid --http-bind-address")?,
            snapshot_addr,
            snapshot_loopback_forced,
            auth,
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
            tls,
            tokenizer_models_dir: cli.tokenizer_models_dir.as_ref().map(Into::into),
            tokenizer_segment_cache_bytes: cli.tokenizer_segment_cache_bytes,
            config_file,
            limits: crate::limits::Limits {
                max_chain_length: cli.max_chain_length,
                max_hash_bytes: cli.max_hash_bytes,
                max_id_bytes: cli.max_id_bytes,
                max_prefixes_per_update: cli.max_prefixes_per_update,
                max_message_bytes: cli.max_message_bytes,
                producer_max_blocks_per_sec: cli.producer_max_blocks_per_sec,
            },
            state,
            max_connections: cli.max_connections,
            max_metric_models: usize::try_from(cli.max_metric_models).unwrap_or(usize::MAX),
            drain_notice: drain_notice.unwrap_or(Duration::ZERO),
            replication,
            load_aware: cli.load_aware.settings()?,
        })
    }
}

/// Parses the command line and folds the `--config` file beneath it (flags win over the file,
/// the file over built-in defaults). Errors are printed; the `Err` is the exit code.
pub fn parse_command_line(args: Vec<OsString>) -> Result<Cli, std::process::ExitCode> {
    let fail = |err: clap::Error| {
        let code = if err.use_stderr() { 2 } else { 0 };
        let _ = err.print();
        std::process::ExitCode::from(code)
    };
    let matches = Cli::command().try_get_matches_from(args).map_err(fail)?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(fail)?;
    if let Some(path) = cli.config.clone() {
        match crate::config_file::ConfigFile::load(std::path::Path::new(&path)) {
            Ok(file) => apply_file(&mut cli, &matches, &file),
            Err(err) => {
                eprintln!("inferencecache-server: {err:#}");
                return Err(std::process::ExitCode::from(2));
            }
        }
    }
    Ok(cli)
}

/// Takes every setting the command line did not set explicitly from the file.
fn apply_file(cli: &mut Cli, matches: &clap::ArgMatches, file: &crate::config_file::ConfigFile) {
    let from_flag = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    macro_rules! take {
        ($id:literal, $field:ident, $value:expr) => {
            if !from_flag($id) {
                if let Some(v) = $value {
                    cli.$field = v;
                }
            }
        };
    }
    take!(
        "grpc_bind_address",
        grpc_bind_address,
        file.grpc_bind_address.clone()
    );
    take!(
        "http_bind_address",
        http_bind_address,
        file.http_bind_address.clone()
    );
    take!(
        "snapshot_bind_address",
        snapshot_bind_address,
        file.snapshot_bind_address.clone()
    );
    take!(
        "engine_block_size",
        engine_block_size,
        file.engine_block_size
    );
    take!("log_format", log_format, file.log_format.clone());
    take!("log_level", log_level, file.log_level.clone());
    take!(
        "insecure_disable_auth",
        insecure_disable_auth,
        file.insecure_disable_auth
    );
    take!("max_entries", max_entries, file.index.max_entries);
    take!("ttl", ttl, file.index.ttl.clone());
    take!(
        "sweep_interval",
        sweep_interval,
        file.index.sweep_interval.clone()
    );
    take!(
        "max_chain_length",
        max_chain_length,
        file.limits.max_chain_length
    );
    take!("max_hash_bytes", max_hash_bytes, file.limits.max_hash_bytes);
    take!("max_id_bytes", max_id_bytes, file.limits.max_id_bytes);
    take!(
        "max_prefixes_per_update",
        max_prefixes_per_update,
        file.limits.max_prefixes_per_update
    );
    take!(
        "max_message_bytes",
        max_message_bytes,
        file.limits.max_message_bytes
    );
    take!(
        "producer_max_blocks_per_sec",
        producer_max_blocks_per_sec,
        file.limits.producer_max_blocks_per_sec
    );
    take!("state_dir", state_dir, file.state.dir.clone().map(Some));
    take!("nats_url", nats_url, file.replication.url.clone().map(Some));
    take!("nats_stream", nats_stream, file.replication.stream.clone());
    take!(
        "nats_creds_file",
        nats_creds_file,
        file.replication.creds_file.clone().map(Some)
    );
    take!(
        "nats_token_file",
        nats_token_file,
        file.replication.token_file.clone().map(Some)
    );
    take!(
        "nats_tls_ca_file",
        nats_tls_ca_file,
        file.replication.tls_ca_file.clone().map(Some)
    );
    take!("nats_buffer", nats_buffer, file.replication.buffer);
    take!(
        "nats_max_age",
        nats_max_age,
        file.replication.max_age.clone()
    );
    take!("nats_max_bytes", nats_max_bytes, file.replication.max_bytes);
    take!(
        "nats_server_id",
        nats_server_id,
        file.replication.server_id.clone().map(Some)
    );
    take!(
        "checkpoint_interval",
        checkpoint_interval,
        file.state.checkpoint_interval.clone()
    );
    take!(
        "tls_cert_file",
        tls_cert_file,
        file.tls.cert_file.clone().map(Some)
    );
    take!(
        "tls_key_file",
        tls_key_file,
        file.tls.key_file.clone().map(Some)
    );
    take!(
        "tls_client_ca_file",
        tls_client_ca_file,
        file.tls.client_ca_file.clone().map(Some)
    );
    take!(
        "tokenizer_models_dir",
        tokenizer_models_dir,
        file.tokenizer_models_dir.clone().map(Some)
    );
    take!(
        "controller_token_file",
        controller_token_file,
        file.auth.controller_token_file.clone().map(Some)
    );
    take!(
        "policy_token_file",
        policy_token_file,
        file.auth.policy_token_file.clone().map(Some)
    );
    take!(
        "producer_token_file",
        producer_token_file,
        file.auth.producer_token_file.clone().map(Some)
    );
}

/// §3 step 3, first match wins: insecure with a control-plane token file; a configured token
/// file missing, unreadable or empty; no control-plane token, auth enabled and an explicit
/// non-loopback snapshot host.
fn validate_auth(cli: &Cli) -> anyhow::Result<crate::auth::AuthConfig> {
    if cli.insecure_disable_auth
        && (cli.controller_token_file.is_some() || cli.policy_token_file.is_some())
    {
        bail!(
            "--insecure-disable-auth and --controller-token-file/--policy-token-file are \
             mutually exclusive"
        );
    }
    for (flag, file) in [
        ("--controller-token-file", &cli.controller_token_file),
        ("--policy-token-file", &cli.policy_token_file),
        ("--producer-token-file", &cli.producer_token_file),
    ] {
        let Some(file) = file else { continue };
        match crate::auth::count_tokens_in_file(std::path::Path::new(file)) {
            Ok(0) => bail!("{flag} {file:?} holds no token"),
            Ok(_) => {}
            Err(e) => bail!("{flag} {file:?}: {e}"),
        }
    }
    if !cli.insecure_disable_auth
        && cli.controller_token_file.is_none()
        && cli.policy_token_file.is_none()
    {
        let host = bind_host(&cli.snapshot_bind_address);
        if !host.is_empty() {
            let addr = parse_bind(&cli.snapshot_bind_address, true)
                .context("invalid --snapshot-bind-address")?;
            if !addr.ip().is_loopback() {
                bail!(
                    "--snapshot-bind-address {:?} is not loopback: set --controller-token-file \
                     and/or --policy-token-file, or --insecure-disable-auth",
                    cli.snapshot_bind_address
                );
            }
        }
    }
    Ok(crate::auth::AuthConfig {
        insecure_disable_auth: cli.insecure_disable_auth,
        controller_token_file: cli.controller_token_file.as_ref().map(Into::into),
        policy_token_file: cli.policy_token_file.as_ref().map(Into::into),
        producer_token_file: cli.producer_token_file.as_ref().map(Into::into),
    })
}

/// The host part of `host:port` (brackets removed); empty for `:8081`.
fn bind_host(addr: &str) -> &str {
    addr.rsplit_once(':')
        .map_or("", |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']')
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

/// Replicated mode's settings, or `None` without `--nats-url`.
fn replication_settings(
    cli: &Cli,
    checkpoint_interval: Duration,
) -> anyhow::Result<Option<crate::replication::Settings>> {
    let Some(url) = cli.nats_url.as_deref() else {
        return Ok(None);
    };
    if url.is_empty() {
        anyhow::bail!("--nats-url must not be empty");
    }
    let stream = cli.nats_stream.trim();
    if stream.is_empty()
        || !stream
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        anyhow::bail!(
            "--nats-stream {:?}: use letters, digits, '-' and '_' (it names the stream and its buckets)",
            cli.nats_stream
        );
    }
    let max_age = inferencecache_cli_flags::parse_duration(&cli.nats_max_age)
        .context("invalid --nats-max-age")?
        .positive()
        .unwrap_or(Duration::from_secs(15 * 60));
    if max_age < checkpoint_interval * 2 {
        anyhow::bail!(
            "--nats-max-age {:?} must be at least twice --checkpoint-interval, or a server \
             could find neither a checkpoint nor the records after it",
            cli.nats_max_age
        );
    }
    let server_id = match cli.nats_server_id.as_deref() {
        Some("") => anyhow::bail!("--nats-server-id must not be empty"),
        Some(id) => id.to_owned(),
        None => format!("ic-{:016x}", crate::replication::random_u64()),
    };
    Ok(Some(crate::replication::Settings {
        url: url.to_owned(),
        stream: stream.to_owned(),
        creds_file: cli.nats_creds_file.as_ref().map(Into::into),
        token_file: cli.nats_token_file.as_ref().map(Into::into),
        tls_ca_file: cli.nats_tls_ca_file.as_ref().map(Into::into),
        buffer: usize::try_from(cli.nats_buffer.max(1)).unwrap_or(usize::MAX),
        max_age,
        max_bytes: cli.nats_max_bytes,
        server_id,
        checkpoint_interval,
    }))
}

fn parse_log_format(s: &str) -> anyhow::Result<LogFormat> {
    inferencecache_logging::parse_format(s).map_err(anyhow::Error::msg)
}

fn parse_log_level(s: &str) -> anyhow::Result<tracing::Level> {
    inferencecache_logging::parse_level(s).map_err(anyhow::Error::msg)
}

/// Installs the global log subscriber on stderr.
pub fn init_logging(settings: &Settings) -> anyhow::Result<()> {
    inferencecache_logging::init(settings.log_level, settings.log_format)
        .map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn snapshot_address_follows_the_auth_matrix() {
        let dir = std::env::temp_dir().join(format!("ic-config-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokens = dir.join("tokens");
        std::fs::write(&tokens, "t\n").unwrap();
        let tokens = tokens.to_str().unwrap();
        let settings = |args: &[&str]| {
            let mut all = vec!["bin"];
            all.extend_from_slice(args);
            Settings::from_cli(
                &Cli::try_parse_from(normalize_args(all.into_iter().map(OsString::from))).unwrap(),
            )
        };
        let s = settings(&[]).unwrap();
        assert_eq!(s.snapshot_addr.to_string(), "127.0.0.1:8081");
        assert!(s.snapshot_loopback_forced);
        let s = settings(&["--snapshot-bind-address", "127.0.0.1:9"]).unwrap();
        assert!(!s.snapshot_loopback_forced);
        let s = settings(&["--insecure-disable-auth"]).unwrap();
        assert_eq!(s.snapshot_addr.to_string(), "0.0.0.0:8081");
        assert!(!s.snapshot_loopback_forced);
        let s = settings(&["--controller-token-file", tokens]).unwrap();
        assert_eq!(s.snapshot_addr.to_string(), "0.0.0.0:8081");
        let s = settings(&[
            "--policy-token-file",
            tokens,
            "--snapshot-bind-address",
            "0.0.0.0:1",
        ]);
        assert!(s.is_ok());
        // Producer tokens alone do not guard the control plane.
        assert!(
            settings(&[
                "--producer-token-file",
                tokens,
                "--snapshot-bind-address",
                "[::]:1"
            ])
            .is_err()
        );
        assert!(
            settings(&[
                "--insecure-disable-auth",
                "--snapshot-bind-address",
                "[::]:1"
            ])
            .is_ok()
        );
        assert!(settings(&["--insecure-disable-auth", "--controller-token-file", tokens]).is_err());
        let err = settings(&["--allowed-controller-sa", "x"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--controller-token-file") && err.contains("--policy-token-file"));
        assert!(settings(&["--controller-audience"]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn limits_come_from_flags_then_the_file_then_defaults() {
        let dir = std::env::temp_dir().join(format!("ic-config-limits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(
            &file,
            "[limits]\nmax_chain_length = 100\nmax_hash_bytes = 64\nproducer_max_blocks_per_sec = 0\n",
        )
        .unwrap();
        let args = [
            "bin",
            "--config",
            file.to_str().unwrap(),
            "--max-hash-bytes",
            "32",
        ];
        let cli = parse_command_line(normalize_args(args.map(OsString::from))).unwrap();
        let limits = Settings::from_cli(&cli).unwrap().limits;
        assert_eq!(limits.max_chain_length, 100, "from the file");
        assert_eq!(limits.max_hash_bytes, 32, "the flag wins");
        assert_eq!(
            limits.producer_max_blocks_per_sec, 0,
            "0 = off, from the file"
        );
        assert_eq!(limits.max_id_bytes, crate::limits::DEFAULT_MAX_ID_BYTES);
        assert_eq!(
            limits.max_message_bytes,
            crate::limits::DEFAULT_MAX_MESSAGE_BYTES
        );
        let cli = Cli::try_parse_from(["bin", "--max-message-bytes", "0"]).unwrap();
        assert!(Settings::from_cli(&cli).is_err());
        assert!(Cli::try_parse_from(["bin", "--max-chain-length", "-1"]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn replication_is_off_by_default_and_validated_from_flags_and_the_file() {
        let settings = |args: &[&str]| {
            let mut all = vec!["bin"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all)
                .map_err(anyhow::Error::from)
                .and_then(|cli| Settings::from_cli(&cli))
        };
        assert!(
            settings(&[]).unwrap().replication.is_none(),
            "off by default"
        );
        let on = settings(&[
            "--nats-url",
            "nats://127.0.0.1:4222",
            "--nats-server-id",
            "x",
        ])
        .unwrap()
        .replication
        .unwrap();
        assert_eq!(
            (
                on.stream.as_str(),
                on.buffer,
                on.max_age,
                on.server_id.as_str()
            ),
            ("inferencecache", 100_000, Duration::from_secs(900), "x")
        );
        for bad in [
            &["--nats-url", "nats://h:1", "--state-dir", "/d"][..],
            &["--nats-url", "nats://h:1", "--nats-stream", "a.b"],
            &["--nats-url", "nats://h:1", "--nats-max-age", "1m"],
            &["--nats-url", ""],
            &["--nats-url", "nats://h:1", "--nats-server-id", ""],
        ] {
            assert!(settings(bad).is_err(), "{bad:?}");
        }
        let dir = std::env::temp_dir().join(format!("ic-config-repl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(
            &file,
            "[replication]\nurl = \"nats://file:4222\"\nstream = \"s1\"\nbuffer = 7\n",
        )
        .unwrap();
        let args = [
            "bin",
            "--config",
            file.to_str().unwrap(),
            "--nats-buffer",
            "9",
        ];
        let cli = parse_command_line(normalize_args(args.map(OsString::from))).unwrap();
        let r = Settings::from_cli(&cli).unwrap().replication.unwrap();
        assert_eq!(
            (r.url.as_str(), r.stream.as_str(), r.buffer),
            ("nats://file:4222", "s1", 9)
        );
    }

    #[test]
    fn state_settings_come_from_flags_then_the_file_and_are_off_by_default() {
        let cli = Cli::try_parse_from(["bin"]).unwrap();
        assert!(
            Settings::from_cli(&cli).unwrap().state.is_none(),
            "off by default"
        );
        let dir = std::env::temp_dir().join(format!("ic-config-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(
            &file,
            "[state]\ndir = \"/from/file\"\ncheckpoint_interval = \"5m\"\n",
        )
        .unwrap();
        let from_file = ["bin", "--config", file.to_str().unwrap()];
        let cli = parse_command_line(normalize_args(from_file.map(OsString::from))).unwrap();
        let state = Settings::from_cli(&cli).unwrap().state.unwrap();
        assert_eq!(state.dir, std::path::PathBuf::from("/from/file"));
        assert_eq!(state.interval, Duration::from_secs(300));
        let flag_wins = [
            "bin",
            "--config",
            file.to_str().unwrap(),
            "--state-dir",
            "/from/flag",
        ];
        let cli = parse_command_line(normalize_args(flag_wins.map(OsString::from))).unwrap();
        let state = Settings::from_cli(&cli).unwrap().state.unwrap();
        assert_eq!(state.dir, std::path::PathBuf::from("/from/flag"));
        assert_eq!(
            state.interval,
            Duration::from_secs(300),
            "the file's interval"
        );
        let cli = Cli::try_parse_from(["bin", "--state-dir", "/d", "--checkpoint-interval", "0"])
            .unwrap();
        let state = Settings::from_cli(&cli).unwrap().state.unwrap();
        assert_eq!(
            state.interval,
            Duration::from_secs(60),
            "<= 0 means the default"
        );
        let cli = Cli::try_parse_from(["bin", "--state-dir", ""]).unwrap();
        assert!(
            Settings::from_cli(&cli).is_err(),
            "an empty directory is an error"
        );
        let cli = Cli::try_parse_from(["bin", "--checkpoint-interval", "soon"]).unwrap();
        assert!(Settings::from_cli(&cli).is_err());
        let _ = std::fs::remove_dir_all(&dir);
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
