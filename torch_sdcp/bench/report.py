"""What the benchmark prints and draws: the paths and their legend, the
tables, the plot."""

from __future__ import annotations

import json
import textwrap

from torch_sdcp.bench.decode import DecodeStep
from torch_sdcp.bench.step_figure import step_lines

PATHS = ("collective", "collective_eager", "symm_mem", "vllm_a2a", "flashinfer", "vllm_direct", "sdcp",
         "sdcp_tagged", "sdcp_masked", "sdcp_view")
OURS = ("sdcp", "sdcp_tagged", "sdcp_masked", "sdcp_view")
PATH_NAMES = {"collective": "collective", "collective_eager": "collective (eager ops)", "symm_mem": "symm-mem",
              "vllm_a2a": "vLLM a2a", "flashinfer": "FlashInfer fused", "vllm_direct": "vLLM direct",
              "sdcp": "torch_sdcp",
              "sdcp_tagged": "torch_sdcp tagged", "sdcp_masked": "torch_sdcp masked", "sdcp_view": "torch_sdcp view"}
#: The boundaries that time a tagged call with --tag.
TAG_BOUNDARIES = ("signal", "query", "topk", "output_lse", "output_lse_up")
#: What the "torch_sdcp tagged" path (--tag) runs, for every boundary that has it.
TAGGED = ("torch_sdcp tagged", "(--tag) the torch_sdcp call above with a call tag (tag=7): the tag rides in the "
                               "call header's dtype word, compared by every peer; its cost against the untagged call")
PATH_KEYS = {name: path for path, name in PATH_NAMES.items()}
#: The title of a boundary's table where it is not the boundary's name.
TITLES = {"output_lse_up": "output_lse_up (Output/LSE after the V up-projection: head_dim 128, the same heads; "
                           "vLLM 0.34 combines here from 8 rows on)"}
UP_LEGEND = ("every path", "the output_lse paths (legend lines of output_lse) at head_dim 128 in place of the "
                           "preset's latent width")

# The host backend runs every path on the CPU: the collective path over gloo,
# torch_sdcp's ops as CPU code spinning on shared memory. Its figures check the
# protocol; the names, the notes and the plot say so, so that no one reads
# them as speed.
HOST_PATH_NAMES = {**PATH_NAMES, "collective": "collective (gloo)", "collective_eager": "collective (gloo, eager ops)"}
HOST_PATHS_NOTE = ("host backend paths: collective = torch.distributed over gloo; torch_sdcp = the sdcp:: ops' "
                   "CPU implementations on shared memory (memfd), each waiting rank spinning on a CPU core")
HOST_DECODE_NOTE = ("  not a speed comparison: CPU wall clock of {world} processes sharing this machine's cores; "
                    "the CPU attention dominates the step, torch_sdcp's waits spin on the cores the peers compute "
                    "on while gloo's block in the kernel, and no GPU kernel runs (this line checks that the outputs "
                    "agree)")
HOST_PLOT_NOTE = ("HOST BACKEND: protocol checks on shared memory, NOT performance.\n"
                  "CPU wall clock of {world} local processes: collective = gloo, torch_sdcp = CPU ops spinning on "
                  "shared memory. No GPU ran; no speed comparison can be read from these lines.")

