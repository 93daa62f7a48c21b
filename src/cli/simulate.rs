//! `idemwatch simulate`: print a deterministic fleet trace as JSON lines, to feed
//! `publish` (or any other system) with realistic traffic.

use std::io::Write;

use clap::Args;

use super::{CliError, CliResult, EXIT_OK};
use idemwatch::sim::fleet::{FleetConfig, FleetSim};
use idemwatch::sim::mqtt_device;

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// How many messages to print.
    #[arg(long, default_value_t = 10_000)]
    pub messages: usize,
    #[arg(long, default_value_t = 20)]
    pub vehicles: usize,
    /// Same seed, same bytes.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Fraction of redelivered messages (0.0001 = 0.01 %, a normal day).
    #[arg(long, default_value_t = 0.0001)]
    pub redelivery_rate: f64,
    /// Fraction of events held back and delivered late.
    #[arg(long, default_value_t = 0.001)]
    pub late_rate: f64,
    /// Chance per event that its device enters a tunnel: it buffers its next 3–8
    /// events and flushes them after its newer live one (older seqs behind a newer
    /// one, the field report's ghost "engine running"). The live demo uses 0.004.
    #[arg(long, default_value_t = 0.0)]
    pub tunnel_rate: f64,
    /// Publish the fleet to this MQTT broker (QoS 1, topic `{topic-prefix}/{device}/events`)
    /// instead of printing it.
    #[arg(long, value_name = "URL")]
    pub mqtt: Option<String>,
    #[arg(long, default_value = "fleet")]
    pub topic_prefix: String,
    /// MQTT only: fraction of publishes a device sends again with the DUP flag (its
    /// PUBACK came too late).
    #[arg(long, default_value_t = 0.0)]
    pub dup_rate: f64,
    /// MQTT only: how many DUP copies such a publish gets.
    #[arg(long, default_value_t = 1)]
    pub dup_copies: u32,
}

pub async fn run(args: SimulateArgs) -> CliResult {
    for (name, rate) in [
        ("redelivery-rate", args.redelivery_rate),
        ("late-rate", args.late_rate),
        ("tunnel-rate", args.tunnel_rate),
        ("dup-rate", args.dup_rate),
    ] {
        if !(0.0..=1.0).contains(&rate) {
            return Err(CliError::usage(format!("--{name} must be between 0 and 1")));
        }
    }
    let mut sim = FleetSim::new(FleetConfig {
        vehicles: args.vehicles,
        seed: args.seed,
        redelivery_rate: args.redelivery_rate,
        late_rate: args.late_rate,
        tunnel_rate: args.tunnel_rate,
        ..FleetConfig::default()
    });
    if let Some(broker) = &args.mqtt {
        let messages: Vec<(String, Vec<u8>)> = (0..args.messages)
            .map(|_| {
                let m = sim.next();
                (m.envelope.device_id.clone(), m.raw)
            })
            .collect();
        let stats = mqtt_device::publish_fleet(
            broker,
            &format!("idemwatch-sim-{}", std::process::id()),
            &args.topic_prefix,
            &messages,
            args.dup_rate,
            args.dup_copies,
            args.seed,
        )
        .await
        .map_err(CliError::unavailable)?;
        println!(
            "{}",
            serde_json::to_string(&stats).unwrap_or_else(|_| "{}".into())
        );
        return Ok(EXIT_OK);
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for _ in 0..args.messages {
        let m = sim.next();
        out.write_all(&m.raw)
            .and_then(|_| out.write_all(b"\n"))
            .map_err(|e| CliError::unavailable(format!("cannot write: {e}")))?;
    }
    out.flush()
        .map_err(|e| CliError::unavailable(format!("cannot write: {e}")))?;
    Ok(EXIT_OK)
}
