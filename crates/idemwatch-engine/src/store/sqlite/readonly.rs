//! The dashboard's SQLite connections: never create the watched database, never
//! write to it (`PRAGMA query_only`).

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::SqliteConnectOptions;

use crate::store::dialect::{dashboard_pool, Pooled, Sql};

pub(crate) fn connect(url: &str) -> Result<Box<dyn Sql>, sqlx::Error> {
    let options = SqliteConnectOptions::from_str(url)?
        .create_if_missing(false)
        .pragma("query_only", "ON")
        .busy_timeout(Duration::from_secs(2));
    let pool = dashboard_pool::<sqlx::Sqlite>().connect_lazy_with(options);
    Ok(Box::new(Pooled(pool)))
}