# What each path runs: kernels and communication (printed with the tables;
# README.md says the same). The collective query and top-K paths already use
# this library's fastest local kernels (query_rope_quant, topk_select).
LEGEND = {
    "signal": [
        ("collective", "all_gather of 8 bytes per rank (NCCL; gloo on the host backend)"),
        ("torch_sdcp", "ExchangeWorkspace.all_gather: sdcp::peer_all_gather, one kernel storing tagged words "
                       "into every peer's buffer and polling its own buffer (data-as-flag, no flag or fence)"),
    ],
    "query": [
        ("collective", "sdcp::query_rope_quant (this library's fused RoPE + concat + FP8/bf16 producer kernel), "
                       "all_gather of the [T, H/N, 576] bytes (NCCL), one permute copy to [T, H, 576]"),
        ("torch_sdcp", "sdcp::query_gather: the same producer math in one kernel, data-as-flag: stores its "
                       "head shard into every peer's buffer (peer memory) and its own heads into the result, "
                       "polls its own buffer as the peers' shards land; returns a fresh tensor"),
        ("torch_sdcp view", "sdcp::query_publish + query_release: the producer stores into every rank's fixed "
                            "view (final layout) after the previous view's release; the reader uses it in "
                            "place; release re-fills it and acknowledges (two kernels per call)"),
    ],
    "topk": [
        ("collective", "pack (score, id) pairs, all_gather (NCCL), permute copies, sdcp::topk_select (this "
                       "library's stable top-K kernel) over the N x C gathered candidates"),
        ("vLLM direct", "a reproduction of vLLM 0.34.0's DirectDCPTopKWorkspace on torch symmetric memory, in "
                        "Triton: pack (score, id) pairs, one push kernel into every peer's ping-pong slot, one "
                        "publish-and-wait kernel (system-scope release add, bounded acquire spins), PDL on SM90+; "
                        "the selection is sdcp::topk_select (vLLM's is CuTeDSL) over the N x C received "
                        "candidates; k8 only; rows over vLLM's direct bound (4096) skipped"),
        ("torch_sdcp", "sdcp::topk_merge: one kernel, data-as-flag: each owner bucket-ranks its candidates, stores "
                       "its best min(C, k) keys into every peer's buffer (peer memory), and merges the peers' "
                       "sorted lists (merge path) as they land in its own buffer"),
    ],
    "output_lse": [
        ("collective", "all_gather of the LSE [T, H] fp32 (NCCL) -> sdcp::lse_correct (one fused kernel: global "
                       "LSE and w_rank * O written head-major [H, T, D]) -> reduce_scatter_tensor (sum, NCCL) on "
                       "heads; the structure of vLLM's cp_lse_ag_out_rs"),
        ("collective (eager ops)", "(--eager-collective) the same two collectives with the correction as ~20 "
                                   "eager torch ops and transpose copies (collective.lse_all_gather_reduce_scatter)"),
        ("symm-mem", "torch symmetric memory: barrier, 2N copy kernels into the peers' inboxes, barrier, "
                     "sdcp::lse_combine (fp32)"),
        ("vLLM a2a", "vLLM's direct all-to-all (PR #50484) on torch symmetric memory: device epoch, one Triton "
                     "dispatch kernel into every peer's slot epoch % 2, one barrier (signal round), one Triton "
                     "combine kernel (fp32)"),
        ("FlashInfer fused", "a reproduction in Triton on torch symmetric memory (NCCL LSA windows in FlashInfer) "
                             "of FlashInfer's fused decode_cp_a2a_lse_reduce (read: flashinfer-python 0.7.4; vLLM "
                             "0.33 pins 0.7.2.post1): one persistent kernel: device epoch, puts into every peer's "
                             "slot epoch % 2, a release flag per peer, bounded acquire waits, grid barriers, the "
                             "LSE-weighted merge (fp32)"),
        ("torch_sdcp", "sdcp::output_lse_combine: one kernel, data-as-flag: stores every peer's head shard and "
                       "LSE into that peer's buffer (peer memory), polls its own buffer as the peers' shards land, "
                       "reads its own shard in place, combines in fp32"),
        ("torch_sdcp masked", "the same kernel with vLLM's empty-shard mask inside (seq_lens, query_start_loc: "
                              "one request per row, every 8th shard empty, the last row padding)"),
    ],
    # The same paths after the V up-projection; legend() says so in one line.
    "output_lse_up": [],
    "decode": [
        ("collective", "query: collective path above; attention; Output/LSE: the fused collective path "
                       "(all_gather, sdcp::lse_correct, reduce_scatter); with --sparse, top-K: collective path"),
        ("torch_sdcp", "query_publish/release (zero copy), attention, output_lse_combine; with --sparse, "
                       "topk_merge"),
    ],
}


def fmt_us(cell: dict, k: str) -> str:
    if "error" in cell:
        return "n/a"
    v = cell.get(k)
    return f"{v:.1f}" if isinstance(v, (int, float)) else "n/a"


# Rows from which the tables print the bytes a call must move and the bandwidth it reaches.
BANDWIDTH_ROWS = 1024
# Memory bandwidth by the datasheet, bytes/s, by a name fragment of
# torch.cuda.get_device_name (most specific first); the share printed is of it.
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                   ("H20", 4.0e12), ("B200", 8.0e12))


def datasheet_bandwidth(device: str) -> float | None:
    """The datasheet memory bandwidth of the GPU named `device`, or None for one not in the table."""
    return next((rate for part, rate in HBM_BYTES_PER_S if part in device), None)


