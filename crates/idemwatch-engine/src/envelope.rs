//! The message envelope (docs/CONTRACT.md §1): parsing with precise errors, the deterministic
//! [`MessageKey`] and the payload [`Fingerprint`].
//!
//! Parsing never panics and never loses input: every rejection carries a
//! [`RejectReason`] and the caller keeps the raw bytes for `dead_letters`.

use std::borrow::Cow;
use std::fmt;

use chrono::{DateTime, Datelike, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Largest accepted serialized payload (docs/CONTRACT.md §1: "a payload over 64 KiB" is `too_large`).
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;
/// Largest raw message we even try to parse. Anything bigger cannot hold a payload
/// under [`MAX_PAYLOAD_BYTES`] plus the envelope fields, so it is rejected unread.
pub const MAX_RAW_BYTES: usize = MAX_PAYLOAD_BYTES + 4 * 1024;
/// What a dead letter keeps of raw bytes over [`MAX_RAW_BYTES`] (docs/CONTRACT.md §9 "Ingress
/// poison"): their first 64 KiB, enough to see what the producer sent, and their true
/// length in the detail ([`dead_letter_raw`]). Bytes within the limit are kept whole,
/// so every letter that could be replayed is.
pub const DEAD_LETTER_KEEP: usize = MAX_PAYLOAD_BYTES;
/// Largest accepted `seq`: the tables store it as a signed 64-bit integer.
pub const MAX_SEQ: u64 = i64::MAX as u64;

/// The raw bytes a dead letter stores and its detail: `raw` whole when the queue could
/// take it, else its first [`DEAD_LETTER_KEEP`] bytes with the true length added to
/// `detail`. A producer's 100 MB message must not become a 100 MB row, nor its
/// insert the statement that times out and keeps it from ever being dead-lettered.
pub fn dead_letter_raw<'a>(raw: &'a [u8], detail: &str) -> (&'a [u8], String) {
    if raw.len() <= MAX_RAW_BYTES {
        return (raw, detail.to_string());
    }
    (
        &raw[..DEAD_LETTER_KEEP],
        format!(
            "{detail} [{} bytes; first {DEAD_LETTER_KEEP} kept]",
            raw.len()
        ),
    )
}

/// The true length of a dead letter whose raw bytes were cut ([`dead_letter_raw`]),
/// read back from its detail; `None` when it was kept whole.
pub fn cut_raw_length(detail: &str) -> Option<usize> {
    let tail = detail.strip_suffix(&format!(" bytes; first {DEAD_LETTER_KEEP} kept]"))?;
    let (_, n) = tail.rsplit_once(" [")?;
    n.parse().ok()
}
// One set of limits for every backend. A message one database stores and another
// refuses would make "processed" depend on the backend (MariaDB's `VARCHAR(255)` zone,
// PostgreSQL's text that cannot hold NUL, MySQL's DATETIME years): each limit below is
// the narrowest column any backend gives the value, so what parses is stored
// everywhere, and what cannot be stored somewhere is refused here, everywhere, with
// the field named (`invalid_field`), instead of failing in one database's transaction.

/// Longest accepted `device_id`, in bytes (docs/CONTRACT.md §1; `VARCHAR(128)` on MySQL).
pub const MAX_DEVICE_ID_BYTES: usize = 128;
/// Longest accepted `payload.zone`, in bytes (`vehicle_state.zone VARCHAR(255)` on
/// MySQL/MariaDB; counted in bytes so that no character set can make it longer).
pub const MAX_ZONE_BYTES: usize = 255;
/// Longest accepted `payload.phone`, in bytes (E.164 is 15 digits; room for spacing).
pub const MAX_PHONE_BYTES: usize = 64;
/// Longest accepted `message_id`, in bytes.
pub const MAX_MESSAGE_ID_BYTES: usize = 255;
/// Earliest and latest accepted `occurred_at` year, in UTC: MySQL's `DATETIME` range
/// (PostgreSQL's and SQLite's text are wider).
pub const OCCURRED_AT_YEARS: std::ops::RangeInclusive<i32> = 1000..=9999;

/// The rule for a `device_id` (docs/CONTRACT.md §1: non-empty, at most 128 bytes, and like every
/// named string field no control character), shared with the write API's `{device}`
/// path segment: one device, one rule on every way in.
pub fn check_device_id(device_id: &str) -> Result<(), String> {
    if device_id.is_empty() {
        return Err("must not be empty".into());
    }
    check_text(device_id, MAX_DEVICE_ID_BYTES)
}

/// A named string field: at most `limit` bytes and no control character (C0, DEL,
/// C1). A NUL cannot be stored in PostgreSQL text at all; the others would be stored
/// by every backend but end up in SMS texts, terminals and logs.
fn check_text(s: &str, limit: usize) -> Result<(), String> {
    if s.len() > limit {
        return Err(format!("is {} bytes, limit {limit}", s.len()));
    }
    if let Some((at, c)) = s.char_indices().find(|(_, c)| c.is_control()) {
        return Err(format!(
            "holds the control character U+{:04X} at byte {at}",
            u32::from(c)
        ));
    }
    Ok(())
}

