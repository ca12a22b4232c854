//! gRPC client side: channel construction (plaintext or TLS), the producer token, failover
//! over several servers and the [`Sink`] abstraction the reporters send through.
//!
//! Failover: a [`GrpcSink`] holds one channel per server (each `--server` entry, and each
//! address a DNS name resolves to). Every call goes to the current one; a call that fails in a
//! way that says the server is gone (unavailable, timed out, cancelled, unknown) moves every
//! clone of the sink to the next server. Whatever that server holds is proven, never assumed:
//! its `server_instance_id` differs, which the reporter treats like a restarted server (digest
//! comparison, reconcile on mismatch; see `reporter.rs`).

use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{
    Ack, CacheEvent, CacheStateUpdate, GetCacheStateRequest, GetCacheStateResponse,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Request, Status};
use tracing::{info, warn};

/// Per-RPC timeout of the reporters (§6, §9).
pub const RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// Where updates and events go. The gRPC implementation is [`GrpcSink`]; tests may substitute
/// anything that records.
pub trait Sink: Send {
    /// One `ReportCacheState` stream carrying exactly `update`; resolves to the Ack.
    fn report(
        &mut self,
        update: CacheStateUpdate,
    ) -> impl std::future::Future<Output = Result<Ack, Status>> + Send;
    /// One unary `PublishEvent`.
    fn publish(
        &mut self,
        event: CacheEvent,
    ) -> impl std::future::Future<Output = Result<Ack, Status>> + Send;
    /// One unary `GetCacheState` (the instance probe and the replica digest).
    fn cache_state(
        &mut self,
        request: GetCacheStateRequest,
    ) -> impl std::future::Future<Output = Result<GetCacheStateResponse, Status>> + Send;
}

/// TLS material for the server connection.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM CA bundle used to verify the server.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain (mTLS).
    pub cert_file: Option<PathBuf>,
    /// Client private key (mTLS).
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    /// True when any TLS option is set (the connection then uses TLS).
    pub fn enabled(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some()
    }
}

/// Builds a lazily connecting channel to `server` (`host:port`, or a full `http(s)://` URI).
pub fn build_channel(server: &str, tls: &TlsFiles) -> anyhow::Result<Channel> {
    build_channel_named(server, None, tls)
}

/// Splits `host:port` (a bracketed IPv6 host included); `None` for a URI or no port.
fn host_port(server: &str) -> Option<(&str, u16)> {
    if server.contains("://") {
        return None;
    }
    let (host, port) = server.rsplit_once(':')?;
    let port = port.parse().ok()?;
    Some((host.trim_start_matches('[').trim_end_matches(']'), port))
}

/// The servers to fail over between: every `--server` entry, a `host:port` whose host
/// resolves to several addresses expanded into one target per address (TLS still verifies the
/// host name). A name that does not resolve now is kept as it is (it is resolved per connect).
pub fn expand_servers(servers: &[String]) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for server in servers {
        let resolved: Vec<std::net::SocketAddr> = match host_port(server) {
            Some((host, _)) if host.parse::<std::net::IpAddr>().is_ok() => Vec::new(),
            Some(_) => std::net::ToSocketAddrs::to_socket_addrs(server.as_str())
                .map(|addrs| addrs.collect())
                .unwrap_or_default(),
            None => Vec::new(),
        };
        let mut unique: Vec<std::net::SocketAddr> = Vec::new();
        for addr in resolved {
            if !unique.contains(&addr) {
                unique.push(addr);
            }
        }
        if unique.len() > 1 {
            let host = host_port(server).map(|(h, _)| h.to_string());
            info!(server = %server, addresses = unique.len(), "server_addresses_expanded");
            out.extend(unique.into_iter().map(|a| (a.to_string(), host.clone())));
        } else {
            out.push((server.clone(), None));
        }
    }
    out
}