def bandwidth_line(row: dict, paths: list, names: dict, device: str) -> str:
    """The least bytes a rank's call must move through its memory and, per
    path, the bandwidth that makes at its k8 time (with its share of the
    GPU's datasheet bandwidth, where the GPU is in the table)."""
    peak = datasheet_bandwidth(device)
    cells = []
    for p in paths:
        us = row[p].get("k8") if "error" not in row[p] else None
        if isinstance(us, (int, float)) and us > 0:
            rate = row["bytes"] / (us * 1e-6)
            cells.append(f"{names[p]} {rate / 1e12:.2f} TB/s" + (f" ({rate / peak:.0%})" if peak else ""))
    of = f" (of {peak / 1e12:.2f} TB/s, {device}'s datasheet)" if peak else f" ({device}: no datasheet bandwidth known)"
    return f"             bytes moved per rank {row['bytes'] / 1e6:.1f} MB; by them (k8): " + ", ".join(cells) + of


def strongest_baseline(row: dict) -> tuple | None:
    """(name, k8 us) of the fastest baseline path of a row, or None."""
    timed = [(row[p]["k8"], p) for p in PATHS
             if p in row and p not in OURS and isinstance(row[p].get("k8"), (int, float))]
    if not timed:
        return None
    us, p = min(timed)
    return PATH_NAMES[p], us


def legend(names, host: bool = False, tagged: bool = False) -> list:
    """LEGEND's lines for the boundaries `names`; with `host`, as they ran on
    the host backend (gloo in place of NCCL, the ops' CPU implementations);
    with `tagged`, the tagged path's line too."""
    if not host:
        lines = ["\nlegend (what each path runs)"]
    else:
        lines = [("\nlegend (what each path runs; on the host backend every sdcp:: op runs its CPU implementation "
                  "and the collectives run over gloo)")]
    names = list(names)
    for name in names:
        paths = LEGEND.get(name, [])
        if name == "output_lse_up":  # the output_lse lines, once, where that table is not printed
            paths = [UP_LEGEND] + ([] if "output_lse" in names else LEGEND["output_lse"])
        for path, what in paths + ([TAGGED] if tagged and name in TAG_BOUNDARIES else []):
            if host:
                what = what.replace("NCCL; gloo on the host backend", "gloo").replace("NCCL", "gloo")
                path = HOST_PATH_NAMES.get(PATH_KEYS.get(path, ""), path)
            lines.append(f"  {name} / {path}: {what}")
    return lines


def unavailable_paths(rows: list) -> dict:
    """{path: error} of the paths that failed in every row of a boundary."""
    timed = [r for r in rows if "rows" in r]
    paths = [p for p in PATHS if timed and all("error" in r.get(p, {}) for r in timed)]
    return {p: timed[0][p]["error"] for p in paths}


