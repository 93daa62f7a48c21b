//! Simulated world around the engine: a deterministic fleet and a sandbox SMS/ERP
//! provider (a real HTTP server).

pub mod fleet;
pub mod sandbox_provider;
