//! Test plumbing shared by the crates' tests and the end-to-end tests (a dev-dependency
//! only, never published): a throw-away directory with a SQLite database and queue URL
//! per test ([`TempEnv`]), and one fresh database per test on every backend
//! ([`backends`], with [`on_every_backend!`]).

use std::path::PathBuf;

pub mod backends;

/// A scratch directory for one test: its SQLite database, its embedded queue, its files.
pub struct TempEnv {
    pub dir: tempfile::TempDir,
}

impl TempEnv {
    pub fn new() -> Self {
        TempEnv {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn db_url(&self) -> String {
        format!(
            "sqlite://{}",
            self.dir.path().join("idemwatch.db").display()
        )
    }

    pub fn queue_url(&self) -> String {
        format!("sqlite://{}", self.dir.path().join("queue.db").display())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Default for TempEnv {
    fn default() -> Self {
        TempEnv::new()
    }
}
