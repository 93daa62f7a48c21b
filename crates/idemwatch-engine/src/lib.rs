//! The embedded idempotent-consumer engine. Knows nothing of terminals: it could be
//! published alone as a library.
//!
//! [`Engine`] ties a [`store::Store`], a [`queue::Queue`], the fleet
//! [`consumers`] and their [`metrics::Metrics`] together.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

pub mod api_keys;
pub mod consumers;
pub mod crash;
pub mod deadlines;
pub mod envelope;
pub mod exporter;
pub mod health;
pub mod http_api;
pub mod http_server;
pub mod idempotency_key;
pub mod ingress;
pub mod metrics;
pub mod mqtt_link;
pub mod provider;
pub mod queue;
pub mod replay;
pub mod retention;
pub mod runner;
pub mod seen_set;
mod sqlite;
pub mod store;
pub mod sweeper;

use consumers::{Consumer, ConsumerMode, Deps};
use crash::{CrashPlan, Crashed};
use metrics::{CountSummary, Metrics};
use provider::ProviderClient;
use queue::{Queue, QueueError};
use runner::{EventSink, RunnerSettings, Worker};
use store::{Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(
        "unknown consumer {0:?} (known: vehicle-state, trip-counter, zone-exit-sms, erp-webhook)"
    )]
    UnknownConsumer(String),
    #[error("{0}")]
    Other(String),
}

/// Everything needed to open an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub db_url: String,
    pub queue_url: String,
    pub sms_url: String,
    pub webhook_url: String,
    pub mode: ConsumerMode,
    /// Which consumers run; empty = all four.
    pub consumers: Vec<String>,
    /// Queue-name prefix, so drills never touch live queues.
    pub namespace: Option<String>,
    pub runner: RunnerSettings,
    pub claim_lease: Duration,
    /// How the business database commits ([`store::Durability`]; durable unless asked).
    pub durability: store::Durability,
    /// Where `seen-set` mode keeps its keys and what it does when that is down.
    pub seen_set: seen_set::SeenSetConfig,
    /// Provider calls of one batch in flight at once, per side-effect consumer.
    pub provider_concurrency: usize,
    /// How long each wait on the database and the broker may last.
    pub deadlines: deadlines::Deadlines,
}

/// The environment variables the command line reads its connection URLs from.
/// Drills start their child processes with the URLs in these, never on the command
/// line: a command line is readable by every user of the machine (`ps`,
/// `/proc/<pid>/cmdline`), a process's environment only by its owner.
pub const ENV_DB: &str = "IDEMWATCH_DB";
pub const ENV_QUEUE: &str = "IDEMWATCH_QUEUE";
pub const ENV_SMS_URL: &str = "IDEMWATCH_SMS_URL";
pub const ENV_WEBHOOK_URL: &str = "IDEMWATCH_WEBHOOK_URL";

/// The connection URLs as a child `idemwatch` process's environment.
pub fn url_env<'a>(
    db_url: &'a str,
    queue_url: &'a str,
    sms_url: &'a str,
    webhook_url: &'a str,
) -> [(&'static str, &'a str); 4] {
    [
        (ENV_DB, db_url),
        (ENV_QUEUE, queue_url),
        (ENV_SMS_URL, sms_url),
        (ENV_WEBHOOK_URL, webhook_url),
    ]
}

impl EngineConfig {
    /// This config's URLs for a child process ([`url_env`]).
    pub fn url_env(&self) -> [(&'static str, &str); 4] {
        url_env(
            &self.db_url,
            &self.queue_url,
            &self.sms_url,
            &self.webhook_url,
        )
    }

    pub fn new(db_url: &str, queue_url: &str, sms_url: &str, webhook_url: &str) -> Self {
        EngineConfig {
            db_url: db_url.to_string(),
            queue_url: queue_url.to_string(),
            sms_url: sms_url.to_string(),
            webhook_url: webhook_url.to_string(),
            mode: ConsumerMode::Idempotent,
            consumers: Vec::new(),
            namespace: None,
            runner: RunnerSettings::default(),
            claim_lease: consumers::DEFAULT_CLAIM_LEASE,
            durability: store::Durability::Durable,
            seen_set: seen_set::SeenSetConfig::default(),
            provider_concurrency: consumers::DEFAULT_PROVIDER_CONCURRENCY,
            deadlines: deadlines::Deadlines::default(),
        }
    }
}

/// Why there is no data directory.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "no data directory: neither $XDG_DATA_HOME nor $HOME is set (idemwatch keeps its database, \
     queue and log in $XDG_DATA_HOME/idemwatch or ~/.local/share/idemwatch); set one of them"
)]
pub struct NoDataDir;

/// `$XDG_DATA_HOME/idemwatch`, else `$HOME/.local/share/idemwatch`. Never a shared
/// directory such as `/tmp`: what lives there (the database, the queue, the log)
/// holds message payloads and must be the user's alone.
pub fn data_dir() -> Result<PathBuf, NoDataDir> {
    let from_env = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    from_env("XDG_DATA_HOME")
        .or_else(|| from_env("HOME").map(|h| h.join(".local").join("share")))
        .map(|d| d.join("idemwatch"))
        .ok_or(NoDataDir)
}

