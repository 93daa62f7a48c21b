# Shared by the scripts in this directory (sourced, not run): which idemwatch binary
# they measure. IDEMWATCH_BIN if set, else the profiling build (the release code with
# line tables for perf: `cargo build --profile profiling`), else the release build,
# else the debug build;
# exit 2 when there is none. Sets BIN and ROOT (the repository), and defines
# with_database.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${IDEMWATCH_BIN:-}
if [[ -z $BIN ]]; then
  for b in "$ROOT/target/profiling/idemwatch" "$ROOT/target/release/idemwatch" "$ROOT/target/debug/idemwatch"; do
    [[ -x $b ]] && BIN=$b && break
  done
fi
[[ -x ${BIN:-} ]] || { echo "build idemwatch first (cargo build --profile profiling)" >&2; exit 2; }

# with_database URL NAME: the database URL with its path (the database) set to NAME.
with_database() {
  python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/"+sys.argv[2])))' "$1" "$2"
}
