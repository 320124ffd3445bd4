//! Issue 14 point 7: AMQP over TLS (`--amqps-listen`), with certificates made in the test:
//! a client that trusts the server's CA speaks AMQP through it; with `--tls-verify-peer` and
//! `--tls-fail-if-no-peer-cert` a client without a certificate, or with one the CA did not
//! sign, is refused; the plain listener carries on beside it.

use crate::common::*;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use rustls_pki_types::{PrivateKeyDer, ServerName};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

struct Issued {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca(name: &str) -> Issued {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    Issued { cert, key }
}

fn issue(by: &Issued, names: &[&str], common_name: &str) -> Issued {
    let mut params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &by.cert, &by.key).unwrap();
    Issued { cert, key }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Connect over TLS trusting `ca`, as `client` (None: no certificate); None when the
/// handshake fails on the client's side.
async fn tls_connect(port: u16, ca: &Issued, client: Option<&Issued>) -> Option<Tls> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        Some(c) => builder
            .with_client_auth_cert(
                vec![c.cert.der().clone()],
                PrivateKeyDer::Pkcs8(c.key.serialize_der().into()),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let deadline = std::time::Instant::now() + WAIT;
    let tcp = loop {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(s) => break s,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "amqps port: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    let name = ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await.ok()
}

/// Connect (as `tls_connect`), send the protocol header and return what the server answers
/// first (empty: refused).
async fn first_answer(port: u16, ca: &Issued, client: Option<&Issued>) -> Vec<u8> {
    let Some(mut tls) = tls_connect(port, ca, client).await else {
        return Vec::new();
    };
    if tls.write_all(b"AMQP\x00\x00\x09\x01").await.is_err() {
        return Vec::new();
    }
    let mut buf = vec![0u8; 64];
    match tokio::time::timeout(WAIT, tls.read(&mut buf)).await {
        Ok(Ok(n)) => buf[..n].to_vec(),
        _ => Vec::new(),
    }
}

/// A method frame on channel 0 carrying connection.start (class 10, method 10).
fn is_connection_start(b: &[u8]) -> bool {
    b.len() >= 11 && b[0] == 1 && b[1..3] == [0, 0] && b[7..11] == [0, 10, 0, 10]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_over_tls_with_client_certificates_checked_against_the_ca() {
    let dir = tempfile::tempdir().unwrap();
    let authority = ca("warren test CA");
    let server = issue(&authority, &["localhost", "127.0.0.1"], "localhost");
    let client = issue(&authority, &[], "guest");
    let rogue_ca = ca("someone else");
    let rogue = issue(&rogue_ca, &[], "guest");
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    let cert = write("server.pem", server.cert.pem());
    let key = write("server.key", server.key.serialize_pem());
    let ca_file = write("ca.pem", authority.cert.pem());
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let http_port = free_port();
    let http_listen = format!("127.0.0.1:{http_port}");
    let broker = spawn_binary(
        &dir.path().join("data"),
        &[
            "--amqps-listen",
            &listen,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &ca_file,
            "--tls-verify-peer",
            "--tls-fail-if-no-peer-cert",
            "--management-listen",
            &http_listen,
            "--management-tls",
        ],
    )
    .await;
    // A client the CA vouches for: connection.start comes over TLS.
    let answer = first_answer(port, &authority, Some(&client)).await;
    assert!(is_connection_start(&answer), "{answer:?}");
    // No certificate, or one the CA did not sign: refused at the handshake.
    assert!(first_answer(port, &authority, None).await.is_empty());
    assert!(first_answer(port, &authority, Some(&rogue))
        .await
        .is_empty());
    // The management API over HTTPS (no client certificate asked for there).
    let mut https = tls_connect(http_port, &authority, None)
        .await
        .expect("HTTPS handshake");
    https
        .write_all(
            b"GET /api/whoami HTTP/1.1\r\nHost: localhost\r\n\
              Authorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nConnection: close\r\n\r\n",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT, https.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"name\":\"guest\""), "{answer}");
    // The plain listener goes on beside it.
    let conn = lapin::Connection::connect(&broker.url, Default::default())
        .await
        .unwrap();
    conn.close(200, "bye".into()).await.unwrap();
    // A key that does not match the certificate stops the start, saying so.
    let other = issue(&authority, &["localhost"], "localhost");
    let wrong_key = write("wrong.key", other.key.serialize_pem());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
        .args([
            "server",
            "--amqp-listen",
            "127.0.0.1:0",
            "--management-listen",
            "none",
        ])
        .args(["--amqps-listen", "127.0.0.1:0", "--tls-cert", &cert])
        .args(["--tls-key", &wrong_key, "--data-dir"])
        .arg(dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("do not go together"), "{err}");
}

/// With a certificate and key but no `--amqps-listen`, AMQP over TLS is served on RabbitMQ's
/// port, 5671 (the test is skipped when something else holds that port).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_defaults_to_5671_once_a_certificate_is_configured() {
    if std::net::TcpListener::bind("127.0.0.1:5671").is_err() {
        eprintln!("port 5671 is taken here: skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let authority = ca("warren test CA");
    let server = issue(&authority, &["localhost", "127.0.0.1"], "localhost");
    let cert = dir.path().join("server.pem");
    let key = dir.path().join("server.key");
    std::fs::write(&cert, server.cert.pem()).unwrap();
    std::fs::write(&key, server.key.serialize_pem()).unwrap();
    let (cert, key) = (cert.to_string_lossy(), key.to_string_lossy());
    let _broker = spawn_binary(
        &dir.path().join("data"),
        &["--tls-cert", &cert, "--tls-key", &key],
    )
    .await;
    let answer = first_answer(5671, &authority, None).await;
    assert!(is_connection_start(&answer), "{answer:?}");
}
