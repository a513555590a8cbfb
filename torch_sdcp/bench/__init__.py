"""The benchmark, `python -m torch_sdcp.bench` (its options: `--help`): what
each DCP boundary costs through the collective path, the symmetric-memory
competitors and torch_sdcp, plus a synthetic MLA decode step.

    cli          the command: options, local ranks, bench.json, tables.txt, latency.png
    boundaries   one timing function per boundary
    decode       the synthetic decode step (DecodeStep)
    timing       Timer (CUDA graphs or the wall clock) and guarded paths
    presets      the model geometries (--preset)
    one_gpu      --one-gpu N: N virtual ranks on one GPU against each other, world 1 beside them,
                 with one_gpu_boundaries (inputs, calls, grids, reference checks), one_gpu_timing
                 (the two methods), one_gpu_report (the table) and virtual_ranks (their memory)
    report       the paths, their legend, the tables and the plot
"""

from torch_sdcp.bench.cli import main, parse_args
from torch_sdcp.bench.decode import DecodeStep
from torch_sdcp.bench.report import LEGEND, OURS, PATH_NAMES, PATHS, legend, plot, tables

__all__ = ["LEGEND", "OURS", "PATHS", "PATH_NAMES", "DecodeStep", "legend", "main", "parse_args", "plot", "tables"]
