//! The leaf of idemwatch's layers: what every other crate may use and that uses none
//! of them. URL and text redaction ([`redact`]), display times ([`clock`]), the
//! Prometheus text format's parser and bounded scraper ([`exposition`]), and the words
//! the engine's metrics, its consumers and the dashboard share ([`vocab`]).

pub mod clock;
pub mod exposition;
pub mod redact;
pub mod vocab;
