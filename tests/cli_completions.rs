//! Shell completions and the manual page (docs/CONTRACT.md §9: `idemwatch completions SHELL`,
//! `idemwatch man`), generated from the clap definitions: each shell gets a script,
//! bash accepts and uses it (a real `bash`: syntax check, `source`, `complete -p`, and
//! the completion function asked for candidates as the shell asks it), zsh parses its
//! own, and `man` renders the page. Without zsh or man the checks of those skip,
//! unless IDEMWATCH_REQUIRE_SERVICES=1 (CI), where they fail.

mod common;

use std::process::{Command, Stdio};

use common::{idemwatch_bin, run_cli, TempEnv};

fn required() -> bool {
    std::env::var("IDEMWATCH_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// `idemwatch ARGS` that must succeed: its stdout.
fn generated(env: &TempEnv, args: &[&str]) -> String {
    let (code, out, err) = run_cli(env, args);
    assert_eq!(code, 0, "idemwatch {args:?}: {err}");
    assert!(err.is_empty(), "nothing on stderr: {err}");
    out
}

/// `tool ARGS` with `script` written to a file named by `{}` in the args; None (skip)
/// when the tool is missing outside CI. (exit success, stdout + stderr)
fn run_tool(tool: &str, args: &[&str]) -> Option<(bool, String)> {
    match Command::new(tool).args(args).stdin(Stdio::null()).output() {
        Ok(out) => Some((
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )),
        Err(e) if !required() => {
            eprintln!("SKIP: {tool} not available ({e})");
            None
        }
        Err(e) => panic!("{tool} is required (IDEMWATCH_REQUIRE_SERVICES=1): {e}"),
    }
}

#[test]
fn every_shell_gets_a_completion_script_naming_the_subcommands() {
    let env = TempEnv::new();
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let script = generated(&env, &["completions", shell]);
        for word in [
            "idemwatch",
            "serve",
            "dead-letters",
            "api-keys",
            "completions",
        ] {
            assert!(
                script.contains(word),
                "the {shell} script does not mention {word}"
            );
        }
    }
    let (code, _, err) = run_cli(&env, &["completions", "tcsh"]);
    assert_eq!(code, 2, "an unknown shell is a usage error: {err}");
}

/// Candidates bash's completion function offers for the words typed so far (the
/// last one being completed), run as bash runs it after `complete -p`.
fn bash_candidates(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let probe = format!(
        "set -e\nsource '{}'\n\
         spec=$(complete -p idemwatch)\n\
         func=$(sed -E 's/.*-F ([^ ]+).*/\\1/' <<<\"$spec\")\n\
         COMP_WORDS=({})\nCOMP_CWORD={}\nCOMP_LINE=\"${{COMP_WORDS[*]}}\"\nCOMP_POINT=${{#COMP_LINE}}\n\
         \"$func\" idemwatch \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"\n",
        script.display(),
        quoted.join(" "),
        words.len() - 1
    );
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", &probe])
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "bash could not complete {words:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn bash_accepts_the_completion_script_and_completes_subcommands_and_flags() {
    let env = TempEnv::new();
    let script = env.path("idemwatch.bash");
    std::fs::write(&script, generated(&env, &["completions", "bash"])).unwrap();
    let path = script.to_str().unwrap();
    let (ok, out) = run_tool("bash", &["--norc", "-n", path]).expect("bash is always there");
    assert!(ok, "bash -n: {out}");
    let (ok, out) = run_tool(
        "bash",
        &[
            "--norc",
            "-c",
            &format!("source '{path}' && complete -p idemwatch"),
        ],
    )
    .unwrap();
    assert!(ok, "source + complete -p: {out}");
    assert!(out.starts_with("complete "), "{out}");

    let subcommands = bash_candidates(&script, &["idemwatch", "se"]);
    assert_eq!(subcommands, ["serve"], "idemwatch se<TAB>");
    let flags = bash_candidates(&script, &["idemwatch", "serve", "--api-k"]);
    assert_eq!(flags, ["--api-keys"], "idemwatch serve --api-k<TAB>");
    let shells = bash_candidates(&script, &["idemwatch", "completions", ""]);
    assert!(
        shells.iter().any(|s| s == "zsh") && shells.iter().any(|s| s == "powershell"),
        "idemwatch completions <TAB>: {shells:?}"
    );
}

#[test]
fn zsh_parses_its_completion_script() {
    let env = TempEnv::new();
    let script = env.path("_idemwatch");
    std::fs::write(&script, generated(&env, &["completions", "zsh"])).unwrap();
    if let Some((ok, out)) = run_tool("zsh", &["-n", script.to_str().unwrap()]) {
        assert!(ok, "zsh -n: {out}");
    }
}

#[test]
fn the_manual_page_renders_with_every_subcommand_and_the_version() {
    let env = TempEnv::new();
    let page = generated(&env, &["man"]);
    assert!(
        page.starts_with(".ie") || page.contains(".TH idemwatch 1"),
        "{page}"
    );
    assert!(
        page.contains(env!("CARGO_PKG_VERSION")),
        "the version in the title"
    );
    let file = env.path("idemwatch.1");
    std::fs::write(&file, &page).unwrap();
    let Some((ok, text)) = run_tool("man", &["-l", "-P", "cat", file.to_str().unwrap()]) else {
        return;
    };
    assert!(ok, "man -l: {text}");
    for word in [
        "SYNOPSIS",
        "serve",
        "dead-letters",
        "completions",
        "--prometheus",
    ] {
        assert!(
            text.contains(word),
            "the rendered page lacks {word}:\n{text}"
        );
    }

    // One page per subcommand for packagers.
    let dir = env.path("man");
    generated(&env, &["man", "--dir", dir.to_str().unwrap()]);
    for page in [
        "idemwatch.1",
        "idemwatch-serve.1",
        "idemwatch-ingest-mqtt.1",
    ] {
        assert!(dir.join(page).is_file(), "man --dir wrote no {page}");
    }
}

/// Completions and the page come from the argument definitions alone: no data
/// directory is made (a packager's build sandbox has no home), and a secret in the
/// environment that a flag reads never shows up in them.
#[test]
fn generating_needs_no_home_and_prints_no_secret_from_the_environment() {
    let env = TempEnv::new();
    for args in [&["completions", "bash"][..], &["man"]] {
        let out = Command::new(idemwatch_bin())
            .args(args)
            .env_clear()
            .env("IDEMWATCH_DB", "postgres://fleet:hunter2-secret@db/fleet")
            .env("IDEMWATCH_QUEUE", "amqp://fleet:hunter2-secret@mq/%2f")
            .current_dir(env.path(""))
            .output()
            .expect("run idemwatch");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "idemwatch {args:?} without HOME: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.is_empty());
        assert!(
            !text.contains("hunter2"),
            "idemwatch {args:?} printed a secret"
        );
    }
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let env = TempEnv::new();
    let out = generated(&env, &["--version"]);
    let packager_said = std::env::var("IDEMWATCH_BUILD_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty());
    let expected_commit = packager_said.or_else(|| {
        Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    });
    let commit = expected_commit.as_deref().unwrap_or("unknown");
    assert_eq!(
        out.trim(),
        format!("idemwatch {} (commit {commit})", env!("CARGO_PKG_VERSION"))
    );
}
