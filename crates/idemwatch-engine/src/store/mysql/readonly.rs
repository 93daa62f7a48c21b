//! The dashboard's MySQL / MariaDB sessions: `READ ONLY` with a statement time
//! limit, so SELECT grants are enough; `time_zone = '+00:00'` as the engine's, so
//! DATETIME columns read as UTC.

use super::dialect as mysql;
use crate::store::dialect::{dashboard_pool, Pooled, Sql};

pub(crate) fn connect(url: &str) -> Result<Box<dyn Sql>, sqlx::Error> {
    let options = mysql::options(url)?;
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
