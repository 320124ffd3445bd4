//! channel class (open, flow, close) and the deprecated access class.

use crate::broker::cmd::Cmd;
use crate::conn::session::{Chan, Session};
use amq_protocol::protocol::access;
use amq_protocol::protocol::channel::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use warren_protocol::AmqpError;

impl Session {
    pub(crate) fn channel_open(&mut self, ch: u16) -> Result<(), AmqpError> {
        // RabbitMQ enforces channel_max as a count of open channels, not a bound on numbers.
        let open = self.channels.len();
        if self.channel_max != 0 && open >= self.channel_max as usize {
            return Err(AmqpError::not_allowed(format!(
                "number of channels opened ({open}) has reached the negotiated channel_max ({})",
                self.channel_max
            ))
            .on_no_method());
        }
        // The open-ok is written by the node before any frame can follow it on the channel.
        self.run(Cmd::OpenChannel { ch })?;
        let generation = self.next_generation;
        self.next_generation += 1;
        self.channels.insert(
            ch,
            Chan {
                generation,
                ..Chan::default()
            },
        );
        Ok(())
    }

    pub(crate) fn channel_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Open(_) => Err(AmqpError::channel_error("second 'channel.open' seen")),
            // As RabbitMQ: clients may not pause deliveries with flow (use basic.qos).
            M::Flow(f) if !f.active => Err(AmqpError::not_implemented("active=false")),
            M::Flow(f) => self
                .run(Cmd::Flow {
                    ch,
                    active: f.active,
                })
                .map(drop),
            // We never send channel.flow, so a flow-ok has nothing to answer; accept it.
            M::FlowOk(_) => Ok(()),
            M::Close(_) => {
                self.close_channel_state(ch);
                self.channels.remove(&ch);
                self.outbox
                    .method(ch, &AMQPClass::Channel(M::CloseOk(channel::CloseOk {})));
                Ok(())
            }
            // close-ok on a channel we are not closing.
            M::CloseOk(_) => Err(AmqpError::command_invalid("unimplemented method")),
            M::OpenOk(_) => Err(AmqpError::command_invalid(
                "channel.open-ok is a server method",
            )),
        }
    }

    pub(crate) fn access_class(&mut self, ch: u16, m: access::AMQPMethod) -> Result<(), AmqpError> {
        match m {
            // Deprecated in 0-9-1; RabbitMQ still answers it.
            access::AMQPMethod::Request(_) => {
                self.outbox.method(
                    ch,
                    &AMQPClass::Access(access::AMQPMethod::RequestOk(access::RequestOk {})),
                );
                Ok(())
            }
            access::AMQPMethod::RequestOk(_) => Err(AmqpError::command_invalid(
                "access.request-ok is a server method",
            )),
        }
    }
}