def tables(data: dict) -> str:
    meta, lines = data["meta"], []
    cuda = meta["backend"] == "cuda"
    k8 = "8 calls per CUDA graph" if cuda else "8 calls back to back"
    lines.append(f"torch_sdcp bench, {meta['date']}: world size {meta['world_size']}, {meta['device']}, "
                 f"torch {meta['torch']}; us per call, k8 / k1 (k8: {k8}; k1: one call)")
    names = PATH_NAMES if cuda else HOST_PATH_NAMES
    if cuda:
        lines.append("ratios: the strongest (fastest) baseline of the row over torch_sdcp, k8")
    else:
        lines.append("host backend: these figures check the protocol on shared memory; they are not "
                     "performance, and no speed-up ratio is printed")
        lines.append(HOST_PATHS_NOTE)
    for name, rows in data["results"].items():
        lines.append(f"\n{TITLES.get(name, name)}")
        unavailable = {} if cuda else unavailable_paths(rows)  # said once, above the rows
        for error in dict.fromkeys(unavailable.values()):
            which = ", ".join(names[p] for p, e in unavailable.items() if e == error)
            lines.append(f"  unavailable on the host backend: {which} ({error})")
        for row in rows:
            if "error" in row and len(row) == 1:
                lines.append(f"  could not run: {row['error']}")
            elif "rows" in row:
                paths = [p for p in PATHS if p in row and p not in unavailable]
                cells = [f"{names[p]} {fmt_us(row[p], 'k8')} / {fmt_us(row[p], 'k1')}" for p in paths]
                best = strongest_baseline(row) if cuda else None
                for p in paths:
                    ours = row[p].get("k8") if p in OURS and "error" not in row[p] else None
                    if best and ours:
                        cells.append(f"{best[0]}/{PATH_NAMES[p]} {best[1] / ours:.2f}x")
                lines.append(f"  rows {row['rows']:>4}  " + " | ".join(cells))
                if row.get("bytes") and row["rows"] >= BANDWIDTH_ROWS:
                    lines.append(bandwidth_line(row, paths, names, meta["device"]))
                if "kernels" in row:
                    lines.append("             kernel alone (k8): " + ", ".join(
                        f"{name} {fmt_us(cell, 'k8')}" for name, cell in row["kernels"].items()))
                for p in paths:
                    if "error" in row[p]:
                        lines.append(f"           {names[p]}: {row[p]['error']}")
            elif any(key.endswith("_bytes_per_rank") for key in row):
                lines.append("  memory per rank: " + ", ".join(
                    f"{key[:-len('_bytes_per_rank')].replace('workspace', 'torch_sdcp workspace')} "
                    f"{v / 2**20:.1f} MiB" for key, v in row.items() if key.endswith("_bytes_per_rank"))
                    + "".join(f", {key} {v}" for key, v in row.items() if not key.endswith("_bytes_per_rank")))
            elif "requests" in row:
                c, s, comp = (row[m].get("k1") for m in ("collective", "sdcp", "compute_only"))
                lines.append(f"  {row['layers']} layers, {row['requests']} requests x {row['context']} tokens"
                             f"{', sparse' if row['sparse'] else ''}: outputs agree: {row['agree']} "
                             f"(max rel. error {row['max_rel_error']:.1e})")
                att = row.get("attention")
                if att:
                    timed = ", ".join(f"{k} {'n/a' if v is None else f'{v:.1f} us'}"
                                      for k, v in (row.get("attention_us") or {}).items())
                    lines.append(f"  attention: {att}: {DecodeStep.ATTENTION.get(att, att)}"
                                 + (f" (one layer, timed: {timed})" if timed else ""))
                if c and s:
                    share = lambda t, comp=comp: max(0.0, (t - comp) / t) if comp else float("nan")  # noqa: E731
                    step = (f"  step: {names['collective']} {c:.1f} us ({share(c):.0%} crossing the group), "
                            f"torch_sdcp {s:.1f} us ({share(s):.0%})")
                    lines.append(step + (f", {1 - s / c:.0%} lower" if cuda else ""))
                    if not cuda:
                        lines.append(HOST_DECODE_NOTE.format(world=meta["world_size"]))
            else:
                lines.append(f"  {json.dumps(row)}")
    if cuda:
        world = meta["world_size"]
        where = ("one GPU: no link crossed" if world == 1
                 else f"{world} GPUs: the link as this machine has it")
        lines += step_lines(data["results"], (meta.get("args") or {}).get("preset", ""),
                            {"collective": names["collective"], "sdcp": names["sdcp"]}, "k8", where)
    tagged = any("sdcp_tagged" in r for rows in data["results"].values() for r in rows)
    lines += legend(data["results"].keys(), host=not cuda, tagged=tagged)
    return "\n".join(lines)


def _span(pairs: list) -> str:
    """(rows, ratio) pairs as "rows 1-128, 1.20x-1.85x"."""
    rows = [r for r, _ in pairs]
    ratios = sorted(x for _, x in pairs)
    where = f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}-{rows[-1]}"
    return where + (f", {ratios[0]:.2f}x" if len(ratios) == 1 else f", {ratios[0]:.2f}x-{ratios[-1]:.2f}x")


def verdict(name: str, rows: list, cuda: bool) -> str:
    """One line for a boundary: on CUDA, torch_sdcp's k8 against the strongest
    baseline of each row (the tables' ratio: > 1x, torch_sdcp is faster); on
    the host backend, what ran, and no speed verdict."""
    failed = [r["error"] for r in rows if "error" in r and len(r) == 1]
    if failed:
        return f"  {name}: could not run ({failed[0]})"
    step = next((r for r in rows if "requests" in r), None)
    if step is not None:
        c, s = step.get("collective", {}).get("k1"), step.get("sdcp", {}).get("k1")
        if not cuda or not (c and s):
            return f"  {name}: outputs agree: {step['agree']} (host backend: no speed verdict)" if not cuda else \
                f"  {name}: outputs agree: {step['agree']}; no step time to compare"
        return (f"  {name}: torch_sdcp's step {s:.1f} us against the collective path's {c:.1f} us, "
                f"{abs(1 - s / c):.0%} {'lower' if s < c else 'higher'}; outputs agree: {step['agree']}")
    timed = [r for r in rows if "rows" in r]
    if not timed:
        return f"  {name}: nothing timed"
    if not cuda:
        where = f"row{'s' if len(timed) > 1 else ''} {', '.join(str(r['rows']) for r in timed)}"
        return f"  {name}: ran at {where} (host backend: a protocol check, no speed verdict)"
    faster: list[tuple[int, float]] = []
    slower: list[tuple[int, float]] = []
    missing: list[int] = []
    for r in timed:
        best = strongest_baseline(r)
        ours = r.get("sdcp", {}).get("k8") if "error" not in r.get("sdcp", {}) else None
        if best is None or not isinstance(ours, (int, float)) or ours <= 0:
            missing.append(r["rows"])
        else:
            (faster if best[1] / ours >= 1 else slower).append((r["rows"], best[1] / ours))
    parts = []
    if faster and not slower:
        parts.append(f"torch_sdcp faster than the strongest baseline at every row timed ({_span(faster)})")
    elif slower and not faster:
        parts.append(f"torch_sdcp slower than the strongest baseline at every row timed ({_span(slower)})")
    elif faster:
        parts.append(f"torch_sdcp faster at {_span(faster)}; slower at {_span(slower)}")
    if missing:
        parts.append(f"no ratio at rows {', '.join(map(str, missing))} (a path did not run)")
    return f"  {name}: " + "; ".join(parts)


