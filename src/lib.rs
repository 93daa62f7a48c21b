//! idemwatch: a terminal dashboard and an embedded idempotent-consumer engine for
//! teams whose queues deliver at least once.
//!
//! Layers, each using only the ones before it:
//! `engine` (store, queue, consumers, runner, metrics) → `sim` (fleet simulator,
//! sandbox provider) → `drills` (redelivery drills with verdicts) → `monitor` (sources
//! into plain-data snapshots for the dashboard and `snapshot --json`) → `tui` (the
//! terminal dashboard). `demo` wires engine and simulator into the live demo the
//! dashboard opens without a config; `bench` measures at production scale with the
//! engine's writes and the monitor's queries; `config` is the dashboard's config file.

pub mod bench;

pub use idemwatch_base::{clock, exposition, redact};
pub use idemwatch_drills as drills;
pub use idemwatch_drills::sim;
pub use idemwatch_engine as engine;
pub use idemwatch_monitor as monitor;
pub use idemwatch_monitor::{config, report};
pub use idemwatch_tui as tui;
pub use idemwatch_tui::demo;
