//! `NAME_FILE`: a connection URL read from a file into `NAME` before the arguments
//! are parsed, the convention of Docker's and Kubernetes' secrets, and how a systemd
//! unit hands a credential over (`LoadCredential=db-url:…` then
//! `Environment=IDEMWATCH_DB_FILE=%d/db-url`; `docs/DEPLOY.md`).
//!
//! Every flag that reads `NAME` (`--db`, `--queue`, `--sms-url`, `--webhook-url`,
//! `--seen-set`) then takes it, whatever the subcommand: a URL with a password is
//! never on a command line (`ps` shows those to every user) nor written in a unit
//! file. The file is read by this process; its content is never printed, errors name
//! the file only.

use std::io::Read as _;
use std::path::Path;

use idemwatch::engine::{ENV_DB, ENV_QUEUE, ENV_SMS_URL, ENV_WEBHOOK_URL};

use super::CliError;

/// `--seen-set`'s environment variable (a Redis URL may carry a password).
pub const ENV_SEEN_SET: &str = "IDEMWATCH_SEEN_SET";

/// The variables that may come from a file named by `NAME_FILE`.
pub const FROM_FILE: [&str; 5] = [
    ENV_DB,
    ENV_QUEUE,
    ENV_SMS_URL,
    ENV_WEBHOOK_URL,
    ENV_SEEN_SET,
];

/// A URL file larger than this is not a URL (a device, a wrong path): refused
/// rather than read to the end.
const MAX_URL_FILE: u64 = 64 * 1024;

/// One URL from `path`: its content, surrounding whitespace (the trailing newline
/// an editor or `echo` leaves) trimmed.
fn read_url_file(var: &str, path: &Path) -> Result<String, CliError> {
    let fail = |why: String| CliError::usage(format!("{var}_FILE={}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| fail(format!("cannot open it: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_URL_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot read it: {e}")))?;
    if bytes.len() as u64 > MAX_URL_FILE {
        return Err(fail(format!("larger than {MAX_URL_FILE} bytes: not a URL")));
    }
    let text = String::from_utf8(bytes).map_err(|_| fail("not UTF-8 text".into()))?;
    let url = text.trim();
    if url.is_empty() {
        return Err(fail("empty".into()));
    }
    if url.contains('\n') {
        return Err(fail("more than one line: one URL expected".into()));
    }
    Ok(url.to_string())
}

/// Set each `NAME` from the file `NAME_FILE` names. Both set is a usage error: which
/// one was meant cannot be guessed. Call before the arguments are parsed and before
/// any thread starts (it changes this process's environment).
pub fn load() -> Result<(), CliError> {
    for var in FROM_FILE {
        let file_var = format!("{var}_FILE");
        let Some(path) = std::env::var_os(&file_var).filter(|p| !p.is_empty()) else {
            continue;
        };
        if std::env::var_os(var).is_some() {
            return Err(CliError::usage(format!(
                "both {var} and {file_var} are set: unset one of them"
            )));
        }
        let url = read_url_file(var, Path::new(&path))?;
        std::env::set_var(var, url);
    }
    Ok(())
}