/// Any string of the payload, keys included, at any depth: no NUL (PostgreSQL's
/// `jsonb` refuses `\u0000`). Other control characters stay allowed there: the
/// payload is stored as JSON, escaped, on every backend.
fn check_no_nul(path: &str, v: &Value) -> Result<(), Rejection> {
    match v {
        Value::String(s) if s.contains('\0') => {
            Err(invalid(path, "holds a NUL character (U+0000)"))
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_no_nul(&format!("{path}[{i}]"), item)),
        Value::Object(m) => check_map_no_nul(path, m),
        _ => Ok(()),
    }
}

fn check_map_no_nul(path: &str, m: &Map<String, Value>) -> Result<(), Rejection> {
    m.iter().try_for_each(|(k, item)| {
        if k.contains('\0') {
            return Err(invalid(path, "has a key holding a NUL character (U+0000)"));
        }
        check_no_nul(&format!("{path}.{k}"), item)
    })
}

/// The five event types a telematics device emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventType {
    IgnitionOn,
    IgnitionOff,
    Position,
    ZoneEnter,
    ZoneExit,
}

impl EventType {
    pub const ALL: [EventType; 5] = [
        EventType::IgnitionOn,
        EventType::IgnitionOff,
        EventType::Position,
        EventType::ZoneEnter,
        EventType::ZoneExit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::IgnitionOn => "ignition_on",
            EventType::IgnitionOff => "ignition_off",
            EventType::Position => "position",
            EventType::ZoneEnter => "zone_enter",
            EventType::ZoneExit => "zone_exit",
        }
    }

    pub fn parse(s: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a message could not be accepted. The string forms are the `reason` column of
/// `dead_letters` and the `reason` label of `idem_dead_lettered_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    MalformedJson,
    MissingField,
    InvalidField,
    UnknownEventType,
    TooLarge,
    /// Same key, different fingerprint: two different events claim one identity.
    KeyConflict,
    /// The queue gave up redelivering it (a handler kept failing on it).
    MaxDeliveries,
    /// A provider's final answer (a 4xx other than 408/425/429): the effect will never
    /// happen for this message as it is. The detail holds the status and the body.
    ProviderRejected,
    /// The database refused this message's rows for what they hold (a constraint, a
    /// value it cannot store); the detail holds the database's error.
    StoreRejected,
}

