//! Poison at every ingress costs only itself (issue 39, docs/CONTRACT.md §9 "Ingress poison"): a
//! message the queue cannot take — over the size limit, not UTF-8 where JSON is
//! required, a broker header the client cannot read — from a producer that is not
//! idemwatch, straight on RabbitMQ or NATS, or brought back by a dead-letter replay,
//! is dead-lettered with its bytes (the first 64 KiB, the true length in the detail)
//! and a reason, acked and counted, and the messages after it flow. (MQTT's door:
//! `tests/mqtt.rs`; the HTTP edge answers 413/400 to its caller and keeps nothing:
//! `tests/http_limits.rs`.)

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use common::zone_exit;
use common::TempEnv;
use idemwatch::engine::consumers::trip_counter;
use idemwatch::engine::crash::CrashPlan;
use idemwatch::engine::envelope::{cut_raw_length, Envelope, RejectReason, DEAD_LETTER_KEEP};
use idemwatch::engine::replay::{self, ReplayPlan, ReplayStatus};
use idemwatch::engine::store::{DeadLetter, DeadLetterFilter, Store};
use idemwatch::engine::{Engine, EngineConfig};
use idemwatch::sim::sandbox_provider;

/// Bytes a producer sent that are over any queue's limit.
const OVERSIZED: usize = 200_000;
/// A body that is not UTF-8, let alone JSON.
const NOT_UTF8: &[u8] = b"\xff\xfe\x00 sensor dump \xc3\x28";

fn body(e: &Envelope) -> Vec<u8> {
    e.to_json_line().into_bytes()
}

