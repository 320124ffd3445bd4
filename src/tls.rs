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

/// The name a client certificate logs in with by EXTERNAL: its subject's common name, as
/// RabbitMQ's `ssl_cert_login_from = common_name` (several common names are joined with ",",
/// as RabbitMQ joins them). None when the certificate has none or cannot be read.
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    // webpki hands the subject's RDNSequence without its SEQUENCE header: put it back.
    let subject = yasna::construct_der(|w| w.write_sequence(|w| w.next().write_der(ee.subject())));
    let cn = yasna::models::ObjectIdentifier::from_slice(&[2, 5, 4, 3]);
    let mut names = Vec::new();
    yasna::parse_der(&subject, |r| {
        r.read_sequence_of(|r| {
            r.read_set_of(|r| {
                r.read_sequence(|r| {
                    let oid = r.next().read_oid()?;
                    let value = r.next().read_tagged_der()?;
                    if oid == cn {
                        // A common name that is no string (or not UTF-8) is no login name.
                        let text = value
                            .as_str()
                            .ok_or_else(|| yasna::ASN1Error::new(yasna::ASN1ErrorKind::Invalid))?;
                        names.push(text.to_string());
                    }
                    Ok(())
                })
            })
        })
    })
    .ok()?;
    (!names.is_empty()).then(|| names.join(","))
}

#[cfg(test)]
mod tests {
    use super::common_name;
    use rcgen::{CertificateParams, DnType, KeyPair};

    fn cert(names: &[(DnType, &str)]) -> rustls_pki_types::CertificateDer<'static> {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        // (rcgen names a certificate "rcgen self signed cert" unless told otherwise.)
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (t, v) in names {
            params.distinguished_name.push(t.clone(), *v);
        }
        let key = KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").der().clone()
    }

    #[test]
    fn the_login_name_is_the_subjects_common_name() {
        let c = cert(&[
            (DnType::OrganizationName, "Example"),
            (DnType::CommonName, "tls-user"),
            (DnType::CountryName, "DE"),
        ]);
        assert_eq!(common_name(&c).as_deref(), Some("tls-user"));
        let no_cn = cert(&[(DnType::OrganizationName, "Example")]);
        assert_eq!(common_name(&no_cn), None);
        let garbage = rustls_pki_types::CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x00]);
        assert_eq!(common_name(&garbage), None);
    }
}
