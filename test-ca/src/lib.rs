//! A throwaway certificate authority for TLS tests: a self-signed CA and leaves for
//! `localhost` / `127.0.0.1`, made in memory with rcgen. Test code only: it panics on any
//! rcgen error, which a test should report as a failure anyway.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// A self-signed CA.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    /// A new CA with common name `name`.
    ///
    /// # Panics
    /// If rcgen cannot generate the key or sign the certificate.
    #[must_use]
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = KeyPair::generate().expect("CA key");
        Self {
            issuer: CertifiedIssuer::self_signed(params, key).expect("self-signed CA"),
        }
    }

    /// The CA certificate, PEM.
    #[must_use]
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `localhost` / 127.0.0.1 signed by this CA: (cert PEM, key PEM).
    ///
    /// # Panics
    /// If rcgen cannot generate the key or sign the certificate.
    #[must_use]
    pub fn leaf(&self) -> (String, String) {
        let params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("leaf parameters");
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed leaf");
        (cert.pem(), key.serialize_pem())
    }
}
