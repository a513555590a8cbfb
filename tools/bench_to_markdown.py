"""Render the bench.json of `python -m torch_sdcp.bench` as markdown tables for
docs/BENCHMARKS.md (us per call; ratios = the strongest baseline of the row /
torch_sdcp, CUDA only: host-backend figures are not performance), followed by
the legend of what each path runs.

    python tools/bench_to_markdown.py sdcp-bench-<date>/bench.json
"""

from __future__ import annotations

import json
import sys

from torch_sdcp.bench import OURS, PATH_NAMES, PATHS, DecodeStep, legend


def cell(row: dict, path: str, k: str) -> str:
    v = row.get(path, {}).get(k)
    return f"{v:.2f}" if isinstance(v, (int, float)) else "n/a"


def strongest(row: dict, k: str):
    timed = [(row[p][k], p) for p in PATHS if p in row and p not in OURS and isinstance(row[p].get(k), (int, float))]
    return min(timed) if timed else None


def render(data: dict) -> str:
    out = [f"{json.dumps(data['meta'])}"]
    cuda = data["meta"]["backend"] == "cuda"
    if not cuda:
        out.append("\nHost backend: these figures check the protocol on shared memory; they are not performance "
                   "(no ratios).")
    for name, rows in data["results"].items():
        out.append(f"\n#### {name}\n")
        table = [r for r in rows if "rows" in r]
        if table:
            paths = [p for p in PATHS if p in table[0]]
            ours = [p for p in paths if p in OURS] if cuda else []
            head = ["rows"] + [f"{PATH_NAMES[p]} {k}" for k in ("k8", "k1") for p in paths] + \
                [f"strongest baseline/{PATH_NAMES[p]} {k}" for p in ours for k in ("k8", "k1")]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for r in table:
                cells = [str(r["rows"])] + [cell(r, p, k) for k in ("k8", "k1") for p in paths]
                for p in ours:
                    for k in ("k8", "k1"):
                        best, b = strongest(r, k), r[p].get(k)
                        cells.append(f"{best[0] / b:.2f}x ({PATH_NAMES[best[1]]})"
                                     if best and isinstance(b, (int, float)) and b else "n/a")
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
                lower = (f"{1 - step['sdcp'] / step['collective']:.0%}" if cuda and step["sdcp"] and step["collective"]
                         else "n/a")
                out.append(f"| {r['layers']} | {r['requests']} x {r['context']} | {r['sparse']} "
                           f"| {cell(r, 'collective', 'k1')} | {cell(r, 'sdcp', 'k1')} "
                           f"| {cell(r, 'compute_only', 'k1')} | {lower} | {r['agree']} ({r['max_rel_error']:.1e}) |")
                if r.get("attention"):
                    out.append(f"\nAttention: {DecodeStep.ATTENTION.get(r['attention'], r['attention'])}.")
            elif "rows" not in r:
                out.append(f"\n{json.dumps(r)}")
    tagged = any("sdcp_tagged" in r for rows in data["results"].values() for r in rows)
    out += legend(data["results"].keys(), tagged=tagged)
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