/// An engine with the trip counter only, on `queue_url`, in `namespace`, its leases
/// running out after 3 s: a delivery lost with a connection comes back soon.
async fn engine(env: &TempEnv, queue_url: &str, namespace: Option<String>) -> Engine {
    let sandbox = sandbox_provider::spawn(([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut cfg = EngineConfig::new(&env.db_url(), queue_url, &sandbox.url(), &sandbox.url());
    cfg.consumers = vec![trip_counter::NAME.into()];
    cfg.namespace = namespace;
    cfg.runner.visibility_timeout = std::time::Duration::from_secs(3);
    Engine::open(&cfg).await.unwrap()
}

async fn letters(store: &dyn Store, consumer: &str) -> Vec<DeadLetter> {
    let mut l = store
        .find_dead_letters(&DeadLetterFilter {
            consumer: Some(consumer.into()),
            ..DeadLetterFilter::default()
        })
        .await
        .unwrap();
    l.sort_by_key(|l| l.id);
    l
}

/// The trip counter's dead letters are the oversized one (cut, its length said) and
/// the one that is not UTF-8 (whole), and nothing else.
async fn assert_poison_kept_bounded(engine: &Engine) {
    let l = letters(engine.store.as_ref(), trip_counter::NAME).await;
    let seen: Vec<_> = l
        .iter()
        .map(|l| {
            let cut = l.detail.as_deref().and_then(cut_raw_length);
            (l.reason.as_str(), l.raw.len(), cut)
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("too_large", DEAD_LETTER_KEEP, Some(OVERSIZED)),
            ("malformed_json", NOT_UTF8.len(), None),
        ],
        "{l:?}"
    );
    assert_eq!(l[1].raw, NOT_UTF8);
}

/// A dead letter no queue would take back used to stop `dead-letters replay` at
/// itself, every time (the queue refused the publish, the replay returned the
/// error): the letters after it were never replayed. Now it is skipped as
/// `too_large` and the replay goes on.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_skips_a_letter_no_queue_would_take_and_replays_the_ones_after_it() {
    let env = TempEnv::new();
    let engine = engine(&env, &env.queue_url(), None).await;
    let st = engine.store.as_ref();
    let huge = vec![b'{'; OVERSIZED];
    let detail = format!("message is {OVERSIZED} bytes");
    st.dead_letter(trip_counter::NAME, RejectReason::TooLarge, &detail, &huge)
        .await
        .unwrap();
    let exit = zone_exit("34-RP-1", 1);
    st.dead_letter(
        trip_counter::NAME,
        RejectReason::MaxDeliveries,
        "gave up",
        &body(&exit),
    )
    .await
    .unwrap();
    let plan = ReplayPlan {
        filter: DeadLetterFilter::default(),
        dry_run: false,
        namespace: None,
    };
    let report = replay::replay(st, engine.queue.as_ref(), &plan)
        .await
        .expect("the replay goes past the oversized letter");
    let statuses: Vec<_> = report.letters.iter().map(|l| l.status).collect();
    assert_eq!(
        statuses,
        [ReplayStatus::TooLarge, ReplayStatus::Replayed],
        "{report:?}"
    );
    assert_eq!((report.replayed, report.skipped), (1, 1));
    let s = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    let c = &s.consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (1, 0), "{s:?}");
    let l = letters(st, trip_counter::NAME).await;
    assert_eq!(l[0].raw.len(), DEAD_LETTER_KEEP, "kept bounded");
    assert_eq!(
        l[0].detail.as_deref().and_then(cut_raw_length),
        Some(OVERSIZED)
    );
}

/// One AMQP 0-9-1 publish written frame by frame, as a foreign producer's client
/// may send it: a header value that is not UTF-8 (AMQP strings are octets, and
/// RabbitMQ passes them on). No Rust client sends one, since they hold headers as
/// Rust strings.
fn raw_amqp_publish(url: &str, queue: &str, messages: &[(Option<&[u8]>, Vec<u8>)]) {
    let u = url::Url::parse(url).unwrap();
    let addr = format!("{}:{}", u.host_str().unwrap(), u.port().unwrap_or(5672));
    let user = percent_encoding::percent_decode_str(u.username())
        .decode_utf8()
        .unwrap()
        .into_owned();
    let password = percent_encoding::percent_decode_str(u.password().unwrap_or(""))
        .decode_utf8()
        .unwrap()
        .into_owned();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let frame = |s: &mut TcpStream, kind: u8, channel: u16, payload: &[u8]| {
        let mut f = vec![kind];
        f.extend(channel.to_be_bytes());
        f.extend((payload.len() as u32).to_be_bytes());
        f.extend(payload);
        f.push(0xCE);
        s.write_all(&f).unwrap();
    };
    let read_frame = |s: &mut TcpStream| -> Vec<u8> {
        let mut head = [0u8; 7];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut payload = vec![0u8; len + 1];
        s.read_exact(&mut payload).unwrap();
        payload.truncate(len);
        payload
    };
    let method = |class: u16, id: u16, args: &[u8]| {
        let mut p = class.to_be_bytes().to_vec();
        p.extend(id.to_be_bytes());
        p.extend(args);
        p
    };
    let short = |v: &[u8]| {
        let mut b = vec![v.len() as u8];
        b.extend(v);
        b
    };
    let long = |v: &[u8]| {
        let mut b = (v.len() as u32).to_be_bytes().to_vec();
        b.extend(v);
        b
    };
    s.write_all(b"AMQP\x00\x00\x09\x01").unwrap();
    read_frame(&mut s); // connection.start
    let mut start_ok = long(&[]); // client properties
    start_ok.extend(short(b"PLAIN"));
    start_ok.extend(long(format!("\0{user}\0{password}").as_bytes()));
    start_ok.extend(short(b"en_US"));
    frame(&mut s, 1, 0, &method(10, 11, &start_ok));
    // connection.tune: channel-max, frame-max, heartbeat; the answer takes the first
    // two and no heartbeats.
    let tune = read_frame(&mut s);
    let frame_max = u32::from_be_bytes([tune[6], tune[7], tune[8], tune[9]]) as usize;
    let mut tune_ok = tune[4..10].to_vec();
    tune_ok.extend([0, 0]);
    frame(&mut s, 1, 0, &method(10, 31, &tune_ok));
    let mut open = short(b"/");
    open.extend([0, 0]);
    frame(&mut s, 1, 0, &method(10, 40, &open));
    read_frame(&mut s); // connection.open-ok
    frame(&mut s, 1, 1, &method(20, 10, &short(b"")));
    read_frame(&mut s); // channel.open-ok
    for (header, body) in messages {
        let mut publish = 0u16.to_be_bytes().to_vec(); // ticket
        publish.extend(short(b""));
        publish.extend(short(queue.as_bytes()));
        publish.push(0);
        frame(&mut s, 1, 1, &method(60, 40, &publish));
        let mut content = 60u16.to_be_bytes().to_vec();
        content.extend(0u16.to_be_bytes());
        content.extend((body.len() as u64).to_be_bytes());
        match header {
            Some(value) => {
                content.extend(0xA000u16.to_be_bytes()); // content-type, headers
                content.extend(short(b"application/json"));
                let mut table = short(b"x-foreign-trace");
                table.push(b'S');
                table.extend(long(value));
                content.extend(long(&table));
            }
            None => content.extend(0u16.to_be_bytes()),
        }
        frame(&mut s, 2, 1, &content);
        let most = if frame_max == 0 { 1 << 17 } else { frame_max };
        for chunk in body.chunks(most - 8) {
            frame(&mut s, 3, 1, chunk);
        }
    }
    let mut close = 200u16.to_be_bytes().to_vec();
    close.extend(short(b"bye"));
    close.extend([0, 0, 0, 0]);
    frame(&mut s, 1, 0, &method(10, 50, &close));
    // Close-ok comes after every publish before it was handled.
    loop {
        let f = read_frame(&mut s);
        if f.get(..4) == Some(&[0, 10, 0, 51]) {
            break;
        }
    }
}

/// A foreign producer on RabbitMQ, straight to a consumer's queue: 200 KB, a body
/// that is not UTF-8, then well-formed messages, one of them with a header value
/// that is not UTF-8. That header used to fail amqprs's frame decoding, close the
/// connection and come back first on the next one (100 reconnects; the messages
/// behind it dead-lettered as `max_deliveries`, dozens of times over); the oversized
/// one was kept whole.
#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_poison_from_a_foreign_producer_is_dead_lettered_bounded_and_the_rest_flows() {
    use idemwatch::engine::queue::amqp::AmqpQueue;
    let _turn = common::amqp::exclusive().await;
    let Some(url) = common::amqp::amqp_url().await else {
        return;
    };
    let env = TempEnv::new();
    let ns = common::amqp::namespace("poison");
    let engine = engine(&env, &url, Some(ns.clone())).await;
    let first = zone_exit("34-FP-1", 1);
    engine.publish(&[body(&first)]).await.unwrap();
    let q = AmqpQueue::open(&url).await.unwrap();
    let queue = engine.queue_name(trip_counter::NAME);
    let broker_queue = q.broker_queue_name(&queue);
    let url2 = url.clone();
    let after = [zone_exit("34-FP-1", 2), zone_exit("34-FP-1", 3)];
    let messages: Vec<(Option<&'static [u8]>, Vec<u8>)> = vec![
        (None, vec![b'7'; OVERSIZED]),
        (None, NOT_UTF8.to_vec()),
        (Some(b"\xff\xfe trace \xc3\x28"), body(&after[0])),
        (None, body(&after[1])),
    ];
    tokio::task::spawn_blocking(move || raw_amqp_publish(&url2, &broker_queue, &messages))
        .await
        .unwrap();
    let s = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    let c = &s.consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (3, 2), "{s:?}");
    assert_eq!(engine.store.zone_exits("34-FP-1").await.unwrap(), 3);
    assert_poison_kept_bounded(&engine).await;
    engine.queue.remove_queue(&queue).await.unwrap();
    q.close().await;
}