impl RejectReason {
    pub const ALL: [RejectReason; 9] = [
        RejectReason::MalformedJson,
        RejectReason::MissingField,
        RejectReason::InvalidField,
        RejectReason::UnknownEventType,
        RejectReason::TooLarge,
        RejectReason::KeyConflict,
        RejectReason::MaxDeliveries,
        RejectReason::ProviderRejected,
        RejectReason::StoreRejected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::MalformedJson => "malformed_json",
            RejectReason::MissingField => "missing_field",
            RejectReason::InvalidField => "invalid_field",
            RejectReason::UnknownEventType => "unknown_event_type",
            RejectReason::TooLarge => "too_large",
            RejectReason::KeyConflict => "key_conflict",
            RejectReason::MaxDeliveries => "max_deliveries",
            RejectReason::ProviderRejected => "provider_rejected",
            RejectReason::StoreRejected => "store_rejected",
        }
    }

    pub fn parse(s: &str) -> Option<RejectReason> {
        RejectReason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejected message: the reason (machine-readable) and a precise human detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct Rejection {
    pub reason: RejectReason,
    pub detail: String,
}

impl Rejection {
    pub fn new(reason: RejectReason, detail: impl Into<String>) -> Self {
        Rejection {
            reason,
            detail: detail.into(),
        }
    }
}

/// The deterministic identity of a real-world event: `device_id:seq:event_type`.
///
/// It is derived from what the device sent, never invented by the receiver, so the
/// same event has the same key however many times and by whatever path it arrives.
/// A key from the payload alone would be wrong: two legitimately identical events
/// would collide.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageKey(String);

impl MessageKey {
    pub fn new(device_id: &str, seq: u64, event_type: EventType) -> Self {
        MessageKey(format!("{device_id}:{seq}:{event_type}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Wrap a key read back from a table.
    pub fn from_stored(s: String) -> Self {
        MessageKey(s)
    }
}

impl fmt::Display for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stable hash of the canonical payload plus `occurred_at` (hex SHA-256).
///
/// Stored beside the key: a redelivery has the same fingerprint; the same key with a
/// different fingerprint is a `key_conflict`, never a silent duplicate.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fingerprint(String);

impl Fingerprint {
    pub fn of(payload: &Map<String, Value>, occurred_at: &DateTime<Utc>) -> Self {
        Fingerprint::of_canonical(&canonical_payload(payload), occurred_at)
    }

    /// [`Fingerprint::of`] given the payload's [`canonical_payload`] already made
    /// (parsing makes it once, to measure the payload against its limit).
    fn of_canonical(canonical: &str, occurred_at: &DateTime<Utc>) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(canonical.as_bytes());
        hasher.update(b"\n");
        hasher.update(rfc3339(occurred_at).as_bytes());
        Fingerprint(hex::encode(hasher.finalize()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn from_stored(s: String) -> Self {
        Fingerprint(s)
    }
}

/// The payload in its canonical form: serde_json's Map is a BTreeMap here (no
/// `preserve_order`), so serializing it yields sorted keys at every depth.
fn canonical_payload(payload: &Map<String, Value>) -> String {
    serde_json::to_string(payload).unwrap_or_default()
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A parsed message with its identity: the envelope, its [`MessageKey`] and its
/// [`Fingerprint`], each computed once when the bytes are parsed and carried with the
/// delivery from the runner through the consumer to the store. (The fingerprint is a
/// SHA-256 over the canonical payload: recomputed per use it cost a hash per consumer
/// and per store call.) It reads as its envelope (`Deref`); its fields are private so
/// the identity can never disagree with the envelope it was computed from.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    envelope: Envelope,
    key: MessageKey,
    fingerprint: Fingerprint,
}

impl Message {
    pub fn new(envelope: Envelope) -> Message {
        Message {
            key: envelope.key(),
            fingerprint: envelope.fingerprint(),
            envelope,
        }
    }

    /// [`Envelope::parse`], with the identity computed once.
    pub fn parse(raw: &[u8]) -> Result<Message, Rejection> {
        Envelope::parse_canonical(raw).map(|(env, canonical)| Message::of(env, &canonical))
    }

    /// Parse one delivery for a consumer that handles the events `wants` says yes to:
    /// those get their identity (key and fingerprint) at once, the others only their
    /// key (they are acked as skipped). Bad input is refused for every consumer alike.
    /// The runner parses a lease as soon as it arrives, beside the batch before it,
    /// so the fingerprint's hashing is off the path a batch waits on.
    pub fn parse_for(raw: &[u8], wants: impl Fn(EventType) -> bool) -> Result<Parsed, Rejection> {
        let (env, canonical) = Envelope::parse_canonical(raw)?;
        Ok(if wants(env.event_type) {
            Parsed::Own(Message::of(env, &canonical))
        } else {
            Parsed::Other(env.key())
        })
    }

    fn of(envelope: Envelope, canonical: &str) -> Message {
        Message {
            key: envelope.key(),
            fingerprint: Fingerprint::of_canonical(canonical, &envelope.occurred_at),
            envelope,
        }
    }

    pub fn key(&self) -> &MessageKey {
        &self.key
    }

    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }
}

impl std::ops::Deref for Message {
    type Target = Envelope;

    fn deref(&self) -> &Envelope {
        &self.envelope
    }
}

impl From<Envelope> for Message {
    fn from(envelope: Envelope) -> Message {
        Message::new(envelope)
    }
}

/// One delivery parsed for one consumer ([`Message::parse_for`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// An event the consumer handles, with its identity.
    Own(Message),
    /// Another consumer's event: only its key, for the record of the skip.
    Other(MessageKey),
}

/// One parsed message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub message_id: Option<String>,
    pub device_id: String,
    pub seq: u64,
    pub event_type: EventType,
    pub occurred_at: DateTime<Utc>,
    #[serde(default)]
    pub payload: Map<String, Value>,
}

impl Envelope {
    /// The key, computed afresh: a producer's view. What the engine handles is a
    /// [`Message`], which computed it once at parse.
    pub fn key(&self) -> MessageKey {
        MessageKey::new(&self.device_id, self.seq, self.event_type)
    }

    /// The fingerprint, computed afresh (see [`Envelope::key`]).
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.payload, &self.occurred_at)
    }

    /// `zone` of a `zone_enter` / `zone_exit`.
    pub fn zone(&self) -> Option<&str> {
        self.payload.get("zone").and_then(Value::as_str)
    }

    /// Optional `phone` of a zone event: where the SMS goes.
    pub fn phone(&self) -> Option<&str> {
        self.payload.get("phone").and_then(Value::as_str)
    }

    pub fn lat_lon(&self) -> Option<(f64, f64)> {
        let lat = self.payload.get("lat").and_then(Value::as_f64)?;
        let lon = self.payload.get("lon").and_then(Value::as_f64)?;
        Some((lat, lon))
    }

    /// One JSON line, as a producer would publish it.
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parse one message. Every failure is a [`Rejection`] with a precise detail;
    /// nothing here panics, whatever the bytes.
    pub fn parse(raw: &[u8]) -> Result<Envelope, Rejection> {
        Envelope::parse_canonical(raw).map(|(env, _)| env)
    }

    /// [`Envelope::parse`], with the payload's canonical form it measured.
    ///
    /// Two paths, one result. A well-formed message is read straight into its fields
    /// ([`Wire`], the strings borrowed from the bytes where they hold no escape):
    /// every message of every consumer is parsed, four times over in a fleet, and a
    /// tree of `Value`s per message was most of the runner's own CPU. Anything that
    /// path does not accept whole — a field missing, null, of the wrong type or out
    /// of its bounds, a key given twice, a message that is not one JSON object — is
    /// parsed again by the reference path below, which names the field and the fault.
    /// The fast path accepts nothing the reference refuses and builds the same
    /// envelope (`the_fast_path_agrees_with_the_reference` checks both on mutated
    /// and generated messages).
    fn parse_canonical(raw: &[u8]) -> Result<(Envelope, String), Rejection> {
        Envelope::parse_fast(raw).map_or_else(|| Envelope::parse_reference(raw), Ok)
    }

    /// The fast path of [`Envelope::parse_canonical`]: `None` for anything it does
    /// not accept whole, to be told why by the reference path. Its checks of the
    /// values are the reference's own (`seq_of` … `payload_of`), in the same order.
    fn parse_fast(raw: &[u8]) -> Option<(Envelope, String)> {
        if raw.len() > MAX_RAW_BYTES {
            return None;
        }
        // A derived `Deserialize` also reads a struct from a JSON array; a message is
        // an object.
        let first = raw.iter().find(|b| !b" \t\n\r".contains(b))?;
        if *first != b'{' {
            return None;
        }
        let wire: Wire<'_> = serde_json::from_slice(raw).ok()?;
        check_device_id(&wire.device_id).ok()?;
        seq_of(wire.seq).ok()?;
        let event_type = event_type_of(&wire.event_type).ok()?;
        let occurred_at = occurred_at_of(&wire.occurred_at).ok()?;
        if let Some(id) = &wire.message_id {
            message_id_of(id).ok()?;
        }
        let payload = wire.payload.unwrap_or_default();
        let canonical = payload_of(event_type, &payload).ok()?;
        Some((
            Envelope {
                message_id: wire.message_id.map(Cow::into_owned),
                device_id: wire.device_id.into_owned(),
                seq: wire.seq,
                event_type,
                occurred_at,
                payload,
            },
            canonical,
        ))
    }

    /// The reference path of [`Envelope::parse_canonical`]: the message read as a
    /// tree of `Value`s, each field taken out and checked in turn, so that every
    /// refusal names its field and its fault.
    fn parse_reference(raw: &[u8]) -> Result<(Envelope, String), Rejection> {
        if raw.len() > MAX_RAW_BYTES {
            return Err(Rejection::new(
                RejectReason::TooLarge,
                format!("message is {} bytes, limit {MAX_RAW_BYTES}", raw.len()),
            ));
        }
        let value: Value = serde_json::from_slice(raw)
            .map_err(|e| Rejection::new(RejectReason::MalformedJson, e.to_string()))?;
        let Value::Object(mut obj) = value else {
            return Err(Rejection::new(
                RejectReason::MalformedJson,
                format!("expected a JSON object, got {}", json_kind(&value)),
            ));
        };

        let device_id = match take_required(&mut obj, "device_id")? {
            Value::String(s) => {
                check_device_id(&s).map_err(|detail| invalid("device_id", &detail))?;
                s
            }
            other => return Err(wrong_type("device_id", "a string", &other)),
        };
        let seq = match take_required(&mut obj, "seq")? {
            Value::Number(n) => match n.as_u64() {
                None => {
                    return Err(invalid(
                        "seq",
                        &format!("{n} is not an unsigned 64-bit integer"),
                    ))
                }
                Some(seq) => seq_of(seq)?,
            },
            other => return Err(wrong_type("seq", "an unsigned integer", &other)),
        };
        let event_type = match take_required(&mut obj, "event_type")? {
            Value::String(s) => event_type_of(&s)?,
            other => return Err(wrong_type("event_type", "a string", &other)),
        };
        let occurred_at = match take_required(&mut obj, "occurred_at")? {
            Value::String(s) => occurred_at_of(&s)?,
            other => return Err(wrong_type("occurred_at", "an RFC 3339 string", &other)),
        };
        let message_id = match obj.remove("message_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                message_id_of(&s)?;
                Some(s)
            }
            Some(other) => return Err(wrong_type("message_id", "a string", &other)),
        };
        let payload = match obj.remove("payload") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m,
            Some(other) => return Err(wrong_type("payload", "an object", &other)),
        };
        let canonical = payload_of(event_type, &payload)?;

        Ok((
            Envelope {
                message_id,
                device_id,
                seq,
                event_type,
                occurred_at,
                payload,
            },
            canonical,
        ))
    }
}

