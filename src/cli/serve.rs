//! `idemwatch serve`: the consumers as a long-running service, with `/metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tokio::sync::watch;

use super::{open_engine, CliError, CliResult, DurabilityArg, EngineArgs, EXIT_OK};
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::{exporter, http_api};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address for /metrics (loopback by default: exposing it is a decision).
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub listen: SocketAddr,
    /// Workers per consumer.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Let callers without Authorization / X-Api-Key share one idempotency scope.
    #[arg(long)]
    pub api_allow_anonymous: bool,
    /// How long the write API remembers an Idempotency-Key.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "24h")]
    pub idempotency_ttl: std::time::Duration,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub durability: DurabilityArg,
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

pub async fn run(args: ServeArgs) -> CliResult {
    let (sms, webhook, _sandbox) = args.engine.provider_urls().await?;
    let mut cfg = args.engine.engine_config(&sms, &webhook);
    cfg.durability = args.durability.durability;
    let engine = Arc::new(open_engine(&cfg).await?);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| CliError::unavailable(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener.local_addr().map_err(CliError::unavailable)?;
    eprintln!(
        "idemwatch serve: consumers {:?} ({}, {} durability) on {} / {}; metrics on http://{addr}/metrics, write API on http://{addr}/v1/…; SMS to {sms}",
        engine.consumer_names(),
        cfg.mode.as_str(),
        engine.store.durability().as_str(),
        engine.store.redacted_url(),
        engine.queue.redacted_url(),
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let gauges = {
        let engine = engine.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                if let Err(e) = engine.refresh_in_doubt_gauge().await {
                    tracing::warn!(error = %e, "in-doubt gauge refresh failed");
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    _ = stop.changed() => break,
                }
            }
        })
    };
    let http = {
        let mut stop = stop_rx.clone();
        let mut app = exporter::router(engine.metrics.clone());
        if let Some(edge) = engine.edge.clone() {
            app = app.merge(http_api::router(http_api::ApiState {
                edge,
                metrics: engine.metrics.clone(),
                config: http_api::ApiConfig {
                    allow_anonymous: args.api_allow_anonymous,
                    ttl: args.idempotency_ttl,
                    idempotent: cfg.mode != idemwatch::engine::consumers::ConsumerMode::Naive,
                    ..http_api::ApiConfig::default()
                },
            }));
        }
        tokio::spawn(async move {
            axum::serve(exporter::no_delay(listener), app)
                .with_graceful_shutdown(async move {
                    let _ = stop.changed().await;
                })
                .await
        })
    };
    let workers = {
        let engine = engine.clone();
        let stop = stop_rx.clone();
        let n = args.workers;
        tokio::spawn(async move { engine.run(n, Arc::new(CrashPlan::none()), stop).await })
    };
    shutdown_signal().await;
    eprintln!("idemwatch serve: stopping (finishing deliveries in hand)…");
    let _ = stop_tx.send(true);
    let _ = workers.await;
    // Deliveries prefetched but not handled go back to the broker now, not at exit.
    engine.queue.close().await;
    let _ = http.await;
    let _ = gauges.await;
    Ok(EXIT_OK)
}
