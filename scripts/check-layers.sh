#!/usr/bin/env bash
# The layers, checked (CI runs this; so can you):
#
# 1. crates: every dependency between the workspace's crates (from `cargo metadata`)
#    points down the layer order below — normal, build and dev dependencies alike
#    (dev-only helper crates may be used by any crate above them);
# 2. modules: inside each crate, no import circle between sibling modules. A file's
#    `crate::a::b` and `super::…` paths are resolved to the module they name; a
#    reference from module x to module y counts as an edge between the two children of
#    their closest common ancestor (so a parent using its child, or a child its parent,
#    is no edge). A strongly connected group of two or more siblings is a circle.
#    Test modules (`#[cfg(test)] mod …`) are left out: they are not part of the
#    library's module graph, and a unit test may use what sits above the code it
#    checks, as an integration test does (between crates, cargo forbids even that).
#
# Exit status 1 and each offence on stderr when a rule is broken.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo metadata --format-version 1 --no-deps --locked >"${TMPDIR:-/tmp}/idemwatch-metadata.$$.json"
trap 'rm -f "${TMPDIR:-/tmp}/idemwatch-metadata.$$.json"' EXIT

python3 - "${TMPDIR:-/tmp}/idemwatch-metadata.$$.json" <<'PY'
import json, os, re, sys

# Lowest first. A crate may depend only on crates before it; dev-only helpers
# (DEV_ONLY) may be dev-dependencies of any crate after them.
LAYERS = [
    "idemwatch-base",
    "idemwatch-testkit",
    "idemwatch-engine",
    "idemwatch-drills",
    "idemwatch-monitor",
    "idemwatch-tui",
    "idemwatch",
]
DEV_ONLY = {"idemwatch-testkit"}

meta = json.load(open(sys.argv[1]))
members = {p["name"]: p for p in meta["packages"]}
failures = []

for name in members:
    if name not in LAYERS:
        failures.append(f"crate {name} has no place in scripts/check-layers.sh's LAYERS")
for name, pkg in members.items():
    if name not in LAYERS:
        continue
    rank = LAYERS.index(name)
    for dep in pkg["dependencies"]:
        other = dep["name"]
        if other not in members:
            continue
        kind = dep["kind"] or "normal"
        if other in DEV_ONLY and kind != "dev":
            failures.append(f"{name} depends on the dev-only {other} as a {kind} dependency")
        elif other not in LAYERS or LAYERS.index(other) >= rank:
            failures.append(f"{name} ({kind}) depends on {other}, which is not below it")

# --- module circles inside each crate ---------------------------------------------

def strip(text):
    """The code without comments, string and char literals (their braces and paths)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif (m := re.match(r'b?r(#*)"', text[i:])) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            out.append('""')
            i = n if j < 0 else j + len(end)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'" and (m := re.match(r"'(\\.|[^\\'])'", text[i:])):
            out.append("' '")
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)

def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)

PATH = re.compile(
    r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)"
    r"|(#\[cfg\(test\)\]\s*)?(?:pub(?:\([^)]*\))?\s+)?\bmod\s+([a-z_][a-z0-9_]*)\s*([{;])"
    r"|[{}]"
)

def walk(src, path):
    """(module, path named) for every crate::/super::/self:: path in one file outside
    test modules, the inline modules (`mod tests { … }`) it opens, and the modules it
    declares as test-only (`#[cfg(test)] mod fixtures;`)."""
    here = module_of(src, path)
    code = strip(open(path, encoding="utf-8").read())
    stack = []  # inline modules: (name, brace depth at which it closes, test-only)
    depth = 0
    for m in PATH.finditer(code):
        tok = m.group(0)
        if m.group(4):
            test = bool(m.group(3)) or any(t for _, _, t in stack)
            inner = here + tuple(n for n, _, _ in stack) + (m.group(4),)
            if m.group(5) == ";":
                if test:
                    yield "test", inner, None
                continue
            stack.append((m.group(4), depth, test))
            depth += 1
            yield "mod", inner, None
            continue
        if tok == "{":
            depth += 1
            continue
        if tok == "}":
            depth -= 1
            if stack and stack[-1][1] == depth:
                stack.pop()
            continue
        if any(t for _, _, t in stack):
            continue
        current = here + tuple(n for n, _, _ in stack)
        head, segs = m.group(1), m.group(2).split("::")[1:]
        if head == "crate":
            base = ()
        else:
            base = current
            if head == "super":
                base = base[:-1]
                while segs and segs[0] == "super":
                    base, segs = base[:-1], segs[1:]
        yield "ref", current, (base, segs)

def references(src, files):
    """(from, to) module pairs: each path resolved to the deepest module it names."""
    modules, refs, tests = {module_of(src, f) for f in files}, [], set()
    for f in files:
        for kind, current, named in walk(src, f):
            if kind == "mod":
                modules.add(current)
            elif kind == "test":
                tests.add(current)
            else:
                refs.append((f, current, named))
    for f, current, (base, segs) in refs:
        if any(current[: len(t)] == t for t in tests):
            continue
        for s in segs:
            if base + (s,) not in modules:
                break
            base = base + (s,)
        yield f, current, base

def circles(graph):
    """Strongly connected groups of two or more nodes (Tarjan)."""
    index, low, on, st, out, counter = {}, {}, set(), [], [], [0]
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        st.append(v); on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = st.pop(); on.discard(w); group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in list(graph):
        if v not in index:
            visit(v)
    return out

sys.setrecursionlimit(10000)
for name, pkg in sorted(members.items()):
    src = os.path.join(os.path.dirname(pkg["manifest_path"]), "src")
    files = []
    for root, dirs, names in os.walk(src):
        dirs.sort()
        files += [os.path.join(root, f) for f in sorted(names) if f.endswith(".rs")]
    edges = {}  # parent -> {child: {child, ...}}
    why = {}
    for f, a, b in references(src, files):
        if True:
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            if k == len(a) or k == len(b):
                continue  # an ancestor or a descendant: no edge between siblings
            parent, x, y = a[:k], a[k], b[k]
            edges.setdefault(parent, {}).setdefault(x, set()).add(y)
            why.setdefault((parent, x, y), os.path.relpath(f))
    for parent, graph in sorted(edges.items()):
        for group in circles(graph):
            where = "::".join(parent) or "(crate root)"
            detail = "; ".join(
                f"{x} -> {y} ({why[(parent, x, y)]})"
                for x in group for y in sorted(graph.get(x, ())) if y in group
            )
            failures.append(f"{name}: import circle among {where}'s modules {', '.join(group)}: {detail}")

if failures:
    for f in failures:
        print(f"check-layers: {f}", file=sys.stderr)
    sys.exit(1)
order = " < ".join(n for n in LAYERS if n in members)
print(f"check-layers: {len(members)} crates in order ({order}); no import circle inside any")
PY
