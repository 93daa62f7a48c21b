//! The drill rig: an isolated corner of the configured system (its own queue
//! namespace, its own device id) plus a supervisor that runs consumer incarnations
//! in-process or as real child processes, restarting them as a supervisor would.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;

use super::{DrillError, DrillOptions};
use crate::sim::sandbox_provider::{self, SandboxClient, SandboxHandle};
use idemwatch_engine::consumers::ConsumerMode;
use idemwatch_engine::crash::{CrashPlan, CrashPoint, CrashStyle};
use idemwatch_engine::envelope::{Envelope, EventType};
use idemwatch_engine::metrics::Metrics;
use idemwatch_engine::queue::Queue;
use idemwatch_engine::runner::{DeliveryEvent, EventSink, RunnerSettings};
use idemwatch_engine::seen_set::SeenSetConfig;
use idemwatch_engine::store::Store;
use idemwatch_engine::{Engine, EngineConfig};

/// Timings that keep a drill to a few seconds while exercising the real paths:
/// redelivery after a visibility timeout, in doubt after a claim lease.
pub(crate) const DRILL_VISIBILITY: Duration = Duration::from_millis(300);
pub(crate) const DRILL_CLAIM_LEASE: Duration = Duration::from_millis(500);
pub(crate) const DRILL_RETRY: Duration = Duration::from_millis(100);
/// A drill's seen-set keys (Redis) outlive the drill only briefly: its device is
/// never seen again.
pub(crate) const DRILL_SEEN_SET_TTL: Duration = Duration::from_secs(600);

/// What one incarnation of a consumer did before it exited or died.
#[derive(Debug, Default)]
pub(crate) struct Incarnation {
    pub events: Vec<DeliveryEvent>,
    pub crashed: bool,
}

pub(crate) struct Rig {
    pub store: Arc<dyn Store>,
    pub queue: Arc<dyn Queue>,
    pub mode: ConsumerMode,
    pub namespace: String,
    pub device: String,
    pub phone: String,
    pub sms_url: String,
    pub webhook_url: String,
    pub db_url: String,
    queue_url: String,
    pub seen_set: SeenSetConfig,
    /// The device broker `device-retransmit` publishes through, if any.
    pub mqtt_broker: Option<String>,
    child_exe: Option<PathBuf>,
    sandbox: SandboxClient,
    _embedded_sandbox: Option<SandboxHandle>,
    progress: Option<mpsc::UnboundedSender<String>>,
}

impl Rig {
    pub async fn new(
        opts: &DrillOptions,
        store: Arc<dyn Store>,
        queue: Arc<dyn Queue>,
        run_id: i64,
    ) -> Result<Rig, DrillError> {
        let (embedded, sms_url) = match &opts.sms_url {
            Some(url) => (None, url.clone()),
            None => {
                let handle = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
                    .await
                    .map_err(|e| DrillError::Setup(format!("cannot start the SMS sandbox: {e}")))?;
                let url = handle.url();
                (Some(handle), url)
            }
        };
        let webhook_url = opts.webhook_url.clone().unwrap_or_else(|| sms_url.clone());
        let sandbox = SandboxClient::new(sms_url.clone())
            .map_err(|e| DrillError::Setup(format!("HTTP client: {e}")))?;
        let salt: u32 = rand::random();
        let child_exe = if opts.kill_process {
            Some(opts.child_exe.clone().ok_or_else(|| {
                DrillError::Setup("--kill-process needs the idemwatch executable".into())
            })?)
        } else {
            None
        };
        Ok(Rig {
            store,
            queue,
            mode: opts.mode,
            namespace: format!("drill-{run_id}-{salt:08x}"),
            device: format!("DRILL-{run_id}-{salt:08x}"),
            phone: format!("+9000{:08}", salt % 100_000_000),
            sms_url,
            webhook_url,
            db_url: opts.db_url.clone(),
            queue_url: opts.queue_url.clone(),
            seen_set: SeenSetConfig {
                ttl: opts.seen_set.ttl.min(DRILL_SEEN_SET_TTL),
                ..opts.seen_set.clone()
            },
            mqtt_broker: opts.mqtt_broker.clone(),
            child_exe,
            sandbox,
            _embedded_sandbox: embedded,
            progress: opts.progress.clone(),
        })
    }

    pub fn say(&self, line: impl Into<String>) {
        let line = line.into();
        tracing::info!(drill = %self.namespace, "{line}");
        if let Some(p) = &self.progress {
            let _ = p.send(line);
        }
    }

