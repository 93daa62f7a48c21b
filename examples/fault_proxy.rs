//! The tests' TCP fault proxy (`tests/common/proxy.rs`) as a process, for the long
//! fault runs of `scripts/faults.sh`: one proxy, written once, that the tests and
//! the scripts share.
//!
//! ```text
//! cargo run --example fault_proxy -- LISTEN_PORT UPSTREAM_HOST:PORT
//! ```
//!
//! Prints `listening 127.0.0.1:PORT`, then reads one command a line on stdin: `pass`,
//! `freeze`, `black-hole`, `reset`; each is answered `ok FAULT`. Ends at EOF.

#[allow(dead_code)]
#[path = "../tests/common/proxy.rs"]
mod proxy;

use std::net::SocketAddr;

use proxy::{Fault, FaultProxy};
use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(listen), Some(upstream)) = (args.first(), args.get(1)) else {
        eprintln!("usage: fault_proxy LISTEN_PORT UPSTREAM_HOST:PORT");
        std::process::exit(2);
    };
    let port: u16 = listen.parse().unwrap_or_else(|_| {
        eprintln!("not a port: {listen}");
        std::process::exit(2)
    });
    let upstream: SocketAddr = match tokio::net::lookup_host(upstream.as_str()).await {
        Ok(mut found) => found.next().unwrap_or_else(|| {
            eprintln!("no address for {upstream}");
            std::process::exit(2)
        }),
        Err(e) => {
            eprintln!("cannot resolve {upstream}: {e}");
            std::process::exit(2)
        }
    };
    let proxy = FaultProxy::start_on(port, upstream).await;
    println!("listening 127.0.0.1:{port}");
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let fault = match line.trim() {
            "pass" => Fault::Pass,
            "freeze" => Fault::Freeze,
            "black-hole" => Fault::BlackHole,
            "reset" => Fault::Reset,
            "" => continue,
            other => {
                println!("unknown {other}");
                continue;
            }
        };
        proxy.inject(fault);
        println!("ok {}", fault.name());
    }
}
