//! The dashboard's PostgreSQL sessions: `default_transaction_read_only = on` and a
//! statement timeout, so a role with SELECT grants is enough and a poll can never
//! hold the database.

use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use crate::store::dialect::{dashboard_pool, Pooled, Sql};

/// A poll query that runs longer than this is cancelled by the server.
const STATEMENT_TIMEOUT_MS: u64 = 5_000;

pub(crate) fn connect(url: &str) -> Result<Box<dyn Sql>, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let options = options
        .options([
            ("default_transaction_read_only", "on".to_string()),
            ("statement_timeout", STATEMENT_TIMEOUT_MS.to_string()),
        ])
        .application_name("idemwatch-dashboard")
        .log_statements(tracing::log::LevelFilter::Trace);
    let pool = dashboard_pool::<sqlx::Postgres>().connect_lazy_with(options);
    Ok(Box::new(Pooled(pool)))
}