    /// A well-formed event of the drill's device.
    pub fn event(&self, seq: u64, event_type: EventType, message_id: &str) -> Envelope {
        let mut payload = serde_json::Map::new();
        match event_type {
            EventType::ZoneEnter | EventType::ZoneExit => {
                payload.insert("zone".into(), json!("X"));
                payload.insert("phone".into(), json!(self.phone));
            }
            EventType::Position => {
                payload.insert("lat".into(), json!(41.0082));
                payload.insert("lon".into(), json!(28.9784));
            }
            _ => {}
        }
        let base = chrono::DateTime::parse_from_rfc3339("2026-11-30T04:12:03Z")
            .map(|t| t.with_timezone(&chrono::Utc))
            .unwrap_or_default();
        Envelope {
            message_id: Some(message_id.to_string()),
            device_id: self.device.clone(),
            seq,
            event_type,
            occurred_at: base + chrono::Duration::seconds(i64::try_from(seq).unwrap_or(0)),
            payload,
        }
    }

    fn config(&self, consumers: &[&str]) -> EngineConfig {
        let mut cfg = EngineConfig::new(
            &self.db_url,
            &self.queue_url,
            &self.sms_url,
            &self.webhook_url,
        );
        cfg.mode = self.mode;
        cfg.consumers = consumers.iter().map(|s| s.to_string()).collect();
        cfg.namespace = Some(self.namespace.clone());
        cfg.claim_lease = DRILL_CLAIM_LEASE;
        cfg.seen_set = self.seen_set.clone();
        cfg.runner = RunnerSettings {
            visibility_timeout: DRILL_VISIBILITY,
            max_deliveries: 50,
            lease_batch: 1,
            batch_max_wait: Duration::ZERO,
            retry_delay: DRILL_RETRY,
            max_retry_delay: DRILL_CLAIM_LEASE,
            max_pause: DRILL_CLAIM_LEASE,
            idle_poll: Duration::from_millis(20),
            pipeline: true,
            // One delivery in hand at a time: a drill's trace names each redelivery.
            prefetch: 1,
            gather: 1,
        };
        cfg
    }

    fn engine(&self, consumers: &[&str]) -> Result<Engine, DrillError> {
        Engine::from_parts(
            self.store.clone(),
            self.queue.clone(),
            Arc::new(Metrics::new()),
            &self.config(consumers),
        )
        .map_err(|e| DrillError::Setup(e.to_string()))
    }

    /// Publish raw bodies to the named consumers' drill queues.
    pub async fn publish(&self, consumers: &[&str], bodies: &[Vec<u8>]) -> Result<(), DrillError> {
        self.engine(consumers)?
            .publish(bodies)
            .await
            .map_err(|e| DrillError::Setup(e.to_string()))
    }

    /// Run one incarnation of `consumer` until its queue is empty or it dies at
    /// `crash`. In-process, or as a real child process with `--kill-process`.
    pub async fn incarnation(
        &self,
        consumer: &str,
        crash: Option<CrashPoint>,
    ) -> Result<Incarnation, DrillError> {
        match &self.child_exe {
            Some(exe) => self.child_incarnation(exe, consumer, crash).await,
            None => self.inprocess_incarnation(consumer, crash).await,
        }
    }

