"""The one-GPU run's table (``--one-gpu N``): per boundary and row count, world
1 (the floor) beside world N, with the lines that say how the figures were
made, the co-residency rule and the legend."""

from __future__ import annotations

from torch_sdcp.bench.one_gpu_boundaries import BOUNDARY_CLASSES
from torch_sdcp.bench.one_gpu_competitors import COMPETITORS
from torch_sdcp.bench.one_gpu_timing import ONE_GRAPH_KS, OneGraph
from torch_sdcp.bench.report import BANDWIDTH_ROWS, PATH_NAMES, datasheet_bandwidth
from torch_sdcp.bench.step_figure import step_lines

#: The legend's line on what the competitors' figures are.
COMPETITORS_NOTE = ("the competitors' figures are reproductions (torch_sdcp.competitors: the engines' peer-memory "
                    "paths written here in Triton after their code; each module's docstring says where it differs "
                    "from the original), on the same virtual ranks: their symmetric buffers in each rank's own "
                    "allocation, a peer's at a fixed offset from the own one, as torch symmetric memory maps them "
                    "across processes; checked like torch_sdcp's cells (vLLM direct against vLLM's own selection); "
                    "a competitor's failed cell is said, not counted in the exit status")


def _us(cell: dict, k: str) -> str:
    v = cell.get(k)
    return f"{v:.1f}" if isinstance(v, (int, float)) else "n/a"


def pdl_line(meta: dict) -> str:
    """The table's line on programmatic dependent launch and what the co-residency rule counts for it."""
    if meta.get("pdl"):
        return ("PDL on (SDCP_PDL not 0): a rank's next kernel may hold SM slots while its current one runs, so "
                "every rank counts twice its grid (SDCP_PDL=0 turns PDL off and counts it once)")
    return "PDL off (SDCP_PDL=0 or before compute capability 9.0): every rank counts its grid once"


def bandwidth_cells(row: dict, worlds: list, key: str, device: str) -> str | None:
    """From BANDWIDTH_ROWS rows: per world, the bytes its N ranks must move (N times one rank's,
    as the plain bench counts a rank's) over the step time, with the share of the GPU's
    datasheet bandwidth; all N ranks share this one GPU's memory. None below those rows."""
    if row["rows"] < BANDWIDTH_ROWS:
        return None
    peak = datasheet_bandwidth(device)
    cells = []
    for w in worlds:
        cell = row.get(f"world{w}", {})
        us, moved = cell.get(key), cell.get("rank_bytes")
        if isinstance(us, (int, float)) and us > 0 and moved:
            rate = w * moved / (us * 1e-6)
            cells.append(f"world {w} {w} x {moved / 1e6:.1f} MB, {rate / 1e12:.2f} TB/s"
                         + (f" ({rate / peak:.0%})" if peak else ""))
    if not cells:
        return None
    of = f"of {peak / 1e12:.2f} TB/s, the datasheet's" if peak else "no datasheet bandwidth known"
    return f"           bytes the ranks move ({key}; {of}): " + ", ".join(cells)


def world_cells(row_cells: dict, worlds: list, keys: list, trials: object) -> tuple[list[str], list[str]]:
    """Per world, a path's figure (or why it has none) and the notes under it."""
    cells, notes = [], []
    for world in worlds:
        cell = row_cells.get(f"world{world}", {})
        if "skipped" in cell:
            cells.append(f"world {world} skipped")
            notes.append(f"world {world}: {cell['skipped']}")
        elif "error" in cell:
            cells.append(f"world {world} {'MISMATCH' if cell.get('check') == 'MISMATCH' else 'failed'}")
            notes.append(f"world {world}: {cell['error']}")
        else:
            cells.append(f"world {world} " + " / ".join(_us(cell, k) for k in keys if k in cell or k == keys[0]))
            if cell.get("host_late_trials"):
                notes.append(f"world {world}: the host was still launching when the timed replays began in "
                             f"{cell['host_late_trials']} of {trials} trials (host "
                             f"{cell.get('host_us_per_step', float('nan')):.2f} us per step): the figure "
                             "may include host time")
    floor, top = row_cells.get("world1", {}), row_cells.get(f"world{worlds[-1]}", {})
    first = keys[0]
    if len(worlds) > 1 and all(isinstance(c.get(first), (int, float)) for c in (floor, top)):
        cells.append(f"world {worlds[-1]} - world 1 {top[first] - floor[first]:+.1f} us ({first})")
    return cells, notes


def checked(row_cells: dict, worlds: list) -> str:
    ran = [c for c in (row_cells.get(f"world{w}", {}) for w in worlds) if "skipped" not in c]
    return ("FAILED" if any(c.get("check") == "MISMATCH" for c in ran)
            else "ok" if all(c.get("check") == "ok" for c in ran)
            else "not completed (an error, below)")


def competitor_lines(row: dict, worlds: list, keys: list, trials: object) -> list[str]:
    """Each competitor's line under a row (world N, world N - world 1, against torch_sdcp at world N)."""
    lines = []
    top, first = f"world{worlds[-1]}", keys[0]
    ours = row.get(top, {}).get(first)
    for name, cells in (row.get("competitors") or {}).items():
        parts, notes = world_cells(cells, worlds, keys, trials)
        theirs = cells.get(top, {}).get(first)
        if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and ours > 0:
            parts.append(f"/ torch_sdcp at world {worlds[-1]} {theirs / ours:.2f}x")
        grids = ", ".join(f"world {w} {cells.get(f'world{w}', {}).get('grid_blocks', '?')}" for w in worlds)
        lines.append(f"           {PATH_NAMES.get(name, name) + ':':<18} " + " | ".join(parts)
                     + f"   (waiting grid blocks per rank: {grids}; check {checked(cells, worlds)})")
        lines += [f"             {note}" for note in notes]
    return lines


