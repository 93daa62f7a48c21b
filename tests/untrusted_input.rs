//! What other people's bytes may do, and may not: a scraped label's escape sequence
//! never reaches the terminal, a provider's huge answer is kept to its cap, a message
//! over the envelope limit never enters a queue, and the data directory is the
//! user's alone (never a shared `/tmp` fallback).

mod common;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use common::{idemwatch_bin, run_cli, TempEnv};
use idemwatch::engine::envelope::MAX_RAW_BYTES;
use idemwatch::engine::provider::{ProviderClient, ProviderError, MAX_PROVIDER_BODY};
use idemwatch::engine::queue::{self, Queue, QueueError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A server that answers every request with `status` and `body`.
async fn answering(status: &'static str, body: Vec<u8>) -> SocketAddr {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = [0u8; 8192];
                let _ = s.read(&mut head).await;
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(&body).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_text_strips_escape_sequences_from_scraped_labels() {
    // Raw ESC and BEL are valid inside a label value (only `\`, `"` and newline are
    // escaped): a clear-screen and an OSC 52 clipboard write.
    let evil = "evil\u{1b}[2J\u{1b}]52;c;cm0gLXJmIH4=\u{7}\u{9b}0m";
    let exposition = format!(
        "# TYPE idem_messages_processed_total counter\n\
         idem_messages_processed_total{{consumer=\"{evil}\"}} 3\n"
    );
    let addr = answering("200 OK", exposition.into_bytes()).await;
    let env = TempEnv::new();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(idemwatch_bin())
            .args(["snapshot", "--spacing", "100ms", "--db", &env.db_url()])
            .args(["--target", &format!("t=http://{addr}/metrics")])
            .env("XDG_CONFIG_HOME", env.path("config"))
            .env("IDEMWATCH_LOG_FILE", env.path("log"))
            .output()
            .expect("snapshot")
    })
    .await
    .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    assert!(text.contains("t/evil[2J]52;c;cm0gLXJmIH4=0m"), "{text}");
    let control: Vec<char> = text
        .chars()
        .filter(|c| c.is_control() && *c != '\n')
        .collect();
    assert!(control.is_empty(), "{control:?} in:\n{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_providers_huge_answer_is_kept_to_its_cap() {
    let huge = "é".repeat(1 << 20).into_bytes();
    let rejecting = answering("400 Bad Request", huge.clone()).await;
    let accepting = answering("200 OK", huge).await;
    let base = |a: SocketAddr| format!("http://{a}");
    let client = ProviderClient::new(&base(rejecting), &base(rejecting));
    match client.send_sms("+100", "hi", None).await {
        Err(ProviderError::Rejected { status, body }) => {
            assert_eq!(status, 400);
            assert!(body.len() <= MAX_PROVIDER_BODY, "{} bytes kept", body.len());
            // The two-byte character cut at the cap is dropped, not garbled.
            assert_eq!(body, "é".repeat(MAX_PROVIDER_BODY / 2));
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    let client = ProviderClient::new(&base(accepting), &base(accepting));
    let reply = client.send_sms("+100", "hi", None).await.unwrap();
    assert!(reply.body.len() <= MAX_PROVIDER_BODY);
}

async fn refuses_oversized_bodies(q: &dyn Queue, queue: &str) {
    let small = br#"{"device_id":"d"}"#.to_vec();
    let at_limit = vec![b' '; MAX_RAW_BYTES];
    let over = vec![b' '; MAX_RAW_BYTES + 1];
    let queues = vec![queue.to_string()];
    match q.publish(&queues, &[small.clone(), over]).await {
        Err(QueueError::TooLarge {
            index,
            bytes,
            limit,
        }) => assert_eq!((index, bytes, limit), (1, MAX_RAW_BYTES + 1, MAX_RAW_BYTES)),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(q.depth(queue).await.unwrap().is_empty(), "nothing queued");
    q.publish(&queues, &[small, at_limit]).await.unwrap();
    assert_eq!(q.depth(queue).await.unwrap().ready, 2);
    q.remove_queue(queue).await.unwrap();
}

#[tokio::test]
async fn the_embedded_queue_refuses_a_body_over_the_envelope_limit() {
    let env = TempEnv::new();
    let q = queue::open(&env.queue_url()).await.unwrap();
    refuses_oversized_bodies(q.as_ref(), "t-oversized").await;
}

#[tokio::test]
async fn rabbitmq_refuses_a_body_over_the_envelope_limit() {
    let _turn = common::amqp::exclusive().await;
    let Some(url) = common::amqp::amqp_url().await else {
        return;
    };
    let q = queue::open(&url).await.unwrap();
    refuses_oversized_bodies(q.as_ref(), &common::amqp::namespace("oversized")).await;
    q.close().await;
}

#[test]
fn publish_refuses_a_file_with_a_line_over_the_limit_and_queues_nothing() {
    let env = TempEnv::new();
    let good = r#"{"device_id":"d","seq":1,"event_type":"position","occurred_at":"2026-11-30T04:12:03Z","payload":{"lat":1,"lon":2}}"#;
    let file = env.path("events.jsonl");
    let huge = "x".repeat(MAX_RAW_BYTES + 1);
    std::fs::write(&file, format!("{good}\n\n{huge}\n{good}\n")).unwrap();
    let (code, _, err) = run_cli(&env, &["publish", file.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("line 3 ({} bytes)", MAX_RAW_BYTES + 1)),
        "{err}"
    );
    assert!(err.contains("nothing was published"), "{err}");
    let (code, out, err) = run_cli(&env, &["consume", "--until-idle", "--json"]);
    assert_eq!(code, 0, "{err}");
    let counts: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(counts["processed"], 0, "{counts}");
    assert_eq!(counts["dead_lettered"], 0, "{counts}");
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn the_data_directory_and_its_files_are_the_users_alone() {
    let env = TempEnv::new();
    let data = env.path("data");
    let run = |args: &[&str]| {
        Command::new(idemwatch_bin())
            .args(args)
            .env("XDG_DATA_HOME", &data)
            .env("HOME", env.dir.path())
            .env_remove("IDEMWATCH_DB")
            .env_remove("IDEMWATCH_QUEUE")
            .env_remove("IDEMWATCH_LOG_FILE")
            .output()
            .expect("run idemwatch")
    };
    let file = env.path("one.jsonl");
    std::fs::write(&file, "not json\n").unwrap();
    let out = run(&["publish", file.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = data.join("idemwatch");
    assert_eq!(mode(&dir), 0o700);
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        files.iter().any(|f| f.ends_with("idemwatch.db"))
            && files.iter().any(|f| f.ends_with("idemwatch.log")),
        "{files:?}"
    );
    for f in &files {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    // A directory left open by an older version is closed again.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(run(&["publish", file.to_str().unwrap()]).status.success());
    assert_eq!(mode(&dir), 0o700);
}

#[test]
fn without_a_home_it_refuses_to_start_rather_than_use_tmp() {
    let env = TempEnv::new();
    let out = Command::new(idemwatch_bin())
        .args(["consume", "--until-idle", "--db", &env.db_url()])
        .env_remove("HOME")
        .env_remove("XDG_DATA_HOME")
        .env("IDEMWATCH_LOG_FILE", env.path("log"))
        .output()
        .expect("run idemwatch");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("no data directory"), "{err}");
    assert!(err.contains("$HOME"), "{err}");
}
