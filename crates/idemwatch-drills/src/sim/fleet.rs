//! A deterministic fleet of simulated telematics devices (docs/CONTRACT.md §1 envelopes).
//!
//! The live demo, the drills and the property tests need traffic that looks like
//! the field report's fleet *and* is reproducible: the same [`FleetConfig`] yields
//! the same messages byte for byte, so a failing run can be replayed exactly. There
//! is no wall clock and no global RNG inside: time is `start + tick × n` for the
//! n-th generated event and all randomness comes from one seeded ChaCha8 stream.
//!
//! Besides fresh events the stream contains the delivery anomalies the pattern
//! must survive: **redeliveries** (exact byte copies of an earlier message, at about
//! 0.01 % normally and 0.4 % inside a deploy window), **late** events (held back
//! so they arrive after a newer event of the same device) and, when
//! [`FleetConfig::tunnel_rate`] is set, **tunnels**: a device loses its link for a
//! few events and buffers them; back in coverage it sends its newest event live and
//! then flushes the buffer, oldest first, so a whole run of older seqs (an
//! `ignition_on` among them, often enough) arrives behind a newer one. That is the
//! field report's ghost "engine running": a consumer without a seq guard applies the
//! flushed `ignition_on` over the newer state.

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};

use idemwatch_engine::envelope::{Envelope, EventType};

/// How many recently emitted messages a redelivery may copy: redeliveries happen
/// within minutes, not days.
pub const REDELIVERY_RING: usize = 1000;
/// A late event is released after at most this many newer events of its device.
pub const MAX_LATE_EVENTS: u32 = 5;
/// After this many steps a held event is released as soon as its device has sent
/// one newer event (the device is picked next if it has not), so nothing is lost.
pub const MAX_HOLD_STEPS: u64 = 5;
/// Events a device buffers in one tunnel: at least this many...
pub const MIN_TUNNEL_EVENTS: u32 = 3;
/// ...and at most this many (a vehicle sends one event every few seconds, so a
/// tunnel of tens of seconds to a minute of driving).
pub const MAX_TUNNEL_EVENTS: u32 = 8;

/// Istanbul, where the field report's fleet drives.
const HOME: (f64, f64) = (41.0, 29.0);
/// Vehicles stay inside this box around [`HOME`] (degrees).
const BOX: (f64, f64) = (0.25, 0.45);

/// Parameters of one simulated fleet. Equal configs give identical streams.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    /// Number of devices (at least 1 is simulated).
    pub vehicles: usize,
    /// Seed of the single RNG stream.
    pub seed: u64,
    /// `occurred_at` of the first generated event.
    pub start: DateTime<Utc>,
    /// Simulated time between two generated events (fleet-wide).
    pub tick: Duration,
    /// Probability per step of a redelivery outside a deploy window.
    pub redelivery_rate: f64,
    /// Probability per step of a redelivery inside a deploy window.
    pub deploy_redelivery_rate: f64,
    /// Probability that a fresh event is held back and arrives late.
    pub late_rate: f64,
    /// Probability that a fresh event of a device with a link is the first one it
    /// buffers in a tunnel (0: no tunnels, the stream of a config without them is
    /// unchanged byte for byte). See [`MIN_TUNNEL_EVENTS`], [`MAX_TUNNEL_EVENTS`].
    pub tunnel_rate: f64,
    /// Device ids are this prefix plus a 4-digit number, e.g. `34-SIM-0001`.
    pub device_prefix: String,
}

impl Default for FleetConfig {
    /// The field report's numbers: 0.01 % redeliveries normally, 0.4 % on deploy days.
    fn default() -> Self {
        FleetConfig {
            vehicles: 20,
            seed: 42,
            start: Utc
                .with_ymd_and_hms(2026, 11, 30, 4, 0, 0)
                .single()
                .unwrap_or(DateTime::UNIX_EPOCH),
            tick: Duration::from_millis(500),
            redelivery_rate: 0.0001,
            deploy_redelivery_rate: 0.004,
            late_rate: 0.001,
            tunnel_rate: 0.0,
            device_prefix: "34-SIM-".to_owned(),
        }
    }
}

