//! confirm class: select. Confirms themselves are sent by `Session::flush_confirms`.

use crate::conn::session::Session;
use amq_protocol::protocol::confirm::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use warren_protocol::AmqpError;

impl Session {
    pub(crate) fn confirm_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Select(s) => {
                let chan = self.chan(ch)?;
                if chan.tx.is_some() {
                    return Err(AmqpError::precondition_failed(
                        "cannot switch from tx to confirm mode",
                    ));
                }
                chan.confirm = true;
                if !s.nowait {
                    self.outbox
                        .method(ch, &AMQPClass::Confirm(M::SelectOk(confirm::SelectOk {})));
                }
                Ok(())
            }
            M::SelectOk(_) => Err(AmqpError::command_invalid(
                "confirm.select-ok is a server method",
            )),
        }
    }
}
