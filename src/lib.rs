//! idemwatch: a terminal dashboard and an embedded idempotent-consumer engine for
//! teams whose queues deliver at least once.
//!
//! The layers are crates (see ARCHITECTURE.md), each using only the ones before it:
//! `idemwatch-base` (redaction, times, the Prometheus text parser, shared words) →
//! `idemwatch-engine` (store, queue, consumers, runner, metrics, HTTP edge) →
//! `idemwatch-drills` (the simulator, redelivery drills with verdicts, chaos) and
//! `idemwatch-monitor` (sources into plain-data snapshots, the config file, reports) →
//! `idemwatch-tui` (the terminal dashboard and its demo). This package is the binary
//! on top: `bench` measures at production scale with the engine's writes and the
//! monitor's queries, and the crates are re-exported here under the paths the binary
//! and the end-to-end tests use.

pub mod bench;

pub use idemwatch_base::{clock, exposition, redact};
pub use idemwatch_drills as drills;
pub use idemwatch_drills::sim;
pub use idemwatch_engine as engine;
pub use idemwatch_monitor as monitor;
pub use idemwatch_monitor::{config, report};
pub use idemwatch_tui as tui;
pub use idemwatch_tui::demo;
