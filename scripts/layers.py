#!/usr/bin/env python3
"""Top-level module import graph of src/ (crate::X paths outside comments and #[cfg(test)] modules,
inline or in their own files), its cycles and mutual pairs. Usage: python3 scripts/layers.py src"""
import os, re, sys, itertools
root = sys.argv[1] if len(sys.argv) > 1 else 'src'
edges = {}
def top(path):
    rel = os.path.relpath(path, root)
    parts = rel.split(os.sep)
    return parts[0][:-3] if len(parts) == 1 else parts[0]
# files that are test modules: `#[cfg(test)] mod name;` declared in a sibling or parent
test_files = set()
for dp, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs'): continue
        text = open(os.path.join(dp, f)).read()
        base = dp if f in ('mod.rs', 'lib.rs', 'main.rs') else os.path.join(dp, f[:-3])
        for name in re.findall(r'#\[cfg\(test\)\]\s*(?:pub\s+)?mod\s+(\w+)\s*;', text):
            test_files.add(os.path.join(base, name + '.rs'))
            test_files.add(os.path.join(base, name, 'mod.rs'))
for dp, _, fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs'): continue
        p = os.path.join(dp, f)
        if f in ('tests.rs',) or p in test_files: continue
        src = open(p).read()
        # cut test modules: from '#[cfg(test)]' followed by 'mod' to the end (modules at the end by convention)
        m = re.search(r'#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{', src)
        if m: src = src[:m.start()]
        # comments (doc comments included: an intra-doc link is no import)
        src = re.sub(r'//.*', '', src)
        t = top(p)
        if t in ('main', 'lib'): continue
        for u in re.findall(r'crate::(\w+)', src):
            if u != t and u not in ('main','lib'):
                edges.setdefault(t, {}).setdefault(u, []).append(os.path.relpath(p, root))
nodes = sorted(set(edges) | {v for d in edges.values() for v in d})
# Tarjan SCC
idx = {}; low = {}; st = []; on = set(); sccs = []; c = [0]
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in edges.get(v, {}):
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        sccs.append(comp)
sys.setrecursionlimit(10000)
for v in nodes:
    if v not in idx: sc(v)
bad = [s for s in sccs if len(s) > 1]
for s in bad:
    print('cycle:', ' '.join(sorted(s)))
    for a in sorted(s):
        for b in sorted(edges.get(a, {})):
            if b in s: print(f'  {a} -> {b}: {len(edges[a][b])} files, e.g. {sorted(set(edges[a][b]))[:3]}')
pairs = [(a,b) for a in edges for b in edges[a] if a < b and a in edges.get(b, {})]
print('mutual pairs:', sorted(pairs))
print('grpc->http:', 'http' in edges.get('grpc', {}), ' storage->upload:', 'upload' in edges.get('storage', {}), ' storage->actors:', 'actors' in edges.get('storage', {}))
