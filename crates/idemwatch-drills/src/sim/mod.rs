//! Simulated world around the engine: a deterministic fleet and a sandbox SMS/ERP
//! provider (a real HTTP server).

pub mod fleet;
pub mod mqtt_device;
pub mod sandbox_provider;