/// How a message came to be in the stream, so tests and drills know the truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimKind {
    /// A new event, emitted in order.
    Fresh,
    /// An exact copy (same bytes, same `message_id`) of an earlier emitted message.
    Redelivery,
    /// A new event held back so it arrives after a newer event of the same device
    /// (a single held event, or one of a tunnel's flushed buffer).
    Late,
}

/// One message as a producer would publish it.
#[derive(Debug, Clone, PartialEq)]
pub struct SimMessage {
    /// The parsed form, for assertions without re-parsing.
    pub envelope: Envelope,
    /// One JSON line (no trailing newline), with a `message_id`: what goes on the queue.
    pub raw: Vec<u8>,
    /// The ground truth about this delivery, which a consumer must not need.
    pub kind: SimKind,
}

/// What a vehicle does next within its trip.
#[derive(Debug, Clone, PartialEq)]
enum Planned {
    IgnitionOn,
    Position,
    ZoneEnter(String),
    ZoneExit(String),
    IgnitionOff,
}

#[derive(Debug)]
struct Vehicle {
    device_id: String,
    phone: String,
    last_seq: u64,
    lat: f64,
    lon: f64,
    heading: f64,
    speed_kmh: f64,
    plan: VecDeque<Planned>,
}

/// A fresh event held back to be delivered late.
#[derive(Debug)]
struct Held {
    message: SimMessage,
    vehicle: usize,
    /// Release after this many newer events of the device...
    wait_events: u32,
    newer_seen: u32,
    /// ...or once held this long and at least one newer event was sent.
    held_at_step: u64,
}

/// A device without a link: the events it generated meanwhile, oldest first.
#[derive(Debug)]
struct Tunnel {
    vehicle: usize,
    buffered: Vec<SimMessage>,
    /// Events still to be buffered; the one after them is sent live, then the buffer.
    left: u32,
}

/// The simulator. Call [`FleetSim::next`] (or iterate) for an endless stream.
#[derive(Debug)]
pub struct FleetSim {
    config: FleetConfig,
    rng: ChaCha8Rng,
    vehicles: Vec<Vehicle>,
    /// Calls to `next` so far: the clock for deploy windows and hold times.
    step: u64,
    /// Fresh events generated so far: the clock for `occurred_at`.
    generated: u64,
    deploy_until: u64,
    recent: VecDeque<SimMessage>,
    held: Vec<Held>,
    released: VecDeque<SimMessage>,
    tunnels: Vec<Tunnel>,
}

impl FleetSim {
    /// A fleet in its initial state: every vehicle parked, engine off, seq 0.
    pub fn new(config: FleetConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        let vehicles = (1..=config.vehicles.max(1))
            .map(|n| Vehicle {
                device_id: format!("{}{n:04}", config.device_prefix),
                phone: format!("+90555{:07}", rng.random_range(0..10_000_000u32)),
                last_seq: 0,
                lat: HOME.0 + rng.random_range(-BOX.0..BOX.0),
                lon: HOME.1 + rng.random_range(-BOX.1..BOX.1),
                heading: rng.random_range(0.0..std::f64::consts::TAU),
                speed_kmh: 0.0,
                plan: VecDeque::new(),
            })
            .collect();
        FleetSim {
            config,
            rng,
            vehicles,
            step: 0,
            generated: 0,
            deploy_until: 0,
            recent: VecDeque::with_capacity(REDELIVERY_RING),
            held: Vec::new(),
            released: VecDeque::new(),
            tunnels: Vec::new(),
        }
    }

    /// The configuration this fleet runs with.
    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// Open a deploy window for the next `window_steps` messages: consumers are
    /// restarting, so redeliveries use `deploy_redelivery_rate`.
    pub fn deploy(&mut self, window_steps: u64) {
        self.deploy_until = self.step.saturating_add(window_steps);
    }

    /// Whether a deploy window is open (the next message is inside it).
    pub fn in_deploy(&self) -> bool {
        self.step < self.deploy_until
    }