// The checks of one field's value, shared by both paths of `parse_canonical`: the
// reference turns their refusals into dead letters, the fast path into a fall-back.

/// `seq` within what every backend stores (a signed BIGINT; see README "Deviations").
fn seq_of(seq: u64) -> Result<u64, Rejection> {
    if seq > MAX_SEQ {
        return Err(invalid(
            "seq",
            &format!("{seq} exceeds {MAX_SEQ}, the largest storable sequence number"),
        ));
    }
    Ok(seq)
}

fn event_type_of(s: &str) -> Result<EventType, Rejection> {
    EventType::parse(s).ok_or_else(|| {
        Rejection::new(
            RejectReason::UnknownEventType,
            format!("event_type {s:?} is not one of ignition_on, ignition_off, position, zone_enter, zone_exit"),
        )
    })
}

/// `occurred_at` as RFC 3339, in the years every backend stores.
fn occurred_at_of(s: &str) -> Result<DateTime<Utc>, Rejection> {
    let occurred_at = DateTime::parse_from_rfc3339(s)
        .map_err(|e| invalid("occurred_at", &format!("{s:?} is not RFC 3339: {e}")))?
        .with_timezone(&Utc);
    if !OCCURRED_AT_YEARS.contains(&occurred_at.year()) {
        return Err(invalid(
            "occurred_at",
            &format!(
                "{} is outside the years {}..={} (UTC) every backend stores",
                rfc3339(&occurred_at),
                OCCURRED_AT_YEARS.start(),
                OCCURRED_AT_YEARS.end()
            ),
        ));
    }
    Ok(occurred_at)
}

