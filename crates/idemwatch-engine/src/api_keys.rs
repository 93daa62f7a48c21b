//! The write API's credentials: `serve --api-keys FILE`, one `NAME TOKEN` per line.
//!
//! A caller sends `Authorization: Bearer TOKEN` or `X-Api-Key: TOKEN`; the token
//! found in the file makes the caller the principal `NAME`, and its idempotency
//! keys live in that principal's scope. Scoping by the name (not by a hash of the
//! token) keeps a caller's stored responses across a token rotation, and never
//! turns an unchecked header into a scope.
//!
//! Tokens are kept only as SHA-256 digests and a presented token is hashed and
//! compared with every digest in constant time (`subtle`), so neither the time of a
//! refusal nor a memory dump gives a token away. The file is read again on SIGHUP
//! and when its modification time or size changes (see [`ApiKeys::watch`]); a file
//! that no longer parses keeps the keys in force and logs why.
//!
//! File format: `#` starts a comment line, blank lines are skipped; a name is 1 to
//! 64 of `A-Z a-z 0-9 . _ @ -`; a token is one word of at least 16 visible ASCII
//! characters (shorter ones are guessable). A repeated name or token is an error.
//! Errors name the file and line, never the token.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::watch;

/// Shortest accepted token.
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest accepted principal name.
pub const MAX_NAME_LEN: usize = 64;

/// Why a keys file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read the API keys file {path}: {cause}")]
    Read { path: String, cause: String },
    #[error("{path}:{line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path}: no keys (one `NAME TOKEN` per line)")]
    Empty { path: String },
}

/// One parsed file: principal names with their tokens' digests.
#[derive(Debug, Default)]
struct KeySet {
    keys: Vec<(String, [u8; 32])>,
}

impl KeySet {
    fn parse(path: &str, text: &str) -> Result<KeySet, KeysError> {
        let mut keys: Vec<(String, [u8; 32])> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let error = |message: String| KeysError::Line {
                path: path.to_string(),
                line: i + 1,
                message,
            };
            let mut words = line.split_ascii_whitespace();
            let (Some(name), Some(token), None) = (words.next(), words.next(), words.next()) else {
                return Err(error("expected `NAME TOKEN`".into()));
            };
            let name_ok = name.len() <= MAX_NAME_LEN
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'-'));
            if !name_ok {
                return Err(error(format!(
                    "name {name:?}: 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 . _ @ -"
                )));
            }
            if token.len() < MIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(error(format!(
                    "the token of {name} must be at least {MIN_TOKEN_LEN} visible ASCII characters"
                )));
            }
            let digest = digest(token);
            if keys.iter().any(|(n, _)| n == name) {
                return Err(error(format!("{name} is named twice")));
            }
            if keys.iter().any(|(_, d)| bool::from(d.ct_eq(&digest))) {
                return Err(error(format!("the token of {name} is also another name's")));
            }
            keys.push((name.to_string(), digest));
        }
        if keys.is_empty() {
            return Err(KeysError::Empty {
                path: path.to_string(),
            });
        }
        Ok(KeySet { keys })
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// What identifies a version of the file on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: meta.modified().ok(),
        len: meta.len(),
    })
}

/// The keys in force, reloadable while the server runs.
#[derive(Debug)]
pub struct ApiKeys {
    path: PathBuf,
    current: RwLock<Arc<KeySet>>,
    loaded: Mutex<Option<Stamp>>,
}

