//! `idemwatch ingest mqtt`: take device messages from an MQTT broker (QoS 1, a
//! persistent session) and put them on the engine's queue for the consumers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::{print_json, CliError, CliResult, EngineArgs, EXIT_OK};
use idemwatch::engine::consumers::FLEET_CONSUMERS;
use idemwatch::engine::ingress::{self, MqttIngressConfig};
use idemwatch::engine::metrics::Metrics;
use idemwatch::engine::{exporter, queue, queue_name};

#[derive(Debug, Args)]
pub struct IngestArgs {
    #[command(subcommand)]
    pub source: IngestSource,
}

#[derive(Debug, Subcommand)]
pub enum IngestSource {
    /// Subscribe with QoS 1 and publish each message to every consumer's queue.
    Mqtt(MqttArgs),
}

#[derive(Debug, Args)]
pub struct MqttArgs {
    /// The device broker.
    #[arg(long, value_name = "URL", default_value = "mqtt://127.0.0.1:1883")]
    pub broker: String,
    /// Topic filter the devices publish on.
    #[arg(long, value_name = "FILTER", default_value = "fleet/+/events")]
    pub topic: String,
    /// The persistent session's client id: the same id resumes the same session
    /// (and gets what the broker kept for it meanwhile).
    #[arg(long, default_value = "idemwatch-ingest")]
    pub client_id: String,
    /// Serve idem_ingress_messages_total on http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Stop after this long without a message (a one-off import); default: run until
    /// interrupted.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub idle_exit: Option<Duration>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Print the counts as JSON when done.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: IngestArgs) -> CliResult {
    let IngestSource::Mqtt(args) = args.source;
    let queue = queue::open(&args.engine.queue_url())
        .await
        .map_err(CliError::unavailable)?;
    let consumers: Vec<String> = if args.engine.consumers.is_empty() {
        FLEET_CONSUMERS.iter().map(|c| c.to_string()).collect()
    } else {
        args.engine.consumers.clone()
    };
    let metrics = Arc::new(Metrics::new());
    if let Some(addr) = args.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| CliError::unavailable(format!("cannot listen on {addr}: {e}")))?;
        let app = exporter::router(metrics.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    let cfg = MqttIngressConfig {
        broker: args.broker.clone(),
        topic: args.topic.clone(),
        client_id: args.client_id.clone(),
        queues: consumers
            .iter()
            .map(|c| queue_name(args.engine.namespace.as_deref(), c))
            .collect(),
        idle_exit: args.idle_exit,
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = stop.send(true);
        }
    });
    let stats = ingress::run_mqtt(&cfg, queue.clone(), metrics, stopped)
        .await
        .map_err(|e| match e {
            ingress::IngressError::BadUrl(..) => CliError::usage(e.to_string()),
            other => CliError::unavailable(other),
        })?;
    queue.close().await;
    if args.json {
        print_json(&stats);
    } else {
        println!(
            "ingested {} messages ({} with the DUP flag) over {} broker connection(s)",
            stats.received, stats.received_dup_flag, stats.connections
        );
    }
    Ok(EXIT_OK)
}
