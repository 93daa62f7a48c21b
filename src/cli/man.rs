//! `idemwatch man`: the manual page, generated from the clap definitions
//! (`clap_mangen`): the same text as `--help`, in roff for `man`.

use std::path::PathBuf;

use clap::{Args, CommandFactory};

use super::{write_stdout, Cli, CliError, CliResult, EXIT_OK};

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Write idemwatch.1 and one page per subcommand (idemwatch-serve.1, …) into DIR
    /// instead of printing idemwatch.1.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// idemwatch.1 on stdout, or every page into `--dir`.
pub fn run(args: &ManArgs) -> CliResult {
    let cmd = Cli::command();
    match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .and_then(|()| clap_mangen::generate_to(cmd, dir))
                .map_err(|e| {
                    CliError::unavailable(format!(
                        "cannot write the manual pages into {}: {e}",
                        dir.display()
                    ))
                })?;
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd).render(&mut page).map_err(|e| {
                CliError::unavailable(format!("cannot render the manual page: {e}"))
            })?;
            return write_stdout("the manual page", &page);
        }
    }
    Ok(EXIT_OK)
}
