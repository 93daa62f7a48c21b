//! Where a dashboard runs its drills, and the options one run gets: the TUI only
//! says which scenario and mode the operator confirmed.

use std::sync::Arc;

use super::{DrillError, DrillOptions, Scenario};
use idemwatch_engine::consumers::ConsumerMode;

/// The database and queue drills run against (in their own corner), the provider,
/// and what `live-redelivery` watches.
#[derive(Debug, Clone)]
pub struct DrillTarget {
    pub db_url: String,
    pub queue_url: String,
    pub sms_url: Option<String>,
    /// What `live-redelivery` watches.
    pub metrics_url: Option<String>,
    /// The device broker `device-retransmit` publishes through (`[drills] mqtt_broker`).
    pub mqtt_broker: Option<String>,
}

impl DrillTarget {
    pub fn new(
        db_url: &str,
        queue_url: &str,
        sms_url: Option<String>,
        metrics_url: Option<String>,
        mqtt_broker: Option<String>,
    ) -> Arc<Self> {
        Arc::new(DrillTarget {
            db_url: db_url.to_string(),
            queue_url: queue_url.to_string(),
            sms_url,
            metrics_url,
            mqtt_broker,
        })
    }

    /// The options of one confirmed run. A live drill counts as confirmed here: the
    /// dashboard offers it only with `allow_live` (or on the demo) and after a
    /// popup that says LIVE.
    pub fn options(
        &self,
        scenario: Scenario,
        mode: ConsumerMode,
    ) -> Result<DrillOptions, DrillError> {
        let mut o = DrillOptions::new(scenario, &self.db_url, &self.queue_url);
        o.mode = mode;
        o.sms_url = self.sms_url.clone();
        o.mqtt_broker = self.mqtt_broker.clone();
        if scenario == Scenario::LiveRedelivery {
            o.live.confirmed = true;
            o.live.metrics_url = self.metrics_url.clone().ok_or_else(|| {
                DrillError::Usage(
                    "live-redelivery needs a metrics endpoint: set [drills] metrics_url or a [[targets]] entry".into(),
                )
            })?;
        }
        Ok(o)
    }
}
