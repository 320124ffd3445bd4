//! basic class: qos, consume, cancel, publish (and the content it carries), get, ack, reject,
//! nack, recover.

use crate::broker::permissions::{Access, Resource};
use crate::broker::Message;
use crate::conn::session::{core, exchange_or_default, Session, TxAck};
use amq_protocol::protocol::basic::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use std::sync::Arc;
use warren_protocol::{AmqpError, Content, ReplyCode};

impl Session {
    pub(crate) fn basic_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Qos(q) => {
                let conn = self.conn;
                core(&self.shared, &mut self.ctx, |b, fx| {
                    b.qos(conn, ch, q.prefetch_count, q.global, fx);
                    self.outbox
                        .method(ch, &AMQPClass::Basic(M::QosOk(basic::QosOk {})));
                });
                Ok(())
            }
            M::Consume(c) => self.basic_consume(ch, c),
            M::Cancel(c) => {
                let conn = self.conn;
                core(&self.shared, &mut self.ctx, |b, fx| {
                    b.cancel(conn, ch, c.consumer_tag.as_str(), fx);
                    if !c.nowait {
                        self.outbox.method(
                            ch,
                            &AMQPClass::Basic(M::CancelOk(basic::CancelOk {
                                consumer_tag: c.consumer_tag.clone(),
                            })),
                        );
                    }
                });
                Ok(())
            }
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
        let conn = self.conn;
        core(&self.shared, &mut self.ctx, |b, fx| {
            // Direct reply-to is no queue of the vhost: RabbitMQ checks nothing there.
            if queue != crate::broker::REPLY_TO {
                let (user, vhost) = (&self.user, &self.vhost);
                self.grant
                    .check(b, user, vhost, Access::Read, Resource::Queue, &queue)?;
            }
            // Deliveries the subscription causes land in `fx` and go out after consume-ok.
            let tag = b.consume(
                conn,
                ch,
                &self.vhost,
                &queue,
                c.consumer_tag.as_str(),
                c.no_ack,
                c.exclusive,
                &c.arguments,
                fx,
            )?;
            if !c.nowait {
                self.outbox.method(
                    ch,
                    &AMQPClass::Basic(M::ConsumeOk(basic::ConsumeOk {
                        consumer_tag: warren_protocol::short(&tag),
                    })),
                );
            }
            Ok(())
        })
    }

    fn basic_get(&mut self, ch: u16, g: basic::Get) -> Result<(), AmqpError> {
        let queue = self.resolve_queue(ch, g.queue.as_str())?;
        let conn = self.conn;
        // A head paged out is read with the broker lock released first (issue 13 point 5):
        // the get hands back the read it needs instead of getting, and is tried again once it
        // is done; a few times at most, as consumers may take what was read: the last try
        // reads for itself.
        for attempt in 0..4 {
            let read = core(&self.shared, &mut self.ctx, |b, _| {
                let (user, vhost) = (&self.user, &self.vhost);
                self.grant
                    .check(b, user, vhost, Access::Read, Resource::Queue, &queue)?;
                if attempt < 3 {
                    if let Some(read) = b.head_read_request(conn, vhost, &queue) {
                        return Ok(Some(read));
                    }
                }
                match b.get(conn, ch, vhost, &queue, g.no_ack)? {
                    Some(r) => {
                        if let Some(rep) = &self.shared.replication {
                            // Not before the cluster has it (see `QueuedMessage::batch`).
                            rep.hold_delivery(conn, &self.outbox, r.batch);
                        }
                        self.outbox.method_with_content(
                            ch,
                            &AMQPClass::Basic(M::GetOk(basic::GetOk {
                                delivery_tag: r.delivery_tag,
                                redelivered: r.redelivered,
                                exchange: warren_protocol::short(&r.msg.exchange),
                                routing_key: warren_protocol::short(&r.msg.routing_key),
                                message_count: r.message_count,
                            })),
                            &r.msg,
                        )
                    }
                    None => self
                        .outbox
                        .method(ch, &AMQPClass::Basic(M::GetEmpty(basic::GetEmpty {}))),
                }
                Ok(None)
            })?;
            match read {
                Some(read) => self.shared.carry_out_reads(vec![read]),
                None => break,
            }
        }
        Ok(())
    }

    fn basic_ack(&mut self, ch: u16, ack: TxAck) -> Result<(), AmqpError> {
        if self.chan(ch)?.tx.is_some() {
            // Checked now, settled at commit (see `Broker::tx_settle`).
            let conn = self.conn;
            let (tag, multiple, reject) = match ack {
                TxAck::Ack { tag, multiple } => (tag, multiple, None),
                TxAck::Reject {
                    tag,
                    multiple,
                    requeue,
                } => (tag, multiple, Some(requeue)),
            };
            return core(&self.shared, &mut self.ctx, |b, _| {
                b.tx_settle(conn, ch, tag, multiple, reject)
            });
        }
        self.apply_ack(ch, ack)
    }

    pub(crate) fn apply_ack(&mut self, ch: u16, ack: TxAck) -> Result<(), AmqpError> {
        let conn = self.conn;
        core(&self.shared, &mut self.ctx, |b, fx| match ack {
            TxAck::Ack { tag, multiple } => b.ack(conn, ch, tag, multiple, fx),
            TxAck::Reject {
                tag,
                multiple,
                requeue,
            } => b.reject(conn, ch, tag, multiple, requeue, fx),
        })
    }

    fn basic_recover(&mut self, ch: u16, requeue: bool, reply: bool) -> Result<(), AmqpError> {
        if !requeue {
            // As RabbitMQ: redelivery to the original consumer is not supported.
            return Err(AmqpError::not_implemented("requeue=false"));
        }
        let conn = self.conn;
        core(&self.shared, &mut self.ctx, |b, fx| {
            b.recover(conn, ch, fx)?;
            if reply {
                self.outbox
                    .method(ch, &AMQPClass::Basic(M::RecoverOk(basic::RecoverOk {})));
            }
            Ok(())
        })
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
            let conn = self.conn;
            let address = core(&self.shared, &mut self.ctx, |b, _| {
                b.reply_address(conn, ch)
            })
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
            let (user, vhost, grant) = (&self.user, &self.vhost, &self.grant);
            core(&self.shared, &mut self.ctx, |b, _| {
                grant.check(
                    b,
                    user,
                    vhost,
                    Access::Write,
                    Resource::Exchange,
                    exchange_or_default(&msg.exchange),
                )?;
                grant.check_topic(
                    b,
                    user,
                    vhost,
                    Access::Write,
                    &msg.exchange,
                    &msg.routing_key,
                )?;
                b.route(vhost, msg.exchange.as_ref(), &msg).map(|_| ())
            })
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
        core(&self.shared, &mut self.ctx, |b, fx| {
            if check {
                let (user, vhost) = (&self.user, &self.vhost);
                self.grant.check(
                    b,
                    user,
                    vhost,
                    Access::Write,
                    Resource::Exchange,
                    exchange_or_default(&msg.exchange),
                )?;
                self.grant.check_topic(
                    b,
                    user,
                    vhost,
                    Access::Write,
                    &msg.exchange,
                    &msg.routing_key,
                )?;
            }
            let outcome = b.publish(&self.vhost, msg.clone(), fx)?;
            if outcome.routed == 0 && mandatory {
                self.outbox.method_with_content(
                    ch,
                    &AMQPClass::Basic(M::Return(basic::Return {
                        reply_code: ReplyCode::NoRoute.code(),
                        reply_text: "NO_ROUTE".into(),
                        exchange: warren_protocol::short(&msg.exchange),
                        routing_key: warren_protocol::short(&msg.routing_key),
                    })),
                    &msg,
                );
            }
            Ok((outcome.rejected, outcome.staged, outcome.held))
        })
        .map_err(|e: AmqpError| e.on(60, 40))
    }
}
