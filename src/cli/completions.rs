//! `idemwatch completions SHELL`: the shell's completion script, generated from the
//! clap definitions (`clap_complete`), so a new flag completes the day it lands.

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use super::{write_stdout, Cli, CliResult};

#[derive(Debug, Args)]
#[command(after_help = "Install, for example:\n  \
    bash: idemwatch completions bash > ~/.local/share/bash-completion/completions/idemwatch\n  \
    zsh:  idemwatch completions zsh > ~/.zfunc/_idemwatch  (with fpath+=~/.zfunc before compinit)\n  \
    fish: idemwatch completions fish > ~/.config/fish/completions/idemwatch.fish")]
pub struct CompletionsArgs {
    /// The shell to complete in.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// The script on stdout.
pub fn run(args: &CompletionsArgs) -> CliResult {
    let mut cmd = Cli::command();
    // Into a buffer first: `generate` panics on a failed write (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "idemwatch", &mut script);
    write_stdout("the completion script", &script)
}
