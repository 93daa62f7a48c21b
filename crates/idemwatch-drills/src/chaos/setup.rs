//! Chaos setup: the ground truth of what will be published, and the arena the run
//! happens in (store, queue, SMS sandbox, the namespaced queues, the `serve`
//! instances the killer picks from).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::process::{Child, Command};

use super::{
    say, setup_failed, ChaosOptions, ChaosReport, CHAOS_ACK_WAIT, CHAOS_CLAIM_LEASE,
    CHAOS_MAX_DELIVERIES,
};
use crate::sim::fleet::{FleetConfig, FleetSim, SimMessage};
use crate::sim::sandbox_provider::{self, SandboxHandle};
use crate::DrillError;
use idemwatch_base::exposition::{ScrapeLimits, Scraper};
use idemwatch_engine::consumers;
use idemwatch_engine::envelope::EventType;
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::queue::Queue;
use idemwatch_engine::store::{MarkerKind, Store};
use idemwatch_engine::{Engine, EngineConfig};

/// The ground truth of what was published.
pub(super) struct Truth {
    pub messages: Vec<SimMessage>,
    /// Distinct keys per event type.
    pub keys: HashMap<EventType, HashSet<String>>,
    pub newest: HashMap<String, (u64, EventType)>,
    pub history_per_device: HashMap<String, usize>,
}

impl Truth {
    /// The distinct keys of one event type (none if the trace had none).
    pub fn keys_of(&self, t: EventType) -> &HashSet<String> {
        static NONE: std::sync::OnceLock<HashSet<String>> = std::sync::OnceLock::new();
        self.keys
            .get(&t)
            .unwrap_or_else(|| NONE.get_or_init(HashSet::new))
    }
}

pub(super) fn generate(opts: &ChaosOptions, prefix: &str) -> Truth {
    let vehicles = (opts.events / 100).clamp(1, 500);
    let mut sim = FleetSim::new(FleetConfig {
        vehicles,
        seed: opts.seed,
        redelivery_rate: opts.dup_rate,
        deploy_redelivery_rate: opts.dup_rate,
        late_rate: opts.late_rate,
        device_prefix: prefix.to_string(),
        ..FleetConfig::default()
    });
    let messages = sim.take_n(opts.events);
    let mut keys: HashMap<EventType, HashSet<String>> = HashMap::new();
    let mut newest: HashMap<String, (u64, EventType)> = HashMap::new();
    let mut distinct: HashSet<String> = HashSet::new();
    let mut history_per_device: HashMap<String, usize> = HashMap::new();
    for m in &messages {
        let e = &m.envelope;
        let key = e.key().to_string();
        keys.entry(e.event_type).or_default().insert(key.clone());
        if distinct.insert(key) {
            *history_per_device.entry(e.device_id.clone()).or_default() += 1;
        }
        let slot = newest
            .entry(e.device_id.clone())
            .or_insert((e.seq, e.event_type));
        if e.seq > slot.0 {
            *slot = (e.seq, e.event_type);
        }
    }
    Truth {
        messages,
        keys,
        newest,
        history_per_device,
    }
}

/// One `idemwatch serve` instance.
pub(super) struct Instance {
    child: Option<Child>,
    args: Vec<String>,
    /// The connection URLs (see [`idemwatch_engine::url_env`]).
    env: Vec<(&'static str, String)>,
    exe: PathBuf,
}

impl Instance {
    pub(super) fn start(&mut self) -> Result<(), DrillError> {
        let child = Command::new(&self.exe)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| setup_failed(format!("cannot start {}: {e}", self.exe.display())))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no destructor, no ack, no goodbye to the broker.
    pub(super) async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }
}

/// Everything a chaos run works in, opened once: the verifier reads the same store
/// and sandbox the instances wrote to.
pub(super) struct Arena {
    pub store: Arc<dyn Store>,
    pub queue: Arc<dyn Queue>,
    pub run_id: i64,
    /// Queue names live under it, so a run never touches another's queues.
    pub namespace: String,
    /// Every device id of this run starts with it: how its rows, dead letters and
    /// SMS are told from everyone else's.
    pub prefix: String,
    pub sandbox: SandboxHandle,
    pub sms_url: String,
    pub truth: Truth,
    /// The engine configuration the publisher and the final drainer use.
    pub cfg: EngineConfig,
    pub queue_names: Vec<String>,
    /// The broker's metrics and its redelivery counter before the run (RabbitMQ).
    broker_metrics: Option<String>,
    redelivered_before: Option<f64>,
}

