"""Layers that never call back up (/work/shared/STYLE.md, docs/architecture.md).

Reads every #include "..." of the library's sources (meta/, agent/ without
its programs) the way the compiler resolves it (the including file's folder,
then -Iinclude -Imeta -Iagent, as the Makefile says) and fails on:

  1. a transport (agent/transport/X/) including a header of another
     transport; what they share lives one floor down (agent/transport/conn/,
     agent/transport/transport.h, agent/mem/);
  2. the floor below the transports (agent/transport/conn/) including any
     transport's header;
  3. a cycle in the folder graph (folder A includes from folder B and B,
     directly or not, from A);
  4. with a build directory given: an object of the agent core or a
     transport that needs a symbol agent.o defines (calling up into the
     lifecycle file instead of the bottom file, agent/log.c).

Usage: python3 check_layers.py REPO [BUILD_DIR]
"""
import os
import re
import subprocess
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SEARCH = ["include", "meta", "agent"]
PROGRAMS = {"sx-agent", "sxctl", "bench", "demo"}


def sources(repo):
    for top in ("meta", "agent"):
        for d, dirs, files in os.walk(os.path.join(repo, top)):
            rel = os.path.relpath(d, repo)
            parts = rel.split(os.sep)
            if len(parts) > 1 and parts[0] == "agent" and parts[1] in PROGRAMS:
                dirs[:] = []
                continue
            for f in sorted(files):
                if f.endswith((".c", ".h")):
                    yield os.path.join(rel, f)


def resolve(repo, src, name):
    for base in [os.path.dirname(src)] + SEARCH:
        p = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(os.path.join(repo, p)):
            return p
    return None  # a generated or system header


def transport_of(path):
    parts = path.split(os.sep)
    if len(parts) >= 4 and parts[:2] == ["agent", "transport"]:
        return parts[2]
    return None


def cycles(edges):
    """Strongly connected components with more than one folder (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    repo = sys.argv[1]
    build = sys.argv[2] if len(sys.argv) > 2 else None
    bad, edges, why, n_inc = [], {}, {}, 0
    for src in sources(repo):
        with open(os.path.join(repo, src), encoding="utf-8") as f:
            text = f.read()
        for name in INCLUDE.findall(text):
            dst = resolve(repo, src, name)
            if dst is None:
                continue
            n_inc += 1
            a, b = transport_of(src), transport_of(dst)
            if a is not None and b is not None and a != b:
                if a == "conn":
                    bad.append(f"{src}: the connection module includes transport {b}'s {dst}")
                elif b != "conn":
                    bad.append(f"{src}: transport {a} includes transport {b}'s {dst}")
            fa, fb = os.path.dirname(src), os.path.dirname(dst)
            if fa != fb:
                edges.setdefault(fa, set()).add(fb)
                why.setdefault((fa, fb), f"{src} -> {dst}")
    for comp in cycles(edges):
        links = [why[(a, b)] for a in comp for b in comp if (a, b) in why]
        bad.append("folders include each other: " + ", ".join(comp) + " (" + "; ".join(links) + ")")
    n_obj = 0
    if build:
        obj = os.path.join(build, "obj", "agent")
        agent_o = os.path.join(obj, "agent.o")
        if not os.path.isfile(agent_o):
            bad.append(f"{agent_o} is not built")
        else:
            defined = set()
            for line in subprocess.run(["nm", "-g", "--defined-only", agent_o], check=True,
                                       capture_output=True, text=True).stdout.splitlines():
                f = line.split()
                if len(f) == 3:
                    defined.add(f[2])
            for d, dirs, files in os.walk(obj):
                rel = os.path.relpath(d, obj).split(os.sep)
                if rel[0] in PROGRAMS:
                    dirs[:] = []
                    continue
                for f in sorted(files):
                    p = os.path.join(d, f)
                    if not f.endswith(".o") or p == agent_o:
                        continue
                    n_obj += 1
                    und = subprocess.run(["nm", "-u", p], check=True, capture_output=True,
                                         text=True).stdout.split()
                    for sym in sorted(set(und) & defined):
                        bad.append(f"{os.path.relpath(p, build)} calls up into agent.c: {sym}")
    for b in bad:
        print(b)
    if bad:
        return 1
    print(f"{n_inc} includes in {len(edges)} folders, {n_obj} objects: no transport includes "
          "another, no cross-folder loop, nothing calls up into agent.c")
    return 0


if __name__ == "__main__":
    sys.exit(main())