fn message_id_of(s: &str) -> Result<(), Rejection> {
    check_text(s, MAX_MESSAGE_ID_BYTES).map_err(|d| invalid("message_id", &d))
}

/// The payload checked for its size, its event type's fields and NULs: its
/// canonical form, which the size was measured on.
fn payload_of(event_type: EventType, payload: &Map<String, Value>) -> Result<String, Rejection> {
    let canonical = canonical_payload(payload);
    let payload_len = canonical.len();
    if payload_len > MAX_PAYLOAD_BYTES {
        return Err(Rejection::new(
            RejectReason::TooLarge,
            format!("payload is {payload_len} bytes, limit {MAX_PAYLOAD_BYTES}"),
        ));
    }
    check_payload(event_type, payload)?;
    check_map_no_nul("payload", payload)?;
    Ok(canonical)
}

/// A well-formed message as it is on the wire: the fast path of
/// [`Envelope::parse_canonical`]. Unknown fields are ignored, as the reference path
/// ignores them; a null `message_id` or `payload` is none, as there.
#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow)]
    device_id: Cow<'a, str>,
    seq: u64,
    #[serde(borrow)]
    event_type: Cow<'a, str>,
    #[serde(borrow)]
    occurred_at: Cow<'a, str>,
    #[serde(default, borrow)]
    message_id: Option<Cow<'a, str>>,
    #[serde(default)]
    payload: Option<Map<String, Value>>,
}

/// The payload fields each event type needs (docs/CONTRACT.md §1).
fn check_payload(event_type: EventType, payload: &Map<String, Value>) -> Result<(), Rejection> {
    match event_type {
        EventType::Position => {
            for field in ["lat", "lon"] {
                match payload.get(field) {
                    None => return Err(missing(&format!("payload.{field}"))),
                    Some(Value::Number(n)) if n.as_f64().is_some_and(f64::is_finite) => {}
                    Some(other) => {
                        return Err(wrong_type(&format!("payload.{field}"), "a number", other))
                    }
                }
            }
        }
        EventType::ZoneEnter | EventType::ZoneExit => {
            match payload.get("zone") {
                None => return Err(missing("payload.zone")),
                Some(Value::String(zone)) => {
                    check_text(zone, MAX_ZONE_BYTES).map_err(|d| invalid("payload.zone", &d))?
                }
                Some(other) => return Err(wrong_type("payload.zone", "a string", other)),
            }
            match payload.get("phone") {
                None | Some(Value::Null) => {}
                Some(Value::String(phone)) => {
                    check_text(phone, MAX_PHONE_BYTES).map_err(|d| invalid("payload.phone", &d))?
                }
                Some(other) => return Err(wrong_type("payload.phone", "a string", other)),
            }
        }
        EventType::IgnitionOn | EventType::IgnitionOff => {}
    }
    Ok(())
}

fn take_required(obj: &mut Map<String, Value>, field: &str) -> Result<Value, Rejection> {
    match obj.remove(field) {
        None | Some(Value::Null) => Err(missing(field)),
        Some(v) => Ok(v),
    }
}

fn missing(field: &str) -> Rejection {
    Rejection::new(
        RejectReason::MissingField,
        format!("required field {field} is missing"),
    )
}

fn invalid(field: &str, what: &str) -> Rejection {
    Rejection::new(RejectReason::InvalidField, format!("{field} {what}"))
}