/// One NATS publish with a header block of the producer's own bytes (HPUB), as the
/// server stores it: no Rust client sends a header that is not UTF-8.
fn raw_nats_publish(url: &str, subject: &str, headers: &[u8], body: &[u8]) {
    let u = url::Url::parse(url).unwrap();
    let mut s = TcpStream::connect((u.host_str().unwrap(), u.port().unwrap_or(4222))).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut info = [0u8; 4096];
    let _ = s.read(&mut info).unwrap();
    s.write_all(b"CONNECT {\"verbose\":false,\"headers\":true,\"protocol\":1}\r\n")
        .unwrap();
    let mut pubm = format!(
        "HPUB {subject} {} {}\r\n",
        headers.len(),
        headers.len() + body.len()
    )
    .into_bytes();
    pubm.extend(headers);
    pubm.extend(body);
    pubm.extend(b"\r\nPING\r\n");
    s.write_all(&pubm).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 256];
    while !answer.ends_with(b"PONG\r\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "NATS closed: {}", String::from_utf8_lossy(&answer));
        answer.extend(&buf[..n]);
    }
    assert!(
        !String::from_utf8_lossy(&answer).contains("-ERR"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
}

/// The same on NATS JetStream, published straight to the consumer's subject; the
/// header that is not UTF-8 used to end async-nats's connection at every delivery
/// (the fetch never returned, `consume` sat still with the message pending).
#[tokio::test(flavor = "multi_thread")]
async fn nats_poison_from_a_foreign_producer_is_dead_lettered_bounded_and_the_rest_flows() {
    use idemwatch::engine::queue::nats::NatsQueue;
    let Some(url) = common::services::nats_url() else {
        return;
    };
    let env = TempEnv::new();
    let ns = format!(
        "t-poison-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    let engine = engine(&env, &url, Some(ns.clone())).await;
    let first = zone_exit("34-FN-1", 1);
    engine.publish(&[body(&first)]).await.unwrap();
    let q = NatsQueue::open(&url).await.unwrap();
    let subject = q.location(&engine.queue_name(trip_counter::NAME)).subject;
    let client = async_nats::connect(&url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let after = [zone_exit("34-FN-1", 2), zone_exit("34-FN-1", 3)];
    for payload in [vec![b'7'; OVERSIZED], NOT_UTF8.to_vec()] {
        js.publish(subject.clone(), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let (url2, subject2, unreadable) = (url.clone(), subject.clone(), body(&after[0]));
    tokio::task::spawn_blocking(move || {
        raw_nats_publish(
            &url2,
            &subject2,
            b"NATS/1.0\r\nX-Foreign-Trace: \xff\xfe \xc3\x28\r\n\r\n",
            &unreadable,
        )
    })
    .await
    .unwrap();
    js.publish(subject.clone(), body(&after[1]).into())
        .await
        .unwrap()
        .await
        .unwrap();
    let s = engine
        .run_until_idle(Arc::new(CrashPlan::none()), None)
        .await
        .unwrap();
    let c = &s.consumers[trip_counter::NAME];
    assert_eq!((c.processed, c.dead_lettered), (3, 2), "{s:?}");
    assert_poison_kept_bounded(&engine).await;
    q.delete_namespace(&ns).await.unwrap();
}
