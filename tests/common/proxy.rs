//! A TCP proxy a test can cut: the way to a database server goes down for this
//! test's connections only, without touching the shared server.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct CuttableProxy {
    addr: SocketAddr,
    down: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl CuttableProxy {
    /// Listen on a free local port and forward every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> CuttableProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let down = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (down, links) = (down.clone(), links.clone());
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if down.load(Ordering::SeqCst) {
                        // Accepted and hung up at once: the client sees a reset, as
                        // with a server gone away, without waiting for a timeout.
                        drop(client);
                        continue;
                    }
                    let link = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    links.lock().unwrap().push(link);
                }
            })
        };
        CuttableProxy {
            addr,
            down,
            links,
            accept,
        }
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url_through(&self, url: &str) -> String {
        let mut u = url::Url::parse(url).expect("valid URL");
        u.set_host(Some("127.0.0.1")).unwrap();
        u.set_port(Some(self.addr.port())).unwrap();
        u.to_string()
    }

    /// Cut every open connection and hang up on new ones.
    pub fn cut(&self) {
        self.down.store(true, Ordering::SeqCst);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Let connections through again.
    pub fn restore(&self) {
        self.down.store(false, Ordering::SeqCst);
    }
}

impl Drop for CuttableProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
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
