//! The dashboard's MySQL / MariaDB sessions: `READ ONLY` with a statement time
//! limit, so SELECT grants are enough; `time_zone = '+00:00'` as the engine's, so
//! DATETIME columns read as UTC.

use super::DbError;
use crate::config::DatabaseConfig;
use idemwatch_engine::store::dialect::{dashboard_pool, mysql, Pooled, Sql};

pub(super) fn connect(settings: &DatabaseConfig) -> Result<Box<dyn Sql>, DbError> {
    let options = mysql::options(&settings.url)?;
    let pool = dashboard_pool::<sqlx::MySql>()
        .after_connect(|conn, _| {
            Box::pin(async move {
                mysql::utc_session(conn).await?;
                sqlx::query("SET SESSION TRANSACTION READ ONLY")
                    .execute(&mut *conn)
                    .await?;
                // MariaDB (seconds) and MySQL (milliseconds) spell the statement
                // time limit differently; the other one is an unknown variable.
                if sqlx::query("SET SESSION max_statement_time = 5")
                    .execute(&mut *conn)
                    .await
                    .is_err()
                {
                    let _ = sqlx::query("SET SESSION max_execution_time = 5000")
                        .execute(&mut *conn)
                        .await;
                }
                Ok(())
            })
        })
        .connect_lazy_with(options);
    Ok(Box::new(Pooled(pool)))
}
