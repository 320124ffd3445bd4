//! One task per socket: protocol header, then a read loop feeding the [`Session`]; a second task
//! owns the write half and drains the connection's [`Outbox`].

pub mod session;

use crate::broker::cmd::{Cmd, Outcome};
use crate::broker::DELIVERY_BUDGET;
use crate::node::Shared;
use crate::outbox::Outbox;
use crate::registry::ConnInfo;
use futures::{FutureExt, StreamExt};
use session::{Next, Session};
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{sleep_until, timeout, Instant};
use tokio_util::codec::{Decoder, FramedRead};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use warren_protocol::{FrameCodec, OutBuffer, PROTOCOL_HEADER};

/// Stop reading from a client whose outgoing buffer is this large until the writer catches up
/// (a client that stops reading must not grow the broker's memory without bound).
const OUTBOX_HIGH_WATER: usize = 8 * 1024 * 1024;

/// The halves of a client's stream: a TCP socket's, or a TLS session's over one.
type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// Serve one AMQP client on a TCP socket.
pub async fn serve(
    socket: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
) {
    let local = socket.local_addr().unwrap_or(peer);
    let (rd, wr) = socket.into_split();
    serve_halves(Box::new(rd), Box::new(wr), peer, local, None, shared, stop).await
}

/// Serve one AMQP client over TLS (`--amqps-listen`), once its handshake is done.
pub async fn serve_tls(
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    peer: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
) {
    let (tcp, session) = stream.get_ref();
    let local = tcp.local_addr().unwrap_or(peer);
    let tls = crate::registry::TlsPeer {
        protocol: match session.protocol_version() {
            Some(tokio_rustls::rustls::ProtocolVersion::TLSv1_3) => "tlsv1.3".into(),
            Some(tokio_rustls::rustls::ProtocolVersion::TLSv1_2) => "tlsv1.2".into(),
            v => format!("{v:?}"),
        },
        cipher: session
            .negotiated_cipher_suite()
            .map(|s| format!("{:?}", s.suite()))
            .unwrap_or_default(),
        // Only a certificate the CA verified reaches here (`--tls-verify-peer`); without it
        // rustls asks for none.
        peer_cert: session.peer_certificates().is_some_and(|c| !c.is_empty()),
        subject: session
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(crate::tls::subject),
    };
    let (rd, wr) = tokio::io::split(stream);
    serve_halves(
        Box::new(rd),
        Box::new(wr),
        peer,
        local,
        Some(tls),
        shared,
        stop,
    )
    .await
}

async fn serve_halves(
    mut rd: Reader,
    wr: Writer,
    peer: SocketAddr,
    local: SocketAddr,
    tls: Option<crate::registry::TlsPeer>,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let handshake_deadline = Instant::now() + shared.config.handshake_timeout;

    // Protocol header: anything else gets ours back and the socket closed.
    let mut header = [0u8; 8];
    match timeout(shared.config.handshake_timeout, rd.read_exact(&mut header)).await {
        Ok(Ok(_)) => {}
        _ => {
            debug!("no protocol header");
            return;
        }
    }
    // RabbitMQ also takes the pre-0-9-1 header `AMQP 1 1 0 9` as 0-9-1; so do we.
    if header != PROTOCOL_HEADER && header != *b"AMQP\x01\x01\x00\x09" {
        info!(header = ?header, "unsupported protocol header");
        let mut wr = wr;
        let _ = wr.write_all(&PROTOCOL_HEADER).await;
        let _ = wr.shutdown().await;
        return;
    }

    // Listed by the management API from here to the end of the connection.
    let info = Arc::new(ConnInfo::new(peer, local).with_tls(tls));
    let _listed = shared.registry.register(info.clone());
    let outbox = Arc::new(Outbox::new(shared.config.frame_max));
    let writer_done = CancellationToken::new();
    let writer = tokio::spawn(write_loop(
        wr,
        outbox.clone(),
        shared.clone(),
        writer_done.clone(),
    ));

    let (commit_tx, commit_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut session = Session::new(shared.clone(), outbox.clone(), peer, commit_tx);
    session.info = Some(info.clone());
    session.start();
    // A panic anywhere in the connection's handling (a defect) must not leak what the
    // connection holds in the broker (exclusive queues, unacked deliveries, its registry
    // entries) nor leave its client waiting: it is caught here, logged, the client gets
    // connection.close 541 INTERNAL_ERROR, and the same teardown as a normal close runs.
    // The broker lock is a parking_lot mutex (no poisoning), released as the panic unwinds.
    let ended = AssertUnwindSafe(read_loop(
        &mut session,
        rd,
        &shared,
        &outbox,
        &info,
        &writer_done,
        &mut stop,
        commit_rx,
        handshake_deadline,
    ))
    .catch_unwind()
    .await;
    if let Err(panic) = ended {
        error!(
            panic = panic_text(&*panic),
            "connection task panicked: closing it with 541 INTERNAL_ERROR"
        );
        session.internal_error();
    }
    if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| session.teardown())) {
        error!(
            panic = panic_text(&*panic),
            "releasing a connection's broker state panicked"
        );
    }
    outbox.close_after_flush();
    // Give the writer a moment to flush a close frame; then drop everything. A writer still
    // blocked on a client that reads nothing is stopped: it holds the socket open.
    let mut writer = writer;
    if timeout(Duration::from_secs(2), &mut writer).await.is_err() {
        debug!("writer did not finish: stopped");
        writer.abort();
    }
}

