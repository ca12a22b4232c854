//! HTTP(S) client of the engine's `/metrics` (spec `sidecar.md` §8): hyper-util's pooled client
//! over hyper-rustls, so plain http, https (verified against the system trust store plus an
//! optional extra CA bundle), chunked and keep-alive responses are handled by maintained code.
//!
//! Bounds, so a misbehaving endpoint cannot hurt the sidecar: one scrape (connect, headers and
//! body) takes at most [`SCRAPE_TIMEOUT`], and a body larger than [`MAX_RESPONSE_BYTES`] is an
//! error, never buffered past the cap.

use crate::metrics::ScrapeError;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use std::sync::Arc;
use std::time::Duration;

/// Bound on one scrape.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest accepted response body (a large vLLM exposition is well under 1 MiB).
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// A reusable metrics client.
#[derive(Clone)]
pub struct MetricsClient {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl std::fmt::Debug for MetricsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MetricsClient")
    }
}

impl MetricsClient {
    /// A client trusting the system's CA certificates.
    pub fn new() -> Self {
        Self::with_roots(system_roots())
    }

    /// A client trusting the system's CA certificates and those in `pem` (a PEM bundle).
    pub fn with_extra_ca(pem: &[u8]) -> Result<Self, ScrapeError> {
        let mut roots = system_roots();
        let mut added = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| ScrapeError(format!("CA bundle: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| ScrapeError(format!("CA bundle: {e}")))?;
            added += 1;
        }
        if added == 0 {
            return Err(ScrapeError("CA bundle holds no certificate".into()));
        }
        Ok(Self::with_roots(roots))
    }

    fn with_roots(roots: RootCertStore) -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("the ring provider supports the default TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// GETs `url` (http or https); the body of a 200 response.
    pub async fn get(&self, url: &str) -> Result<String, ScrapeError> {
        let fail = |m: String| ScrapeError(format!("GET {url}: {m}"));
        let uri: hyper::Uri = url.parse().map_err(|e| fail(format!("{e}")))?;
        match uri.scheme_str() {
            Some("http") | Some("https") => {}
            _ => return Err(fail("only http:// and https:// URLs are supported".into())),
        }
        let request = hyper::Request::get(uri)
            .header(hyper::header::ACCEPT, "text/plain")
            .header(hyper::header::USER_AGENT, "inferencecache-sidecar")
            .body(Empty::<Bytes>::new())
            .map_err(|e| fail(e.to_string()))?;
        let scrape = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| fail(error_chain(&e)))?;
            let status = response.status();
            if status != hyper::StatusCode::OK {
                return Err(fail(format!("status {}", status.as_u16())));
            }
            let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| fail(format!("reading the body: {e}")))?
                .to_bytes();
            String::from_utf8(body.to_vec()).map_err(|_| fail("non-UTF-8 body".into()))
        };
        match tokio::time::timeout(SCRAPE_TIMEOUT, scrape).await {
            Ok(r) => r,
            Err(_) => Err(fail("timed out".into())),
        }
    }
}

impl Default for MetricsClient {
    fn default() -> Self {
        Self::new()
    }
}

fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    // Unreadable system certificates leave https to the extra bundle (if any); http still works.
    let found = rustls_native_certs::load_native_certs();
    let _ = roots.add_parsable_certificates(found.certs);
    roots
}

/// The error and its sources, for a log line that says why a connection failed.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