/// The data directory, for callers that run after the binary checked [`data_dir`]
/// (it refuses to start without one); a library caller without a home gets a
/// relative `idemwatch` directory, never a shared one.
pub fn default_data_dir() -> PathBuf {
    data_dir().unwrap_or_else(|_| PathBuf::from("idemwatch"))
}

/// Create `dir` readable by its owner only (0700), and take away group and other
/// access from one that exists.
#[cfg(unix)]
pub fn make_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// `sqlite://…/idemwatch.db` in the default data directory.
pub fn default_db_url() -> String {
    format!(
        "sqlite://{}",
        default_data_dir().join("idemwatch.db").display()
    )
}

/// The embedded queue's file beside a SQLite database, else in the data directory.
pub fn default_queue_url(db_url: &str) -> String {
    let dir = db_url
        .strip_prefix("sqlite://")
        .map(|p| p.split('?').next().unwrap_or(p))
        .map(PathBuf::from)
        .and_then(|p| p.parent().map(|d| d.to_path_buf()))
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(default_data_dir);
    format!("sqlite://{}", dir.join("idemwatch-queue.db").display())
}

/// The queue one consumer reads, in a namespace or not: `{namespace}/{consumer}`
/// (written once, in `replay.rs`).
pub use replay::queue_name;

/// The consumer engine.
pub struct Engine {
    pub store: Arc<dyn Store>,
    /// The same database's HTTP-edge side (opened by [`Engine::open`]).
    pub edge: Option<Arc<dyn store::edge::EdgeStore>>,
    pub queue: Arc<dyn Queue>,
    pub metrics: Arc<Metrics>,
    pub deps: Deps,
    consumers: Vec<Arc<dyn Consumer>>,
    /// One breaker per consumer, shared by its workers (see `health.rs`).
    health: Vec<Arc<health::ConsumerHealth>>,
    namespace: Option<String>,
    runner: RunnerSettings,
}

impl Engine {
    /// Open the store and queue the config names and build the consumers.
    pub async fn open(cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let stores = store::open_with(&cfg.db_url, cfg.durability, &cfg.deadlines).await?;
        let queue = queue::open_with(&cfg.queue_url, &cfg.deadlines).await?;
        let mut engine = Engine::from_parts(stores.store, queue, Arc::new(Metrics::new()), cfg)?;
        engine.edge = Some(stores.edge);
        Ok(engine)
    }

