//! gRPC client side: channel construction (plaintext or TLS), the producer token and the
//! [`Sink`] abstraction the reporters send through.

use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{Ack, CacheEvent, CacheStateUpdate};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};
use tracing::warn;

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
                        warn!(path = %self.path.display(), "token file holds no token; keeping the last one")
                    }
                },
                Err(e) => {
                    warn!(path = %self.path.display(), err = %e, "token file unreadable; keeping the last token")
                }
            }
        }
        st.token.clone()
    }
}

/// The gRPC sink: one `ReportCacheState` stream per update, unary `PublishEvent`.
#[derive(Debug, Clone)]
pub struct GrpcSink {
    client: InferenceCacheClient<Channel>,
    token: Option<TokenSource>,
    timeout: Duration,
}

impl GrpcSink {
    /// Wraps a channel.
    pub fn new(channel: Channel, token: Option<TokenSource>) -> Self {
        Self {
            client: InferenceCacheClient::new(channel),
            token,
            timeout: RPC_TIMEOUT,
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
        let req = self.decorate(Request::new(tokio_stream::iter(vec![update])));
        let fut = self.client.report_cache_state(req);
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("ReportCacheState timed out")),
        }
    }

    async fn publish(&mut self, event: CacheEvent) -> Result<Ack, Status> {
        let req = self.decorate(Request::new(event));
        let fut = self.client.publish_event(req);
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded("PublishEvent timed out")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_token_skips_comments_and_blanks() {
        assert_eq!(
            first_token("\n# c\n  tok1 \ntok2\n").as_deref(),
            Some("tok1")
        );
        assert_eq!(first_token("# only\n\n"), None);
    }
}
