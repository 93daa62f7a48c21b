//! Build script: the git commit the binary is built from, for `idemwatch --version`
//! (as `IDEMWATCH_GIT_COMMIT`, read by `src/cli/mod.rs`).
//!
//! Hand-written rather than `vergen` or `built`: one `git rev-parse` is all we need,
//! and those crates bring a dependency tree (and, for vergen's git backends, libgit2
//! or gitoxide) into every build for it.
//!
//! A build never fails over the commit: outside a git checkout (a crates.io tarball, a
//! copied tree, a container build without `.git`) or without `git` it is `unknown`,
//! unless the packager says which it was in `IDEMWATCH_BUILD_COMMIT`. A checkout that
//! is not this package's own (the tree vendored inside another repository) does not
//! count: its HEAD is somebody else's commit.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `git ARGS` in the package's directory, its trimmed stdout when it succeeded.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// Rerun when `path` (a file git rewrites when HEAD moves) changes. Only files that
/// exist: cargo reruns a build script on every build for a missing one.
fn rerun_if_changed(path: String) {
    let path = PathBuf::from(path);
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// The commit of this package's own checkout, with the files to watch for a new one.
fn checkout_commit(manifest_dir: &Path) -> Option<String> {
    let top = PathBuf::from(git(&["rev-parse", "--show-toplevel"])?);
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if !same(&top, manifest_dir) {
        return None;
    }
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    // HEAD (a checkout of another branch or commit), the branch's ref (a new commit on
    // it) and packed-refs (where `git gc` moves refs): a new commit reruns this script,
    // and only that, so an edit of a source file never does.
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        rerun_if_changed(head);
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(path) = git(&["rev-parse", "--git-path", &branch]) {
            rerun_if_changed(path);
        }
    }
    if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"]) {
        rerun_if_changed(packed);
    }
    Some(commit)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=IDEMWATCH_BUILD_COMMIT");
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let commit = std::env::var("IDEMWATCH_BUILD_COMMIT")
        .ok()
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())
        .or_else(|| checkout_commit(&manifest_dir))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=IDEMWATCH_GIT_COMMIT={commit}");
}
