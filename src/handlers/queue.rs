//! queue class: declare, bind, unbind, purge, delete.

use crate::broker::permissions::{Access, Resource};
use crate::broker::QueueDeclare;
use crate::conn::session::{core_durable, exchange_or_default, strip_cr_lf, Session};
use amq_protocol::protocol::queue::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use warren_protocol::AmqpError;

impl Session {
    pub(crate) fn queue_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Declare(d) => self.queue_declare(ch, d),
            M::Bind(b) => {
                let queue = self.resolve_queue(ch, &strip_cr_lf(b.queue.as_str()))?;
                // An empty routing key with an empty queue name means the queue's name.
                let key = if b.routing_key.as_str().is_empty() && b.queue.as_str().is_empty() {
                    queue.clone()
                } else {
                    b.routing_key.as_str().to_string()
                };
                self.queue_bind(
                    ch,
                    &queue,
                    &strip_cr_lf(b.exchange.as_str()),
                    &key,
                    &b.arguments,
                    b.nowait,
                    true,
                )
            }
            M::Unbind(b) => {
                let queue = self.resolve_queue(ch, &strip_cr_lf(b.queue.as_str()))?;
                self.queue_bind(
                    ch,
                    &queue,
                    &strip_cr_lf(b.exchange.as_str()),
                    b.routing_key.as_str(),
                    &b.arguments,
                    false,
                    false,
                )
            }
            M::Purge(p) => {
                let queue = self.resolve_queue(ch, p.queue.as_str())?;
                let conn = self.conn;
                core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
                    let (user, vhost) = (&self.user, &self.vhost);
                    self.grant
                        .check(b, user, vhost, Access::Read, Resource::Queue, &queue)?;
                    let count = b.queue_purge(conn, &self.vhost, &queue, fx)?;
                    if !p.nowait {
                        self.outbox.method(
                            ch,
                            &AMQPClass::Queue(M::PurgeOk(queue::PurgeOk {
                                message_count: count,
                            })),
                        );
                    }
                    Ok(())
                })
            }
            M::Delete(d) => {
                let queue = self.resolve_queue(ch, &strip_cr_lf(d.queue.as_str()))?;
                let conn = self.conn;
                core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
                    let (user, vhost) = (&self.user, &self.vhost);
                    self.grant
                        .check(b, user, vhost, Access::Configure, Resource::Queue, &queue)?;
                    let count =
                        b.queue_delete(conn, &self.vhost, &queue, d.if_unused, d.if_empty, fx)?;
                    if !d.nowait {
                        self.outbox.method(
                            ch,
                            &AMQPClass::Queue(M::DeleteOk(queue::DeleteOk {
                                message_count: count,
                            })),
                        );
                    }
                    Ok(())
                })
            }
            M::DeclareOk(_) | M::BindOk(_) | M::PurgeOk(_) | M::DeleteOk(_) | M::UnbindOk(_) => {
                Err(AmqpError::command_invalid(
                    "queue *-ok methods are server methods",
                ))
            }
        }
    }

    fn queue_declare(&mut self, ch: u16, d: queue::Declare) -> Result<(), AmqpError> {
        let name = if d.passive && d.queue.as_str().is_empty() {
            self.resolve_queue(ch, "")?
        } else {
            strip_cr_lf(d.queue.as_str()).into_owned()
        };
        let decl = QueueDeclare {
            name,
            passive: d.passive,
            durable: d.durable,
            exclusive: d.exclusive,
            auto_delete: d.auto_delete,
            arguments: d.arguments,
        };
        let conn = self.conn;
        let panic_on = self.shared.config.panic_on_declare.as_deref();
        let info = core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
            if !decl.passive {
                // RabbitMQ checks the name a server-named queue gets, and for a dead-letter
                // exchange, reading the queue and writing to the exchange.
                let name = if decl.name.is_empty() {
                    b.server_queue_name()
                } else {
                    decl.name.clone()
                };
                let (user, vhost) = (&self.user, &self.vhost);
                let exists = b.queue_info(vhost, &name).is_some();
                let check = |access, resource, name: &str| {
                    self.grant.check(b, user, vhost, access, resource, name)
                };
                check(Access::Configure, Resource::Queue, &name)?;
                // Checked when the queue is made (a redeclare changes nothing).
                if !exists {
                    if let Some(dlx) =
                        crate::handlers::exchange::dead_letter_exchange(&decl.arguments)
                    {
                        check(Access::Read, Resource::Queue, &name)?;
                        check(Access::Write, Resource::Exchange, exchange_or_default(&dlx))?;
                    }
                }
            }
            // Test hook (off unless a test sets it): a defect that panics with the broker lock
            // held, to show the connection task recovers from it (conn::serve).
            if panic_on == Some(decl.name.as_str()) {
                panic!("injected panic declaring {}", decl.name);
            }
            let info = b.queue_declare(conn, &self.vhost, decl, fx)?;
            if !d.nowait {
                self.outbox.method(
                    ch,
                    &AMQPClass::Queue(M::DeclareOk(queue::DeclareOk {
                        queue: warren_protocol::short(&info.name),
                        message_count: info.message_count,
                        consumer_count: info.consumer_count,
                    })),
                );
            }
            Ok::<_, AmqpError>(info)
        })?;
        self.chan(ch)?.last_queue = Some(info.name);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn queue_bind(
        &mut self,
        ch: u16,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: &amq_protocol::types::FieldTable,
        nowait: bool,
        bind: bool,
    ) -> Result<(), AmqpError> {
        let conn = self.conn;
        core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
            // Writing to the queue, then reading the exchange (RabbitMQ's order).
            let (user, vhost) = (&self.user, &self.vhost);
            self.grant
                .check(b, user, vhost, Access::Write, Resource::Queue, queue)?;
            self.grant.check(
                b,
                user,
                vhost,
                Access::Read,
                Resource::Exchange,
                exchange_or_default(exchange),
            )?;
            self.grant
                .check_topic(b, user, vhost, Access::Read, exchange, routing_key)?;
            b.queue_bind(
                conn,
                &self.vhost,
                queue,
                exchange,
                routing_key,
                arguments,
                bind,
                fx,
            )?;
            if !nowait {
                let ok = if bind {
                    M::BindOk(queue::BindOk {})
                } else {
                    M::UnbindOk(queue::UnbindOk {})
                };
                self.outbox.method(ch, &AMQPClass::Queue(ok));
            }
            Ok(())
        })
    }
}