    /// The next message on the queue. The stream never ends.
    #[allow(clippy::should_implement_trait)] // `Iterator` is implemented too; this one cannot end.
    pub fn next(&mut self) -> SimMessage {
        let rate = if self.in_deploy() {
            self.config.deploy_redelivery_rate
        } else {
            self.config.redelivery_rate
        };
        self.step += 1;
        self.release_overdue();
        if let Some(late) = self.released.pop_front() {
            return self.emit(late);
        }
        if !self.recent.is_empty() && self.chance(rate) {
            let pick = self.rng.random_range(0..self.recent.len());
            if let Some(original) = self.recent.get(pick) {
                let mut copy = original.clone();
                copy.kind = SimKind::Redelivery;
                return copy;
            }
        }
        // At most one event is held and one tunnel entered per step, and a tunnel
        // buffers a bounded number of events, so even rates of 1 make progress.
        let mut may_hold = true;
        let mut may_tunnel = true;
        loop {
            let vehicle = self.pick_vehicle();
            let message = self.generate(vehicle);
            if let Some(i) = self.tunnels.iter().position(|t| t.vehicle == vehicle) {
                let tunnel = &mut self.tunnels[i];
                if tunnel.left > 0 {
                    tunnel.left -= 1;
                    tunnel.buffered.push(message);
                    continue;
                }
                // Back in coverage: the live event first, then the buffer.
                let tunnel = self.tunnels.remove(i);
                self.released
                    .extend(tunnel.buffered.into_iter().map(|mut m| {
                        m.kind = SimKind::Late;
                        m
                    }));
                self.note_newer_event(vehicle);
                return self.emit(message);
            }
            if may_tunnel && self.chance(self.config.tunnel_rate) {
                let events = self.rng.random_range(MIN_TUNNEL_EVENTS..=MAX_TUNNEL_EVENTS);
                self.tunnels.push(Tunnel {
                    vehicle,
                    buffered: vec![message],
                    left: events - 1,
                });
                may_tunnel = false;
                continue;
            }
            if may_hold && self.chance(self.config.late_rate) {
                self.held.push(Held {
                    message,
                    vehicle,
                    wait_events: self.rng.random_range(1..=MAX_LATE_EVENTS),
                    newer_seen: 0,
                    held_at_step: self.step,
                });
                may_hold = false;
                continue;
            }
            self.note_newer_event(vehicle);
            return self.emit(message);
        }
    }

    /// The next `n` messages, collected. Not named `take`: on a `FleetSim` value
    /// `sim.take(n)` resolves to `Iterator::take`, which would move the simulator.
    pub fn take_n(&mut self, n: usize) -> Vec<SimMessage> {
        (0..n).map(|_| FleetSim::next(self)).collect()
    }

