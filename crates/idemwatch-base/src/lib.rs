//! The leaf of idemwatch's layers: what every other crate may use and that uses none
//! of them. URL and text redaction ([`redact`]), display times ([`clock`]), the
//! Prometheus text format's parser and bounded scraper ([`exposition`]).

pub mod clock;
pub mod exposition;
pub mod redact;
