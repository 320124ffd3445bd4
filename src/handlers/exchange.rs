//! exchange class: declare, delete, bind, unbind.

use crate::broker::cmd::Cmd;
use crate::broker::ExchangeDeclare;
use crate::conn::session::{strip_cr_lf, Session};
use amq_protocol::protocol::exchange::{self, AMQPMethod as M};
use warren_protocol::AmqpError;

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
        self.run(Cmd::DeclareExchange {
            ch,
            decl,
            nowait: d.nowait,
        })
        .map(drop)
    }

    fn exchange_delete(&mut self, ch: u16, d: exchange::Delete) -> Result<(), AmqpError> {
        self.run(Cmd::DeleteExchange {
            ch,
            name: strip_cr_lf(d.exchange.as_str()).into_owned(),
            if_unused: d.if_unused,
            nowait: d.nowait,
        })
        .map(drop)
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
        self.run(Cmd::BindExchange {
            ch,
            destination: destination.to_string(),
            source: source.to_string(),
            key: routing_key.to_string(),
            arguments: arguments.clone(),
            bind,
            nowait,
        })
        .map(drop)
    }
}
