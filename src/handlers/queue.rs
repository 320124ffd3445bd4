//! queue class: declare, bind, unbind, purge, delete.

use crate::broker::cmd::{Cmd, Outcome};
use crate::broker::QueueDeclare;
use crate::conn::session::{strip_cr_lf, Session};
use amq_protocol::protocol::queue::{self, AMQPMethod as M};
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
                self.run(Cmd::PurgeQueue {
                    ch,
                    queue,
                    nowait: p.nowait,
                })
                .map(drop)
            }
            M::Delete(d) => {
                let queue = self.resolve_queue(ch, &strip_cr_lf(d.queue.as_str()))?;
                self.run(Cmd::DeleteQueue {
                    ch,
                    queue,
                    if_unused: d.if_unused,
                    if_empty: d.if_empty,
                    nowait: d.nowait,
                })
                .map(drop)
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
        let declared = self.run(Cmd::DeclareQueue {
            ch,
            decl,
            nowait: d.nowait,
        })?;
        if let Outcome::Declared(name) = declared {
            self.chan(ch)?.last_queue = Some(name);
        }
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
        self.run(Cmd::BindQueue {
            ch,
            queue: queue.to_string(),
            exchange: exchange.to_string(),
            key: routing_key.to_string(),
            arguments: arguments.clone(),
            bind,
            nowait,
        })
        .map(drop)
    }
}
