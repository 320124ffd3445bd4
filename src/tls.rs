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

/// What a client certificate's subject says: its distinguished name as RabbitMQ shows it
/// (RFC 4514, last RDN first: `CN=client,O=Example,C=DE`) and the name it logs in with by
/// EXTERNAL: its common name, as RabbitMQ's `ssl_cert_login_from = common_name` (several
/// common names are joined with ",", as RabbitMQ joins them). None when it cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub dn: String,
    pub common_name: Option<String>,
}

const CN: &[u64] = &[2, 5, 4, 3];

/// The subject of a (DER) certificate; see [`Subject`].
pub fn subject(cert: &CertificateDer<'_>) -> Option<Subject> {
    let ee = webpki::EndEntityCert::try_from(cert).ok()?;
    // webpki hands the subject's RDNSequence without its SEQUENCE header: put it back.
    let name = yasna::construct_der(|w| w.write_sequence(|w| w.next().write_der(ee.subject())));
    // BER, not DER: a multi-valued RDN whose values are not in DER's order still reads.
    let rdns: Vec<Vec<(Vec<u64>, yasna::models::TaggedDerValue)>> = yasna::parse_ber(&name, |r| {
        r.collect_sequence_of(|r| {
            r.collect_set_of(|r| {
                r.read_sequence(|r| {
                    let oid = r.next().read_oid()?;
                    let value = r.next().read_tagged_der()?;
                    Ok((oid.components().clone(), value))
                })
            })
        })
    })
    .ok()?;
    let mut names = Vec::new();
    let mut parts = Vec::new();
    for rdn in &rdns {
        let mut attrs = Vec::new();
        for (oid, value) in rdn {
            let text = directory_string(value);
            if oid == CN {
                names.extend(text.clone());
            }
            let value = match text {
                Some(t) => escape_dn_value(&t),
                // RFC 4514: a value of a type with no string form is `#` and its BER, in hex.
                None => {
                    let ber = yasna::construct_der(|w| w.write_tagged_der(value));
                    format!(
                        "#{}",
                        ber.iter().map(|b| format!("{b:02x}")).collect::<String>()
                    )
                }
            };
            attrs.push(format!("{}={value}", attribute_name(oid)));
        }
        parts.push(attrs.join("+"));
    }
    parts.reverse();
    Some(Subject {
        dn: parts.join(","),
        common_name: (!names.is_empty()).then(|| names.join(",")),
    })
}

/// A DirectoryString's text, whichever of X.520's string types it comes in (as RabbitMQ's
/// rabbit_cert_info reads them): UTF-8 and the ASCII ones as they are, BMPString as UTF-16,
/// UniversalString as UTF-32, TeletexString as Latin-1. None for anything else.
fn directory_string(v: &yasna::models::TaggedDerValue) -> Option<String> {
    use yasna::tags::*;
    if v.pcbit() != yasna::PCBit::Primitive {
        return None;
    }
    let b = v.value();
    match v.tag() {
        TAG_UTF8STRING | TAG_PRINTABLESTRING | TAG_IA5STRING | TAG_VISIBLESTRING
        | TAG_NUMERICSTRING => String::from_utf8(b.to_vec()).ok(),
        TAG_TELETEXSTRING => Some(b.iter().map(|&c| char::from(c)).collect()),
        TAG_BMPSTRING if b.len().is_multiple_of(2) => {
            char::decode_utf16(b.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])))
                .collect::<Result<String, _>>()
                .ok()
        }
        TAG_UNIVERSALSTRING if b.len().is_multiple_of(4) => b
            .chunks_exact(4)
            .map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        _ => None,
    }
}

/// RFC 4514's short names for the usual attribute types; others by their OID.
fn attribute_name(oid: &[u64]) -> String {
    let short = match oid {
        [2, 5, 4, 3] => "CN",
        [2, 5, 4, 6] => "C",
        [2, 5, 4, 7] => "L",
        [2, 5, 4, 8] => "ST",
        [2, 5, 4, 9] => "STREET",
        [2, 5, 4, 10] => "O",
        [2, 5, 4, 11] => "OU",
        [0, 9, 2342, 19200300, 100, 1, 1] => "UID",
        [0, 9, 2342, 19200300, 100, 1, 25] => "DC",
        _ => "",
    };
    if short.is_empty() {
        oid.iter().map(u64::to_string).collect::<Vec<_>>().join(".")
    } else {
        short.to_string()
    }
}

/// A value escaped as RFC 4514 says (`,+"\<>;` and a leading `#` or space, a trailing space).
fn escape_dn_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let last = v.chars().count().saturating_sub(1);
    for (i, c) in v.chars().enumerate() {
        let special = matches!(c, ',' | '+' | '"' | '\\' | '<' | '>' | ';')
            || (i == 0 && (c == '#' || c == ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::subject;
    use rcgen::{CertificateParams, DnType, DnValue, KeyPair};

    fn cert(names: &[(DnType, DnValue)]) -> rustls_pki_types::CertificateDer<'static> {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        // (rcgen names a certificate "rcgen self signed cert" unless told otherwise.)
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (t, v) in names {
            params.distinguished_name.push(t.clone(), v.clone());
        }
        let key = KeyPair::generate().expect("key");
        params.self_signed(&key).expect("cert").der().clone()
    }

    #[test]
    fn the_login_name_is_the_subjects_common_name() {
        let c = cert(&[
            (
                DnType::CountryName,
                DnValue::PrintableString("DE".try_into().unwrap()),
            ),
            (
                DnType::OrganizationName,
                DnValue::Utf8String("Example, Inc.".into()),
            ),
            (DnType::CommonName, DnValue::Utf8String("tls-user".into())),
        ]);
        let s = subject(&c).expect("a subject");
        assert_eq!(s.common_name.as_deref(), Some("tls-user"));
        assert_eq!(s.dn, "CN=tls-user,O=Example\\, Inc.,C=DE");
        let no_cn = cert(&[(
            DnType::OrganizationName,
            DnValue::Utf8String("Example".into()),
        )]);
        assert_eq!(subject(&no_cn).expect("a subject").common_name, None);
        let garbage = rustls_pki_types::CertificateDer::from(vec![0x30, 0x03, 0x02, 0x01, 0x00]);
        assert_eq!(subject(&garbage), None);
    }

    #[test]
    fn common_names_in_every_string_type_read_as_rabbitmq_reads_them() {
        let cases = [
            (DnValue::BmpString("bmp-ü".try_into().unwrap()), "bmp-ü"),
            (
                DnValue::UniversalString("univ-€".try_into().unwrap()),
                "univ-€",
            ),
            (DnValue::TeletexString("t61".try_into().unwrap()), "t61"),
            (
                DnValue::PrintableString("printable".try_into().unwrap()),
                "printable",
            ),
        ];
        for (value, expected) in cases {
            let c = cert(&[(DnType::CommonName, value)]);
            let s = subject(&c).expect("a subject");
            assert_eq!(s.common_name.as_deref(), Some(expected));
        }
    }
}