    /// Build an engine over already-open parts (drills share one store and queue
    /// between several engines). The metrics report the durability the store was
    /// opened with, whatever `cfg.durability` says: the store is what commits.
    pub fn from_parts(
        store: Arc<dyn Store>,
        queue: Arc<dyn Queue>,
        metrics: Arc<Metrics>,
        cfg: &EngineConfig,
    ) -> Result<Engine, EngineError> {
        let seen_set =
            seen_set::GuardedSeenSet::open(&cfg.seen_set, store.clone(), metrics.clone())?;
        // A Redis seen-set forgets a key after its TTL: a dedup window the dashboard
        // compares the duplicates' ages with. (The SQL seen-set's is the retention.)
        if cfg.mode == ConsumerMode::SeenSet && cfg.seen_set.url.is_some() {
            metrics.set_seen_set_ttl(cfg.seen_set.ttl);
        }
        let deps = Deps {
            store: store.clone(),
            seen_set,
            provider: ProviderClient::new(&cfg.sms_url, &cfg.webhook_url),
            metrics: metrics.clone(),
            claim_lease: cfg.claim_lease,
            provider_concurrency: cfg.provider_concurrency.max(1),
            custody: Arc::default(),
        };
        let names: Vec<String> = if cfg.consumers.is_empty() {
            consumers::FLEET_CONSUMERS
                .iter()
                .map(|s| s.to_string())
                .collect()
        } else {
            cfg.consumers.clone()
        };
        let consumers = names
            .iter()
            .map(|n| {
                consumers::build(n, &deps, cfg.mode)
                    .ok_or_else(|| EngineError::UnknownConsumer(n.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        for c in &consumers {
            metrics.register_consumer(c.name(), consumers::risk_class(c.name()));
        }
        metrics.set_durability(store.durability());
        let health = consumers
            .iter()
            .map(|c| {
                Arc::new(health::ConsumerHealth::new(
                    c.name(),
                    cfg.runner.backoff(),
                    metrics.clone(),
                ))
            })
            .collect();
        Ok(Engine {
            store,
            edge: None,
            queue,
            metrics,
            deps,
            consumers,
            health,
            namespace: cfg.namespace.clone(),
            runner: cfg.runner.clone(),
        })
    }

    pub fn consumers(&self) -> &[Arc<dyn Consumer>] {
        &self.consumers
    }

    /// A consumer's pause, if its store or provider is unhealthy now.
    pub fn pause(&self, consumer: &str) -> Option<health::Pause> {
        self.consumers
            .iter()
            .zip(&self.health)
            .find(|(c, _)| c.name() == consumer)
            .and_then(|(_, h)| h.pause())
    }

    pub fn consumer_names(&self) -> Vec<&'static str> {
        self.consumers.iter().map(|c| c.name()).collect()
    }

    /// The queue a consumer reads: its name, prefixed by the namespace if any.
    pub fn queue_name(&self, consumer: &str) -> String {
        replay::queue_name(self.namespace.as_deref(), consumer)
    }

    /// Publish raw messages to every consumer's queue (the fan-out exchange).
    pub async fn publish(&self, bodies: &[Vec<u8>]) -> Result<(), EngineError> {
        let queues: Vec<String> = self
            .consumers
            .iter()
            .map(|c| self.queue_name(c.name()))
            .collect();
        self.queue.publish(&queues, bodies).await?;
        Ok(())
    }

    /// One worker for one consumer of this engine.
    pub fn worker(
        &self,
        consumer: &str,
        crash: Arc<CrashPlan>,
        events: Option<EventSink>,
    ) -> Result<Worker, EngineError> {
        let (c, health) = self
            .consumers
            .iter()
            .zip(&self.health)
            .find(|(c, _)| c.name() == consumer)
            .ok_or_else(|| EngineError::UnknownConsumer(consumer.to_string()))?;
        Ok(Worker::new(
            c.clone(),
            self.queue.clone(),
            self.queue_name(consumer),
            self.store.clone(),
            self.metrics.clone(),
            crash,
            self.runner.clone(),
            events,
        )
        .with_health(health.clone())
        .with_seen_set(self.deps.seen_set.clone()))
    }

    /// Run every consumer (one worker each) until all their queues are empty.
    pub async fn run_until_idle(
        &self,
        crash: Arc<CrashPlan>,
        events: Option<EventSink>,
    ) -> Result<CountSummary, Crashed> {
        let workers = self
            .consumer_names()
            .into_iter()
            .map(|c| self.worker(c, crash.clone(), events.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| Crashed(crash::CrashPoint::AfterHandle))?;
        let results = futures::future::join_all(workers.iter().map(|w| w.run_until_idle())).await;
        for r in results {
            r?;
        }
        Ok(self.summary())
    }

    /// Run `workers_per_consumer` workers per consumer until `shutdown`.
    pub async fn run(
        &self,
        workers_per_consumer: usize,
        crash: Arc<CrashPlan>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<(), Crashed> {
        let mut workers = Vec::new();
        for c in self.consumer_names() {
            for _ in 0..workers_per_consumer.max(1) {
                if let Ok(w) = self.worker(c, crash.clone(), None) {
                    workers.push(w);
                }
            }
        }
        // The claim sweeper runs beside the workers: no claim stays in doubt forever,
        // even when no redelivery comes (see `sweeper`).
        let sweeper = sweeper::run(self.consumers.clone(), self.deps.clone(), shutdown.clone());
        // It ends with the workers (a crashed worker ends `run` without a shutdown).
        let workers_done =
            futures::future::join_all(workers.iter().map(|w| w.run(shutdown.clone())));
        tokio::pin!(workers_done, sweeper);
        let results = tokio::select! {
            r = &mut workers_done => r,
            () = &mut sweeper => workers_done.await,
        };
        // Provider answers the workers kept through a store outage are recorded one
        // last time; what is still kept leaves with the process, its claims resent
        // under the same key after the lease.
        for c in &self.consumers {
            if self.deps.custody.answers_kept() == 0 {
                break;
            }
            if let Err(e) = consumers::record_kept(c.name(), &self.deps).await {
                tracing::warn!(consumer = c.name(), error = %e, left = self.deps.custody.answers_kept(),
                    "stopping with provider answers not recorded: their claims are resent under the same key after the lease");
            }
        }
        for r in results {
            r?;
        }
        Ok(())
    }

    /// Counts of this engine's consumers since it started.
    pub fn summary(&self) -> CountSummary {
        self.metrics.summary(self.consumer_names())
    }

    /// Re-drive this engine's in-doubt claims once (what [`Engine::run`] does on
    /// its own every [`sweeper::interval`]).
    pub async fn sweep_claims(&self) -> Result<sweeper::SweepReport, EngineError> {
        Ok(sweeper::sweep(
            &self.consumers,
            self.store.as_ref(),
            &self.metrics,
            self.deps.claim_lease,
        )
        .await?)
    }

    /// Refresh `idem_side_effect_claims_in_doubt` from the claims table.
    pub async fn refresh_in_doubt_gauge(&self) -> Result<(), EngineError> {
        let in_doubt = self.store.claims_in_doubt(self.deps.claim_lease).await?;
        for c in &self.consumers {
            let n = in_doubt.iter().filter(|k| k.consumer == c.name()).count();
            self.metrics
                .set_claims_in_doubt(c.name(), i64::try_from(n).unwrap_or(i64::MAX));
        }
        Ok(())
    }
}
