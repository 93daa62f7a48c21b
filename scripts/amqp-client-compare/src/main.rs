//! Not part of idemwatch: our process's CPU per delivery when
//! consuming N messages from a quorum queue, prefetch 300, acking with `multiple`
//! every 100 deliveries, through lapin 4 (the engine's client) and through amqprs 2.
//!
//! Why: in `bench engine --queue amqp://…` lapin's own I/O thread takes ~40 % of our
//! process's samples and most of its context switches; amqprs runs on tokio tasks.
//! Only the consume phase is timed (publishing is set-up and differs: lapin waits
//! for confirms, amqprs for the queue's count).
//!
//!     cargo run --release -- lapin 100000; cargo run --release -- amqprs 100000
//!
//! Needs RabbitMQ on 127.0.0.1:5672 (guest/guest); each run declares and deletes its
//! own quorum queue.
use std::time::Instant;

const BATCH: usize = 100;
const PREFETCH: u16 = 300;

fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let (u, k): (f64, f64) = (f[11].parse().unwrap(), f[12].parse().unwrap());
    (u + k) / 100.0
}

fn bodies(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{{\"device_id\":\"dev-{:04}\",\"seq\":{i},\"event_type\":\"zone_exit\",\"occurred_at\":\"2026-12-05T18:00:00Z\",\"payload\":{{\"lat\":41.0,\"lon\":29.0,\"zone\":\"kadikoy\",\"phone\":\"+905551112233\"}}}}", i % 1000).into_bytes())
        .collect()
}

mod with_lapin {
    use super::*;
    use futures::StreamExt;
    use lapin::options::*;
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    use lapin::{BasicProperties, Connection, ConnectionProperties};

    pub async fn run(url: &str, n: usize) -> (f64, f64) {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let name = format!("cmp.lapin.{}", std::process::id());
        let mut args = FieldTable::default();
        args.insert(
            ShortString::from("x-queue-type"),
            AMQPValue::LongString("quorum".into()),
        );
        ch.queue_declare(
            ShortString::from(name.as_str()),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut confirms = Vec::new();
        for b in bodies(n) {
            confirms.push(
                ch.basic_publish(
                    ShortString::from(""),
                    ShortString::from(name.as_str()),
                    BasicPublishOptions::default(),
                    &b,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap(),
            );
        }
        for c in confirms {
            c.await.unwrap();
        }
        let cch = conn.create_channel().await.unwrap();
        cch.basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .unwrap();
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let mut consumer = cch
            .basic_consume(
                ShortString::from(name.as_str()),
                ShortString::from("cmp"),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut got = 0;
        let mut bytes = 0;
        while got < n {
            let d = consumer.next().await.unwrap().unwrap();
            bytes += d.data.len();
            got += 1;
            if got % BATCH == 0 || got == n {
                d.acker
                    .ack(BasicAckOptions { multiple: true })
                    .await
                    .unwrap();
            }
        }
        let r = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        assert!(bytes > 0);
        ch.queue_delete(
            ShortString::from(name.as_str()),
            QueueDeleteOptions::default(),
        )
        .await
        .unwrap();
        r
    }
}

mod with_amqprs {
    use super::*;
    use amqprs::channel::*;
    use amqprs::connection::{Connection, OpenConnectionArguments};
    use amqprs::{BasicProperties, FieldName, FieldTable, FieldValue};

    pub async fn run(n: usize) -> (f64, f64) {
        let conn = Connection::open(&OpenConnectionArguments::new(
            "127.0.0.1",
            5672,
            "guest",
            "guest",
        ))
        .await
        .unwrap();
        let ch = conn.open_channel(None).await.unwrap();
        let name = format!("cmp.amqprs.{}", std::process::id());
        let mut args = FieldTable::new();
        args.insert(
            FieldName::try_from("x-queue-type").unwrap(),
            FieldValue::from(String::from("quorum")),
        );
        ch.queue_declare(
            QueueDeclareArguments::durable_client_named(&name)
                .arguments(args)
                .finish(),
        )
        .await
        .unwrap();
        // Publish without confirms here (amqprs confirms come through a callback); wait
        // for the queue to hold them all before timing.
        let mut props = BasicProperties::default();
        props.with_delivery_mode(2);
        for b in bodies(n) {
            ch.basic_publish(props.clone(), b, BasicPublishArguments::new("", &name))
                .await
                .unwrap();
        }
        loop {
            let (_, count, _) = ch
                .queue_declare(QueueDeclareArguments::new(&name).passive(true).finish())
                .await
                .unwrap()
                .unwrap();
            if count as usize >= n {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let cch = conn.open_channel(None).await.unwrap();
        cch.basic_qos(BasicQosArguments::new(0, PREFETCH, false))
            .await
            .unwrap();
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let (_tag, mut rx) = cch
            .basic_consume_rx(BasicConsumeArguments::new(&name, "cmp"))
            .await
            .unwrap();
        let mut got = 0;
        let mut bytes = 0;
        while got < n {
            let m = rx.recv().await.unwrap();
            bytes += m.content.as_ref().map_or(0, |c| c.len());
            got += 1;
            if got % BATCH == 0 || got == n {
                let tag = m.deliver.unwrap().delivery_tag();
                cch.basic_ack(BasicAckArguments::new(tag, true))
                    .await
                    .unwrap();
            }
        }
        let r = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        assert!(bytes > 0);
        ch.queue_delete(QueueDeleteArguments::new(&name))
            .await
            .unwrap();
        r
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args[1].clone();
    let n: usize = args.get(2).map_or(20000, |s| s.parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (wall, cpu) = rt.block_on(async {
        match which.as_str() {
            "lapin" => with_lapin::run("amqp://guest:guest@127.0.0.1:5672/%2f", n).await,
            _ => with_amqprs::run(n).await,
        }
    });
    println!(
        "{which}: {n} deliveries in {wall:.3} s = {:.0} msg/s, our CPU {:.2} us/msg",
        n as f64 / wall,
        cpu * 1e6 / n as f64
    );
}