/// [`build_channel`] with the TLS server name given apart from the address (an address a DNS
/// name resolved to).
pub fn build_channel_named(
    server: &str,
    tls_name: Option<&str>,
    tls: &TlsFiles,
) -> anyhow::Result<Channel> {
    let uri = if server.contains("://") {
        server.to_string()
    } else if tls.enabled() {
        format!("https://{server}")
    } else {
        format!("http://{server}")
    };
    let mut ep = Endpoint::from_shared(uri)?.connect_timeout(RPC_TIMEOUT);
    if tls.enabled() {
        let mut cfg = ClientTlsConfig::new();
        if let Some(name) = tls_name {
            cfg = cfg.domain_name(name);
        }
        if let Some(ca) = &tls.ca_file {
            let pem = std::fs::read(ca)
                .map_err(|e| anyhow::anyhow!("reading CA file {}: {e}", ca.display()))?;
            cfg = cfg.ca_certificate(Certificate::from_pem(pem));
        } else {
            cfg = cfg.with_enabled_roots();
        }
        match (&tls.cert_file, &tls.key_file) {
            (Some(c), Some(k)) => {
                let cert = std::fs::read(c)
                    .map_err(|e| anyhow::anyhow!("reading client cert {}: {e}", c.display()))?;
                let key = std::fs::read(k)
                    .map_err(|e| anyhow::anyhow!("reading client key {}: {e}", k.display()))?;
                cfg = cfg.identity(Identity::from_pem(cert, key));
            }
            (None, None) => {}
            _ => anyhow::bail!("--server-tls-cert-file and --server-tls-key-file go together"),
        }
        ep = ep.tls_config(cfg)?;
    }
    Ok(ep.connect_lazy())
}

/// The producer bearer token, re-read whenever its file changes (mtime or size).
#[derive(Debug, Clone)]
pub struct TokenSource {
    path: PathBuf,
    state: Arc<Mutex<TokenState>>,
}

#[derive(Debug, Default)]
struct TokenState {
    stamp: Option<(SystemTime, u64)>,
    token: Option<String>,
}

/// First non-empty line not starting with `#`, trimmed.
pub fn first_token(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
}

impl TokenSource {
    /// Reads the file once; errors when it cannot be read or holds no token.
    pub fn new(path: impl Into<PathBuf>) -> anyhow::Result<Self> {
        let src = Self {
            path: path.into(),
            state: Arc::default(),
        };
        if src.current().is_none() {
            anyhow::bail!("token file {} holds no token", src.path.display());
        }
        Ok(src)
    }

    /// The current token; a failed re-read keeps the last good one.
    pub fn current(&self) -> Option<String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let stamp = std::fs::metadata(&self.path)
            .ok()
            .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
        if stamp.is_some() && stamp != st.stamp {
            match std::fs::read_to_string(&self.path) {
                Ok(text) => match first_token(&text) {
                    Some(tok) => {
                        st.token = Some(tok);
                        st.stamp = stamp;
                    }
                    None => {
                        warn!(path = %self.path.display(), "token_file_empty")
                    }
                },
                Err(e) => {
                    warn!(path = %self.path.display(), err = %e, "token_file_unreadable")
                }
            }
        }
        st.token.clone()
    }
}

/// The gRPC sink: one `ReportCacheState` stream per update, unary `PublishEvent`, over one or
/// several servers (failover; see the module docs). Clones share the current server.
#[derive(Debug, Clone)]
pub struct GrpcSink {
    clients: Arc<[(String, InferenceCacheClient<Channel>)]>,
    current: Arc<AtomicUsize>,
    token: Option<TokenSource>,
    timeout: Duration,
}

/// Whether a failed call says the server is gone (so the next call tries another one), as
/// opposed to an answer from a live server (bad credentials, a refused message).
pub fn server_gone(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
    )
}

impl GrpcSink {
    /// Wraps a channel.
    pub fn new(channel: Channel, token: Option<TokenSource>) -> Self {
        Self::with_servers(vec![(String::new(), channel)], token)
    }

