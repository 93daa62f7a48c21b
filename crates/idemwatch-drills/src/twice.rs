//! The review rule of the field report as an on-demand check: "what happens if I
//! call this handler twice with the same message?" A consumer passes when handling a
//! fleet trace with every message delivered twice leaves the database, the provider
//! and the counters exactly as handling it once.
//!
//! The check runs on a scratch SQLite database and its own sandbox provider, never
//! on the watched system.

use std::sync::Arc;

use serde::Serialize;

use super::{DrillError, Verdict};
use crate::sim::fleet::{FleetConfig, FleetSim};
use crate::sim::sandbox_provider::{self, SandboxClient};
use idemwatch_engine::consumers::{self, ConsumerMode, RiskClass};
use idemwatch_engine::crash::CrashPlan;
use idemwatch_engine::store::StateDigest;
use idemwatch_engine::{Engine, EngineConfig};

/// Everything observable after a run, minus wall-clock columns.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub digest: StateDigest,
    /// (to, text, idempotency key) of every SMS the provider sent, sorted.
    pub sms: Vec<(String, String, Option<String>)>,
    /// Every webhook body the ERP sink accepted, sorted.
    pub webhooks: Vec<String>,
    /// (consumer, processed, out_of_order, side effects sent).
    pub processed: Vec<(String, u64, u64, u64)>,
}

/// Run `messages` through `consumers` (empty = all) on the given database and
/// queue with a fresh sandbox provider, and observe the result.
pub async fn observe(
    db_url: &str,
    queue_url: &str,
    consumers: &[&str],
    mode: ConsumerMode,
    messages: &[Vec<u8>],
) -> Result<Observation, DrillError> {
    let setup = |e: &dyn std::fmt::Display| DrillError::Setup(e.to_string());
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .map_err(|e| setup(&e))?;
    let mut cfg = EngineConfig::new(db_url, queue_url, &sandbox.url(), &sandbox.url());
    cfg.mode = mode;
    cfg.consumers = consumers.iter().map(|c| c.to_string()).collect();
    let engine = Engine::open(&cfg).await.map_err(|e| setup(&e))?;
    engine.publish(messages).await.map_err(|e| setup(&e))?;
    let summary = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .map_err(|e| setup(&e))?;
    let client = SandboxClient::new(sandbox.url()).map_err(|e| setup(&e))?;
    let provider = |e: reqwest::Error| DrillError::Provider(e.to_string());
    let mut sms: Vec<_> = client
        .sent_sms()
        .await
        .map_err(provider)?
        .into_iter()
        .map(|s| (s.to, s.text, s.idempotency_key))
        .collect();
    sms.sort();
    let mut webhooks: Vec<_> = client
        .sent_erp()
        .await
        .map_err(provider)?
        .into_iter()
        .map(|w| w.body.to_string())
        .collect();
    webhooks.sort();
    Ok(Observation {
        digest: engine.store.digest().await?,
        sms,
        webhooks,
        processed: summary
            .consumers
            .iter()
            .map(|(n, c)| (n.clone(), c.processed, c.out_of_order, c.side_effects_sent))
            .collect(),
    })
}

/// The verdict of the "twice" check for one consumer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TwiceCheck {
    pub consumer: String,
    pub risk: RiskClass,
    pub mode: ConsumerMode,
    pub messages: usize,
    pub verdict: Verdict,
    pub detail: String,
}

/// Deliver a fleet trace once, then every message twice in a row, and compare.
pub async fn check_consumer(
    consumer: &str,
    mode: ConsumerMode,
    messages: usize,
) -> Result<TwiceCheck, DrillError> {
    let risk = risk_of(consumer)?;
    let mut sim = FleetSim::new(FleetConfig {
        vehicles: 3,
        seed: 11,
        redelivery_rate: 0.0,
        late_rate: 0.05,
        ..FleetConfig::default()
    });
    let once: Vec<Vec<u8>> = sim.take_n(messages).into_iter().map(|m| m.raw).collect();
    let twice: Vec<Vec<u8>> = once.iter().flat_map(|m| [m.clone(), m.clone()]).collect();
    let mut runs = Vec::new();
    for trace in [&once, &twice] {
        let dir = tempfile::tempdir().map_err(|e| DrillError::Setup(e.to_string()))?;
        let url = |f: &str| format!("sqlite://{}", dir.path().join(f).display());
        runs.push(
            observe(
                &url("db.sqlite"),
                &url("queue.sqlite"),
                &[consumer],
                mode,
                trace,
            )
            .await?,
        );
    }
    let (a, b) = (&runs[0], &runs[1]);
    let mut differences = Vec::new();
    if a.digest != b.digest {
        differences.push("database rows differ");
    }
    if a.sms != b.sms {
        differences.push("SMS sent differ");
    }
    if a.webhooks != b.webhooks {
        differences.push("webhooks sent differ");
    }
    if a.processed != b.processed {
        differences.push("effect counters differ");
    }
    let verdict = if differences.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail
    };
    let detail = if differences.is_empty() {
        format!(
            "same result: {} SMS, {} webhooks, {} history rows, {} dedup rows",
            a.sms.len(),
            a.webhooks.len(),
            a.digest.history.len(),
            a.digest.processed.len()
        )
    } else {
        format!(
            "{} (once: {} SMS, {} webhooks; twice: {} SMS, {} webhooks)",
            differences.join(", "),
            a.sms.len(),
            a.webhooks.len(),
            b.sms.len(),
            b.webhooks.len()
        )
    };
    Ok(TwiceCheck {
        consumer: consumer.to_string(),
        risk,
        mode,
        messages,
        verdict,
        detail,
    })
}

/// The check for every fleet consumer.
pub async fn check_all(mode: ConsumerMode, messages: usize) -> Vec<Result<TwiceCheck, String>> {
    let mut out = Vec::new();
    for c in consumers::FLEET_CONSUMERS {
        out.push(
            check_consumer(c, mode, messages)
                .await
                .map_err(|e| format!("{c}: {e}")),
        );
    }
    out
}

fn risk_of(consumer: &str) -> Result<RiskClass, DrillError> {
    consumers::risk_class(consumer)
        .ok_or_else(|| DrillError::Usage(format!("unknown consumer {consumer:?}")))
}
