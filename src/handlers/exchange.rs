//! exchange class: declare, delete, bind, unbind.

use crate::broker::permissions::{Access, Resource};
use crate::broker::ExchangeDeclare;
use crate::conn::session::{core_durable, exchange_or_default, strip_cr_lf, Session};
use amq_protocol::protocol::exchange::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use warren_protocol::AmqpError;

/// The `alternate-exchange` argument of an exchange.declare, if it names one.
pub(crate) fn alternate_exchange(args: &amq_protocol::types::FieldTable) -> Option<String> {
    match args.inner().get("alternate-exchange")? {
        amq_protocol::types::AMQPValue::LongString(s) => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        amq_protocol::types::AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// The `x-dead-letter-exchange` argument of a queue.declare, if it names one.
pub(crate) fn dead_letter_exchange(args: &amq_protocol::types::FieldTable) -> Option<String> {
    match args.inner().get("x-dead-letter-exchange")? {
        amq_protocol::types::AMQPValue::LongString(s) => {
            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        amq_protocol::types::AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

impl Session {
    pub(crate) fn exchange_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Declare(d) => self.exchange_declare(ch, d),
            M::Delete(d) => self.exchange_delete(ch, d),
            M::Bind(b) => self.exchange_bind(
                ch,
                &strip_cr_lf(b.destination.as_str()),
                &strip_cr_lf(b.source.as_str()),
                b.routing_key.as_str(),
                &b.arguments,
                b.nowait,
                true,
            ),
            M::Unbind(b) => self.exchange_bind(
                ch,
                &strip_cr_lf(b.destination.as_str()),
                &strip_cr_lf(b.source.as_str()),
                b.routing_key.as_str(),
                &b.arguments,
                b.nowait,
                false,
            ),
            M::DeclareOk(_) | M::DeleteOk(_) | M::BindOk(_) | M::UnbindOk(_) => Err(
                AmqpError::command_invalid("exchange *-ok methods are server methods"),
            ),
        }
    }

    fn exchange_declare(&mut self, ch: u16, d: exchange::Declare) -> Result<(), AmqpError> {
        let decl = ExchangeDeclare {
            name: strip_cr_lf(d.exchange.as_str()).into_owned(),
            kind: d.kind.as_str().to_string(),
            passive: d.passive,
            durable: d.durable,
            auto_delete: d.auto_delete,
            internal: d.internal,
            arguments: d.arguments,
        };
        core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
            if !decl.passive && !decl.name.is_empty() {
                let (user, vhost) = (&self.user, &self.vhost);
                let check = |access, name: &str| {
                    self.grant
                        .check(b, user, vhost, access, Resource::Exchange, name)
                };
                check(Access::Configure, &decl.name)?;
                // An alternate exchange: reading the new one, writing to the alternate
                // (RabbitMQ), so nobody routes into an exchange they may not write to.
                if let Some(ae) = alternate_exchange(&decl.arguments) {
                    check(Access::Read, &decl.name)?;
                    check(Access::Write, exchange_or_default(&ae))?;
                }
            }
            b.exchange_declare(&self.vhost, decl, fx)?;
            if !d.nowait {
                self.outbox.method(
                    ch,
                    &AMQPClass::Exchange(M::DeclareOk(exchange::DeclareOk {})),
                );
            }
            Ok(())
        })
    }

    fn exchange_delete(&mut self, ch: u16, d: exchange::Delete) -> Result<(), AmqpError> {
        let name = strip_cr_lf(d.exchange.as_str());
        core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
            // The default exchange is refused by the core first (RabbitMQ's order).
            if !name.is_empty() {
                let (user, vhost) = (&self.user, &self.vhost);
                self.grant
                    .check(b, user, vhost, Access::Configure, Resource::Exchange, &name)?;
            }
            match b.exchange_delete(&self.vhost, &name, d.if_unused, fx) {
                Ok(()) => {}
                // RabbitMQ answers delete-ok for an exchange that does not exist.
                Err(e) if e.code == warren_protocol::ReplyCode::NotFound => {}
                Err(e) => return Err(e),
            }
            if !d.nowait {
                self.outbox
                    .method(ch, &AMQPClass::Exchange(M::DeleteOk(exchange::DeleteOk {})));
            }
            Ok(())
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn exchange_bind(
        &mut self,
        ch: u16,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: &amq_protocol::types::FieldTable,
        nowait: bool,
        bind: bool,
    ) -> Result<(), AmqpError> {
        core_durable(&self.shared, &mut self.ctx, &self.outbox, |b, fx| {
            // Writing to the destination, then reading the source (RabbitMQ's order).
            let (user, vhost) = (&self.user, &self.vhost);
            self.grant.check(
                b,
                user,
                vhost,
                Access::Write,
                Resource::Exchange,
                exchange_or_default(destination),
            )?;
            self.grant.check(
                b,
                user,
                vhost,
                Access::Read,
                Resource::Exchange,
                exchange_or_default(source),
            )?;
            self.grant
                .check_topic(b, user, vhost, Access::Read, source, routing_key)?;
            b.exchange_bind(
                &self.vhost,
                destination,
                source,
                routing_key,
                arguments,
                bind,
                fx,
            )?;
            if !nowait {
                let ok = if bind {
                    M::BindOk(exchange::BindOk {})
                } else {
                    M::UnbindOk(exchange::UnbindOk {})
                };
                self.outbox.method(ch, &AMQPClass::Exchange(ok));
            }
            Ok(())
        })
    }
}
