//! `idemwatch ingest mqtt`: take device messages from an MQTT broker (QoS 1, a
//! persistent session) and put them on the engine's queue for the consumers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};

use super::{print_json, CliError, CliResult, EngineArgs, EXIT_OK};
use idemwatch::engine::consumers::FLEET_CONSUMERS;
use idemwatch::engine::ingress::{self, IngressError, MqttIngressConfig};
use idemwatch::engine::metrics::Metrics;
use idemwatch::engine::mqtt_link::{LinkConfig, Password, TlsFiles};
use idemwatch::engine::{exporter, queue, queue_name, store};

/// Where `ingest mqtt` reads the broker password when no `--password-file` is given.
pub const ENV_MQTT_PASSWORD: &str = "IDEMWATCH_MQTT_PASSWORD";
/// The client id without `--client-id`.
const DEFAULT_CLIENT_ID: &str = "idemwatch-ingest";

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
    /// The device broker: mqtt://[USER@]HOST[:PORT], or mqtts:// for TLS (port 8883 by
    /// default). The password is never part of it: IDEMWATCH_MQTT_PASSWORD or
    /// --password-file.
    #[arg(long, value_name = "URL", default_value = "mqtt://127.0.0.1:1883")]
    pub broker: String,
    /// A topic filter the devices publish on (repeatable). Subscribed on every
    /// connect; filters an earlier run subscribed that are no longer given are
    /// unsubscribed.
    #[arg(long = "topic", value_name = "FILTER", default_values_t = [String::from("fleet/+/events")])]
    pub topics: Vec<String>,
    /// Share the subscription with the other ingest processes of group NAME
    /// ($share/NAME/FILTER): each message goes to one of them. Give each process its
    /// own stable --client-id.
    #[arg(long, value_name = "NAME")]
    pub share_group: Option<String>,
    /// The persistent session's client id: the same id resumes the same session
    /// (and gets what the broker kept for it meanwhile). Default: idemwatch-ingest,
    /// required with --share-group.
    #[arg(long, value_name = "ID")]
    pub client_id: Option<String>,
    /// A file whose first line is the broker password of the URL's user (else the
    /// IDEMWATCH_MQTT_PASSWORD environment variable).
    #[arg(long, value_name = "FILE")]
    pub password_file: Option<PathBuf>,
    /// PEM certificates to trust for an mqtts:// broker, instead of the system's roots.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// PEM certificate (chain) of this client, for brokers that authenticate
    /// clients by certificate; with --client-key.
    #[arg(long, value_name = "FILE", requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// Serve the ingress's metrics (messages, DUP flags, connection, errors, dead
    /// letters) on http://ADDR/metrics.
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

impl MqttArgs {
    /// The password, from the file or the environment, never both.
    fn password(&self) -> Result<Option<Password>, CliError> {
        let from_env = std::env::var(ENV_MQTT_PASSWORD)
            .ok()
            .filter(|p| !p.is_empty());
        match (&self.password_file, from_env) {
            (Some(_), Some(_)) => Err(CliError::usage(format!(
                "both --password-file and {ENV_MQTT_PASSWORD} are set: give one"
            ))),
            (Some(file), None) => Password::from_file(file)
                .map(Some)
                .map_err(|e| CliError::usage(e.to_string())),
            (None, Some(p)) => Ok(Some(Password::new(p))),
            (None, None) => Ok(None),
        }
    }

    fn link(&self) -> Result<LinkConfig, CliError> {
        let tls = TlsFiles {
            ca_file: self.ca_file.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
        };
        LinkConfig::new(&self.broker, self.password()?, tls)
            .map_err(|e| CliError::usage(e.to_string()))
    }
}

pub async fn run(args: IngestArgs) -> CliResult {
    let IngestSource::Mqtt(args) = args.source;
    let client_id = match (&args.client_id, &args.share_group) {
        (Some(id), _) => id.clone(),
        (None, None) => DEFAULT_CLIENT_ID.to_string(),
        (None, Some(_)) => {
            return Err(CliError::usage(
                "--share-group needs a --client-id of this process's own (two members with one id take the session from each other)",
            ))
        }
    };
    let consumers: Vec<String> = if args.engine.consumers.is_empty() {
        FLEET_CONSUMERS.iter().map(|c| c.to_string()).collect()
    } else {
        args.engine.consumers.clone()
    };
    let cfg = MqttIngressConfig {
        link: args.link()?,
        filters: args.topics.clone(),
        share_group: args.share_group.clone(),
        client_id,
        queues: consumers
            .iter()
            .map(|c| queue_name(args.engine.namespace.as_deref(), c))
            .collect(),
        idle_exit: args.idle_exit,
    };
    cfg.validate().map_err(|e| CliError::usage(e.to_string()))?;
    let queue = queue::open(&args.engine.queue_url())
        .await
        .map_err(CliError::unavailable)?;
    // Where the door's dead letters go, and the session's subscriptions are kept.
    let store = store::open(&args.engine.db_url())
        .await
        .map_err(CliError::unavailable)?;
    let metrics = Arc::new(Metrics::new());
    if let Some(addr) = args.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| CliError::unavailable(format!("cannot listen on {addr}: {e}")))?;
        let app = exporter::router(metrics.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    // SIGINT or SIGTERM (what systemd, Docker and Kubernetes send to stop a
    // service): finish the batch in hand, send its PUBACKs, disconnect, exit 0. The
    // session keeps what is not acked for the next start.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        super::serve::shutdown_signal().await;
        let _ = stop.send(true);
    });
    let ran = ingress::run_mqtt(&cfg, queue.clone(), store, metrics, stopped).await;
    queue.close().await;
    let stats = ran.map_err(|e| match e {
        IngressError::BadUrl(..) | IngressError::BadConfig(_) | IngressError::Link(_) => {
            CliError::usage(e.to_string())
        }
        other => CliError::unavailable(other),
    })?;
    if args.json {
        print_json(&stats);
    } else {
        println!(
            "ingested {} messages ({} with the DUP flag, {} dead-lettered) over {} broker connection(s); filters: {}{}",
            stats.received,
            stats.received_dup_flag,
            stats.dead_lettered_total(),
            stats.connections,
            stats.filters.join(", "),
            if stats.unsubscribed.is_empty() {
                String::new()
            } else {
                format!("; unsubscribed: {}", stats.unsubscribed.join(", "))
            }
        );
    }
    Ok(EXIT_OK)
}
