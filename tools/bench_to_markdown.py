"""Render the bench.json of `python -m torch_sdcp.bench` as markdown tables for
docs/BENCHMARKS.md (us per call; ratios = other path / torch_sdcp).

    python tools/bench_to_markdown.py sdcp-bench-<date>/bench.json
"""

from __future__ import annotations

import json
import sys

from torch_sdcp.bench import PATH_NAMES, PATHS


def cell(row: dict, path: str, k: str) -> str:
    v = row.get(path, {}).get(k)
    return f"{v:.2f}" if isinstance(v, (int, float)) else "n/a"


def render(data: dict) -> str:
    out = [f"{json.dumps(data['meta'])}"]
    for name, rows in data["results"].items():
        out.append(f"\n#### {name}\n")
        table = [r for r in rows if "rows" in r]
        if table:
            paths = [p for p in PATHS if p in table[0]]
            others = [p for p in paths if p not in ("sdcp", "sdcp_view")]
            head = ["rows"] + [f"{PATH_NAMES[p]} {k}" for k in ("k8", "k1") for p in paths] + \
                [f"{PATH_NAMES[p]}/ours {k}" for p in others for k in ("k8", "k1")]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for r in table:
                cells = [str(r["rows"])] + [cell(r, p, k) for k in ("k8", "k1") for p in paths]
                for p in others:
                    for k in ("k8", "k1"):
                        a, b = r[p].get(k), r["sdcp"].get(k)
                        cells.append(f"{a / b:.2f}x" if isinstance(a, (int, float)) and b else "n/a")
                out.append("| " + " | ".join(cells) + " |")
            kernels = [r for r in table if "kernels" in r]
            if kernels:
                names = list(kernels[0]["kernels"])
                out.append("\nKernel alone, k8 (us): " + "; ".join(
                    f"rows {r['rows']}: " + ", ".join(f"{n} {cell(r['kernels'], n, 'k8')}" for n in names)
                    for r in kernels))
        for r in rows:
            if "requests" in r:  # the decode-step demo
                step = {m: r[m].get("k1") for m in ("collective", "sdcp", "compute_only")}
                out.append("| layers | requests x context | sparse | collective step us | torch_sdcp step us "
                           "| compute only us | lower by | outputs agree (max rel. error) |")
                out.append("|" + "---|" * 8)
                lower = f"{1 - step['sdcp'] / step['collective']:.0%}" if step["sdcp"] and step["collective"] else "n/a"
                out.append(f"| {r['layers']} | {r['requests']} x {r['context']} | {r['sparse']} "
                           f"| {cell(r, 'collective', 'k1')} | {cell(r, 'sdcp', 'k1')} | {cell(r, 'compute_only', 'k1')} "
                           f"| {lower} | {r['agree']} ({r['max_rel_error']:.1e}) |")
            elif "rows" not in r:
                out.append(f"\n{json.dumps(r)}")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
