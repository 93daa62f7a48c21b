//! How long the engine waits for each peer before it gives up on the way to it.
//!
//! A wait that ends only when a peer wakes up is a defect (issue 39): a PostgreSQL
//! connection that a NAT forgot, or a broker link frozen by a failover, answers
//! nothing and refuses nothing, and every consumer on it stood still for as long as
//! the socket did. Each wait on a peer is bounded by one of these, and a bound that
//! fires is an *infrastructure* failure of kind `timeout`: the consumer pauses (under
//! the cause of the peer that went silent), gives its deliveries back uncounted and
//! tries again on a fresh connection; the message never pays for it.
//!
//! Where each applies:
//!
//! | deadline | database | queue (broker) |
//! |---|---|---|
//! | `statement_timeout` | one store call (a transaction), client side; the server's own statement timeout, lock waits and idle-in-transaction limit (PostgreSQL, MariaDB), the busy timeout (SQLite) | — |
//! | `connect_timeout` | opening the store (and its migration connection) | opening a broker connection |
//! | `acquire_timeout` | waiting for a pooled connection, opening one included (sqlx opens it inside the acquire) | — |
//! | `heartbeat` | — | AMQP heartbeat, NATS ping interval: a link silent for two of them is closed and the next call dials again |
//!
//! Calls with a bound of their own that these do not change: one broker request
//! (AMQP RPC, JetStream request: 10 s), one Redis command or dial (2 s), one provider
//! call (3 s to connect, 10 s in all).

use std::time::Duration;

/// The deadlines of one engine (`[engine]` and `[queue]` in the config, or the
/// command line's `--statement-timeout`, `--connect-timeout`, `--acquire-timeout`,
/// `--heartbeat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The longest one store call (one transaction, a batch's) may take; the server
    /// is told the same per statement, so it stops work nobody waits for any more.
    pub statement_timeout: Duration,
    /// The longest opening a connection to any peer may take (TCP, TLS, login).
    pub connect_timeout: Duration,
    /// The longest a store call waits for one of the pool's connections.
    pub acquire_timeout: Duration,
    /// The broker link's keep-alive: AMQP's negotiated heartbeat, NATS's ping
    /// interval. A link silent for two of them is closed and the next call redials.
    pub heartbeat: Duration,
}

/// 20 s (docs/CONTRACT.md §9): a batch transaction takes milliseconds, the slowest
/// statement on the consumers' path (a retention batch at 40 M rows) 3 s
/// (docs/SCALE.md); twenty seconds of silence is a connection that stopped
/// answering, not a slow database. Not 30: a frozen connection costs this wait plus
/// the probe on a fresh one (2–6 s measured), and the promise is a consumer
/// processing again within 30 s of the database answering on a new connection —
/// which, when only the old sockets froze, is from the first second.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(20);
/// 10 s: a connect and login over TLS to another region take well under a
/// second; ten is room for a loaded server without holding a paused consumer
/// long on a way that is black-holed.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// 10 s: a healthy pool hands a connection out in microseconds (16 connections,
/// one transaction per batch); waiting longer means every connection is stuck,
/// which the statement deadline is already ending.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// 10 s: RabbitMQ's guidance is 5–20 s (below 5 s false alarms on a loaded broker);
/// two missed beats close the link, so a frozen one is found in 20–30 s rather than
/// the 2–3 minutes of amqprs's and async-nats's 60 s defaults.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            heartbeat: DEFAULT_HEARTBEAT,
        }
    }
}

impl Deadlines {
    /// The statement deadline in whole seconds, at least one: what the servers that
    /// count lock waits in seconds (InnoDB, MariaDB's idle transactions) are told.
    pub fn statement_secs(&self) -> u64 {
        self.statement_timeout.as_secs_f64().ceil().max(1.0) as u64
    }

    /// The statement deadline in milliseconds, at least one (PostgreSQL's unit; 0
    /// there would mean "no limit").
    pub fn statement_millis(&self) -> u64 {
        u64::try_from(self.statement_timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// The heartbeat in whole seconds for AMQP (a 16-bit count of seconds; 0 would
    /// turn it off), between 1 and `u16::MAX`.
    pub fn heartbeat_secs(&self) -> u16 {
        let secs = self.heartbeat.as_secs_f64().ceil().max(1.0);
        if secs >= f64::from(u16::MAX) {
            u16::MAX
        } else {
            secs as u16
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_units_each_server_is_told_never_turn_a_deadline_off() {
        let d = Deadlines {
            statement_timeout: Duration::from_millis(300),
            heartbeat: Duration::from_millis(1),
            ..Deadlines::default()
        };
        // 0 means "no limit" to PostgreSQL, InnoDB and AMQP alike.
        assert_eq!(d.statement_millis(), 300);
        assert_eq!(d.statement_secs(), 1);
        assert_eq!(d.heartbeat_secs(), 1);
        let d = Deadlines::default();
        assert_eq!((d.statement_millis(), d.statement_secs()), (20_000, 20));
        assert_eq!(d.heartbeat_secs(), 10);
        let long = Deadlines {
            heartbeat: Duration::from_secs(1 << 20),
            ..d
        };
        assert_eq!(long.heartbeat_secs(), u16::MAX);
    }
}
