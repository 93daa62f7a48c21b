//! The dashboard's PostgreSQL sessions: `default_transaction_read_only = on` and a
//! statement timeout, so a role with SELECT grants is enough and a poll can never
//! hold the database.

use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use super::DbError;
use crate::config::DatabaseConfig;
use idemwatch_engine::store::dialect::{dashboard_pool, Pooled, Sql};

/// A poll query that runs longer than this is cancelled by the server.
const STATEMENT_TIMEOUT_MS: u64 = 5_000;

pub(super) fn connect(settings: &DatabaseConfig) -> Result<Box<dyn Sql>, DbError> {
    let options: PgConnectOptions = settings.url.parse()?;
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