    /// `true` with probability `p`; NaN or non-positive never, ≥ 1 always.
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.random::<f64>() < p
    }

    /// Record an emitted message for later redelivery.
    fn emit(&mut self, message: SimMessage) -> SimMessage {
        if self.recent.len() == REDELIVERY_RING {
            self.recent.pop_front();
        }
        self.recent.push_back(message.clone());
        message
    }

    /// Vehicles interleave pseudo-randomly, except that a device whose held event
    /// is overdue sends next, so the held event can be released after it.
    fn pick_vehicle(&mut self) -> usize {
        let step = self.step;
        let overdue = self
            .held
            .iter()
            .find(|h| h.newer_seen == 0 && step.saturating_sub(h.held_at_step) >= MAX_HOLD_STEPS);
        match overdue {
            Some(h) => h.vehicle,
            None => self.rng.random_range(0..self.vehicles.len()),
        }
    }

    /// A newer event of `vehicle` is being emitted (only emitted ones count, so a
    /// late event always arrives behind a delivered newer seq): count it for the
    /// device's held events and queue those that waited long enough.
    fn note_newer_event(&mut self, vehicle: usize) {
        let step = self.step;
        for held in self.held.iter_mut().filter(|h| h.vehicle == vehicle) {
            held.newer_seen += 1;
        }
        self.release_where(|h| {
            h.newer_seen >= h.wait_events
                || (h.newer_seen > 0 && step.saturating_sub(h.held_at_step) >= MAX_HOLD_STEPS)
        });
    }

    /// Release held events that are overdue and already behind a newer event.
    fn release_overdue(&mut self) {
        let step = self.step;
        self.release_where(|h| {
            h.newer_seen > 0 && step.saturating_sub(h.held_at_step) >= MAX_HOLD_STEPS
        });
    }

    fn release_where(&mut self, ready: impl Fn(&Held) -> bool) {
        let mut i = 0;
        while i < self.held.len() {
            if ready(&self.held[i]) {
                let mut message = self.held.remove(i).message;
                message.kind = SimKind::Late;
                self.released.push_back(message);
            } else {
                i += 1;
            }
        }
    }

    /// The next event of `index`'s trip, as a fresh message.
    fn generate(&mut self, index: usize) -> SimMessage {
        if self.vehicles[index].plan.is_empty() {
            let trip = self.plan_trip();
            self.vehicles[index].plan = trip;
        }
        let planned = self.vehicles[index]
            .plan
            .pop_front()
            .unwrap_or(Planned::Position);
        if planned == Planned::Position {
            self.drive(index);
        }
        let occurred_at = self.occurred_at();
        self.generated += 1;
        let message_id = format!("sim-{:x}-{}", self.config.seed, self.generated);

        let vehicle = &mut self.vehicles[index];
        vehicle.last_seq += 1;
        let (event_type, payload) = match planned {
            Planned::IgnitionOn => (EventType::IgnitionOn, json!({})),
            Planned::IgnitionOff => {
                vehicle.speed_kmh = 0.0;
                (EventType::IgnitionOff, json!({}))
            }
            Planned::Position => (
                EventType::Position,
                json!({
                    "lat": round6(vehicle.lat),
                    "lon": round6(vehicle.lon),
                    "speed_kmh": vehicle.speed_kmh.round(),
                }),
            ),
            Planned::ZoneEnter(zone) => (
                EventType::ZoneEnter,
                json!({ "zone": zone, "phone": vehicle.phone }),
            ),
            Planned::ZoneExit(zone) => (
                EventType::ZoneExit,
                json!({ "zone": zone, "phone": vehicle.phone }),
            ),
        };
        let envelope = Envelope {
            message_id: Some(message_id),
            device_id: vehicle.device_id.clone(),
            seq: vehicle.last_seq,
            event_type,
            occurred_at,
            payload: match payload {
                Value::Object(map) => map,
                _ => Map::new(),
            },
        };
        let raw = envelope.to_json_line().into_bytes();
        SimMessage {
            envelope,
            raw,
            kind: SimKind::Fresh,
        }
    }

    /// One trip: start, drive, visit a zone, drive, stop.
    fn plan_trip(&mut self) -> VecDeque<Planned> {
        let zone = format!("depot-{}", self.rng.random_range(1..=9u8));
        let mut trip = VecDeque::from([Planned::IgnitionOn]);
        let legs: [(usize, usize); 3] = [(2, 8), (1, 6), (2, 8)];
        for (leg, (lo, hi)) in legs.into_iter().enumerate() {
            let positions = self.rng.random_range(lo..=hi);
            trip.extend((0..positions).map(|_| Planned::Position));
            match leg {
                0 => trip.push_back(Planned::ZoneEnter(zone.clone())),
                1 => trip.push_back(Planned::ZoneExit(zone.clone())),
                _ => trip.push_back(Planned::IgnitionOff),
            }
        }
        trip
    }

    /// Move a vehicle plausibly: a gentle random walk in heading and speed, turning
    /// back at the edge of the Istanbul box.
    fn drive(&mut self, index: usize) {
        let turn = self.rng.random_range(-0.5..0.5);
        let speed = self.rng.random_range(10.0..90.0);
        let v = &mut self.vehicles[index];
        v.heading = (v.heading + turn).rem_euclid(std::f64::consts::TAU);
        v.speed_kmh = (v.speed_kmh * 0.6 + speed * 0.4).clamp(0.0, 120.0);
        // About 30 s between a device's positions; 1° latitude ≈ 111 km.
        let km = v.speed_kmh * 30.0 / 3600.0;
        let dlat = km * v.heading.cos() / 111.0;
        let dlon = km * v.heading.sin() / (111.0 * HOME.0.to_radians().cos());
        v.lat += dlat;
        v.lon += dlon;
        if (v.lat - HOME.0).abs() > BOX.0 || (v.lon - HOME.1).abs() > BOX.1 {
            v.lat -= dlat;
            v.lon -= dlon;
            v.heading = (v.heading + std::f64::consts::PI).rem_euclid(std::f64::consts::TAU);
        }
    }

    /// `start + tick × n` for the n-th generated event (saturating, never the wall clock).
    fn occurred_at(&self) -> DateTime<Utc> {
        let nanos = self
            .config
            .tick
            .as_nanos()
            .saturating_mul(u128::from(self.generated));
        let nanos = i64::try_from(nanos).unwrap_or(i64::MAX);
        self.config
            .start
            .checked_add_signed(chrono::Duration::nanoseconds(nanos))
            .unwrap_or(self.config.start)
    }
}

