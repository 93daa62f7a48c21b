//! The dashboard's SQLite connections: never create the watched database, never
//! write to it (`PRAGMA query_only`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::SqliteConnectOptions;

use super::DbError;
use crate::config::DatabaseConfig;
use idemwatch_engine::store::dialect::{dashboard_pool, Pooled, Sql};

pub(super) fn connect(settings: &DatabaseConfig) -> Result<Box<dyn Sql>, DbError> {
    let options = SqliteConnectOptions::from_str(&settings.url)?
        .create_if_missing(false)
        .pragma("query_only", "ON")
        .busy_timeout(Duration::from_secs(2));
    let pool = dashboard_pool::<sqlx::Sqlite>().connect_lazy_with(options);
    Ok(Box::new(Pooled(pool)))
}
