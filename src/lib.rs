//! idemwatch: a terminal dashboard and an embedded idempotent-consumer engine for
//! teams whose queues deliver at least once.
//!
//! Layers, each using only the ones before it:
//! `engine` (store, queue, consumers, runner, metrics) → `sim` (fleet simulator,
//! sandbox provider) → `drills` (redelivery drills with verdicts).

pub mod drills;
pub mod engine;
pub mod sim;
