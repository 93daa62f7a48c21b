//! `idemwatch sms-sandbox`: the SMS/ERP provider of docs/CONTRACT.md §4, standalone.

use std::net::SocketAddr;

use clap::Args;

use super::{CliError, CliResult, EXIT_OK};
use idemwatch::sim::sandbox_provider;

#[derive(Debug, Args)]
pub struct SandboxArgs {
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:9465")]
    pub listen: SocketAddr,
    /// Answer every POST after this long, give or take a quarter of it (a real SMS
    /// API's tens of milliseconds), e.g. `80ms`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "0s", value_name = "DURATION")]
    pub latency: std::time::Duration,
}

pub async fn run(args: SandboxArgs) -> CliResult {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| CliError::unavailable(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener.local_addr().map_err(CliError::unavailable)?;
    eprintln!("SMS/ERP sandbox on http://{addr}, latency {:?} (POST /sms, GET /sms/sent, POST /erp, GET /erp/sent); Ctrl-C stops it", args.latency);
    let state = sandbox_provider::SandboxState::new();
    state.set_latency(args.latency);
    sandbox_provider::serve_with_state(listener, state, super::serve::shutdown_signal())
        .await
        .map_err(CliError::unavailable)?;
    Ok(EXIT_OK)
}
