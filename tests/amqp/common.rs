//! Test harness: the real server on 127.0.0.1:0 in-process, lapin clients, and a raw-frame
//! client for the error cases a well-behaved client library cannot produce.

#![allow(dead_code)]

use amq_protocol::protocol::{channel, connection, queue, AMQPClass};
use bytes::BytesMut;
use futures::StreamExt;
use lapin::{Connection, ConnectionProperties};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::codec::Decoder;
use warren::{Config, Shared};
use warren_protocol::{Frame, FrameCodec, OutBuffer, PROTOCOL_HEADER};

/// How long any single wait in a test may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(5);

pub struct TestServer {
    pub addr: SocketAddr,
    pub data_dir: tempfile::TempDir,
    pub shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_with(Config::default()).await
    }

    pub async fn start_with(config: Config) -> Self {
        let data_dir = tempfile::tempdir().expect("temp dir");
        Self::start_in(config, data_dir).await
    }

    /// Start on an existing data folder (what a restart does).
    async fn start_in(mut config: Config, data_dir: tempfile::TempDir) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        config.amqp_listen = addr;
        config.data_dir = data_dir.path().to_path_buf();
        let shared = Shared::open(config).expect("open the data folder");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(warren::serve(listener, shared.clone(), async {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            data_dir,
            shared,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Stop gracefully and start again on the same data folder (new port).
    pub async fn restart(self) -> Self {
        let config = self.shared.config.clone();
        self.restart_with(config).await
    }

    /// Restart on the same data folder with other settings.
    pub async fn restart_with(mut self, config: Config) -> Self {
        self.stop().await;
        let TestServer {
            data_dir, shared, ..
        } = self;
        // The store closes when the last handle on the shared state goes.
        wait_for_last_handle(shared).await;
        Self::start_in(config, data_dir).await
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    pub async fn connect(&self) -> Connection {
        self.connect_url(&self.url()).await
    }

    pub async fn connect_url(&self, url: &str) -> Connection {
        tokio::time::timeout(
            WAIT,
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        .expect("connect timed out")
        .expect("connect")
    }

    /// Raise the disk alarm (every byte free counts as below the limit) and wait until it is
    /// on; `clear_disk_alarm` lowers it again.
    pub async fn raise_disk_alarm(&self) {
        self.shared
            .disk_free_limit
            .store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + WAIT;
        while !*self.shared.disk_alarm.borrow() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "disk alarm never raised"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn clear_disk_alarm(&self) {
        self.shared
            .disk_free_limit
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stop the server as SIGTERM would, and wait for it.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }
}

async fn wait_for_last_handle(shared: Arc<Shared>) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut shared = shared;
    loop {
        match Arc::try_unwrap(shared) {
            Ok(inner) => {
                drop(inner);
                return;
            }
            Err(back) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "server state still in use"
                );
                shared = back;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// The AMQP reply code carried by a lapin error, if any.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// The reply code and text of a lapin error (panics on other errors).
pub fn amqp_error(e: &lapin::Error) -> (u16, String) {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            (amqp.get_id(), amqp.get_message().as_str().to_string())
        }
        other => panic!("expected an AMQP error, got {other:?}"),
    }
}

/// The error of a method sent after one the broker answers only by closing the channel (an
/// ack): the channel.close can reach lapin before it sends the method, which then fails as
/// "channel closing" without going out; otherwise it carries the broker's code and text.
pub fn assert_refused_after_unanswered(e: &lapin::Error, code: u16, text: &str) {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(_) => {
            assert_eq!(amqp_error(e), (code, text.to_string()))
        }
        lapin::ErrorKind::InvalidChannelState(..) => {}
        other => panic!("expected the channel closed with {code}, got {other:?}"),
    }
}

/// Next delivery from a consumer, within [`WAIT`].
pub async fn next_delivery(consumer: &mut lapin::Consumer) -> lapin::message::Delivery {
    tokio::time::timeout(WAIT, consumer.next())
        .await
        .expect("no delivery in time")
        .expect("consumer ended")
        .expect("delivery error")
}

/// A consumer with automatic acknowledgement (`no_ack`) on `queue`, tagged `tag` ("" lets the
/// broker name it).
pub async fn consume_no_ack(ch: &lapin::Channel, queue: &str, tag: &str) -> lapin::Consumer {
    ch.basic_consume(
        queue.into(),
        tag.into(),
        lapin::options::BasicConsumeOptions {
            no_ack: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .expect("basic.consume")
}

/// Assert that no delivery arrives for a short while.
pub async fn no_delivery(consumer: &mut lapin::Consumer) {
    if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await {
        panic!("unexpected delivery: {d:?}");
    }
}

pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// A client that speaks frames directly.
pub struct Raw {
    pub stream: TcpStream,
    buf: BytesMut,
    codec: FrameCodec,
}

impl Raw {
    pub async fn tcp(addr: SocketAddr) -> Raw {
        let stream = TcpStream::connect(addr).await.expect("tcp connect");
        Raw {
            stream,
            buf: BytesMut::new(),
            codec: FrameCodec::new(0),
        }
    }

    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    pub async fn send(&mut self, channel: u16, method: AMQPClass) {
        let mut out = OutBuffer::new();
        out.method(channel, &method);
        self.send_bytes(&out.to_vec()).await;
    }

    /// Raw bytes until EOF or [`WAIT`] (used for the protocol header answer).
    pub async fn read_some(&mut self) -> Vec<u8> {
        let mut data = vec![0u8; 64];
        match tokio::time::timeout(WAIT, self.stream.read(&mut data)).await {
            Ok(Ok(n)) => data[..n].to_vec(),
            _ => Vec::new(),
        }
    }

    /// Next frame; None at EOF. Panics after [`WAIT`].
    pub async fn recv(&mut self) -> Option<Frame> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(frame) = self
                .codec
                .decode(&mut self.buf)
                .expect("server sent a bad frame")
            {
                return Some(frame);
            }
            let mut chunk = [0u8; 8192];
            let n = tokio::time::timeout_at(deadline, self.stream.read(&mut chunk))
                .await
                .expect("no frame from server in time")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Next method frame (heartbeats skipped).
    pub async fn recv_method(&mut self) -> Option<(u16, AMQPClass)> {
        loop {
            match self.recv().await? {
                Frame::Method(ch, m) => return Some((ch, m)),
                Frame::Heartbeat(_) => continue,
                other => panic!("expected a method, got {other:?}"),
            }
        }
    }

    /// Header, tune and open with guest/guest; returns the server's tune.
    pub async fn handshake_with(
        addr: SocketAddr,
        channel_max: u16,
        frame_max: u32,
        heartbeat: u16,
    ) -> (Raw, connection::Tune, connection::Start) {
        let mut raw = Raw::tcp(addr).await;
        raw.send_bytes(&PROTOCOL_HEADER).await;
        let start = match raw.recv_method().await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Start(s)))) => s,
            other => panic!("expected start, got {other:?}"),
        };
        let mut caps = amq_protocol::types::FieldTable::default();
        for cap in ["authentication_failure_close", "connection.blocked"] {
            caps.insert(cap.into(), amq_protocol::types::AMQPValue::Boolean(true));
        }
        let mut props = amq_protocol::types::FieldTable::default();
        props.insert(
            "capabilities".into(),
            amq_protocol::types::AMQPValue::FieldTable(caps),
        );
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
        )
        .await;
        let tune = match raw.recv_method().await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Tune(t)))) => t,
            other => panic!("expected tune, got {other:?}"),
        };
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            })),
        )
        .await;
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        )
        .await;
        match raw.recv_method().await {
            Some((0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))) => {}
            other => panic!("expected open-ok, got {other:?}"),
        }
        (raw, tune, start)
    }

    pub async fn handshake(addr: SocketAddr) -> Raw {
        Self::handshake_with(addr, 2047, 131072, 0).await.0
    }

    /// A handshake, channel 1 open, and queue `name` declared on it (transient).
    pub async fn with_queue(addr: SocketAddr, name: &str) -> Raw {
        let mut raw = Self::handshake(addr).await;
        raw.open_channel(1).await;
        raw.send(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.into(),
                ..Default::default()
            })),
        )
        .await;
        match raw.recv_method().await {
            Some((1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_)))) => raw,
            other => panic!("expected queue.declare-ok, got {other:?}"),
        }
    }

    pub async fn open_channel(&mut self, ch: u16) {
        self.send(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await;
        match self.recv_method().await {
            Some((c, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))) if c == ch => {}
            other => panic!("expected channel.open-ok, got {other:?}"),
        }
    }

    /// Wait for connection.close (skipping other frames) and answer close-ok.
    pub async fn expect_connection_close(&mut self) -> connection::Close {
        loop {
            match self.recv().await {
                Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                    let ok = AMQPClass::Connection(connection::AMQPMethod::CloseOk(
                        connection::CloseOk {},
                    ));
                    let mut out = OutBuffer::new();
                    out.method(0, &ok);
                    let _ = self.stream.write_all(&out.to_vec()).await;
                    return c;
                }
                Some(_) => continue,
                None => panic!("socket closed without connection.close"),
            }
        }
    }

    /// Wait for channel.close on `ch`.
    pub async fn expect_channel_close(&mut self, ch: u16) -> channel::Close {
        loop {
            match self.recv().await {
                Some(Frame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(close))))
                    if c == ch =>
                {
                    return close;
                }
                Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                    panic!("connection closed instead of channel: {c:?}")
                }
                Some(_) => continue,
                None => panic!("socket closed"),
            }
        }
    }

    /// Send channel.open without waiting for the answer.
    pub async fn open_channel_no_wait(&mut self, ch: u16) {
        self.send(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await;
    }

    /// The server closes the socket (EOF) within [`WAIT`].
    pub async fn expect_eof(&mut self) {
        loop {
            if self.recv().await.is_none() {
                return;
            }
        }
    }
}

