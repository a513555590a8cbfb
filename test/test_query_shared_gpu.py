"""Query family at DCP4 and DCP8 with every rank on GPU 0 (time-sliced,
correctness only): the producer's gather, all_gather_heads, the view read
late and NaN queries, in one spawn per world size."""

from __future__ import annotations

import pytest
import torch
from _dist import in_turn, run_workers
from _helpers import SHARED_GPU_WORLDS, requires_gpus
from _query import GATHER_DTYPES
from test_query_gather import _heads_worker, _peer_gather_worker
from test_query_produce import _nan_producer_worker
from test_query_view import _view_worker

# DCP4 and DCP8 with every rank on GPU 0 (time-sliced, correctness only): the
# fused producer's gather (rows 1 and max_rows, both dtypes and RoPE styles),
# all_gather_heads with sentinel words and NaNs in every dtype, the view read
# late, NaN queries through the producer, gather and view.
SHARED_GPU_WORLD_CASES = [(1, 8, torch.float8_e4m3fn, "interleaved", 0.02), (17, 16, torch.bfloat16, "neox", None),
                          (32, 8, torch.float8_e4m3fn, "neox", None)]


@requires_gpus(1)
@pytest.mark.parametrize("world", SHARED_GPU_WORLDS)
def test_peer_gather_heads_and_view_cuda_shared_gpu(world):
    rows = [1, 32]
    steps = ((_peer_gather_worker, ("cuda", SHARED_GPU_WORLD_CASES, 32, True)),
             (_heads_worker, ("cuda", rows, 32, True)), (_view_worker, ("cuda_shared", 6, world - 1)),
             (_nan_producer_worker, ("cuda_shared",)))
    assert run_workers(in_turn, world, args=steps, timeout=240) == \
        [[len(SHARED_GPU_WORLD_CASES), len(rows) * len(GATHER_DTYPES), 6, True]] * world