def verdicts(data: dict) -> list:
    """The closing summary: one verdict line per boundary of the run."""
    cuda = data["meta"]["backend"] == "cuda"
    head = ("verdict (k8: torch_sdcp against the strongest baseline of each row; > 1x: torch_sdcp faster)" if cuda
            else "verdict (host backend: not performance, so no speed verdict)")
    return [head] + [verdict(name, rows, cuda) for name, rows in data["results"].items()]


def host_plot_header(meta: dict, width: float) -> tuple:
    """The host figure's title and note lines, wrapped to a figure `width`
    inches wide, and the height they take above the panels, in inches."""
    title = textwrap.wrap(f"torch_sdcp on the host backend: protocol check, world size {meta['world_size']} "
                          f"({meta['date'][:10]})", width=int(width * 10))
    note = [line for para in HOST_PLOT_NOTE.format(world=meta["world_size"]).split("\n")
            for line in textwrap.wrap(para, width=int(width * 12))]
    return title, note, 0.25 * len(title) + 0.19 * len(note) + 0.1


#: What k8 is, in the plot's legends.
K8_LEGEND = "k8: 8 calls captured back to back\nin one CUDA graph, us per call"
K8_LEGEND_HOST = "k8: 8 calls back to back,\nwall clock per call"


def plot(data: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return "matplotlib is not installed: no plot"
    boundaries = [b for b, rows in data["results"].items()
                  if b != "signal" and any("rows" in r for r in rows)]
    if not boundaries:
        return "no boundary with timed rows: no plot"
    meta = data["meta"]
    cuda = meta["backend"] == "cuda"
    names = PATH_NAMES if cuda else HOST_PATH_NAMES
    width = 5 * len(boundaries)
    if not cuda:
        title, note, header_in = host_plot_header(meta, width)
    fig, axes = plt.subplots(1, len(boundaries), figsize=(width, 4 if cuda else 4 + header_in), squeeze=False)
    for ax, name in zip(axes[0], boundaries, strict=False):
        rows = [r for r in data["results"][name] if "rows" in r]
        for p in PATHS:
            pts = [(r["rows"], r[p]["k8"]) for r in rows if p in r and "k8" in r[p]]
            if pts:
                ax.plot(*zip(*pts, strict=False), marker="o", label=names[p])
        ax.set_xscale("log", base=2)
        measured = sorted({r["rows"] for r in rows})
        ax.set_xticks(measured, [str(r) for r in measured])  # ticks at the measured rows only
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("rows (decode tokens)")
        ax.set_ylabel("us per call (k8)" if cuda else "CPU wall clock us per call (k8)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(title=K8_LEGEND if cuda else K8_LEGEND_HOST, title_fontsize="small", fontsize="small")
        if not cuda:  # on every panel, so that no panel cropped out of the figure reads as speed
            ax.text(0.5, 0.5, "protocol check\nnot performance", transform=ax.transAxes, ha="center",
                    va="center", fontsize=22, color="0.6", alpha=0.35, rotation=20, zorder=0)
    if cuda:
        fig.suptitle(f"torch_sdcp, world size {meta['world_size']}, {meta['device']} ({meta['date'][:10]})")
        fig.tight_layout()
    else:
        height = 4 + header_in
        fig.suptitle("\n".join(title), y=1 - 0.1 / height, va="top")
        fig.text(0.5, 1 - (0.25 + 0.25 * len(title)) / height, "\n".join(note), ha="center", va="top",
                 fontsize=10, color="darkred",
                 bbox={"boxstyle": "round", "facecolor": "mistyrose", "edgecolor": "darkred"})
        fig.tight_layout(rect=(0, 0, 1, 1 - header_in / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
