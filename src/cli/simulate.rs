//! `idemwatch simulate`: print a deterministic fleet trace as JSON lines, to feed
//! `publish` (or any other system) with realistic traffic.

use std::io::Write;

use clap::Args;

use super::{CliError, CliResult, EXIT_OK};
use idemwatch::sim::fleet::{FleetConfig, FleetSim};

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
}

pub fn run(args: SimulateArgs) -> CliResult {
    for (name, rate) in [
        ("redelivery-rate", args.redelivery_rate),
        ("late-rate", args.late_rate),
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
        ..FleetConfig::default()
    });
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
