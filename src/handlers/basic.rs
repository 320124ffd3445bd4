//! basic class: qos, consume, cancel, publish (and the content it carries), get, ack, reject,
//! nack, recover.

use crate::broker::cmd::{Cmd, Outcome};
use crate::broker::Message;
use crate::conn::session::{Session, TxAck};
use amq_protocol::protocol::basic::{self, AMQPMethod as M};
use std::sync::Arc;
use warren_protocol::{AmqpError, Content};

impl Session {
    pub(crate) fn basic_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Qos(q) => self
                .run(Cmd::Qos {
                    ch,
                    prefetch_count: q.prefetch_count,
                    global: q.global,
                })
                .map(drop),
            M::Consume(c) => self.basic_consume(ch, c),
            M::Cancel(c) => self
                .run(Cmd::Cancel {
                    ch,
                    tag: c.consumer_tag.to_string(),
                    nowait: c.nowait,
                })
                .map(drop),
            M::Publish(p) => {
                if p.immediate {
                    return Err(AmqpError::not_implemented("immediate=true"));
                }
                self.chan(ch)?.content.publish(p.into())
            }
            M::Get(g) => self.basic_get(ch, g),
            M::Ack(a) => self.basic_ack(
                ch,
                TxAck::Ack {
                    tag: a.delivery_tag,
                    multiple: a.multiple,
                },
            ),
            M::Reject(r) => self.basic_ack(
                ch,
                TxAck::Reject {
                    tag: r.delivery_tag,
                    multiple: false,
                    requeue: r.requeue,
                },
            ),
            M::Nack(n) => self.basic_ack(
                ch,
                TxAck::Reject {
                    tag: n.delivery_tag,
                    multiple: n.multiple,
                    requeue: n.requeue,
                },
            ),
            M::RecoverAsync(r) => self.basic_recover(ch, r.requeue, false),
            M::Recover(r) => self.basic_recover(ch, r.requeue, true),
            M::QosOk(_)
            | M::ConsumeOk(_)
            | M::CancelOk(_)
            | M::Return(_)
            | M::Deliver(_)
            | M::GetOk(_)
            | M::GetEmpty(_)
            | M::RecoverOk(_) => Err(AmqpError::command_invalid(
                "this basic method is sent by servers, not clients",
            )),
        }
    }

    fn basic_consume(&mut self, ch: u16, c: basic::Consume) -> Result<(), AmqpError> {
        let queue = self.resolve_queue(ch, c.queue.as_str())?;
        self.run(Cmd::Consume {
            ch,
            queue,
            tag: c.consumer_tag.to_string(),
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            arguments: c.arguments,
            nowait: c.nowait,
        })
        .map(drop)
    }

    fn basic_get(&mut self, ch: u16, g: basic::Get) -> Result<(), AmqpError> {
        let queue = self.resolve_queue(ch, g.queue.as_str())?;
        // A head paged out is read with the broker lock released first (issue 13 point 5):
        // the get hands back the read it needs instead of getting, and is tried again with
        // what was read, which the queue takes in the same critical section as the get. Each
        // round moves the queue on (a batch is taken, expired messages go, or what made the
        // read stale, another read or a removal, happened); only the same read asked again
        // and again (a defect) ends the connection.
        let (mut read, mut last, mut same) = (None, None, 0);
        loop {
            let got = self.run(Cmd::Get {
                ch,
                queue: queue.clone(),
                no_ack: g.no_ack,
                read: read.take(),
            })?;
            let Outcome::Read(request) = got else {
                return Ok(());
            };
            if last.as_ref() == Some(&request.plan) {
                same += 1;
                if same >= 100 {
                    return Err(AmqpError::connection(
                        warren_protocol::ReplyCode::InternalError,
                        format!("basic.get from queue '{queue}' asked for the same read 100 times"),
                    ));
                }
            } else {
                same = 0;
            }
            last = Some(request.plan.clone());
            read = Some(Box::new(self.shared.read_for(request)));
        }
    }

    fn basic_ack(&mut self, ch: u16, ack: TxAck) -> Result<(), AmqpError> {
        if self.chan(ch)?.tx.is_some() {
            // Checked now, settled at commit (see `Broker::tx_settle`).
            let (tag, multiple, reject) = match ack {
                TxAck::Ack { tag, multiple } => (tag, multiple, None),
                TxAck::Reject {
                    tag,
                    multiple,
                    requeue,
                } => (tag, multiple, Some(requeue)),
            };
            return self
                .run(Cmd::Settle {
                    ch,
                    tag,
                    multiple,
                    reject,
                })
                .map(drop);
        }
        self.apply_ack(ch, ack)
    }

    pub(crate) fn apply_ack(&mut self, ch: u16, ack: TxAck) -> Result<(), AmqpError> {
        let cmd = match ack {
            TxAck::Ack { tag, multiple } => Cmd::Ack { ch, tag, multiple },
            TxAck::Reject {
                tag,
                multiple,
                requeue,
            } => Cmd::Reject {
                ch,
                tag,
                multiple,
                requeue,
            },
        };
        self.run(cmd).map(drop)
    }

    fn basic_recover(&mut self, ch: u16, requeue: bool, reply: bool) -> Result<(), AmqpError> {
        if !requeue {
            // As RabbitMQ: redelivery to the original consumer is not supported.
            return Err(AmqpError::not_implemented("requeue=false"));
        }
        self.run(Cmd::Recover { ch, reply }).map(drop)
    }

    /// A complete published message: route it now, or keep it for commit in tx mode.
    pub(crate) fn publish_content(&mut self, ch: u16, content: Content) -> Result<(), AmqpError> {
        // A whole message arrived: under a disk alarm the connection task stops reading now.
        self.published = true;
        if let Some(user_id) = content.properties.user_id() {
            // Users tagged impersonator may publish in another's name (RabbitMQ).
            if user_id.as_str() != self.user
                && !self.shared.query(|b| {
                    b.user(&self.user)
                        .is_some_and(|u| u.tags.iter().any(|t| t == "impersonator"))
                })
            {
                return Err(AmqpError::precondition_failed(format!(
                    "user_id property set to '{}' but authenticated user was '{}'",
                    user_id.as_str(),
                    self.user
                ))
                .on(60, 40));
            }
        }
        let expiration = match content.properties.expiration() {
            Some(e) => Some(crate::broker::args::parse_expiration(e.as_str()).map_err(
                |reason| {
                    AmqpError::precondition_failed(format!(
                        "invalid expiration '{}': {reason}",
                        e.as_str()
                    ))
                    .on(60, 40)
                },
            )?),
            None => None,
        };
        let mandatory = content.publish.mandatory;
        let (mut properties, mut raw_properties) = (content.properties, content.raw_properties);
        // Direct reply-to: the request carries this channel's reply address instead.
        if properties.reply_to().as_ref().map(|r| r.as_str()) == Some(crate::broker::REPLY_TO) {
            let address = self
                .run(Cmd::ReplyAddress { ch })
                .and_then(Outcome::into_address)
                .map_err(|e| e.on(60, 40))?;
            properties = properties.with_reply_to(address.as_str().into());
            raw_properties = warren_protocol::codec::encode_properties(&properties);
        }
        let msg = Arc::new(Message {
            exchange: content.publish.exchange,
            routing_key: content.publish.routing_key,
            properties,
            raw_properties,
            body: content.body,
            expiration,
        });
        let in_tx = self.chan(ch)?.tx.is_some();
        if in_tx {
            // Errors about the exchange come now, as in RabbitMQ; routing happens at commit.
            self.run(Cmd::CheckPublish { msg: msg.clone() })
                .map_err(|e| e.on(60, 40))?;
            if let Some(tx) = self.chan(ch)?.tx.as_mut() {
                tx.publishes.push((msg, mandatory));
            }
            return Ok(());
        }
        let (rejected, staged, held) = self.route_message(ch, msg, mandatory, true)?;
        for q in held {
            if !self.hold.contains(&q) {
                self.hold.push(q);
            }
        }
        let ticket = self.ctx.last_ticket.take();
        if staged {
            self.throttle = ticket.or(self.throttle);
        }
        let chan = self.chan(ch)?;
        if chan.confirm {
            chan.publish_seq += 1;
            if rejected {
                let seq = chan.publish_seq;
                chan.failed.insert(seq);
            }
            // A persistent message in a durable queue is confirmed after its fsync.
            if let Some(ticket) = ticket {
                let (seq, generation) = (chan.publish_seq, chan.generation);
                chan.durable_pending.push_back(seq);
                self.commit_waits
                    .push_back(crate::conn::session::CommitWait {
                        ticket,
                        channel: ch,
                        generation,
                        seq,
                    });
            }
        }
        Ok(())
    }

    /// Enqueue a message; unroutable mandatory messages come back as basic.return.
    /// Returns whether a queue refused the message (x-overflow reject-publish), whether a
    /// queue staged it past its in-memory window, and the queues that hold it past their
    /// window for their consumers.
    /// `check`: the write permission is checked here (a transaction's messages were checked
    /// when published, so that a commit is never partly refused).
    pub(crate) fn route_message(
        &mut self,
        ch: u16,
        msg: Arc<Message>,
        mandatory: bool,
        check: bool,
    ) -> Result<(bool, bool, crate::broker::Targets), AmqpError> {
        self.run(Cmd::Publish {
            ch,
            msg,
            mandatory,
            check,
        })
        .and_then(Outcome::into_published)
        .map_err(|e| e.on(60, 40))
    }
}
