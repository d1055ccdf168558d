"""The converted graph as a picture: Graphviz DOT text, nodes coloured by compute dtype, casts marked."""
from __future__ import annotations

import shutil
import subprocess
from collections import Counter, defaultdict

import torch
import torch.fx as fx

from ..base.meta import module_path

COLOURS = {"low": "#f4a261", "fp32": "#8ecae6", "follow": "#e9ecef", "cast": "#e63946", "io": "#ffffff"}


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _kind(d, low) -> str:
    if d is None:
        return "io"
    if d.kind == "cast":
        return "cast"
    if d.kind in ("input", "output", "param", "other") or d.dtype is None:
        return "io"
    if d.op_class in ("low",) or (d.dtype == low and d.op_class not in ("fp32", "fp32_out")):
        return "low" if d.dtype == low else "fp32"
    return "fp32" if d.dtype == torch.float32 else "low"


def _group(node: fx.Node, depth: int) -> str | None:
    if depth <= 0 or node.op in ("placeholder", "output", "get_attr"):
        return None
    path = module_path(node)
    if not path:
        return None
    parts = path.split(".")
    return ".".join(parts[:depth]) if len(parts) >= depth else None


def to_dot(gm: fx.GraphModule, depth: int = 2, title: str | None = None) -> str:
    """DOT text of ``gm``, each module at ``depth`` of the module tree (``layer1.0``) collapsed into one box that
    counts its nodes per dtype and its casts; ``depth=0`` draws every node."""
    info = gm.meta["autocastfx"]
    low = info.dtype
    short = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    lines = ["digraph autocastfx {", '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="Helvetica", '
             'fontsize=10]; edge [color="#888888", arrowsize=0.6];']
    if title:
        lines.append(f'  labelloc=t; label="{_esc(title)}"; fontname="Helvetica";')
    cells = "".join(f'<td bgcolor="{COLOURS[k]}">{name}</td>' for k, name in
                    (("low", short[low]), ("fp32", "fp32"), ("cast", "cast")))
    lines.append(f'  legend [shape=plaintext, style="", label=<<table border="0" cellborder="1" cellspacing="0">'
                 f'<tr>{cells}</tr></table>>];')
    rep_of: dict[str, str] = {}
    groups: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue  # weights show in their consumer's box
        g = _group(node, depth)
        if g is not None:
            groups[g].append(node)
            rep_of[node.name] = f"g_{g}"
        else:
            rep_of[node.name] = node.name
    # collapse casts into the group of their reader when it is one
    for node in gm.graph.nodes:
        d = node.meta.get("autocastfx")
        if d is not None and d.kind == "cast" and depth > 0:
            readers = {rep_of.get(u.name) for u in node.users}
            if len(readers) == 1:
                r = readers.pop()
                if r and r.startswith("g_"):
                    rep_of[node.name] = r
                    groups[r[2:]].append(node)
    drawn = set()
    for g, members in groups.items():
        kinds = Counter(_kind(n.meta.get("autocastfx"), low) for n in members)
        casts = kinds.pop("cast", 0)
        kinds.pop("io", None)
        main = "low" if kinds.get("low", 0) >= kinds.get("fp32", 0) else "fp32"
        counts = ", ".join(f"{short[low] if k == 'low' else k} {v}" for k, v in sorted(kinds.items()))
        label = f"{g}\n{counts}" + (f"\ncasts {casts}" if casts else "")
        pen = f', color="{COLOURS["cast"]}", penwidth=2' if casts else ""
        lines.append(f'  "g_{_esc(g)}" [label="{_esc(label)}", fillcolor="{COLOURS[main]}"{pen}];')
        drawn.add(f"g_{g}")
    for node in gm.graph.nodes:
        r = rep_of.get(node.name)
        if r is None or r in drawn:
            continue
        d = node.meta.get("autocastfx")
        k = _kind(d, low)
        dt = short.get(d.dtype, "") if d is not None and d.dtype is not None else ""
        tgt = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        label = f"{node.name}\n{tgt} {dt}".strip()
        shape = ', shape=cds' if k == "cast" else (', shape=ellipse' if node.op in ("placeholder", "output") else "")
        lines.append(f'  "{_esc(r)}" [label="{_esc(label)}", fillcolor="{COLOURS[k]}"{shape}];')
        drawn.add(r)
    edges = set()
    for node in gm.graph.nodes:
        dst = rep_of.get(node.name)
        for a in node.all_input_nodes:
            src = rep_of.get(a.name)
            if src and dst and src != dst and (src, dst) not in edges:
                edges.add((src, dst))
                lines.append(f'  "{_esc(src)}" -> "{_esc(dst)}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(dot_text: str, path: str) -> str:
    """Write ``path``: .dot as text, .svg/.png/.pdf through Graphviz's ``dot``."""
    fmt = path.rsplit(".", 1)[-1].lower() if "." in path else "dot"
    if fmt in ("dot", "gv"):
        with open(path, "w") as f:
            f.write(dot_text)
        return path
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError("drawing to ." + fmt + " needs Graphviz's `dot` program (apt-get install graphviz, "
                           "brew install graphviz); write a .dot file instead with -o graph.dot")
    subprocess.run([exe, f"-T{fmt}", "-o", path], input=dot_text.encode(), check=True)
    return path
