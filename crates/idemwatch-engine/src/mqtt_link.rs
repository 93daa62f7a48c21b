//! How the MQTT ingress reaches a fleet broker (issue 44): `mqtt[s]://USER@HOST:PORT`,
//! a password that never comes from the command line, TLS with a CA file and a client
//! certificate, and each way a connection fails named for the operator.
//!
//! - The password comes from `IDEMWATCH_MQTT_PASSWORD` or a file (the CLI reads them,
//!   [`Password`] holds it): a command-line value would show in `ps`, shell history and
//!   systemd's journal. A URL that carries one is refused, without echoing it. It is
//!   never formatted: [`Password`]'s `Debug` prints stars, and nothing else reads it
//!   but the MQTT CONNECT.
//! - TLS is rustls (rumqttc's `use-rustls-no-provider`) on ring, the provider reqwest
//!   and async-nats already link. The roots are `--ca-file`'s certificates, or the
//!   system's (`rustls-native-certs`) without one; a client certificate and key for
//!   brokers that authenticate services by certificate (AWS IoT, EMQX, Mosquitto's
//!   `require_certificate`).
//! - A refused login or a certificate that fails a check will fail the same way on
//!   every retry: [`failure`] calls them fatal, and `ingest mqtt` exits 3 naming the user
//!   (never the password) or the check. A broker that is away (refused, reset, timed
//!   out) is an outage: retried with backoff, never fatal.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rumqttc::{ConnectReturnCode, ConnectionError, MqttOptions, TlsConfiguration, Transport};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{AlertDescription, CertificateError, RootCertStore};

/// Default port of `mqtt://`.
pub const MQTT_PORT: u16 = 1883;
/// Default port of `mqtts://` (IANA's "secure-mqtt").
pub const MQTTS_PORT: u16 = 8883;

/// What went wrong with an ingress, the `kind` label of `idem_ingress_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IngressErrorKind {
    /// The broker could not be reached or the connection broke (an outage).
    Connect,
    /// The broker refused the login (user name, password, or not authorized).
    LoginRefused,
    /// The TLS handshake failed (a certificate check, or no TLS on the other side).
    Tls,
    /// The broker broke the MQTT protocol, or refused a subscription.
    Protocol,
    /// The engine's queue refused a batch (retried; nothing acked meanwhile).
    Queue,
    /// The database refused a dead letter or the subscription record (retried).
    Store,
}

impl IngressErrorKind {
    pub const ALL: [IngressErrorKind; 6] = [
        IngressErrorKind::Connect,
        IngressErrorKind::LoginRefused,
        IngressErrorKind::Tls,
        IngressErrorKind::Protocol,
        IngressErrorKind::Queue,
        IngressErrorKind::Store,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            IngressErrorKind::Connect => "connect",
            IngressErrorKind::LoginRefused => "login_refused",
            IngressErrorKind::Tls => "tls",
            IngressErrorKind::Protocol => "protocol",
            IngressErrorKind::Queue => "queue",
            IngressErrorKind::Store => "store",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("bad broker URL {0}: {1}")]
    BadUrl(String, String),
    #[error("{0}")]
    Password(String),
    #[error("TLS: {0}")]
    TlsSetup(String),
}

/// A broker password. Formatting it prints stars: it cannot end up in a log line, an
/// error or `--json` by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(***)")
    }
}

impl Password {
    pub fn new(secret: String) -> Password {
        Password(secret)
    }

    /// The first line of `path` (a trailing newline is not part of a password). The
    /// error names the file, never what it holds.
    pub fn from_file(path: &Path) -> Result<Password, LinkError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            LinkError::Password(format!(
                "cannot read --password-file {}: {e}",
                path.display()
            ))
        })?;
        let line = text.lines().next().unwrap_or("");
        if line.is_empty() {
            return Err(LinkError::Password(format!(
                "--password-file {} is empty",
                path.display()
            )));
        }
        Ok(Password(line.to_string()))
    }
}

/// A broker as `--broker` names it: `mqtt://[USER@]HOST[:PORT]` or `mqtts://…`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    pub tls: bool,
    pub host: String,
    pub port: u16,
    /// Percent-decoded.
    pub user: Option<String>,
}