/// The real `warren` binary, started on `data` (a free loopback port, extra server arguments),
/// once it accepts connections.
pub struct Binary {
    pub child: std::process::Child,
    pub url: String,
}

impl Binary {
    /// The AMQP address of its URL (amqp://guest:guest@127.0.0.1:PORT/%2f).
    pub fn addr(&self) -> SocketAddr {
        let port: u16 = self
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.split('/').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {}", self.url));
        SocketAddr::from(([127, 0, 0, 1], port))
    }
}

impl Drop for Binary {
    /// A test that fails half-way must not leave a broker running (it would hold its port,
    /// its data folder, and whatever descriptors it inherited, such as a build lock).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub async fn spawn_binary(data: &std::path::Path, extra: &[&str]) -> Binary {
    spawn_binary_with(data, extra, |_| {}).await
}

/// Like [`spawn_binary`], with extra environment variables.
pub async fn spawn_binary_env(
    data: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Binary {
    spawn_binary_with(data, extra, |c| {
        c.envs(env.iter().copied());
    })
    .await
}

/// The `warren server` command on `data` and a free loopback port (returned), run through
/// `wrapper` (a program and its arguments that exec the rest, like `prlimit ... --`) if any.
fn binary_command(
    data: &std::path::Path,
    extra: &[&str],
    wrapper: &[&str],
) -> (std::process::Command, u16) {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut cmd = match wrapper {
        [program, args @ ..] => {
            let mut c = std::process::Command::new(program);
            c.args(args).arg(env!("CARGO_BIN_EXE_warren"));
            c
        }
        [] => std::process::Command::new(env!("CARGO_BIN_EXE_warren")),
    };
    cmd.args(["server", "--amqp-listen", &format!("127.0.0.1:{port}")]);
    // No HTTP API unless the test asks for one.
    if !extra.contains(&"--management-listen") {
        cmd.args(["--management-listen", "none"]);
    }
    cmd.args(extra)
        .arg("--data-dir")
        .arg(data)
        .env("WARREN_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    (cmd, port)
}

/// Like [`spawn_binary`], with `configure` applied to the command first (environment,
/// resource limits, where stderr goes).
pub async fn spawn_binary_with(
    data: &std::path::Path,
    extra: &[&str],
    configure: impl FnOnce(&mut std::process::Command),
) -> Binary {
    spawn_binary_wrapped(data, extra, &[], configure).await
}

/// Like [`spawn_binary_with`], run through `wrapper` (see `binary_command`).
pub async fn spawn_binary_wrapped(
    data: &std::path::Path,
    extra: &[&str],
    wrapper: &[&str],
    configure: impl FnOnce(&mut std::process::Command),
) -> Binary {
    let (mut cmd, port) = binary_command(data, extra, wrapper);
    configure(&mut cmd);
    let mut child = cmd.spawn().expect("start warren");
    let deadline = tokio::time::Instant::now() + WAIT * 2;
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("warren exited at start: {status}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "warren did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Binary {
        child,
        url: format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
    }
}

/// Run the binary on `data` until it exits by itself (a start that must fail; killed and
/// failed after 30 s): its exit status and what it wrote to stderr.
pub fn run_binary_to_exit(
    data: &std::path::Path,
    extra: &[&str],
) -> (std::process::ExitStatus, String) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let (mut cmd, _) = binary_command(data, extra, &[]);
    cmd.stderr(log.reopen().unwrap());
    let mut child = cmd.spawn().expect("start warren");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("warren did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(log.path()).unwrap())
}

/// Stop a binary as SIGTERM does and wait (bounded) for a clean exit.
pub fn stop_binary(b: &mut Binary) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &b.child.id().to_string()])
        .status();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = b.child.try_wait().unwrap() {
            assert!(status.success(), "warren exited with {status} on SIGTERM");
            return;
        }
        if std::time::Instant::now() > deadline {
            let _ = b.child.kill();
            let _ = b.child.wait();
            panic!("warren did not stop within 15 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `method path` with a JSON body on the management API at 127.0.0.1:`port` as guest (unless
/// `headers` authorize otherwise), with extra headers: the status and the body.
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let uri = format!("http://127.0.0.1:{port}{path}");
    let mut req = ureq::http::Request::builder()
        .method(method)
        .uri(&uri)
        .header("content-type", "application/json");
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
    {
        req = req.header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=");
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(body.unwrap_or("").to_string()).unwrap();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(10)))
        .allow_non_standard_methods(true)
        .build()
        .into();
    // Status 0: no answer (a node not listening yet, or gone), with the error as the body.
    let mut r = match agent.run(req) {
        Ok(r) => r,
        Err(e) => return (0, e.to_string()),
    };
    let status = r.status().as_u16();
    (status, r.body_mut().read_to_string().unwrap_or_default())
}

/// Wait (at most [`WAIT`]) until `f` holds.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
