//! A store outage a test causes on its own database only (issue 14's faults).

use sqlx::Connection;

use super::backends::{Kind, TestDb};
use super::proxy::FaultProxy;

/// How a test takes its own database away, and gives it back.
pub enum Outage {
    /// SQLite: another connection holds the write lock, longer than the store's busy
    /// timeout, so the engine's writes fail as SQLITE_BUSY.
    Locked(sqlx::SqliteConnection),
    /// PostgreSQL: our database refuses connections and its sessions are terminated.
    Refused { admin: String, name: String },
    /// MariaDB: the TCP way to the server is cut.
    Cut,
}

impl Outage {
    pub async fn start(db: &TestDb, proxy: Option<&FaultProxy>) -> Outage {
        match db.kind {
            Kind::Sqlite => {
                let mut c = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
                sqlx::query("BEGIN IMMEDIATE")
                    .execute(&mut c)
                    .await
                    .unwrap();
                Outage::Locked(c)
            }
            Kind::Postgres => {
                let (admin, name) = (
                    db.admin_url().unwrap().to_string(),
                    db.name().unwrap().to_string(),
                );
                let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
                sqlx::query(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS false"))
                    .execute(&mut c)
                    .await
                    .unwrap();
                // Our own database's sessions only (its name is unique to this test).
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = $1 AND pid <> pg_backend_pid()",
                )
                .bind(&name)
                .execute(&mut c)
                .await
                .unwrap();
                Outage::Refused { admin, name }
            }
            Kind::Mysql => {
                proxy.expect("MariaDB goes through the proxy").cut();
                Outage::Cut
            }
        }
    }

    pub async fn end(self, proxy: Option<&FaultProxy>) {
        match self {
            Outage::Locked(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
            }
            Outage::Refused { admin, name } => {
                let mut c = sqlx::PgConnection::connect(&admin).await.unwrap();
                sqlx::query(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
                    .execute(&mut c)
                    .await
                    .unwrap();
            }
            Outage::Cut => proxy.expect("the proxy").restore(),
        }
    }
}
