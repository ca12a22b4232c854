//! gRPC TLS with hot reload and optional mutual TLS (spec `server.md` §10, D3).
//!
//! The certificate resolver checks the certificate file's mtime on every handshake and reloads
//! cert and key when it is newer than the pair it serves; a failed reload logs
//! `grpc_tls_reload` and keeps serving the last good pair. With a client CA bundle, every
//! connection must present a certificate chaining to it; the bundle is reloaded by the same
//! mtime rule. Handshakes run on their own tasks, so a slow or hostile client never delays
//! other accepts.

use crate::connections::{Admitted, ConnectionGate};
use anyhow::Context as _;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rustls::DistinguishedName;
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, error};

/// The files behind the gRPC listener's TLS.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn load_pair(files: &TlsFiles, provider: &CryptoProvider) -> anyhow::Result<CertifiedKey> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .with_context(|| format!("read certificate {}", files.cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("parse certificate {}", files.cert.display()))?;
    if certs.is_empty() {
        anyhow::bail!("no certificate in {}", files.cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("read private key {}", files.key.display()))?;
    CertifiedKey::from_der(certs, key, provider)
        .context("certificate and key do not form a usable pair")
}

fn load_roots(path: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path)
        .with_context(|| format!("read client CA {}", path.display()))?
    {
        let cert = cert.with_context(|| format!("parse client CA {}", path.display()))?;
        roots.add(cert).context("invalid client CA certificate")?;
    }
    if roots.is_empty() {
        anyhow::bail!("no certificate in client CA bundle {}", path.display());
    }
    Ok(roots)
}

/// Serves the newest valid certificate pair, reloading on mtime change.
#[derive(Debug)]
struct ReloadingCert {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: ArcSwap<CertifiedKey>,
    /// mtime of the last load attempt (successful or not), so a broken file is reported once
    /// per change instead of once per handshake.
    seen: Mutex<Option<SystemTime>>,
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let modified = mtime(&self.files.cert);
        let mut seen = self.seen.lock();
        if modified.is_some() && modified > *seen {
            *seen = modified;
            match load_pair(&self.files, &self.provider) {
                Ok(pair) => self.current.store(Arc::new(pair)),
                Err(err) => {
                    error!(err = %format!("{err:#}"), cert_file = %self.files.cert.display(), "grpc_tls_reload")
                }
            }
        }
        drop(seen);
        Some(self.current.load_full())
    }
}

/// Verifies client certificates against a CA bundle that is reloaded on mtime change.
#[derive(Debug)]
struct ReloadingClientVerifier {
    path: PathBuf,
    provider: Arc<CryptoProvider>,
    inner: ArcSwap<Arc<dyn ClientCertVerifier>>,
    seen: Mutex<Option<SystemTime>>,
}

impl ReloadingClientVerifier {
    fn build(
        path: &Path,
        provider: &Arc<CryptoProvider>,
    ) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
        let roots = load_roots(path)?;
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .context("build client certificate verifier")
    }

    fn current(&self) -> Arc<Arc<dyn ClientCertVerifier>> {
        let modified = mtime(&self.path);
        let mut seen = self.seen.lock();
        if modified.is_some() && modified > *seen {
            *seen = modified;
            match Self::build(&self.path, &self.provider) {
                Ok(v) => self.inner.store(Arc::new(v)),
                Err(err) => {
                    error!(err = %format!("{err:#}"), cert_file = %self.path.display(), "grpc_tls_reload")
                }
            }
        }
        drop(seen);
        self.inner.load_full()
    }
}

impl ClientCertVerifier for ReloadingClientVerifier {
    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The bundle can change under us; sending no hints lets clients offer any certificate,
        // which is then verified against the current bundle.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.load().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.load().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.load().supported_verify_schemes()
    }
}

/// Builds the listener's TLS configuration; any unloadable file is an error (exit 1 at startup,
/// ERROR `grpc_tls_load`).
pub fn server_config(files: &TlsFiles) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = provider();
    let pair = load_pair(files, &provider)?;
    let resolver = Arc::new(ReloadingCert {
        files: files.clone(),
        provider: provider.clone(),
        current: ArcSwap::from_pointee(pair),
        seen: Mutex::new(mtime(&files.cert)),
    });
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
        .context("TLS protocol versions")?;
    let mut config = match &files.client_ca {
        Some(ca) => {
            let verifier = ReloadingClientVerifier::build(ca, &provider)?;
            let verifier = Arc::new(ReloadingClientVerifier {
                path: ca.clone(),
                provider: provider.clone(),
                inner: ArcSwap::from_pointee(verifier),
                seen: Mutex::new(mtime(ca)),
            });
            builder
                .with_client_cert_verifier(verifier)
                .with_cert_resolver(resolver)
        }
        None => builder.with_no_client_auth().with_cert_resolver(resolver),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// Accepts TCP connections through `gate` and yields the ones that complete a TLS handshake.
/// Each handshake runs on its own task and must finish, like the HTTP/2 preface after it, within
/// [`crate::connections::PREFACE_TIMEOUT`] of the accept; failures are dropped (a plaintext
/// client simply fails).
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    gate: ConnectionGate,
) -> ReceiverStream<Result<Admitted<TlsStream<TcpStream>>, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(128);
    let acceptor = TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(err) => {
                        debug!(err = %err, "grpc_accept_error");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            // Over the connection cap the socket is closed before any handshake work.
            let Some(admission) = gate.admit() else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                // The handshake and the HTTP/2 preface share one deadline from the accept.
                match tokio::time::timeout_at(admission.deadline(), acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(admission.wrap(stream))).await;
                    }
                    Ok(Err(err)) => debug!(peer = %peer, err = %err, "grpc_tls_handshake_failed"),
                    Err(_) => debug!(peer = %peer, "grpc_tls_handshake_timeout"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