impl Iterator for FleetSim {
    type Item = SimMessage;

    /// Never `None`: the fleet drives forever.
    fn next(&mut self) -> Option<SimMessage> {
        Some(FleetSim::next(self))
    }
}

/// Distinct `device:seq:zone_exit` keys among `messages`: the number of "left zone"
/// SMS a correct consumer must send, however many duplicates the stream holds.
pub fn distinct_zone_exits(messages: &[SimMessage]) -> usize {
    messages
        .iter()
        .filter(|m| m.envelope.event_type == EventType::ZoneExit)
        .map(|m| m.envelope.key())
        .collect::<HashSet<_>>()
        .len()
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(seed: u64) -> FleetConfig {
        FleetConfig {
            seed,
            ..FleetConfig::default()
        }
    }

    fn quiet(seed: u64) -> FleetConfig {
        FleetConfig {
            redelivery_rate: 0.0,
            deploy_redelivery_rate: 0.0,
            late_rate: 0.0,
            ..config(seed)
        }
    }

    fn bytes(messages: &[SimMessage]) -> Vec<&[u8]> {
        messages.iter().map(|m| m.raw.as_slice()).collect()
    }

    #[test]
    fn same_seed_same_bytes_different_seed_different() {
        let a = FleetSim::new(config(7)).take_n(5_000);
        let b = FleetSim::new(config(7)).take_n(5_000);
        let c = FleetSim::new(config(8)).take_n(5_000);
        assert_eq!(bytes(&a), bytes(&b));
        assert_eq!(
            a.iter().map(|m| m.kind).collect::<Vec<_>>(),
            b.iter().map(|m| m.kind).collect::<Vec<_>>()
        );
        assert_ne!(bytes(&a), bytes(&c));
    }

    #[test]
    fn every_line_parses_back_to_the_same_envelope() {
        let config = FleetConfig {
            late_rate: 0.05,
            redelivery_rate: 0.05,
            ..config(3)
        };
        for m in FleetSim::new(config).take_n(5_000) {
            assert!(!m.raw.contains(&b'\n'));
            let parsed = Envelope::parse(&m.raw).expect("simulated line must parse");
            assert_eq!(parsed.key(), m.envelope.key());
            assert_eq!(parsed, m.envelope);
            assert!(parsed.message_id.is_some());
            assert!(parsed.seq <= i64::MAX as u64);
            assert!(parsed.device_id.starts_with("34-SIM-"));
        }
    }

    #[test]
    fn occurred_at_follows_the_simulated_clock() {
        let start = FleetConfig::default().start;
        let msgs = FleetSim::new(quiet(1)).take_n(10);
        for (n, m) in msgs.iter().enumerate() {
            let expected = start + chrono::Duration::milliseconds(500 * n as i64);
            assert_eq!(m.envelope.occurred_at, expected);
        }
    }

    #[test]
    fn fresh_seqs_are_contiguous_per_device() {
        let msgs = FleetSim::new(quiet(11)).take_n(20_000);
        assert!(msgs.iter().all(|m| m.kind == SimKind::Fresh));
        let mut last: HashMap<&str, u64> = HashMap::new();
        for m in &msgs {
            let seq = last.entry(m.envelope.device_id.as_str()).or_insert(0);
            assert_eq!(m.envelope.seq, *seq + 1, "gap for {}", m.envelope.device_id);
            *seq += 1;
        }
        assert_eq!(last.len(), 20, "every vehicle takes part");
        assert!(last.contains_key("34-SIM-0001") && last.contains_key("34-SIM-0020"));
    }

    #[test]
    fn trips_are_well_formed_per_device() {
        let config = FleetConfig {
            late_rate: 0.02,
            ..config(5)
        };
        let msgs = FleetSim::new(config).take_n(30_000);
        let mut by_device: HashMap<&str, Vec<&Envelope>> = HashMap::new();
        for m in msgs.iter().filter(|m| m.kind != SimKind::Redelivery) {
            by_device
                .entry(&m.envelope.device_id)
                .or_default()
                .push(&m.envelope);
        }
        let mut zone_visits = 0;
        for (device, mut events) in by_device {
            events.sort_by_key(|e| e.seq);
            // Events still held when the stream was cut are missing at the tail:
            // check the contiguous prefix 1..=k.
            let prefix = events
                .iter()
                .zip(1u64..)
                .take_while(|(e, n)| e.seq == *n)
                .count();
            assert!(
                events.len() - prefix <= 2 * MAX_LATE_EVENTS as usize,
                "{device}"
            );
            events.truncate(prefix);
            let mut engine_on = false;
            let mut zone: Option<&str> = None;
            let mut phone: Option<&str> = None;
            for e in &events {
                match e.event_type {
                    EventType::IgnitionOn => {
                        assert!(!engine_on, "{device}: double ignition_on");
                        engine_on = true;
                    }
                    EventType::IgnitionOff => {
                        assert!(engine_on && zone.is_none(), "{device}: bad ignition_off");
                        engine_on = false;
                    }
                    EventType::Position => {
                        assert!(engine_on, "{device}: moving with engine off");
                        let (lat, lon) = e.lat_lon().expect("position has lat/lon");
                        assert!((40.7..41.3).contains(&lat) && (28.5..29.5).contains(&lon));
                    }
                    EventType::ZoneEnter => {
                        assert!(engine_on && zone.is_none(), "{device}: bad zone_enter");
                        zone = e.zone();
                    }
                    EventType::ZoneExit => {
                        assert_eq!(e.zone(), zone, "{device}: exit of another zone");
                        zone = None;
                        zone_visits += 1;
                    }
                }
                if let Some(p) = e.phone() {
                    assert!(p.starts_with("+90555") && p.len() == 13, "{p}");
                    assert_eq!(*phone.get_or_insert(p), p, "{device}: phone changed");
                }
            }
        }
        assert!(zone_visits > 100);
    }

    #[test]
    fn redelivery_rate_matches_normal_and_deploy_days() {
        let count = |config: FleetConfig, deploy: bool| {
            let mut sim = FleetSim::new(config);
            if deploy {
                sim.deploy(1_000_000);
            }
            let msgs = sim.take_n(200_000);
            assert_eq!(sim.in_deploy(), deploy);
            msgs.iter()
                .filter(|m| m.kind == SimKind::Redelivery)
                .count()
        };
        // Expected 20 (sd ≈ 4.5) and 800 (sd ≈ 28): allow about ±4 sd.
        let normal = count(config(21), false);
        assert!(
            (4..=40).contains(&normal),
            "normal-day redeliveries: {normal}"
        );
        let deploy = count(config(21), true);
        assert!(
            (690..=910).contains(&deploy),
            "deploy-day redeliveries: {deploy}"
        );
    }

    #[test]
    fn deploy_window_closes_after_its_steps() {
        let mut sim = FleetSim::new(config(2));
        assert!(!sim.in_deploy());
        sim.deploy(3);
        assert!(sim.in_deploy());
        sim.take_n(2);
        assert!(sim.in_deploy());
        sim.take_n(1);
        assert!(!sim.in_deploy());
    }

    #[test]
    fn redeliveries_are_exact_copies_of_earlier_messages() {
        let config = FleetConfig {
            redelivery_rate: 0.02,
            ..config(9)
        };
        let msgs = FleetSim::new(config).take_n(20_000);
        let mut seen: HashSet<&[u8]> = HashSet::new();
        let mut redeliveries = 0;
        for m in &msgs {
            match m.kind {
                SimKind::Redelivery => {
                    assert!(
                        seen.contains(m.raw.as_slice()),
                        "redelivery of unseen bytes"
                    );
                    redeliveries += 1;
                }
                _ => assert!(seen.insert(m.raw.as_slice()), "fresh/late message repeated"),
            }
        }
        assert!(redeliveries > 200);
        let keys: HashSet<_> = msgs.iter().map(|m| m.envelope.key()).collect();
        assert_eq!(
            keys.len(),
            msgs.len() - redeliveries,
            "one key per real event"
        );
        let exits = msgs
            .iter()
            .filter(|m| {
                m.kind != SimKind::Redelivery && m.envelope.event_type == EventType::ZoneExit
            })
            .count();
        assert_eq!(distinct_zone_exits(&msgs), exits);
    }

    #[test]
    fn late_events_arrive_after_a_newer_seq_and_none_is_lost() {
        let config = FleetConfig {
            late_rate: 0.01,
            ..quiet(13)
        };
        let n = 50_000;
        let msgs = FleetSim::new(config).take_n(n);
        let mut max_seen: HashMap<&str, u64> = HashMap::new();
        let mut late = 0;
        for (i, m) in msgs.iter().enumerate() {
            let device = m.envelope.device_id.as_str();
            let max = max_seen.get(device).copied().unwrap_or(0);
            match m.kind {
                SimKind::Late => {
                    assert!(
                        max > m.envelope.seq,
                        "late event at {i} not behind a newer seq"
                    );
                    late += 1;
                }
                SimKind::Fresh => assert!(m.envelope.seq > max, "fresh event out of order at {i}"),
                SimKind::Redelivery => unreachable!("redeliveries are off"),
            }
            max_seen.insert(device, max.max(m.envelope.seq));
        }
        assert!(late > 200, "late events: {late}");
        // Nothing lost: every seq up to a margin below the newest one was delivered.
        let mut seen: HashMap<&str, HashSet<u64>> = HashMap::new();
        for m in &msgs {
            seen.entry(&m.envelope.device_id)
                .or_default()
                .insert(m.envelope.seq);
        }
        for (device, seqs) in seen {
            let max = max_seen[device];
            for s in 1..=max.saturating_sub(2 * u64::from(MAX_LATE_EVENTS)) {
                assert!(seqs.contains(&s), "{device}: seq {s} lost");
            }
        }
    }

    #[test]
    fn late_events_are_released_within_bounded_steps() {
        let config = FleetConfig {
            vehicles: 200,
            late_rate: 0.05,
            ..quiet(17)
        };
        let msgs = FleetSim::new(config).take_n(20_000);
        let position: HashMap<_, usize> = msgs
            .iter()
            .enumerate()
            .map(|(i, m)| (m.envelope.key(), i))
            .collect();
        // occurred_at orders generation: a late event is delivered at most a few steps
        // after the fresh events generated right after it.
        let mut generated: Vec<&SimMessage> = msgs.iter().collect();
        generated.sort_by_key(|m| m.envelope.occurred_at);
        for (g, m) in generated.iter().enumerate() {
            if m.kind == SimKind::Late {
                let delivered = position[&m.envelope.key()];
                assert!(
                    delivered <= g + 40,
                    "held too long: generated {g}, delivered {delivered}"
                );
            }
        }
    }

    /// The runs of a tunnel's flush: (index of the live event that came out of the
    /// tunnel, the flushed messages right behind it).
    fn flushes(msgs: &[SimMessage]) -> Vec<(usize, &[SimMessage])> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < msgs.len() {
            let run = msgs[i + 1..]
                .iter()
                .take_while(|m| m.kind == SimKind::Late)
                .count();
            if run > 0 {
                out.push((i, &msgs[i + 1..i + 1 + run]));
            }
            i += run + 1;
        }
        out
    }

    #[test]
    fn tunnel_devices_flush_older_seqs_after_a_newer_one_deterministically() {
        let config = FleetConfig {
            tunnel_rate: 0.01,
            ..quiet(23)
        };
        let msgs = FleetSim::new(config.clone()).take_n(20_000);
        let again = FleetSim::new(config.clone()).take_n(20_000);
        assert_eq!(bytes(&msgs), bytes(&again), "same seed, same stream");
        assert_eq!(
            msgs.iter().map(|m| m.kind).collect::<Vec<_>>(),
            again.iter().map(|m| m.kind).collect::<Vec<_>>()
        );
        let other = FleetSim::new(FleetConfig { seed: 24, ..config }).take_n(20_000);
        assert_ne!(bytes(&msgs), bytes(&other));

        let runs = flushes(&msgs);
        let mut ghost_ignitions = 0;
        for (live, flushed) in &runs {
            let live = &msgs[*live].envelope;
            // One device's buffer, oldest first, every seq from the tunnel's entry up
            // to the one just before the live event: older seqs after a newer one.
            assert!(
                (MIN_TUNNEL_EVENTS..=MAX_TUNNEL_EVENTS).contains(&(flushed.len() as u32)),
                "flush of {}",
                flushed.len()
            );
            for (k, m) in flushed.iter().enumerate() {
                assert_eq!(m.envelope.device_id, live.device_id);
                assert_eq!(
                    m.envelope.seq,
                    live.seq - flushed.len() as u64 + k as u64,
                    "flushed in seq order, right up to the live one"
                );
                assert!(m.envelope.seq < live.seq);
            }
            ghost_ignitions += flushed
                .iter()
                .filter(|m| m.envelope.event_type == EventType::IgnitionOn)
                .count();
        }
        // 20 000 events at 1 % start ~200 tunnels (fewer: a device in one starts none).
        assert!(runs.len() > 100, "tunnels flushed: {}", runs.len());
        assert!(
            ghost_ignitions > 10,
            "flushed ignition_on: {ghost_ignitions}"
        );
        // Late events come only from tunnels here, and nothing is lost or doubled: each
        // device's seqs 1..=newest arrive exactly once, but for a tunnel still open
        // when the stream was cut.
        let mut seqs: HashMap<&str, Vec<u64>> = HashMap::new();
        for m in &msgs {
            seqs.entry(&m.envelope.device_id)
                .or_default()
                .push(m.envelope.seq);
        }
        let flushed: usize = runs.iter().map(|(_, f)| f.len()).sum();
        assert_eq!(
            flushed,
            msgs.iter().filter(|m| m.kind == SimKind::Late).count()
        );
        for (device, mut got) in seqs {
            got.sort_unstable();
            let n = got.len() as u64;
            assert_eq!(
                got,
                (1..=n).collect::<Vec<_>>(),
                "{device}: lost or doubled"
            );
        }
    }

    #[test]
    fn a_tunnel_with_every_rate_at_one_still_makes_progress() {
        let config = FleetConfig {
            vehicles: 3,
            tunnel_rate: 1.0,
            late_rate: 1.0,
            ..quiet(29)
        };
        let msgs = FleetSim::new(config).take_n(2_000);
        assert_eq!(msgs.len(), 2_000);
        assert!(msgs.iter().any(|m| m.kind == SimKind::Late));
        assert!(msgs.iter().any(|m| m.kind == SimKind::Fresh));
    }

    #[test]
    fn iterator_and_zero_vehicles_work() {
        let config = FleetConfig {
            vehicles: 0,
            ..quiet(4)
        };
        let msgs: Vec<SimMessage> = FleetSim::new(config).take_n(50);
        assert!(msgs.iter().all(|m| m.envelope.device_id == "34-SIM-0001"));
        let via_iter: Vec<SimMessage> = FleetSim::new(quiet(4)).take(10).collect();
        assert_eq!(bytes(&via_iter), bytes(&FleetSim::new(quiet(4)).take_n(10)));
    }
}
