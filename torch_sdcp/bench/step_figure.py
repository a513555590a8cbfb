"""What the DCP boundaries of one decode step cost, summed from a run's
measured cells: per model, its layers' query gathers and combines and its
fresh top-K merges, per path and row count. The boundaries only (no
attention, no MoE), and each cell is the figure the table printed, so a step
figure is no better than its cells: a one-GPU run's cells hold no link."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEP_MODELS", "StepModel", "step_lines", "step_us"]


@dataclass(frozen=True)
class StepModel:
    """The boundaries of one decode step of a model."""

    name: str
    layers: int  # attention layers: one query gather and one combine each
    topk_layers: int  # layers that compute a fresh top-K (the others reuse the one before)

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} layers, each one query gather and one combine; "
                f"{self.topk_layers} fresh top-K merges")


#: By bench preset (presets.PRESETS). GLM-5: 78 layers, a fresh top-K in 21
#: (the others share the indexer's result of the layer before); DeepSeek-V3.2:
#: 61 layers, an indexer in each (vLLM's compute_skip_topk_layers: no
#: index_topk_freq, no indexer_types).
STEP_MODELS = {
    "glm-5": StepModel("GLM-5", layers=78, topk_layers=21),
    "deepseek-v3.2": StepModel("DeepSeek-V3.2", layers=61, topk_layers=61),
}

#: The boundaries a step is summed from.
STEP_BOUNDARIES = ("query", "topk", "output_lse")
#: vLLM 0.34's a2a combine after the V up-projection (head_dim 128): from this many rows on.
UP_PROJECTED_FROM_ROWS = 8


def step_us(model: StepModel, query: float, topk: float, output_lse: float) -> float:
    """Microseconds of one step's boundaries from one call of each."""
    return model.layers * (query + output_lse) + model.topk_layers * topk


def _figure(cell: object, key: str) -> float | None:
    if not isinstance(cell, dict) or "error" in cell or "skipped" in cell:
        return None
    v = cell.get(key)
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def step_lines(results: dict, preset: str, columns: dict[str, str], key: str, where: str,
               ratio: bool = True) -> list[str]:
    """The step figure's lines under a run's tables. ``results``: the run's
    {boundary: [row, ...]}; ``columns``: {cell name in a row: its name in the
    line}, the first compared with the last (``ratio``: first over last, the
    tables' ratio; else last minus first); ``key``: the figure (``"k8"``,
    ``"k64"``); ``where``: what the cells are (said in the line)."""
    model = STEP_MODELS.get(preset)
    if model is None:
        return []
    missing = [b for b in STEP_BOUNDARIES if b not in results]
    head = f"\none decode step's DCP boundaries, {model.describe()} ({key} figures above; {where})"
    if missing:
        return [head, f"  not summed: the run has no {', '.join(missing)} (a step needs "
                      f"{', '.join(STEP_BOUNDARIES)})"]
    lines = [head] + _row_lines(results, model, STEP_BOUNDARIES, columns, key, ratio, 0)
    if len(lines) == 1:
        lines.append("  not summed: no row count has all three boundaries")
    if "output_lse_up" in results:  # the run measured the combine after the V up-projection too
        up = _row_lines(results, model, ("query", "topk", "output_lse_up"), columns, key, ratio,
                        UP_PROJECTED_FROM_ROWS)
        if up:
            lines += [f"  with the combine after the V up-projection (output_lse_up, head_dim 128), as vLLM 0.34's "
                      f"a2a runs it from {UP_PROJECTED_FROM_ROWS} rows:"] + up
    return lines


def _row_lines(results: dict, model: StepModel, boundaries: tuple[str, ...], columns: dict[str, str], key: str,
               ratio: bool, from_rows: int) -> list[str]:
    """One line per row count (from ``from_rows``) that every boundary of ``boundaries`` ran."""
    by_rows = {b: {r["rows"]: r for r in results[b] if "rows" in r} for b in boundaries}
    lines = []
    for rows in sorted(r for r in set.intersection(*(set(v) for v in by_rows.values())) if r >= from_rows):
        parts, sums = [], {}
        for cell, label in columns.items():
            figs = [_figure(by_rows[b][rows].get(cell), key) for b in boundaries]
            if all(f is not None for f in figs):
                q, t, o = figs
                assert q is not None and t is not None and o is not None
                sums[label] = step_us(model, q, t, o)
                parts.append(f"{label} {sums[label]:.0f} us")
            else:
                parts.append(f"{label} n/a (a cell did not run)")
        labels = list(columns.values())
        if len(sums) == len(labels) > 1 and sums[labels[-1]] > 0:
            first, last = sums[labels[0]], sums[labels[-1]]
            parts.append(f"{labels[0]}/{labels[-1]} {first / last:.2f}x ({last - first:+.0f} us)" if ratio
                         else f"{labels[-1]} - {labels[0]} {last - first:+.0f} us")
        lines.append(f"  rows {rows:>4}  " + " | ".join(parts))
    return lines