impl Arena {
    /// Open the store and queue, start the drill run, the SMS sandbox and the truth,
    /// and declare the namespaced queues before anyone consumes or publishes.
    pub async fn prepare(opts: &ChaosOptions) -> Result<Arena, DrillError> {
        let store = idemwatch_engine::store::open(&opts.db_url).await?;
        let queue = idemwatch_engine::queue::open(&opts.queue_url)
            .await
            .map_err(setup_failed)?;
        let run_id = store.start_drill_run("chaos", "idempotent").await?;
        let salt: u32 = rand::random();
        let namespace = format!("chaos-{run_id}-{salt:08x}");
        let prefix = format!("CHAOS-{salt:08x}-");
        let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
            .await
            .map_err(|e| setup_failed(format!("cannot start the SMS sandbox: {e}")))?;
        let sms_url = sandbox.url();
        let broker_metrics = broker_metrics_url(&opts.queue_url);
        let redelivered_before = match &broker_metrics {
            Some(u) => broker_redeliveries(u).await,
            None => None,
        };
        let truth = generate(opts, &prefix);
        say(
            opts,
            format!(
                "chaos #{run_id}: {} messages for {} vehicles, {} instances, a SIGKILL {}",
                truth.messages.len(),
                truth.history_per_device.len(),
                opts.instances,
                opts.kill_every
            ),
        );
        let mut cfg = EngineConfig::new(&opts.db_url, &opts.queue_url, &sms_url, &sms_url);
        cfg.namespace = Some(namespace.clone());
        let queue_names: Vec<String> = consumers::FLEET_CONSUMERS
            .iter()
            .map(|c| idemwatch_engine::replay::queue_name(Some(&namespace), c))
            .collect();
        for q in &queue_names {
            queue.depth(q).await.map_err(setup_failed)?;
        }
        Ok(Arena {
            store,
            queue,
            run_id,
            namespace,
            prefix,
            sandbox,
            sms_url,
            truth,
            cfg,
            queue_names,
            broker_metrics,
            redelivered_before,
        })
    }

    /// An engine over the arena's store and queue with `cfg`, its own metrics.
    pub fn engine(&self, cfg: &EngineConfig) -> Result<Engine, DrillError> {
        Engine::from_parts(
            self.store.clone(),
            self.queue.clone(),
            Arc::new(Metrics::new()),
            cfg,
        )
        .map_err(setup_failed)
    }

    /// `opts.instances` `idemwatch serve` processes on the arena, started.
    pub fn start_instances(&self, opts: &ChaosOptions) -> Result<Vec<Instance>, DrillError> {
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--namespace".into(),
            self.namespace.clone(),
            "--mode".into(),
            "idempotent".into(),
            "--claim-lease-ms".into(),
            CHAOS_CLAIM_LEASE.as_millis().to_string(),
            "--max-deliveries".into(),
            CHAOS_MAX_DELIVERIES.to_string(),
        ];
        if opts.queue_url.starts_with("nats://") {
            args.extend([
                "--visibility-ms".into(),
                CHAOS_ACK_WAIT.as_millis().to_string(),
            ]);
        }
        let env: Vec<(&'static str, String)> =
            idemwatch_engine::url_env(&opts.db_url, &opts.queue_url, &self.sms_url, &self.sms_url)
                .map(|(k, v)| (k, v.to_string()))
                .to_vec();
        let mut instances: Vec<Instance> = (0..opts.instances)
            .map(|_| Instance {
                child: None,
                args: args.clone(),
                env: env.clone(),
                exe: opts.exe.clone(),
            })
            .collect();
        for inst in &mut instances {
            inst.start()?;
        }
        Ok(instances)
    }

    /// The broker's redeliveries over the run, where its metrics are reachable.
    pub async fn broker_redelivered(&self) -> Option<f64> {
        match (&self.broker_metrics, self.redelivered_before) {
            (Some(u), Some(before)) => broker_redeliveries(u).await.map(|after| after - before),
            _ => None,
        }
    }

    /// Remove the run's queues, record the report and its marker, stop the sandbox.
    pub async fn finish(self, report: &ChaosReport, kills: u64) -> Result<(), DrillError> {
        for q in &self.queue_names {
            let _ = self.queue.remove_queue(q).await;
        }
        self.queue.close().await;
        let report_json = serde_json::to_value(report).unwrap_or(Value::Null);
        self.store
            .finish_drill_run(self.run_id, report.verdict.as_str(), &report_json)
            .await?;
        self.store
            .add_marker(
                MarkerKind::Drill,
                &format!("chaos run: {}", report.verdict.as_str()),
                Some(&json!({"run_id": self.run_id, "kills": kills}).to_string()),
            )
            .await?;
        let _ = self.sandbox.shutdown().await;
        Ok(())
    }
}

/// Where a RabbitMQ broker serves Prometheus metrics: its host, port 15692
/// (`IDEMWATCH_BROKER_METRICS_URL` overrides). Only for `amqp://` queues.
pub(super) fn broker_metrics_url(queue_url: &str) -> Option<String> {
    if let Ok(u) = std::env::var("IDEMWATCH_BROKER_METRICS_URL") {
        return Some(u);
    }
    let u = url::Url::parse(queue_url).ok()?;
    if !u.scheme().starts_with("amqp") {
        return None;
    }
    Some(format!("http://{}:15692/metrics", u.host_str()?))
}

/// `rabbitmq_global_messages_redelivered_total`, summed over protocols and queue types.
pub(super) async fn broker_redeliveries(url: &str) -> Option<f64> {
    let exposition = Scraper::new(Duration::from_secs(3), ScrapeLimits::default())
        .ok()?
        .exposition(url)
        .await
        .ok()?;
    let mut sum = None;
    for s in exposition.named("rabbitmq_global_messages_redelivered_total") {
        *sum.get_or_insert(0.0) += s.value;
    }
    sum
}