/// The text of a caught panic (a `&str` or `String` payload, as `panic!` makes them).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Read frames and hand them to the session until the connection ends (the caller tears the
/// session down, also after a panic in here).
#[allow(clippy::too_many_arguments)]
async fn read_loop(
    session: &mut Session,
    rd: Reader,
    shared: &Arc<Shared>,
    outbox: &Arc<Outbox>,
    info: &Arc<ConnInfo>,
    writer_done: &CancellationToken,
    stop: &mut watch::Receiver<bool>,
    mut commit_rx: tokio::sync::mpsc::UnboundedReceiver<crate::commit::Done>,
    handshake_deadline: Instant,
) {
    let mut frames = FramedRead::new(rd, FrameCodec::new(session.frame_max()));
    // Decodes the frames already buffered (below), keeping its own memo of the last publish.
    let mut inline = FrameCodec::new(session.frame_max());
    let mut disk_alarm = shared.disk_alarm.subscribe();
    let mut memory_alarm = shared.memory_alarm.subscribe();
    // Woken when a queue that held a publisher drains (flow control, below).
    let drained = shared.drained.clone();
    let mut last_recv = Instant::now();
    // Set when we sent connection.close and wait for close-ok.
    let mut closing_deadline: Option<Instant> = None;

    loop {
        // Disk alarm: a connection that publishes stops being read (TCP back-pressure) until
        // the alarm clears; clients that understand it are told with connection.blocked.
        if session.published && shared.alarmed() && session.is_open() {
            session.published = false;
            let memory = shared.alarms.load(std::sync::atomic::Ordering::Acquire)
                & crate::node::MEMORY_ALARM;
            let reason = if memory != 0 {
                "low on memory"
            } else {
                "low on disk"
            };
            session.send_blocked(Some(reason));
            loop {
                tokio::select! {
                    changed = disk_alarm.changed() => {
                        if changed.is_err() || !shared.alarmed() {
                            break;
                        }
                    }
                    changed = memory_alarm.changed() => {
                        if changed.is_err() || !shared.alarmed() {
                            break;
                        }
                    }
                    _ = writer_done.cancelled() => break,
                    // Asked to close (the management API, a leader change, the shutdown): a
                    // blocked publisher is closed like any other, not only once the alarm
                    // clears.
                    asked = asked_to_close(info, stop) => {
                        closing_deadline = Some(close_now(session, shared, info, asked));
                        break;
                    }
                }
            }
            if closing_deadline.is_none() {
                session.send_blocked(None);
            }
            continue;
        }
        session.published = false;
        // Flow control: this client published into a queue past its window; wait for the
        // store to take it before reading more.
        if let (Some(ticket), Some(committer)) = (session.throttle.take(), &shared.committer) {
            while closing_deadline.is_none() && committer.written.load(Ordering::Acquire) < ticket {
                let progress = committer.progress.notified();
                if committer.written.load(Ordering::Acquire) >= ticket {
                    break;
                }
                // A cluster node's store writes may linger (`commit::LINGER`): not this one.
                committer.hurry();
                tokio::select! {
                    _ = progress => {}
                    _ = writer_done.cancelled() => break,
                    // A store that stopped (a full disk) never takes it: a close asked for
                    // meanwhile (a leader that stopped on it closes its clients) must still
                    // happen, or the client waits for ever.
                    asked = asked_to_close(info, stop) => {
                        closing_deadline = Some(close_now(session, shared, info, asked));
                    }
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
        // Flow control: a queue kept this client's message in memory past its window because
        // its consumers are behind; wait for them (bounded: the queue stops holding after
        // `flow_hold` and pages instead).
        if !session.hold.is_empty() {
            let hold = std::mem::take(&mut session.hold);
            let deadline = Instant::now() + shared.config.flow_hold;
            loop {
                let notified = drained.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let caller = crate::node::Caller::Node {
                    conn: session.conn,
                    outbox: None,
                };
                // Commands are values: each pass hands the core its own copy (a few queue
                // ids, inline in the SmallVec: no allocation up to eight).
                let queues = hold.clone();
                let (holding, _) = shared.execute(caller, Cmd::Holding { queues });
                if !matches!(holding, Ok(Outcome::Holding(true))) {
                    break;
                }
                tokio::select! {
                    _ = notified => {}
                    _ = sleep_until(deadline) => break,
                    _ = writer_done.cancelled() => break,
                }
            }
        }
        if outbox.len() > OUTBOX_HIGH_WATER {
            // A client that stops reading keeps the outbox full, and this loop here: a close
            // asked for meanwhile, and its deadline, are still kept.
            tokio::select! {
                _ = outbox.drained.notified() => {}
                _ = writer_done.cancelled() => break,
                // A reply held for a commit can be what keeps the outbox full: the commit's
                // news must still be taken, or the hold (and the connection) stays for ever.
                Some(done) = commit_rx.recv() => session.on_commit(done),
                asked = asked_to_close(info, stop), if closing_deadline.is_none() => {
                    closing_deadline = Some(close_now(session, shared, info, asked));
                }
                _ = sleep_until(closing_deadline.unwrap_or_else(Instant::now)),
                    if closing_deadline.is_some() => {
                    debug!("the client read nothing until the close's deadline");
                    break;
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
            continue;
        }
        let heartbeat = session.heartbeat();
        let deadline = if let Some(d) = closing_deadline {
            d
        } else if !session.is_open() {
            handshake_deadline
        } else if heartbeat > 0 {
            // A peer silent for two heartbeat intervals is gone.
            last_recv + Duration::from_secs(2 * heartbeat as u64)
        } else {
            Instant::now() + Duration::from_secs(3600)
        };
        tokio::select! {
            biased;
                        _ = writer_done.cancelled() => break,
            Some(done) = commit_rx.recv() => session.on_commit(done),
            asked = asked_to_close(info, stop), if closing_deadline.is_none() => {
                closing_deadline = Some(close_now(session, shared, info, asked));
            }
            frame = frames.next() => {
                match frame {
                    None => break,
                    Some(Err(e)) => {
                        debug!(error = %e, "frame error");
                        session.frame_error(&e);
                        break;
                    }
                    Some(Ok(frame)) => {
                        last_recv = Instant::now();
                        let mut next = session.handle(frame);
                        // The frames already read: handle them now rather than going back
                        // through select! for each (bounded, and stopping for the checks at the
                        // top of the loop).
                        let mut more = 0;
                        while matches!(next, Next::Continue) && more < 256 {
                            if outbox.len() > OUTBOX_HIGH_WATER
                                || session.closed_channel
                                || session.throttle.is_some()
                                || !session.hold.is_empty()
                                || (session.published && shared.alarmed())
                            {
                                break;
                            }
                            // The negotiated frame_max applies from tune-ok on.
                            inline.frame_max = session.frame_max();
                            match inline.decode(frames.read_buffer_mut()) {
                                Ok(Some(frame)) => next = session.handle(frame),
                                Ok(None) => break,
                                Err(e) => {
                                    debug!(error = %e, "frame error");
                                    session.frame_error(&e);
                                    next = Next::Close;
                                }
                            }
                            more += 1;
                        }
                        if !has_complete_frame(frames.read_buffer()) {
                            session.flush_confirms();
                        }
                        if std::mem::take(&mut session.closed_channel) {
                            // The writer was woken from this task, so tokio runs it on this
                            // worker only once this task yields, and reads of a busy socket
                            // are ready at once: without a yield the channel.close waited
                            // behind every frame the client kept sending (RabbitMQ's comes back
                            // between them; lapin's ack_after_close test relies on it).
                            tokio::task::yield_now().await;
                        }
                        frames.decoder_mut().frame_max = session.frame_max();
                        match next {
                            Next::Continue => {}
                            Next::Closing => {
                                if closing_deadline.is_none() {
                                    closing_deadline = Some(Instant::now() + Duration::from_secs(3));
                                }
                            }
                            Next::Drain => {
                                if closing_deadline.is_none() {
                                    // RabbitMQ waits for the client's TCP close up to the
                                    // heartbeat interval, at most 30 s.
                                    let hb = session.heartbeat();
                                    let wait = if hb > 0 { hb.min(30) } else { 30 };
                                    closing_deadline =
                                        Some(Instant::now() + Duration::from_secs(wait as u64));
                                }
                            }
                            Next::Linger => {
                                if closing_deadline.is_none() {
                                    closing_deadline = Some(Instant::now() + session::LINGER);
                                }
                            }
                            Next::Close => break,
                        }
                    }
                }
            }
            _ = sleep_until(deadline) => {
                if closing_deadline.is_some() {
                    debug!("no close-ok in time");
                } else if !session.is_open() {
                    info!("handshake timed out");
                } else {
                    warn!(heartbeat, "missed heartbeats from client, closing");
                }
                break;
            }
        }
    }
}

/// Whether the read buffer holds at least one whole frame (else we are at the end of what the
/// client sent in one go, and pending confirms should go out now).
fn has_complete_frame(buf: &[u8]) -> bool {
    if buf.len() < 7 {
        return false;
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    buf.len() >= size + 8
}

/// Why a connection is to close from outside: asked to (RabbitMQ's DELETE
/// /api/connections/{name}, a leader that stops leading: `ConnInfo::close`), or the node's
/// shutdown.
enum Asked {
    Close,
    Shutdown,
}

/// Resolves once the connection is asked to close from outside (every wait of the read loop
/// selects on it: a connection held back by flow control, blocked by an alarm or not read by
/// its client still closes when asked).
async fn asked_to_close(info: &ConnInfo, stop: &mut watch::Receiver<bool>) -> Asked {
    loop {
        tokio::select! {
            _ = info.close_requested.notified() => return Asked::Close,
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return Asked::Shutdown;
                }
            }
        }
    }
}

/// connection.close 320 with the reason asked for; returns when the connection ends at the
/// latest, close-ok or not.
fn close_now(session: &mut Session, shared: &Shared, info: &ConnInfo, asked: Asked) -> Instant {
    match asked {
        Asked::Close => {
            let reason = info.take_close_reason().unwrap_or_default();
            info!(%reason, "closing the connection as asked");
            session.force_close(&reason);
        }
        Asked::Shutdown => {
            session.force_close("broker forced connection closure with reason 'shutdown'")
        }
    }
    Instant::now() + shared.config.shutdown_grace
}

async fn write_loop(
    mut wr: Writer,
    outbox: Arc<Outbox>,
    shared: Arc<Shared>,
    done: CancellationToken,
) {
    // However the writer ends (also by a panic), the read loop hears of it and ends too.
    let _done = done.drop_guard();
    let mut local = OutBuffer::new();
    let mut last_write = Instant::now();
    let mut since_refill = 0usize;
    loop {
        outbox.take(&mut local);
        if !local.is_empty() {
            let len = local.len();
            // A vectored write: large bodies go from the message's memory to the socket.
            if let Err(e) = wr.write_all_buf(&mut local).await {
                debug!(error = %e, "write failed");
                break;
            }
            since_refill += len;
            local.clear();
            last_write = Instant::now();
            outbox.drained.notify_waiters();
            continue;
        }
        // Idle: everything handed to us is on the wire. Give the core back its delivery budget
        // if it ran dry (or a good part of it was used), which resumes held-back deliveries.
        if outbox.throttled.load(Ordering::Acquire) || since_refill >= DELIVERY_BUDGET as usize / 4
        {
            since_refill = 0;
            refill(&shared, &outbox);
            // Only what can go now: bytes behind a hold (deliveries waiting for their commit)
            // wait for the release to wake us. Looping on them spun here, taking the broker
            // lock over and over, and starved the node (seen under load on a cluster).
            if outbox.has_unheld() {
                continue;
            }
        }
        if outbox.close_after_flush.load(Ordering::Acquire) {
            break;
        }
        let heartbeat = outbox.heartbeat.load(Ordering::Relaxed);
        let beat_at = last_write + Duration::from_millis(heartbeat as u64 * 500);
        tokio::select! {
            _ = outbox.wake.notified() => {}
            _ = sleep_until(beat_at), if heartbeat > 0 => outbox.heartbeat(),
        }
    }
    let _ = wr.shutdown().await;
}

fn refill(shared: &Shared, outbox: &Outbox) {
    let conn = outbox.conn_id.load(Ordering::Acquire);
    if conn == 0 {
        return;
    }
    // The node refills only an empty outbox, and clears its `throttled` mark.
    let caller = crate::node::Caller::Node {
        conn,
        outbox: Some(outbox),
    };
    let budget = DELIVERY_BUDGET as usize;
    let _ = shared.execute(caller, Cmd::Refill { budget });
}

#[cfg(test)]
mod tests {
    use super::has_complete_frame;

    #[test]
    fn complete_frame_detection() {
        assert!(!has_complete_frame(&[1, 0, 1, 0, 0, 0]));
        assert!(!has_complete_frame(&[1, 0, 1, 0, 0, 0, 2, 9, 9]));
        assert!(has_complete_frame(&[1, 0, 1, 0, 0, 0, 2, 9, 9, 206]));
    }
}