impl BrokerUrl {
    pub fn parse(url: &str) -> Result<BrokerUrl, LinkError> {
        let redacted = idemwatch_base::redact::redact_url(url);
        let bad = |why: &str| LinkError::BadUrl(redacted.clone(), why.to_string());
        let u = url::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
        let tls = match u.scheme() {
            "mqtt" | "tcp" => false,
            "mqtts" | "ssl" => true,
            _ => return Err(bad("expected mqtt://[USER@]HOST:PORT or mqtts://…")),
        };
        if u.password().is_some() {
            return Err(bad(
                "a password in the URL would show in the process list: give it in IDEMWATCH_MQTT_PASSWORD or --password-file",
            ));
        }
        let host = u.host_str().ok_or_else(|| bad("no host"))?;
        // `[::1]` is how a URL writes an IPv6 address; a socket and a TLS server
        // name want it bare.
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let user = match u.username() {
            "" => None,
            raw => Some(
                percent_encoding::percent_decode_str(raw)
                    .decode_utf8()
                    .map_err(|_| bad("the user name is not UTF-8"))?
                    .into_owned(),
            ),
        };
        Ok(BrokerUrl {
            tls,
            port: u.port().unwrap_or(if tls { MQTTS_PORT } else { MQTT_PORT }),
            host,
            user,
        })
    }

    /// `HOST:PORT`: where, without who.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The URL as logs and errors show it: scheme, user, host and port.
    pub fn shown(&self) -> String {
        let scheme = if self.tls { "mqtts" } else { "mqtt" };
        match &self.user {
            Some(u) => format!("{scheme}://{u}@{}", self.address()),
            None => format!("{scheme}://{}", self.address()),
        }
    }
}

/// The certificate files of a TLS link.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificates to trust instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain and key of this client, for brokers that ask for one.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    pub fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }
}

/// Everything needed to connect: where, as whom, over what.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    pub url: BrokerUrl,
    pub password: Option<Password>,
    pub tls: TlsFiles,
}

impl LinkConfig {
    /// A link to `url` without a password or certificate files.
    pub fn plain(url: &str) -> Result<LinkConfig, LinkError> {
        LinkConfig::new(url, None, TlsFiles::default())
    }

    /// Check the parts against each other (the files are read by [`LinkConfig::options`]).
    pub fn new(
        url: &str,
        password: Option<Password>,
        tls: TlsFiles,
    ) -> Result<LinkConfig, LinkError> {
        let url = BrokerUrl::parse(url)?;
        if password.is_some() && url.user.is_none() {
            return Err(LinkError::Password(format!(
                "a password needs a user name (MQTT sends none without one): --broker {}://USER@{}",
                if url.tls { "mqtts" } else { "mqtt" },
                url.address()
            )));
        }
        if !url.tls && !tls.is_empty() {
            return Err(LinkError::TlsSetup(
                "--ca-file, --client-cert and --client-key need an mqtts:// broker".into(),
            ));
        }
        if tls.client_cert.is_some() != tls.client_key.is_some() {
            return Err(LinkError::TlsSetup(
                "--client-cert and --client-key go together".into(),
            ));
        }
        Ok(LinkConfig { url, password, tls })
    }

    /// The client's options for `client_id`: address, login, and TLS with the
    /// certificates read now (a file that cannot be read fails here, before any
    /// connection).
    pub fn options(&self, client_id: &str) -> Result<MqttOptions, LinkError> {
        let mut options = MqttOptions::new(client_id, self.url.host.clone(), self.url.port);
        if let Some(user) = &self.url.user {
            let password = self
                .password
                .as_ref()
                .map(|p| p.0.clone())
                .unwrap_or_default();
            options.set_credentials(user.clone(), password);
        }
        if self.url.tls {
            let config = self.tls_config()?;
            options.set_transport(Transport::Tls(TlsConfiguration::Rustls(Arc::new(config))));
        }
        Ok(options)
    }

    fn tls_config(&self) -> Result<rustls::ClientConfig, LinkError> {
        let setup = |e: String| LinkError::TlsSetup(e);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| setup(e.to_string()))?;
        let mut roots = RootCertStore::empty();
        match &self.tls.ca_file {
            Some(path) => {
                for cert in read_certs(path, "--ca-file")? {
                    roots
                        .add(cert)
                        .map_err(|e| setup(format!("--ca-file {}: {e}", path.display())))?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(setup(format!(
                        "no trusted root certificates on this system ({} errors reading them): give --ca-file",
                        found.errors.len()
                    )));
                }
            }
        }
        let builder = builder.with_root_certificates(roots);
        match (&self.tls.client_cert, &self.tls.client_key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert, "--client-cert")?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    setup(format!(
                        "--client-key {}: no private key read ({e})",
                        key.display()
                    ))
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| setup(format!("--client-cert/--client-key: {e}")))
            }
            _ => Ok(builder.with_no_client_auth()),
        }
    }
}

