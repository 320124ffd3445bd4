//! lapin over TLS against the warren binary named by `WARREN_BIN` (issue 14 point 7): the
//! test makes a CA and certificates, starts warren with `--amqps-listen` and the TLS flags, and
//! connects with lapin's own TLS stack (rustls), as an application would:
//! - amqps with the CA trusted: declare, publish with confirms, get;
//! - `--tls-verify-peer --tls-fail-if-no-peer-cert`: no certificate, or one another CA signed,
//!   is refused; a certificate the CA signed connects;
//! - EXTERNAL: the certificate's common name is the user (no password); a common name that
//!   names no user, or no certificate, is refused with 403; EXTERNAL is not offered without
//!   TLS.

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Issued {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Issued {
    /// lapin's client identity: the certificate and its key in PEM.
    fn identity(&self) -> OwnedIdentity {
        OwnedIdentity::PKCS8 {
            pem: self.cert.pem().into_bytes(),
            key: self.key.serialize_pem().into_bytes(),
        }
    }
}

fn ca(name: &str) -> Issued {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("CA");
    Issued { cert, key }
}

fn issue(by: &Issued, names: &[&str], common_name: &str) -> Issued {
    let mut params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("params");
    params
        .distinguished_name
        .push(DnType::OrganizationName, "warren tests");
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, &by.cert, &by.key).expect("cert");
    Issued { cert, key }
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The certificates of one test: a CA, the server's, two clients' ("tls-user", a user that
/// exists, and "nobody-here", one that does not), and a client of another CA.
struct Pki {
    dir: tempfile::TempDir,
    authority: Issued,
    user: Issued,
    stranger: Issued,
    rogue: Issued,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let authority = ca("warren lapin-tls CA");
        let server = issue(&authority, &["localhost", "127.0.0.1"], "localhost");
        let user = issue(&authority, &[], "tls-user");
        let stranger = issue(&authority, &[], "nobody-here");
        let rogue = issue(&ca("someone else"), &[], "tls-user");
        std::fs::write(dir.path().join("server.pem"), server.cert.pem()).expect("write");
        std::fs::write(dir.path().join("server.key"), server.key.serialize_pem()).expect("write");
        std::fs::write(dir.path().join("ca.pem"), authority.cert.pem()).expect("write");
        Pki {
            dir,
            authority,
            user,
            stranger,
            rogue,
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// What lapin is given: our CA to trust, and the client's certificate if any.
    fn client(&self, who: Option<&Issued>) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: who.map(Issued::identity),
            cert_chain: Some(self.authority.cert.pem()),
        }
    }
}

/// A warren process; killed when dropped.
struct Broker {
    child: Child,
    amqp: u16,
    amqps: u16,
    _data: tempfile::TempDir,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn binary() -> PathBuf {
    PathBuf::from(std::env::var("WARREN_BIN").expect("WARREN_BIN names the warren binary"))
}

/// Start warren with TLS on a free port (and plain AMQP on another), the user "tls-user"
/// (permitted on "/") imported from a definitions file, plus `extra` flags; wait until both
/// ports accept connections.
fn start(pki: &Pki, extra: &[&str]) -> Broker {
    let data = tempfile::tempdir().expect("tempdir");
    let definitions = data.path().join("definitions.json");
    std::fs::write(
        &definitions,
        r#"{"users": [{"name": "tls-user", "password": "never-used-by-EXTERNAL", "tags": ""}],
            "permissions": [{"user": "tls-user", "vhost": "/",
                             "configure": ".*", "write": ".*", "read": ".*"}]}"#,
    )
    .expect("write");
    let (amqp, amqps) = (free_port(), free_port());
    let path = |p: &Path| p.to_string_lossy().into_owned();
    let child = Command::new(binary())
        .arg("server")
        .args(["--amqp-listen", &format!("127.0.0.1:{amqp}")])
        .args(["--amqps-listen", &format!("127.0.0.1:{amqps}")])
        .args(["--management-listen", "none"])
        .args(["--data-dir", &path(&data.path().join("data"))])
        .args(["--tls-cert", &path(&pki.file("server.pem"))])
        .args(["--tls-key", &path(&pki.file("server.key"))])
        .args(["--tls-ca", &path(&pki.file("ca.pem"))])
        .args(["--load-definitions", &path(&definitions)])
        .args(extra)
        .env("WARREN_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start warren");
    let broker = Broker {
        child,
        amqp,
        amqps,
        _data: data,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    for port in [amqp, amqps] {
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "warren did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    broker
}

/// Connect over TLS (the server's certificate names "localhost").
async fn connect_tls(
    broker: &Broker,
    credentials: &str,
    query: &str,
    tls: OwnedTLSConfig,
) -> lapin::Result<Connection> {
    let uri = format!("amqps://{credentials}localhost:{}/%2f{query}", broker.amqps);
    let runtime = lapin::runtime::default_runtime()?;
    let connect =
        Connection::connect_with_config(&uri, ConnectionProperties::default(), tls, runtime);
    tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .expect("a TLS connect that neither succeeds nor fails")
}

/// Publish to a fresh queue with confirms (as `user_id`, when given) and get the message
/// back: the connection works end to end.
async fn round_trip(conn: &Connection, queue: &str, user_id: Option<&str>) -> lapin::Result<()> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    let mut props = BasicProperties::default();
    if let Some(u) = user_id {
        props = props.with_user_id(u.into());
    }
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            b"over tls",
            props,
        )
        .await?
        .await?;
    assert!(confirm.is_ack(), "{confirm:?}");
    let got = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await?
        .expect("the message");
    assert_eq!(got.delivery.data, b"over tls");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapin_speaks_amqp_over_tls_trusting_the_ca() {
    let pki = Pki::new();
    let broker = start(&pki, &[]);
    let conn = connect_tls(&broker, "guest:guest@", "", pki.client(None))
        .await
        .expect("amqps connection");
    round_trip(&conn, "lapin-tls", None)
        .await
        .expect("round trip over TLS");
    // (lapin may still be closing the channel round_trip dropped: the result is lapin's.)
    let _ = conn.close(200, "bye".into()).await;
    // The plain listener beside it.
    let plain = Connection::connect(
        &format!("amqp://guest:guest@127.0.0.1:{}/%2f", broker.amqp),
        ConnectionProperties::default(),
    )
    .await
    .expect("plain connection");
    round_trip(&plain, "lapin-plain", None)
        .await
        .expect("round trip");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_are_checked_against_the_ca() {
    let pki = Pki::new();
    let broker = start(&pki, &["--tls-verify-peer", "--tls-fail-if-no-peer-cert"]);
    // No certificate, or one another CA signed: no connection.
    assert!(connect_tls(&broker, "guest:guest@", "", pki.client(None))
        .await
        .is_err());
    assert!(
        connect_tls(&broker, "guest:guest@", "", pki.client(Some(&pki.rogue)))
            .await
            .is_err()
    );
    // A certificate the CA signed, logging in with PLAIN.
    let conn = connect_tls(&broker, "guest:guest@", "", pki.client(Some(&pki.user)))
        .await
        .expect("a client the CA vouches for");
    round_trip(&conn, "lapin-verified", None)
        .await
        .expect("round trip");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_logs_in_as_the_certificates_common_name() {
    let pki = Pki::new();
    let broker = start(&pki, &["--tls-verify-peer"]);
    let external = "?auth_mechanism=external";
    let conn = connect_tls(&broker, "", external, pki.client(Some(&pki.user)))
        .await
        .expect("EXTERNAL login as tls-user");
    // A message's user_id must be the login's (406 otherwise): the login is tls-user.
    round_trip(&conn, "lapin-external", Some("tls-user"))
        .await
        .expect("publish as tls-user");
    let err = round_trip(&conn, "lapin-external-2", Some("guest"))
        .await
        .expect_err("publishing as guest");
    assert!(err.to_string().contains("PRECONDITION_FAILED"), "{err}");
    // A common name that names no user.
    let err = connect_tls(&broker, "", external, pki.client(Some(&pki.stranger)))
        .await
        .expect_err("no user nobody-here");
    assert!(
        err.to_string().contains("ACCESS_REFUSED") || err.to_string().contains("403"),
        "{err}"
    );
    // EXTERNAL is offered on TLS without a client certificate too (as RabbitMQ offers it), and
    // refused with 403 there; it is not offered on the plain listener.
    let err = connect_tls(&broker, "", external, pki.client(None))
        .await
        .expect_err("EXTERNAL without a certificate");
    assert!(err.to_string().contains("ACCESS_REFUSED"), "{err}");
    let uri = format!("amqp://127.0.0.1:{}/%2f{external}", broker.amqp);
    let plain = Connection::connect(&uri, ConnectionProperties::default());
    let plain = tokio::time::timeout(Duration::from_secs(10), plain)
        .await
        .expect("an answer");
    assert!(plain.is_err());
}
