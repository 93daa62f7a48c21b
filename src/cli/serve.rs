//! `idemwatch serve`: the consumers as a long-running service, with `/metrics`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::{open_engine, CliError, CliResult, DurabilityArg, EngineArgs, EXIT_OK};
use idemwatch::engine::api_keys::ApiKeys;
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::http_server::{self, ConnectionLimits};
use idemwatch::engine::{exporter, http_api};
use idemwatch::redact::redact_url;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address for /metrics (loopback by default: exposing it is a decision).
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub listen: SocketAddr,
    /// Workers per consumer.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Serve the write API on its own address (recommended): /metrics stays on
    /// --listen, the port a Prometheus server — and often a wider network — is given.
    /// Without it the write API shares --listen.
    #[arg(long, value_name = "ADDR")]
    pub api_listen: Option<SocketAddr>,
    /// The write API's credentials: one `NAME TOKEN` per line (tokens of at least 16
    /// characters). Read again on SIGHUP and when the file changes. Without it the
    /// write API answers 404, unless --api-allow-anonymous.
    #[arg(long, value_name = "FILE")]
    pub api_keys: Option<PathBuf>,
    /// Let callers without credentials in, all sharing one idempotency scope.
    #[arg(long)]
    pub api_allow_anonymous: bool,
    /// Write requests handled at once; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = http_api::ApiConfig::default().max_in_flight, value_name = "N")]
    pub api_max_in_flight: usize,
    /// How long the write API remembers an Idempotency-Key.
    #[arg(long, value_parser = humantime::parse_duration, default_value = super::shown(http_api::ApiConfig::default().ttl))]
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

/// The keys file, refused at start when it does not parse (exit 2).
fn load_keys(path: &std::path::Path) -> Result<Arc<ApiKeys>, CliError> {
    let keys = ApiKeys::load(path).map_err(|e| CliError::usage(e.to_string()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                eprintln!(
                    "idemwatch serve: warning: {} is readable by other users (chmod 600 it)",
                    path.display()
                );
            }
        }
    }
    Ok(Arc::new(keys))
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), CliError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::unavailable(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener.local_addr().map_err(CliError::unavailable)?;
    Ok((listener, bound))
}

/// `config_path`: `--config`, whose `[engine]` and `[queue]` deadlines apply under
/// the command line's.
pub async fn run(args: ServeArgs, config_path: Option<PathBuf>) -> CliResult {
    let keys = args.api_keys.as_deref().map(load_keys).transpose()?;
    let api_on = keys.is_some() || args.api_allow_anonymous;
    if args.api_listen.is_some() && !api_on {
        return Err(CliError::usage(
            "--api-listen needs --api-keys FILE (or --api-allow-anonymous): without credentials the write API is off",
        ));
    }
    let (sms, webhook, _sandbox) = args.engine.provider_urls().await?;
    let mut cfg = args.engine.engine_config(&sms, &webhook);
    cfg.deadlines = args
        .engine
        .deadlines(super::config_deadlines(config_path.as_deref())?);
    cfg.durability = args.durability.durability;
    let engine = Arc::new(open_engine(&cfg).await?);
    let (metrics_listener, addr) = bind(args.listen).await?;
    let api_listener = match args.api_listen {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    let api = engine.edge.clone().filter(|_| api_on).map(|edge| {
        http_api::router(http_api::ApiState {
            edge,
            metrics: engine.metrics.clone(),
            config: http_api::ApiConfig {
                keys: keys.clone(),
                allow_anonymous: args.api_allow_anonymous,
                ttl: args.idempotency_ttl,
                idempotent: cfg.mode != idemwatch::engine::consumers::ConsumerMode::Naive,
                max_in_flight: args.api_max_in_flight,
                ..http_api::ApiConfig::default()
            },
        })
    });
    let api_where = match (&api, &api_listener) {
        (None, _) => "write API off (no --api-keys)".to_string(),
        (Some(_), Some((_, a))) => format!("write API on http://{a}/v1/…"),
        (Some(_), None) => format!(
            "write API on http://{addr}/v1/… (beside /metrics; --api-listen separates them)"
        ),
    };
    eprintln!(
        "idemwatch serve: consumers {:?} ({}, {} durability) on {} / {}; metrics on http://{addr}/metrics, {api_where}; SMS to {}",
        engine.consumer_names(),
        cfg.mode.as_str(),
        engine.store.durability().as_str(),
        engine.store.redacted_url(),
        engine.queue.redacted_url(),
        redact_url(&sms),
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
    let key_reloads = keys
        .clone()
        .map(|k| tokio::spawn(k.watch(Duration::from_secs(2), stop_rx.clone())));
    let serve_on = |listener: TcpListener, app: axum::Router| {
        let mut stop = stop_rx.clone();
        tokio::spawn(http_server::serve(
            listener,
            app,
            ConnectionLimits::default(),
            async move {
                let _ = stop.changed().await;
            },
        ))
    };
    let mut metrics_app = exporter::router(engine.metrics.clone());
    let mut servers = Vec::new();
    match (api, api_listener) {
        (Some(api), Some((listener, _))) => servers.push(serve_on(listener, api)),
        (Some(api), None) => metrics_app = metrics_app.merge(api),
        (None, _) => {}
    }
    servers.push(serve_on(metrics_listener, metrics_app));
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
    for server in servers {
        let _ = server.await;
    }
    if let Some(reloads) = key_reloads {
        let _ = reloads.await;
    }
    let _ = gauges.await;
    Ok(EXIT_OK)
}
