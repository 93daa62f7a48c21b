//! One fresh database per test on every backend, so runs never interfere.
//!
//! Server URLs come from `IDEMWATCH_PG_URL` / `IDEMWATCH_MYSQL_URL` (defaults: the
//! machine's local servers). When a server is unreachable the test is skipped with a
//! message, unless `IDEMWATCH_REQUIRE_SERVICES=1` (CI), where it fails.

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::Connection;

use super::TempEnv;

pub const PG_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const MYSQL_DEFAULT: &str = "mysql://root@127.0.0.1:3306/test";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    Postgres,
    Mysql,
}

pub struct TestDb {
    pub kind: Kind,
    /// The database URL handed to idemwatch.
    pub url: String,
    /// Scratch directory: the SQLite files and the embedded queue.
    pub env: TempEnv,
    admin_url: Option<String>,
    name: Option<String>,
}

pub fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

fn unique_name() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "idw_t_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        rand::random::<u16>()
    )
}

fn with_database(url: &str, db: &str) -> String {
    let mut u = url::Url::parse(url).expect("valid server URL");
    u.set_path(&format!("/{db}"));
    u.to_string()
}

impl TestDb {
    pub async fn new(kind: Kind) -> Option<TestDb> {
        let env = TempEnv::new();
        let (admin_var, default) = match kind {
            Kind::Sqlite => {
                let url = env.db_url();
                return Some(TestDb {
                    kind,
                    url,
                    env,
                    admin_url: None,
                    name: None,
                });
            }
            Kind::Postgres => ("IDEMWATCH_PG_URL", PG_DEFAULT),
            Kind::Mysql => ("IDEMWATCH_MYSQL_URL", MYSQL_DEFAULT),
        };
        let admin = std::env::var(admin_var).unwrap_or_else(|_| default.to_string());
        let name = unique_name();
        let created = match kind {
            Kind::Postgres => match sqlx::PgConnection::connect(&admin).await {
                Ok(mut c) => sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut c)
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            },
            Kind::Mysql => match sqlx::MySqlConnection::connect(&admin).await {
                Ok(mut c) => sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut c)
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            },
            Kind::Sqlite => unreachable!(),
        };
        if let Err(e) = created {
            if required() {
                panic!(
                    "{kind:?} server at {} is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}",
                    idemwatch_base::redact::redact_url(&admin)
                );
            }
            eprintln!("SKIP: {kind:?} server unreachable ({e}); set {admin_var} or start it");
            return None;
        }
        Some(TestDb {
            kind,
            url: with_database(&admin, &name),
            env,
            admin_url: Some(admin),
            name: Some(name),
        })
    }

    pub fn queue_url(&self) -> String {
        self.env.queue_url()
    }

    /// The server URL this test's database was created through (servers only).
    pub fn admin_url(&self) -> Option<&str> {
        self.admin_url.as_deref()
    }

    /// This test's own database name (servers only).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// One statement with the backend's own driver, on a connection of its own: what an
    /// operator (or a naive consumer) does behind the engine's back.
    pub async fn exec(&self, sql: &str) {
        match self.kind {
            Kind::Sqlite => {
                let mut c = sqlx::SqliteConnection::connect(&self.url).await.unwrap();
                sqlx::query(sql).execute(&mut c).await.expect(sql);
            }
            Kind::Postgres => {
                let mut c = sqlx::PgConnection::connect(&self.url).await.unwrap();
                sqlx::query(sql).execute(&mut c).await.expect(sql);
            }
            Kind::Mysql => {
                let mut c = sqlx::MySqlConnection::connect(&self.url).await.unwrap();
                sqlx::query(sql).execute(&mut c).await.expect(sql);
            }
        }
    }

    /// A PostgreSQL login role named after this database plus `suffix`, with CONNECT
    /// on the database, USAGE on `public`, and `grants` (each a `GRANT … TO` without
    /// its `TO {role}`): the URL that logs in as it. Drop it with [`drop_pg_role`].
    pub async fn pg_role(&self, suffix: &str, grants: &[&str]) -> (String, String) {
        assert_eq!(self.kind, Kind::Postgres, "roles are a PostgreSQL fixture");
        let database = self.name.clone().expect("a server database");
        let role = format!("{database}_{suffix}");
        let mut admin = sqlx::PgConnection::connect(&self.url).await.unwrap();
        let mut statements = vec![
            format!("CREATE ROLE {role} LOGIN"),
            format!("GRANT CONNECT ON DATABASE {database} TO {role}"),
            format!("GRANT USAGE ON SCHEMA public TO {role}"),
        ];
        statements.extend(grants.iter().map(|g| format!("{g} TO {role}")));
        for sql in statements {
            sqlx::query(&sql).execute(&mut admin).await.expect(&sql);
        }
        admin.close().await.unwrap();
        let mut url = url::Url::parse(&self.url).unwrap();
        url.set_username(&role).unwrap();
        url.set_password(None).unwrap();
        (role, url.to_string())
    }

    /// Drop the per-test database (a failed test leaves it for inspection;
    /// `.ci/run` sweeps `idw_t_%` databases before each run).
    pub async fn cleanup(self) {
        let (Some(admin), Some(name)) = (&self.admin_url, &self.name) else {
            return;
        };
        let sql = format!("DROP DATABASE IF EXISTS {name}");
        match self.kind {
            Kind::Postgres => {
                if let Ok(mut c) = sqlx::PgConnection::connect(admin).await {
                    let _ = sqlx::query(&format!("{sql} WITH (FORCE)"))
                        .execute(&mut c)
                        .await;
                }
            }
            Kind::Mysql => {
                if let Ok(mut c) = sqlx::MySqlConnection::connect(admin).await {
                    let _ = sqlx::query(&sql).execute(&mut c).await;
                }
            }
            Kind::Sqlite => {}
        }
    }
}

/// Generate one `#[tokio::test]` per backend for each listed `async fn(&TestDb)`.
#[macro_export]
macro_rules! on_every_backend {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    if let Some(db) = $crate::backends::TestDb::new($crate::backends::Kind::Sqlite).await {
                        super::$test(&db).await;
                        db.cleanup().await;
                    }
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    if let Some(db) = $crate::backends::TestDb::new($crate::backends::Kind::Postgres).await {
                        super::$test(&db).await;
                        db.cleanup().await;
                    }
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    if let Some(db) = $crate::backends::TestDb::new($crate::backends::Kind::Mysql).await {
                        super::$test(&db).await;
                        db.cleanup().await;
                    }
                }
            )*
        }
    };
}

/// Drop a role of [`TestDb::pg_role`] once its database is gone (roles belong to the
/// cluster; `.ci/run` sweeps any a failed run left).
pub async fn drop_pg_role(role: &str) {
    let server = std::env::var("IDEMWATCH_PG_URL").unwrap_or_else(|_| PG_DEFAULT.to_string());
    let mut c = sqlx::PgConnection::connect(&server).await.unwrap();
    sqlx::query(&format!("DROP ROLE IF EXISTS {role}"))
        .execute(&mut c)
        .await
        .unwrap();
}
