//! A TCP fault proxy the tests own, in front of any shared service (PostgreSQL,
//! MariaDB, RabbitMQ, NATS, Redis): the way to the server goes wrong for this test's
//! connections only, without touching the server. What toxiproxy does, in a few
//! dozen lines of tokio and no other binary.
//!
//! The faults are the gray ones production has (issue 39):
//!
//! - [`Fault::Freeze`]: the open connections stop moving, their sockets stay open
//!   (a NAT or load balancer that forgot its sessions, a failover that left them
//!   hanging); new connections pass.
//! - [`Fault::BlackHole`]: the same, and new connections are accepted but never
//!   forwarded (a partition: nothing answers, nothing refuses).
//! - [`Fault::Reset`]: every open connection is reset (RST), and new ones are reset
//!   as they arrive (a firewall rejecting, a server restarting).
//!
//! [`FaultProxy::heal`] puts the way back ([`Fault::Pass`]): frozen connections move
//! again with what they held, the black-holed ones are closed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the way to the server does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Freeze,
    BlackHole,
    Reset,
}

impl Fault {
    /// The three faults, for a test per fault.
    pub const ALL: [Fault; 3] = [Fault::Freeze, Fault::BlackHole, Fault::Reset];

    pub fn name(self) -> &'static str {
        match self {
            Fault::Pass => "pass",
            Fault::Freeze => "freeze",
            Fault::BlackHole => "black-hole",
            Fault::Reset => "reset",
        }
    }
}

/// The way now: the fault, and how many injections came before it (a link knows
/// the count it was born under, so a freeze holds only the links it found open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Way {
    fault: Fault,
    injection: u64,
}

impl Way {
    /// Whether bytes stop moving on a link born under injection `born`.
    fn holds(self, born: u64) -> bool {
        match self.fault {
            Fault::Freeze => born < self.injection,
            Fault::BlackHole => true,
            Fault::Pass | Fault::Reset => false,
        }
    }
}

pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Way>,
    /// Connections forwarded to the server and still open.
    open: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Listen on a free local port and forward every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        FaultProxy::start_on(0, upstream).await
    }

    /// [`FaultProxy::start`] on 127.0.0.1:`port` (0: a free one).
    pub async fn start_on(port: u16, upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, watching) = watch::channel(Way {
            fault: Fault::Pass,
            injection: 0,
        });
        let open = Arc::new(AtomicUsize::new(0));
        let accept = {
            let open = open.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let _ = client.set_nodelay(true);
                    tokio::spawn(link(client, upstream, watching.clone(), open.clone()));
                }
            })
        };
        FaultProxy {
            addr,
            mode,
            open,
            accept,
        }
    }

    /// In front of the server a URL names (`default_port` when it names none).
    pub async fn in_front_of(url: &str, default_port: u16) -> FaultProxy {
        FaultProxy::start(server_addr(url, default_port).await).await
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url_through(&self, url: &str) -> String {
        let mut u = url::Url::parse(url).expect("valid URL");
        u.set_host(Some("127.0.0.1")).unwrap();
        u.set_port(Some(self.addr.port())).unwrap();
        u.to_string()
    }

    /// Start `fault` (or end one with [`Fault::Pass`]).
    pub fn inject(&self, fault: Fault) {
        self.mode.send_modify(|way| {
            way.fault = fault;
            way.injection += 1;
        });
    }

    /// Let connections through again.
    pub fn heal(&self) {
        self.inject(Fault::Pass);
    }

    /// Connections forwarded to the server and still open.
    pub fn open_links(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Reset every open connection and hang up on new ones (an outage).
    pub fn cut(&self) {
        self.inject(Fault::Reset);
    }

    /// Let connections through again.
    pub fn restore(&self) {
        self.heal();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Every link ends: a reset is what a vanished proxy looks like.
        self.inject(Fault::Reset);
    }
}

/// One client connection, for as long as it lasts.
async fn link(
    client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<Way>,
    open: Arc<AtomicUsize>,
) {
    let way = *mode.borrow_and_update();
    let born = way.injection;
    match way.fault {
        Fault::Reset => return reset(&client),
        Fault::BlackHole => {
            // Accepted, never forwarded; closed once the way heals (or resets).
            let _ = mode.wait_for(|w| w.fault != Fault::BlackHole).await;
            return reset(&client);
        }
        Fault::Pass | Fault::Freeze => {}
    }
    let server =
        match tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(upstream)).await {
            Ok(Ok(s)) => s,
            _ => return reset(&client),
        };
    let _ = server.set_nodelay(true);
    open.fetch_add(1, Ordering::SeqCst);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, mode.clone(), born);
    let down = pump(server_read, client_write, mode, born);
    let ended = tokio::select! {
        (r, w) = up => (r, w),
        (r, w) = down => (r, w),
    };
    open.fetch_sub(1, Ordering::SeqCst);
    drop(ended);
}

/// Copy `from` → `to` while the way passes; hold (read nothing, keep what was read)
/// while it holds a link born under `born`; end with a reset of both sockets when it
/// resets. Returns the halves it owned so that the caller drops them (closing the
/// connection) last.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Way>,
    born: u64,
) -> (OwnedReadHalf, OwnedWriteHalf) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut read: Option<usize> = None;
    loop {
        let way = *mode.borrow_and_update();
        if way.fault == Fault::Reset {
            reset(from.as_ref());
            reset(to.as_ref());
            return (from, to);
        }
        if way.holds(born) {
            // Frozen: nothing read, what was read before is held.
            if mode.changed().await.is_err() {
                return (from, to);
            }
            continue;
        }
        if let Some(n) = read.take() {
            if to.write_all(&buf[..n]).await.is_err() {
                return (from, to);
            }
            continue;
        }
        tokio::select! {
            got = from.read(&mut buf) => match got {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return (from, to);
                }
                // Written at the top of the loop, unless the way froze meanwhile.
                Ok(n) => read = Some(n),
            },
            _ = mode.changed() => {}
        }
    }
}

/// Close with RST rather than FIN when the socket is dropped. (tokio deprecates
/// `SO_LINGER` because a positive linger blocks the thread on drop; a zero one never
/// does: the kernel discards what is unsent and resets at once.)
#[allow(deprecated)]
fn reset(socket: &TcpStream) {
    let _ = socket.set_linger(Some(Duration::ZERO));
}

/// The socket address of a server URL (`host:port`, default port given).
pub async fn server_addr(url: &str, default_port: u16) -> SocketAddr {
    let u = url::Url::parse(url).expect("valid URL");
    let host = u.host_str().unwrap_or("127.0.0.1").to_string();
    let port = u.port().unwrap_or(default_port);
    let mut found = tokio::net::lookup_host((host.as_str(), port))
        .await
        .expect("resolve server");
    found.next().expect("an address")
}