/// Every PEM certificate of `path`; none is an error.
fn read_certs(path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>, LinkError> {
    let bad = |e: String| LinkError::TlsSetup(format!("{flag} {}: {e}", path.display()));
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// A failed connection, named: its kind, whether trying again can help, and what to
/// tell the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkFailure {
    pub kind: IngressErrorKind,
    /// The same attempt will fail the same way: stop and say so.
    pub fatal: bool,
    pub message: String,
}

/// Name what `e` says about the link to `url`.
pub fn failure(e: &ConnectionError, url: &BrokerUrl) -> LinkFailure {
    let at = url.shown();
    let retry = |kind, message| LinkFailure {
        kind,
        fatal: false,
        message,
    };
    let fatal = |kind, message| LinkFailure {
        kind,
        fatal: true,
        message,
    };
    match e {
        ConnectionError::ConnectionRefused(code) => {
            let who = match &url.user {
                Some(u) => format!("user {u}"),
                None => "an anonymous client (no user in --broker)".to_string(),
            };
            match code {
                ConnectReturnCode::BadUserNamePassword => fatal(
                    IngressErrorKind::LoginRefused,
                    format!("{at} refused the login of {who}: bad user name or password"),
                ),
                ConnectReturnCode::NotAuthorized => fatal(
                    IngressErrorKind::LoginRefused,
                    format!("{at} refused the login of {who}: not authorized"),
                ),
                ConnectReturnCode::BadClientId => fatal(
                    IngressErrorKind::LoginRefused,
                    format!("{at} refused the client id of {who}"),
                ),
                ConnectReturnCode::RefusedProtocolVersion => fatal(
                    IngressErrorKind::Protocol,
                    format!("{at} does not speak MQTT 3.1.1"),
                ),
                ConnectReturnCode::ServiceUnavailable | ConnectReturnCode::Success => retry(
                    IngressErrorKind::Connect,
                    format!("{at} is not available ({code:?})"),
                ),
            }
        }
        ConnectionError::Tls(tls) => tls_failure(tls, url),
        ConnectionError::Io(io) => match rustls_error(io) {
            Some(r) => tls_check(r, url),
            None => retry(IngressErrorKind::Connect, format!("{at}: {io}")),
        },
        ConnectionError::NetworkTimeout | ConnectionError::FlushTimeout => retry(
            IngressErrorKind::Connect,
            format!("{at}: no answer in time"),
        ),
        ConnectionError::MqttState(
            rumqttc::StateError::Io(io)
            | rumqttc::StateError::Deserialization(rumqttc::Error::Io(io)),
        ) => match rustls_error(io) {
            // A broker that refuses our client certificate says so once the handshake
            // is over, in the first read (TLS 1.3).
            Some(r) => tls_check(r, url),
            None => retry(IngressErrorKind::Connect, format!("{at}: {io}")),
        },
        ConnectionError::MqttState(rumqttc::StateError::ConnectionAborted) => retry(
            IngressErrorKind::Connect,
            format!("{at}: the broker closed the connection"),
        ),
        other => retry(IngressErrorKind::Protocol, format!("{at}: {other}")),
    }
}

fn tls_failure(e: &rumqttc::TlsError, url: &BrokerUrl) -> LinkFailure {
    match e {
        rumqttc::TlsError::TLS(r) => tls_check(r, url),
        rumqttc::TlsError::Io(io) => match rustls_error(io) {
            Some(r) => tls_check(r, url),
            // A socket that broke during the handshake is an outage like any other.
            None => LinkFailure {
                kind: IngressErrorKind::Connect,
                fatal: false,
                message: format!("{}: {io}", url.shown()),
            },
        },
        rumqttc::TlsError::DNSName(_) => LinkFailure {
            kind: IngressErrorKind::Tls,
            fatal: true,
            message: format!(
                "{}: {} cannot be checked against a certificate (not a DNS name or IP address)",
                url.shown(),
                url.host
            ),
        },
        other => LinkFailure {
            kind: IngressErrorKind::Tls,
            fatal: true,
            message: format!("{}: TLS: {other}", url.shown()),
        },
    }
}

/// The rustls error inside an I/O error (tokio-rustls wraps the handshake's).
fn rustls_error(io: &std::io::Error) -> Option<&rustls::Error> {
    io.get_ref()?.downcast_ref::<rustls::Error>()
}

/// Which check of the TLS handshake failed, in the operator's words.
fn tls_check(e: &rustls::Error, url: &BrokerUrl) -> LinkFailure {
    use rustls::Error as E;
    let at = url.shown();
    let check = match e {
        E::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => {
                "the broker's certificate is not signed by a trusted CA (check --ca-file)".to_string()
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!("the broker's certificate is not valid for the name {}", url.host)
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the broker's certificate has expired".to_string()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the broker's certificate is not valid yet (or this clock is behind)".to_string()
            }
            CertificateError::Revoked => "the broker's certificate is revoked".to_string(),
            CertificateError::BadSignature => {
                "the broker's certificate has a bad signature".to_string()
            }
            other => format!("the broker's certificate failed a check: {other:?}"),
        },
        E::AlertReceived(alert) => match alert {
            AlertDescription::CertificateRequired | AlertDescription::HandshakeFailure => format!(
                "the broker wants a client certificate it accepts (--client-cert/--client-key; it answered {alert:?})"
            ),
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::AccessDenied
            | AlertDescription::DecryptError => {
                format!("the broker refused our client certificate ({alert:?})")
            }
            other => format!("the broker ended the handshake ({other:?})"),
        },
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the broker did not answer in TLS (is the port a TLS listener?)".to_string()
        }
        other => format!("handshake failed: {other}"),
    };
    LinkFailure {
        kind: IngressErrorKind::Tls,
        fatal: true,
        message: format!("{at}: TLS: {check}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_url_names_user_host_and_port_and_never_takes_a_password() {
        let u = BrokerUrl::parse("mqtts://ingest%40fleet@broker.example:18883").unwrap();
        assert_eq!(
            (u.tls, u.host.as_str(), u.port, u.user.as_deref()),
            (true, "broker.example", 18883, Some("ingest@fleet"))
        );
        assert_eq!(u.shown(), "mqtts://ingest@fleet@broker.example:18883");
        assert_eq!(BrokerUrl::parse("mqtt://h").unwrap().port, MQTT_PORT);
        assert_eq!(BrokerUrl::parse("mqtts://h").unwrap().port, MQTTS_PORT);
        let e = BrokerUrl::parse("mqtt://u:hunter2@h:1883")
            .unwrap_err()
            .to_string();
        assert!(e.contains("IDEMWATCH_MQTT_PASSWORD"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        assert!(BrokerUrl::parse("http://h").is_err());
    }

    #[test]
    fn a_password_never_formats() {
        let p = Password::new("hunter2".into());
        assert_eq!(format!("{p:?}"), "Password(***)");
        let link = LinkConfig::new("mqtt://u@h", Some(p), TlsFiles::default()).unwrap();
        assert!(!format!("{link:?}").contains("hunter2"));
    }

    #[test]
    fn parts_that_cannot_go_together_are_refused_before_connecting() {
        let p = || Some(Password::new("x".into()));
        assert!(LinkConfig::new("mqtt://h", p(), TlsFiles::default()).is_err());
        let ca = TlsFiles {
            ca_file: Some("ca.pem".into()),
            ..TlsFiles::default()
        };
        assert!(LinkConfig::new("mqtt://h", None, ca.clone()).is_err());
        assert!(LinkConfig::new("mqtts://h", None, ca).is_ok());
        let half = TlsFiles {
            client_cert: Some("c.pem".into()),
            ..TlsFiles::default()
        };
        assert!(LinkConfig::new("mqtts://h", None, half).is_err());
    }

    #[test]
    fn a_refused_login_is_fatal_and_names_the_user() {
        let url = BrokerUrl::parse("mqtt://fleet-ingest@h:1883").unwrap();
        let f = failure(
            &ConnectionError::ConnectionRefused(ConnectReturnCode::NotAuthorized),
            &url,
        );
        assert!(f.fatal);
        assert_eq!(f.kind, IngressErrorKind::LoginRefused);
        assert!(f.message.contains("user fleet-ingest"), "{}", f.message);
        let away = failure(
            &ConnectionError::Io(std::io::ErrorKind::ConnectionRefused.into()),
            &url,
        );
        assert!(!away.fatal);
        assert_eq!(away.kind, IngressErrorKind::Connect);
    }
}