impl ApiKeys {
    /// Read `path`; an unreadable or malformed file is an error (the server should
    /// not start with credentials it cannot check).
    pub fn load(path: &Path) -> Result<ApiKeys, KeysError> {
        let keys = ApiKeys {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(KeySet::default())),
            loaded: Mutex::new(None),
        };
        keys.reload()?;
        Ok(keys)
    }

    /// Keys from text, for tests and embedders with their own store of secrets.
    pub fn from_text(text: &str) -> Result<ApiKeys, KeysError> {
        let set = KeySet::parse("(inline)", text)?;
        Ok(ApiKeys {
            path: PathBuf::new(),
            current: RwLock::new(Arc::new(set)),
            loaded: Mutex::new(None),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many principals are in force.
    pub fn len(&self) -> usize {
        self.set().keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set(&self) -> Arc<KeySet> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Read the file again; on success the new keys are in force for the next
    /// request, on failure the old ones stay.
    pub fn reload(&self) -> Result<usize, KeysError> {
        let path_text = self.path.display().to_string();
        let before = stamp(&self.path);
        let text = std::fs::read_to_string(&self.path).map_err(|e| KeysError::Read {
            path: path_text.clone(),
            cause: e.to_string(),
        })?;
        let set = KeySet::parse(&path_text, &text);
        *self.loaded.lock().unwrap_or_else(PoisonError::into_inner) = before;
        let set = set?;
        let n = set.keys.len();
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(set);
        Ok(n)
    }

    /// Reload when the file's modification time or size changed since the last
    /// read. `None` when nothing changed.
    pub fn reload_if_changed(&self) -> Option<Result<usize, KeysError>> {
        let now = stamp(&self.path);
        let last = *self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        (now != last).then(|| self.reload())
    }

    /// The principal whose token this is. Every key is compared (in constant time),
    /// whichever matches.
    pub fn principal(&self, token: &str) -> Option<String> {
        let presented = digest(token);
        let set = self.set();
        let mut found = None;
        for (name, d) in &set.keys {
            if bool::from(d.ct_eq(&presented)) {
                found = Some(name);
            }
        }
        found.cloned()
    }

    /// Reload on SIGHUP and whenever the file changes (checked every `poll`), until
    /// `stop` turns true. Outcomes go to the log: a refused file keeps the old keys.
    pub async fn watch(self: Arc<Self>, poll: Duration, mut stop: watch::Receiver<bool>) {
        #[cfg(unix)]
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        loop {
            #[cfg(unix)]
            let hangup = async {
                match hup.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let hangup = std::future::pending::<()>();
            let outcome = tokio::select! {
                () = hangup => Some(self.reload()),
                () = tokio::time::sleep(poll) => self.reload_if_changed(),
                _ = stop.changed() => return,
            };
            match outcome {
                Some(Ok(n)) => {
                    tracing::info!(path = %self.path.display(), principals = n, "API keys reloaded")
                }
                Some(Err(e)) => {
                    tracing::error!(error = %e, "API keys file refused: the previous keys stay in force")
                }
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: &str = "tok-alice-0123456789";
    const BOB: &str = "tok-bob-abcdefghijkl";

    #[test]
    fn a_token_names_its_principal() {
        let keys = ApiKeys::from_text(&format!("# fleet apps\nalice {ALICE}\n\n  bob\t{BOB}  \n"))
            .unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.principal(ALICE).as_deref(), Some("alice"));
        assert_eq!(keys.principal(BOB).as_deref(), Some("bob"));
        assert_eq!(keys.principal("tok-alice-012345678"), None);
        assert_eq!(keys.principal(""), None);
    }

    #[test]
    fn malformed_files_are_refused_with_the_line_and_without_the_token() {
        for (text, line) in [
            ("alice\n", 1),
            (&format!("alice {ALICE} extra\n") as &str, 1),
            ("alice short\n", 1),
            (&format!("# c\nal ice {ALICE}\n"), 2),
            (&format!("alice {ALICE}\nalice {BOB}\n"), 2),
            (&format!("alice {ALICE}\nbob {ALICE}\n"), 2),
            (&format!("{} {ALICE}\n", "n".repeat(65)), 1),
        ] {
            match ApiKeys::from_text(text) {
                Err(KeysError::Line {
                    line: l, message, ..
                }) => {
                    assert_eq!(l, line, "{text}");
                    assert!(
                        !message.contains(ALICE) && !message.contains(BOB),
                        "{message}"
                    );
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
        assert!(matches!(
            ApiKeys::from_text("# nothing\n"),
            Err(KeysError::Empty { .. })
        ));
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, format!("alice {ALICE}\n")).unwrap();
        let keys = ApiKeys::load(&path).unwrap();
        assert!(keys.reload_if_changed().is_none());
        std::fs::write(&path, format!("alice {ALICE}\nbob {BOB}\n")).unwrap();
        assert_eq!(keys.reload_if_changed(), Some(Ok(2)));
        assert_eq!(keys.principal(BOB).as_deref(), Some("bob"));
        std::fs::write(&path, "bob\n").unwrap();
        assert!(matches!(keys.reload_if_changed(), Some(Err(_))));
        assert_eq!(keys.principal(BOB).as_deref(), Some("bob"));
        // The broken version is not retried until the file changes again.
        assert!(keys.reload_if_changed().is_none());
        std::fs::write(&path, format!("carol {ALICE}\n")).unwrap();
        assert_eq!(keys.reload_if_changed(), Some(Ok(1)));
        assert_eq!(keys.principal(ALICE).as_deref(), Some("carol"));
        assert_eq!(keys.principal(BOB), None);
    }
}
