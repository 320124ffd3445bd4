//! The amqps listener's TLS (rustls on ring): the server's certificate and key from PEM files,
//! and, as RabbitMQ's `verify_peer` and `fail_if_no_peer_cert`, client certificates checked
//! against a CA file.

use crate::config::TlsConfig;
use anyhow::Context;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use tokio_rustls::rustls;

/// The rustls server configuration `t` describes; an error names the file at fault.
pub fn server_config(t: &TlsConfig) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let certs = CertificateDer::pem_file_iter(&t.cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading the certificate in {}", t.cert.display()))?;
    if certs.is_empty() {
        anyhow::bail!("{} holds no certificate", t.cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(&t.key)
        .with_context(|| format!("reading the private key in {}", t.key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = if t.verify_peer {
        let ca =
            t.ca.as_ref()
                .ok_or_else(|| anyhow::anyhow!("--tls-verify-peer needs --tls-ca"))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(ca)
            .with_context(|| format!("reading the CA certificates in {}", ca.display()))?
        {
            let c = c.with_context(|| format!("reading {}", ca.display()))?;
            roots
                .add(c)
                .with_context(|| format!("a CA certificate in {}", ca.display()))?;
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
        let verifier = if t.fail_if_no_peer_cert {
            verifier
        } else {
            verifier.allow_unauthenticated()
        };
        builder.with_client_cert_verifier(verifier.build().context("the client verifier")?)
    } else {
        builder.with_no_client_auth()
    };
    let config = builder
        .with_single_cert(certs, key)
        .context("the certificate and key do not go together")?;
    Ok(Arc::new(config))
}