    async fn inprocess_incarnation(
        &self,
        consumer: &str,
        crash: Option<CrashPoint>,
    ) -> Result<Incarnation, DrillError> {
        let engine = self.engine(&[consumer])?;
        let plan = Arc::new(match crash {
            Some(p) => CrashPlan::at(p, 1, CrashStyle::Unwind),
            None => CrashPlan::none(),
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        let sink: EventSink = Arc::new(move |e| {
            let _ = tx.send(e);
        });
        let worker = engine
            .worker(consumer, plan, Some(sink))
            .map_err(|e| DrillError::Setup(e.to_string()))?;
        let crashed = worker.run_until_idle().await.is_err();
        drop(worker);
        let mut events = Vec::new();
        while let Ok(e) = rx.try_recv() {
            events.push(e);
        }
        Ok(Incarnation { events, crashed })
    }

    async fn child_incarnation(
        &self,
        exe: &PathBuf,
        consumer: &str,
        crash: Option<CrashPoint>,
    ) -> Result<Incarnation, DrillError> {
        let cfg = self.config(&[consumer]);
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("consume")
            .arg("--until-idle")
            .arg("--events")
            .envs(cfg.url_env())
            .args(["--consumer", consumer, "--mode", self.mode.as_str()])
            .args(["--namespace", &self.namespace])
            .args([
                "--visibility-ms",
                &cfg.runner.visibility_timeout.as_millis().to_string(),
            ])
            .args(["--claim-lease-ms", &cfg.claim_lease.as_millis().to_string()])
            .args([
                "--retry-ms",
                &cfg.runner.retry_delay.as_millis().to_string(),
            ])
            .args(["--lease-batch", "1"])
            .args([
                "--seen-set-unavailable",
                self.seen_set.unavailable.as_str(),
                "--seen-set-ttl",
                &format!("{}ms", self.seen_set.ttl.as_millis()),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        // Like the other URLs, through the environment: a password never in argv.
        match &self.seen_set.url {
            Some(url) => cmd.env("IDEMWATCH_SEEN_SET", url),
            None => cmd.env_remove("IDEMWATCH_SEEN_SET"),
        };
        if let Some(p) = crash {
            cmd.args(["--crash-at", p.as_str(), "--crash-abort"]);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| DrillError::Setup(format!("cannot start {}: {e}", exe.display())))?;
        let pid = child.id().unwrap_or(0);
        let mut events = Vec::new();
        if let Some(out) = child.stdout.take() {
            let mut lines = BufReader::new(out).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(e) = serde_json::from_str::<DeliveryEvent>(&line) {
                    events.push(e);
                }
            }
        }
        let status = child
            .wait()
            .await
            .map_err(|e| DrillError::Setup(format!("waiting for child {pid}: {e}")))?;
        let crashed = !status.success();
        self.say(format!(
            "child process {pid} ({consumer}) exited: {status}{}",
            if crashed {
                " — restarting it, as a supervisor would"
            } else {
                ""
            }
        ));
        Ok(Incarnation { events, crashed })
    }

    /// Supervise `consumer` through `incarnations` lives: each of the first
    /// `crashing` ones is armed to die at `point`; the rest run clean.
    pub async fn supervise(
        &self,
        consumer: &str,
        incarnations: u32,
        crashing: u32,
        point: CrashPoint,
    ) -> Result<Vec<DeliveryEvent>, DrillError> {
        let mut all = Vec::new();
        for i in 1..=incarnations {
            let crash = (i <= crashing).then_some(point);
            let inc = self.incarnation(consumer, crash).await?;
            if crash.is_some() && !inc.crashed {
                self.say(format!(
                    "{consumer}: incarnation {i} was armed but never reached {point}"
                ));
            } else if crash.is_some() {
                self.say(format!("{consumer}: incarnation {i} died at {point}"));
            }
            all.extend(inc.events);
        }
        Ok(all)
    }

    /// SMS the provider really sent for this drill's device.
    pub async fn sms_sent(&self) -> Result<usize, DrillError> {
        let sent = self.sandbox.sent_sms().await.map_err(provider_err)?;
        Ok(sent
            .iter()
            .filter(|s| s.text.contains(&self.device))
            .count())
    }

    /// Every SMS request the provider received for this device: the Idempotency-Key
    /// each carried.
    pub async fn sms_request_keys(&self) -> Result<Vec<Option<String>>, DrillError> {
        let reqs = self.sandbox.sms_requests().await.map_err(provider_err)?;
        Ok(reqs
            .into_iter()
            .filter(|r| r.text.as_deref().is_some_and(|t| t.contains(&self.device)))
            .map(|r| r.idempotency_key)
            .collect())
    }

    /// The texts of the SMS the watched system's provider sent; `None` when the drill
    /// only has its own embedded sandbox (it sees nothing of the watched system) or the
    /// provider has no sent list.
    pub async fn sms_texts_sent(&self) -> Option<Vec<String>> {
        if self._embedded_sandbox.is_some() {
            return None;
        }
        let sent = self.sandbox.sent_sms().await.ok()?;
        Some(sent.into_iter().map(|s| s.text).collect())
    }

    pub fn db_url(&self) -> &str {
        &self.db_url
    }

    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// Calls to the provider beyond the first per key for this drill's device, SMS
    /// and webhooks (see [`super::verdict::repeat_calls`]).
    pub async fn provider_repeat_calls(&self) -> Result<u64, DrillError> {
        let sms = self.sandbox.sms_requests().await.map_err(provider_err)?;
        let erp = self.sandbox.erp_requests().await.map_err(provider_err)?;
        let device = self.device.as_str();
        let sms = sms
            .iter()
            .filter(|r| r.text.as_deref().is_some_and(|t| t.contains(device)))
            .map(|r| {
                let content = format!("sms {}", r.text.as_deref().unwrap_or_default());
                (r.idempotency_key.as_deref(), content)
            });
        let erp = erp
            .iter()
            .filter(|r| r.body.get("device_id").and_then(|d| d.as_str()) == Some(device))
            .map(|r| (r.idempotency_key.as_deref(), format!("erp {}", r.body)));
        Ok(super::verdict::repeat_calls(sms.chain(erp)))
    }

    pub async fn webhooks_sent(&self) -> Result<usize, DrillError> {
        let sent = self.sandbox.sent_erp().await.map_err(provider_err)?;
        Ok(sent
            .iter()
            .filter(|s| s.body.get("device_id").and_then(|d| d.as_str()) == Some(&self.device))
            .count())
    }

    pub async fn counter(&self) -> Result<i64, DrillError> {
        Ok(self.store.zone_exits(&self.device).await?)
    }

    /// Drop whatever is left in the drill's queues, and the queues themselves on a
    /// broker (drill namespaces must not pile up there).
    pub async fn clean_up(&self, consumers: &[&str]) {
        for c in consumers {
            let _ = self
                .queue
                .remove_queue(&format!("{}/{c}", self.namespace))
                .await;
        }
    }
}

fn provider_err(e: reqwest::Error) -> DrillError {
    DrillError::Provider(e.to_string())
}
