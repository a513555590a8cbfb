"""Render a bench_boundaries.py JSON file as the markdown tables of
docs/BENCHMARKS.md (per-call microseconds; ratios = other path / torch_sdcp).

    python tools/bench_to_markdown.py bench.json
"""

from __future__ import annotations

import json
import sys

PATHS = ("nccl", "symm_mem", "sdcp")
NAMES = {"nccl": "NCCL", "symm_mem": "symm-mem", "sdcp": "torch_sdcp"}


def cell(row, path, k):
    v = row.get(path, {}).get(k) if isinstance(row.get(path), dict) else None
    return f"{v:.2f}" if isinstance(v, (int, float)) else "n/a"


def render(data: dict) -> str:
    out = []
    for name, rows in data["results"].items():
        table = [r for r in rows if "rows" in r]
        extra = [r for r in rows if "rows" not in r]
        out.append(f"\n#### {name}\n")
        if table:
            paths = [p for p in PATHS if p in table[0]]
            dtype = "dtype | " if "dtype" in table[0] else ""
            head = f"| {dtype}rows | " + " | ".join(f"{NAMES[p]} k8" for p in paths) + " | " + \
                " | ".join(f"{NAMES[p]} k1" for p in paths)
            ratios = [p for p in paths if p != "sdcp"]
            head += "".join(f" | {NAMES[p]}/ours k8 | {NAMES[p]}/ours k1" for p in ratios) + " |"
            out.append(head)
            out.append("|" + "---|" * (head.count("|") - 1))
            for r in table:
                line = f"| {r['dtype'] + ' | ' if dtype else ''}{r['rows']} | "
                line += " | ".join(cell(r, p, "k8") for p in paths) + " | "
                line += " | ".join(cell(r, p, "k1") for p in paths)
                for p in ratios:
                    for k in ("k8", "k1"):
                        a, b = r.get(p, {}).get(k), r["sdcp"].get(k)
                        line += f" | {a / b:.2f}x" if isinstance(a, (int, float)) and b else " | n/a"
                out.append(line + " |")
        for e in extra:
            if "what" in e:
                out.append("| what | torch_sdcp k8 | torch_sdcp k1 | NCCL all_gather k8 | NCCL all_gather k1 |")
                out.append("|---|---|---|---|---|")
                out.append(f"| {e['what']} | {cell(e, 'sdcp', 'k8')} | {cell(e, 'sdcp', 'k1')} "
                           f"| {cell(e, 'nccl_all_gather', 'k8')} | {cell(e, 'nccl_all_gather', 'k1')} |")
            else:
                out.append(f"\n{json.dumps(e)}")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