    /// One channel per server, named for the logs; the first one is used first.
    pub fn with_servers(channels: Vec<(String, Channel)>, token: Option<TokenSource>) -> Self {
        Self {
            clients: channels
                .into_iter()
                .map(|(name, channel)| (name, InferenceCacheClient::new(channel)))
                .collect(),
            current: Arc::default(),
            token,
            timeout: RPC_TIMEOUT,
        }
    }

    /// Number of servers it fails over between.
    pub fn servers(&self) -> usize {
        self.clients.len()
    }

    /// The current server's position and client.
    fn client(&self) -> (usize, InferenceCacheClient<Channel>) {
        let at = self.current.load(Ordering::Acquire) % self.clients.len().max(1);
        (at, self.clients[at].1.clone())
    }

    /// After a failed call on server `at`: move to the next server if the failure says this
    /// one is gone (once per failure, however many clones saw it).
    fn after_failure(&self, at: usize, status: &Status) {
        if self.clients.len() < 2 || !server_gone(status) {
            return;
        }
        let next = (at + 1) % self.clients.len();
        if self
            .current
            .compare_exchange(at, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            warn!(
                event = "server_failover",
                from = %self.clients[at].0,
                to = %self.clients[next].0,
                code = ?status.code(),
                "server unreachable; failing over"
            );
        }
    }

    fn decorate<T>(&self, mut req: Request<T>) -> Request<T> {
        req.set_timeout(self.timeout);
        if let Some(tok) = self.token.as_ref().and_then(TokenSource::current)
            && let Ok(v) = format!("Bearer {tok}").parse()
        {
            req.metadata_mut().insert("authorization", v);
        }
        req
    }
}

impl Sink for GrpcSink {
    async fn report(&mut self, update: CacheStateUpdate) -> Result<Ack, Status> {
        let (at, mut client) = self.client();
        let req = self.decorate(Request::new(tokio_stream::iter(vec![update])));
        let result = match tokio::time::timeout(self.timeout, client.report_cache_state(req)).await
        {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("ReportCacheState timed out")),
        };
        // /readyz and `server_reachable` follow the latest call of any kind.
        crate::exporter::server_health().record(result.is_ok());
        if let Err(status) = &result {
            self.after_failure(at, status);
        }
        result
    }

    async fn publish(&mut self, event: CacheEvent) -> Result<Ack, Status> {
        let (at, mut client) = self.client();
        let req = self.decorate(Request::new(event));
        let result = match tokio::time::timeout(self.timeout, client.publish_event(req)).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("PublishEvent timed out")),
        };
        // /readyz and `server_reachable` follow the latest call of any kind.
        crate::exporter::server_health().record(result.is_ok());
        if let Err(status) = &result {
            self.after_failure(at, status);
        }
        result
    }

    async fn cache_state(
        &mut self,
        request: GetCacheStateRequest,
    ) -> Result<GetCacheStateResponse, Status> {
        let (at, mut client) = self.client();
        let req = self.decorate(Request::new(request));
        let result = match tokio::time::timeout(self.timeout, client.get_cache_state(req)).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("GetCacheState timed out")),
        };
        // /readyz and `server_reachable` follow the latest call of any kind.
        crate::exporter::server_health().record(result.is_ok());
        if let Err(status) = &result {
            self.after_failure(at, status);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ports_and_literal_addresses() {
        assert_eq!(host_port("a.example:9090"), Some(("a.example", 9090)));
        assert_eq!(host_port("[::1]:9090"), Some(("::1", 9090)));
        assert_eq!(host_port("http://a:1"), None);
        assert_eq!(host_port("a"), None);
        let servers = vec!["127.0.0.1:1".to_string(), "127.0.0.2:2".to_string()];
        assert_eq!(
            expand_servers(&servers),
            vec![
                ("127.0.0.1:1".to_string(), None),
                ("127.0.0.2:2".to_string(), None)
            ]
        );
    }

    #[test]
    fn first_token_skips_comments_and_blanks() {
        assert_eq!(
            first_token("\n# c\n  tok1 \ntok2\n").as_deref(),
            Some("tok1")
        );
        assert_eq!(first_token("# only\n\n"), None);
    }
}