def method_lines(meta: dict) -> list[str]:
    """The table's lines on how the figure was made (a run before --one-gpu-method: one-graph)."""
    n = meta["one_gpu"]
    head = (f"{meta['date']}: {meta['device']}, torch {meta['torch']}; us per step (one boundary call of every "
            "virtual rank, each on its own stream)")
    if meta.get("method", OneGraph.name) == OneGraph.name:
        return [f"{head}, k8 / k1; method one-graph: k8, 8 steps in ONE CUDA graph, every rank's call a branch of "
                "it (k1: one step per graph), the bench's Timer",
                "a graph does not promise that its branches run concurrently: at N = 4 and 8 some cells whose grids "
                "fit time out at the first replay with this method (docs/NOTES.md)"]
    steps = meta["steps_per_graph"]
    return [f"{head}, k{steps}; method graph-per-rank: each rank's {steps} steps in a CUDA graph of its own, the "
            f"{n} graphs launched on {n} streams forked from rank 0's and joined back; CUDA events on rank 0's "
            f"stream over {meta['replays']} replays, every launch queued first (a spin as head start), median of "
            f"{meta['trials']} trials",
            f"a rank that starts late is waited for by its peers at its first step only: that skew, and the fork, "
            f"join and {n} graph launches of a replay, count 1/{steps} each in a step's figure"]


def tables(data: dict) -> str:
    """The one-GPU run's table: per boundary and row count, world 1 (the
    floor) beside world N, us per step by the method the run used."""
    meta = data["meta"]
    n = meta["one_gpu"]
    worlds = meta["worlds"]
    keys = meta.get("figure_keys", [f"k{k}" for k in ONE_GRAPH_KS])
    lines = [f"torch_sdcp bench: {meta['note']}",
             *method_lines(meta),
             "world 1 is the floor: one virtual rank, the same kernels with no peer, timed the same way",
             f"co-residency: {meta['sms']} SMs; blocks per SM "
             + ("assumed" if meta["blocks_per_sm_assumed"] else "given (--blocks-per-sm)") + ": "
             + ", ".join(f"{b} {v}" for b, v in meta["blocks_per_sm"].items())
             + f"; a row whose {n} grids cannot all be resident is skipped; waits give up after "
               f"{meta['timeout_s']:g} s",
             pdl_line(meta)]
    if meta.get("grid_sms"):
        how = "--one-gpu-slice" if meta.get("sliced") else "SDCP_BENCH_GRID_SMS"
        lines.append(f"grids sized for {meta['grid_sms']} of {meta['sms']} SMs ({how}): every rank's grids are "
                     f"resident at once, so a cell above the slice's rows is {n} ranks' work on one GPU, not a "
                     "whole-GPU rank's; world 1 runs the same slice")
    for name, rows in data["results"].items():
        lines.append(f"\n{name}")
        for row in rows:
            cells, notes = world_cells(row, worlds, keys, meta.get("trials", "?"))
            grids = ", ".join(f"world {w} {row.get(f'world{w}', {}).get('grid_blocks', '?')}" for w in worlds)
            label = "torch_sdcp: " if row.get("competitors") else ""
            lines.append(f"  rows {row['rows']:>4}  {label}" + " | ".join(cells)
                         + f"   (blocks per rank: {grids}; reference check {checked(row, worlds)})")
            lines += [f"           {note}" for note in notes]
            lines += competitor_lines(row, worlds, keys, meta.get("trials", "?"))
            first = keys[0]
            moved_line = bandwidth_cells(row, worlds, first, meta["device"])
            if moved_line:
                lines.append(moved_line)
    if len(worlds) > 1:
        lines += step_lines(data["results"], (meta.get("args") or {}).get("preset", ""),
                            {f"world{w}": f"world {w}" for w in worlds}, keys[0],
                            f"one GPU, {n} virtual ranks: the kernel side only, the link is not in it", ratio=False)
    lines.append("\nlegend (what each virtual rank runs; every rank's region is its own allocation on this GPU, "
                 "so a store into a peer's buffer goes to this GPU's HBM, and the ranks' grids share its SMs)")
    ran = set()
    for name, rows in data["results"].items():
        lines.append(f"  {name}: {BOUNDARY_CLASSES[name].runs}")
        for comp in dict.fromkeys(c for row in rows for c in (row.get("competitors") or {})):
            ran.add(comp)
            lines.append(f"  {name} / {PATH_NAMES.get(comp, comp)}: {COMPETITORS[comp].runs}")
    if ran:
        lines.append(f"  {COMPETITORS_NOTE}")
    if meta.get("failures"):
        lines.append(f"\n{meta['failures']} cell(s) FAILED (mismatch against the reference, or an error)")
    if meta.get("competitor_failures"):
        lines.append(f"{meta['competitor_failures']} competitor cell(s) FAILED (not counted in the exit status)")
    return "\n".join(lines)

