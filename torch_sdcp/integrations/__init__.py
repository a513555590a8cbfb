"""Engine integrations: adapters with the call shapes of the DCP call sites
engines use today, over workspaces cached per group and geometry.

    from torch_sdcp import integrations as sdcp

    sdcp.prepare_mla_dcp(dcp_group, max_rows=128, num_heads=64)      # model load, every rank
    q = sdcp.query_gather(ql_nope, q_pe, positions, cos_sin_cache, group=dcp_group)
    out = sdcp.cp_lse_ag_out_rs(attn_out, attn_lse, dcp_group)
    sdcp.teardown()                                                   # shutdown, every rank

See docs/INTEGRATION.md and :mod:`torch_sdcp.integrations.dcp`. Every engine
face (these adapters, the vLLM plugin :mod:`torch_sdcp.integrations.vllm`,
the SGLang plugin :mod:`torch_sdcp.integrations.sglang`) runs over one core,
:mod:`torch_sdcp.integrations._face` (the table of boundaries:
:mod:`torch_sdcp.integrations._boundaries`); :func:`counters` reads every face's
calls per seam (on peer memory, fallbacks by reason, void calls, timeouts).
"""

from torch_sdcp.integrations._cache import counters
from torch_sdcp.integrations.dcp import (
    DEFAULT_MAX_ROWS,
    MLADCPWorkspaces,
    all_gather,
    cp_lse_ag_out_rs,
    prepare_all_gather,
    prepare_mla_dcp,
    prepare_output_lse,
    prepare_query_gather,
    prepare_topk,
    query_gather,
    teardown,
    topk_merge,
    workspaces,
)

__all__ = [
    "DEFAULT_MAX_ROWS", "counters", "MLADCPWorkspaces", "all_gather", "cp_lse_ag_out_rs", "prepare_all_gather",
    "prepare_mla_dcp", "prepare_output_lse", "prepare_query_gather", "prepare_topk", "query_gather", "teardown",
    "topk_merge", "workspaces",
]
