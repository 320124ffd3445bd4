//! tx class: select, commit, rollback. Publishes and acks wait in the channel until commit.

use crate::broker::cmd::Cmd;
use crate::conn::session::{Session, Tx};
use amq_protocol::protocol::tx::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use warren_protocol::AmqpError;

impl Session {
    pub(crate) fn tx_class(&mut self, ch: u16, m: M) -> Result<(), AmqpError> {
        match m {
            M::Select(_) => {
                let chan = self.chan(ch)?;
                if chan.confirm {
                    return Err(AmqpError::precondition_failed(
                        "cannot switch from confirm to tx mode",
                    ));
                }
                if chan.tx.is_none() {
                    chan.tx = Some(Tx::default());
                }
                self.outbox
                    .method(ch, &AMQPClass::Tx(M::SelectOk(tx::SelectOk {})));
                Ok(())
            }
            M::Commit(_) => {
                let work = self.take_tx(ch)?;
                // As in RabbitMQ, commit-ok means the committed publishes and acks are on disk
                // (it used to be sent before their fsync): it waits for the latest commit
                // ticket of the routing calls and of the commit itself.
                let mut routed = None;
                for (msg, mandatory) in work.publishes {
                    let _ = self.route_message(ch, msg, mandatory, false)?;
                    routed = routed.max(self.ctx.last_ticket);
                }
                self.run_after(Cmd::TxCommit { ch }, routed).map(drop)
            }
            M::Rollback(_) => {
                self.take_tx(ch)?;
                self.run(Cmd::TxRollback { ch }).map(drop)
            }
            M::SelectOk(_) | M::CommitOk(_) | M::RollbackOk(_) => Err(AmqpError::command_invalid(
                "tx *-ok methods are server methods",
            )),
        }
    }

    /// Take the pending work of a transactional channel, leaving it transactional and empty.
    fn take_tx(&mut self, ch: u16) -> Result<Tx, AmqpError> {
        match self.chan(ch)?.tx.as_mut() {
            Some(tx) => Ok(std::mem::take(tx)),
            None => Err(AmqpError::precondition_failed(
                "channel is not transactional",
            )),
        }
    }
}