fn wrong_type(field: &str, expected: &str, got: &Value) -> Rejection {
    invalid(
        field,
        &format!("must be {expected}, got {}", json_kind(got)),
    )
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// RFC 3339 in UTC with `Z`, the one timestamp format idemwatch writes.
pub fn rfc3339(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::AutoSi, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GOOD: &str = r#"{"message_id":"p-81f3","device_id":"34-ABC-123","seq":48211,"event_type":"zone_exit","occurred_at":"2026-11-30T04:12:03Z","payload":{"zone":"X","phone":"+905551112233"}}"#;

    fn reject(raw: &str) -> Rejection {
        Envelope::parse(raw.as_bytes()).expect_err("should be rejected")
    }

    #[test]
    fn a_dead_letter_keeps_raw_bytes_whole_up_to_the_limit_and_the_first_64_kib_beyond() {
        let whole = vec![b'x'; MAX_RAW_BYTES];
        let (kept, detail) = dead_letter_raw(&whole, "too big");
        assert_eq!((kept.len(), detail.as_str()), (MAX_RAW_BYTES, "too big"));
        assert_eq!(cut_raw_length(&detail), None);
        let over = vec![b'y'; 5 << 20];
        let (kept, detail) = dead_letter_raw(&over, "message is 5242880 bytes");
        assert_eq!(kept, &over[..DEAD_LETTER_KEEP]);
        assert_eq!(
            detail,
            "message is 5242880 bytes [5242880 bytes; first 65536 kept]"
        );
        assert_eq!(cut_raw_length(&detail), Some(5 << 20));
    }

    #[test]
    fn field_report_message_parses_with_deterministic_key() {
        let env = Envelope::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(env.key().as_str(), "34-ABC-123:48211:zone_exit");
        assert_eq!(env.zone(), Some("X"));
        assert_eq!(env.phone(), Some("+905551112233"));
    }

    #[test]
    fn fingerprint_ignores_message_id_and_key_order() {
        let a = Envelope::parse(GOOD.as_bytes()).unwrap();
        let reordered = r#"{"payload":{"phone":"+905551112233","zone":"X"},"occurred_at":"2026-11-30T07:12:03+03:00","event_type":"zone_exit","seq":48211,"device_id":"34-ABC-123","message_id":"other"}"#;
        let b = Envelope::parse(reordered.as_bytes()).unwrap();
        assert_eq!(a.key(), b.key());
        assert_eq!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn different_payload_same_key_has_different_fingerprint() {
        let a = Envelope::parse(GOOD.as_bytes()).unwrap();
        let b = Envelope::parse(GOOD.replace("\"X\"", "\"Y\"").as_bytes()).unwrap();
        assert_eq!(a.key(), b.key());
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn every_bad_input_has_its_reason() {
        assert_eq!(reject("not json").reason, RejectReason::MalformedJson);
        assert_eq!(reject("[1,2]").reason, RejectReason::MalformedJson);
        assert_eq!(
            reject(&GOOD.replace("\"seq\":48211,", "")).reason,
            RejectReason::MissingField
        );
        assert_eq!(
            reject(&GOOD.replace("48211", "\"48211\"")).reason,
            RejectReason::InvalidField
        );
        assert_eq!(
            reject(&GOOD.replace("48211", "-1")).reason,
            RejectReason::InvalidField
        );
        assert_eq!(
            reject(&GOOD.replace("48211", "9223372036854775808")).reason,
            RejectReason::InvalidField
        );
        assert_eq!(
            reject(&GOOD.replace("34-ABC-123", "")).reason,
            RejectReason::InvalidField
        );
        assert_eq!(
            reject(&GOOD.replace("2026-11-30T04:12:03Z", "yesterday")).reason,
            RejectReason::InvalidField
        );
        assert_eq!(
            reject(&GOOD.replace("zone_exit", "teleport")).reason,
            RejectReason::UnknownEventType
        );
        assert_eq!(
            reject(&GOOD.replace("\"zone\":\"X\",", "")).reason,
            RejectReason::MissingField
        );
        let huge = GOOD.replace("\"X\"", &format!("\"{}\"", "x".repeat(MAX_PAYLOAD_BYTES)));
        assert_eq!(reject(&huge).reason, RejectReason::TooLarge);
        let detail = reject(&GOOD.replace("\"seq\":48211,", "")).detail;
        assert!(detail.contains("seq"), "{detail}");
    }

    /// The limits are docs/CONTRACT.md §1's numbers, not only the constants' names: a payload of
    /// exactly 64 KiB is accepted and one byte more is `too_large`; a message padded
    /// with whitespace to 68 KiB is read, one byte beyond is refused unread.
    #[test]
    fn the_size_limits_are_64_kib_of_payload_and_68_kib_of_message() {
        let with_note = |n: usize| {
            GOOD.replace(
                "\"phone\"",
                &format!("\"note\":\"{}\",\"phone\"", "x".repeat(n)),
            )
        };
        let base = r#"{"zone":"X","phone":"+905551112233","note":""}"#.len();
        let exact = with_note(65_536 - base);
        Envelope::parse(exact.as_bytes()).expect("a payload of 64 KiB is accepted");
        assert_eq!(
            reject(&with_note(65_537 - base)).reason,
            RejectReason::TooLarge
        );
        let padded = |total: usize| format!("{exact}{}", " ".repeat(total - exact.len()));
        Envelope::parse(padded(69_632).as_bytes()).expect("a message of 68 KiB is read");
        let unread = reject(&padded(69_633));
        assert_eq!(unread.reason, RejectReason::TooLarge);
        assert!(
            unread.detail.starts_with("message is 69633 bytes"),
            "{}",
            unread.detail
        );
    }

    #[test]
    fn what_one_backend_cannot_store_is_refused_on_all_of_them() {
        let refused = |raw: String, field: &str| {
            let r = reject(&raw);
            assert_eq!(r.reason, RejectReason::InvalidField, "{raw}");
            assert!(r.detail.starts_with(field), "{field}: {}", r.detail);
        };
        // The field report's poison: a NUL in the device id (PostgreSQL text).
        refused(GOOD.replace("34-ABC-123", "34-\\u0000-NUL"), "device_id");
        refused(GOOD.replace("34-ABC-123", "34-\\u001b[2J"), "device_id");
        refused(GOOD.replace("\"X\"", "\"X\\u0085\""), "payload.zone");
        refused(GOOD.replace("+905551112233", "+90\\n555"), "payload.phone");
        refused(GOOD.replace("p-81f3", "p-\\u007f"), "message_id");
        // MariaDB's VARCHAR(255) zone: 255 bytes pass, 256 do not (in any script).
        let zone = |z: &str| GOOD.replace("\"X\"", &format!("\"{z}\""));
        assert!(Envelope::parse(zone(&"z".repeat(MAX_ZONE_BYTES)).as_bytes()).is_ok());
        refused(zone(&"z".repeat(MAX_ZONE_BYTES + 1)), "payload.zone");
        refused(zone(&"ı".repeat(MAX_ZONE_BYTES / 2 + 1)), "payload.zone");
        // PostgreSQL's jsonb: no NUL anywhere in the payload, keys included; other
        // control characters in free payload text are stored escaped everywhere.
        let extra = |x: &str| GOOD.replace("\"zone\":\"X\"", &format!("\"zone\":\"X\",{x}"));
        refused(
            extra("\"note\":{\"a\":[\"ok\",\"n\\u0000\"]}"),
            "payload.note.a[1]",
        );
        refused(extra("\"k\\u0000\":1"), "payload");
        assert!(Envelope::parse(extra("\"note\":\"two\\nlines\"").as_bytes()).is_ok());
        // MySQL's DATETIME years, after conversion to UTC.
        let at = |t: &str| GOOD.replace("2026-11-30T04:12:03Z", t);
        refused(at("0999-12-31T23:59:59Z"), "occurred_at");
        refused(at("9999-12-31T23:00:00-05:00"), "occurred_at");
        assert!(Envelope::parse(at("1000-01-01T00:00:00Z").as_bytes()).is_ok());
        assert!(Envelope::parse(at("9999-12-31T23:59:59Z").as_bytes()).is_ok());
        // Non-ASCII that is not a control character is fine.
        assert!(Envelope::parse(zone("Kadıköy ☕").as_bytes()).is_ok());
    }

    #[test]
    fn position_needs_numeric_lat_lon() {
        let pos = r#"{"device_id":"d","seq":1,"event_type":"position","occurred_at":"2026-11-30T04:12:03Z","payload":{"lat":41.0,"lon":"29"}}"#;
        let r = reject(pos);
        assert_eq!(r.reason, RejectReason::InvalidField);
        assert!(r.detail.contains("payload.lon"));
        // JSON has no NaN or infinity, and a number beyond f64 is refused while parsing
        // (serde_json without `arbitrary_precision`): no parsed lat/lon is ever non-finite,
        // which is why the finiteness guard's mutant is accepted in .cargo/mutants.toml.
        let beyond_f64 = reject(&pos.replace("\"29\"", "1e400"));
        assert_eq!(beyond_f64.reason, RejectReason::MalformedJson);
    }

    /// The names are what `dead_letters.reason` holds and operators filter on: each
    /// reason reads back from its stored name.
    #[test]
    fn every_reject_reason_reads_back_from_its_stored_name() {
        let names = RejectReason::ALL.map(RejectReason::as_str);
        assert_eq!(
            names,
            [
                "malformed_json",
                "missing_field",
                "invalid_field",
                "unknown_event_type",
                "too_large",
                "key_conflict",
                "max_deliveries",
                "provider_rejected",
                "store_rejected",
            ]
        );
        for r in RejectReason::ALL {
            assert_eq!(RejectReason::parse(r.as_str()), Some(r));
            assert_eq!(r.to_string(), r.as_str());
        }
        assert_eq!(RejectReason::parse("teleport"), None);
    }

    /// Key and fingerprint are stored beside every processed message: their forms
    /// must not change between versions, or every redelivery after an upgrade would
    /// be a key conflict. The fingerprint is SHA-256 over the payload with sorted
    /// keys, a newline and `occurred_at` in UTC (here computed outside Rust).
    #[test]
    fn key_and_fingerprint_keep_their_stored_form() {
        let env = Envelope::parse(GOOD.as_bytes()).unwrap();
        let fp = env.fingerprint();
        assert_eq!(
            fp.as_str(),
            "36582865e140577c52eff1ede5f49db138bd8b2aa7faadce7b71ba22defe61ab"
        );
        assert_eq!(fp.to_string(), fp.as_str());
        assert_eq!(Fingerprint::from_stored(fp.to_string()), fp);
        let key = env.key();
        assert_eq!(key.to_string(), "34-ABC-123:48211:zone_exit");
        assert_eq!(MessageKey::from_stored(key.to_string()), key);
        let at = "2026-11-30T07:12:03.25+03:00"
            .parse::<DateTime<Utc>>()
            .unwrap();
        assert_eq!(rfc3339(&at), "2026-11-30T04:12:03.250Z");
    }

    #[test]
    fn a_position_reads_its_coordinates_and_a_zone_event_has_none() {
        let pos = r#"{"device_id":"d","seq":1,"event_type":"position","occurred_at":"2026-11-30T04:12:03Z","payload":{"lat":41.0082,"lon":-28.9784}}"#;
        let env = Envelope::parse(pos.as_bytes()).unwrap();
        assert_eq!(env.lat_lon(), Some((41.0082, -28.9784)));
        assert_eq!(Envelope::parse(GOOD.as_bytes()).unwrap().lat_lon(), None);
    }

    #[test]
    fn the_largest_storable_seq_is_accepted() {
        let raw = GOOD.replace("48211", "9223372036854775807");
        assert_eq!(Envelope::parse(raw.as_bytes()).unwrap().seq, MAX_SEQ);
    }

    /// A producer reading its dead letters learns what it sent wrong.
    #[test]
    fn a_wrong_type_says_what_it_got() {
        let detail = |raw: String| reject(&raw).detail;
        let pos = r#"{"device_id":"d","seq":1,"event_type":"position","occurred_at":"2026-11-30T04:12:03Z","payload":{"lat":null,"lon":1}}"#;
        assert_eq!(
            detail(pos.to_string()),
            "payload.lat must be a number, got null"
        );
        for (value, kind) in [
            ("true", "a boolean"),
            ("7", "a number"),
            ("[1]", "an array"),
            ("{}", "an object"),
        ] {
            assert_eq!(
                detail(GOOD.replace("\"34-ABC-123\"", value)),
                format!("device_id must be a string, got {kind}")
            );
        }
        assert_eq!(
            detail(GOOD.replace("48211", "\"48211\"")),
            "seq must be an unsigned integer, got a string"
        );
    }

    /// The fast path accepts nothing the reference path refuses and builds the same
    /// envelope and canonical payload; it takes the messages producers send.
    fn agree(raw: &[u8]) -> Result<(), String> {
        match (Envelope::parse_fast(raw), Envelope::parse_reference(raw)) {
            (Some(fast), Ok(reference)) if fast == reference => Ok(()),
            (Some(fast), reference) => Err(format!("fast {fast:?}, reference {reference:?}")),
            (None, _) => Ok(()),
        }
    }

    #[test]
    fn the_fast_path_agrees_with_the_reference() {
        let cases = [
            GOOD.to_string(),
            format!("  \n{GOOD}\t "),
            GOOD.replace("\"seq\":48211", "\"seq\":48211,\"seq\":7"),
            GOOD.replace("\"payload\":{", "\"payload\":null,\"x\":{"),
            GOOD.replace("\"message_id\":\"p-81f3\"", "\"message_id\":null"),
            GOOD.replace("\"message_id\":\"p-81f3\"", "\"message_id\":5"),
            GOOD.replace(
                "\"message_id\":\"p-81f3\"",
                "\"extra\":[1,{\"a\":2}],\"extra\":3",
            ),
            GOOD.replace("34-ABC-123", "34-ABC\\u0041"),
            GOOD.replace("zone_exit", "zone\\u005fexit"),
            GOOD.replace("\"seq\"", "\"se\\u0071\""),
            GOOD.replace("48211", "48211.0"),
            GOOD.replace("48211", &MAX_SEQ.to_string()),
            GOOD.replace("48211", &(MAX_SEQ + 1).to_string()),
            GOOD.replace("2026-11-30T04:12:03Z", "0999-11-30T04:12:03Z"),
            GOOD.replace("\"X\"", "\"X\\u0000\""),
            GOOD.replace("\"device_id\":\"34-ABC-123\"", "\"device_id\":null"),
            r#"["34-ABC-123",48211,"zone_exit","2026-11-30T04:12:03Z"]"#.to_string(),
            format!("{GOOD} x"),
        ];
        for case in &cases {
            agree(case.as_bytes()).unwrap_or_else(|e| panic!("{case}: {e}"));
        }
        // The messages a producer sends take the fast path.
        for case in &cases[..2] {
            assert!(Envelope::parse_fast(case.as_bytes()).is_some(), "{case}");
        }
        let position = r#"{"device_id":"D","seq":1,"event_type":"position","occurred_at":"2026-11-30T04:12:03.250+03:00","payload":{"lat":41.0,"lon":29.0,"speed_kmh":12}}"#;
        assert!(Envelope::parse_fast(position.as_bytes()).is_some());
        agree(position.as_bytes()).unwrap();
        // What the fast path refuses is refused, or taken, by the reference alone.
        assert!(Envelope::parse_fast(cases[2].as_bytes()).is_none());
        assert_eq!(Envelope::parse(cases[2].as_bytes()).unwrap().seq, 7);
    }

    proptest! {
        #[test]
        fn the_fast_path_agrees_on_mutated_envelopes(pos in 0usize..GOOD.len(), byte in any::<u8>(), cut in 0usize..=GOOD.len()) {
            let mut bytes = GOOD.as_bytes().to_vec();
            bytes[pos] = byte;
            prop_assert!(agree(&bytes).is_ok(), "{:?}", agree(&bytes));
            prop_assert!(agree(&GOOD.as_bytes()[..cut]).is_ok());
        }

        #[test]
        fn parse_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Envelope::parse(&bytes);
        }

        #[test]
        fn parse_never_panics_on_mutated_envelopes(pos in 0usize..GOOD.len(), byte in any::<u8>(), cut in 0usize..GOOD.len()) {
            let mut bytes = GOOD.as_bytes().to_vec();
            bytes[pos] = byte;
            let _ = Envelope::parse(&bytes);
            let _ = Envelope::parse(&GOOD.as_bytes()[..cut]);
        }

        #[test]
        fn roundtrip_keeps_key_and_fingerprint(device in "[A-Za-z0-9-]{1,40}", seq in 0..=MAX_SEQ, t in 0usize..5, secs in 0i64..4_000_000_000) {
            let env = Envelope {
                message_id: None,
                device_id: device,
                seq,
                event_type: EventType::ALL[t],
                occurred_at: DateTime::from_timestamp(secs, 0).unwrap(),
                payload: serde_json::json!({"zone":"Z","lat":1.5,"lon":2.5}).as_object().unwrap().clone(),
            };
            let back = Envelope::parse(env.to_json_line().as_bytes()).unwrap();
            prop_assert_eq!(back.key(), env.key());
            prop_assert_eq!(back.fingerprint(), env.fingerprint());
        }
    }
}
