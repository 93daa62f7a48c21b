//! Exporters served from a child process for the dashboard benches, so that their
//! cost is not counted as the dashboard's.

use std::path::Path;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;

use super::{BenchError, BenchResult};

/// Start `exe args…` (a hidden `bench serve-…` command) and read the one JSON line it
/// prints once it serves. The child is killed when the returned handle is dropped.
pub async fn spawn_server(exe: &Path, args: &[&str]) -> BenchResult<(Child, serde_json::Value)> {
    let mut child = tokio::process::Command::new(exe)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| BenchError::Run(format!("cannot start the exporters: {e}")))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| BenchError::Run("no stdout".into()))?;
    let first = BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .map_err(|e| BenchError::Run(e.to_string()))?
        .ok_or_else(|| BenchError::Run("the exporters process said nothing".into()))?;
    let line = serde_json::from_str(&first)
        .map_err(|e| BenchError::Run(format!("unexpected exporters line {first:?}: {e}")))?;
    Ok((child, line))
}
