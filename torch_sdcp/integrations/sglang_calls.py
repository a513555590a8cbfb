"""SGLang's DCP call shapes on peer memory: the SGLang face over the
integration core (:mod:`torch_sdcp.integrations._face`).

Each replacement has the signature, shapes and layouts of the SGLang function
it replaces and falls back to that function (or, without SGLang, to
torch_sdcp's collective path) for a call this face does not cover (``fi_a2a``,
a world of one, an fp8 output, a geometry without a workspace, more rows than
the bound, no peer memory), logged once per reason. :func:`prepare` creates
the workspaces of one MLA geometry. :mod:`torch_sdcp.integrations.sglang`
registers these with SGLang and re-exports them; this module never imports
SGLang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from torch_sdcp.integrations._boundaries import OUTPUT_DTYPES, query_direct
from torch_sdcp.integrations._engine import EngineHooks, engine_logger, query_geometry, workspace_options
from torch_sdcp.integrations._face import Face, Seam, Site
from torch_sdcp.integrations._groups import normalise_device
from torch_sdcp_settings import SGLANG

__all__ = ["LAYER", "REPLACED", "all_gather_q_for_mla_decode", "check", "configure", "cp_lse_ag_out_rs_mla",
           "dcp_a2a_lse_reduce", "engine", "face", "forget_early", "in_layer", "prepare", "teardown", "workspaces"]

_OWN_PATH = "SGLang's own"

face = Face("sglang", via="cpu_group", create_missing=False, make_logger=engine_logger("sglang"),
            options=workspace_options(SGLANG))


class SGLangHooks(EngineHooks):
    """What the calls read from SGLang, and whether install() patched it."""

    def __init__(self) -> None:
        super().__init__()
        self.installed = False
        # Made before SGLang sized its KV pool: the rows bound used, by model
        # runner, and the workspaces (by id) whose bytes SGLang counted.
        self.early_rows: dict[int, int] = {}
        self.early: set[int] = set()


#: What the calls read from SGLang, and whether install() patched it.
engine = SGLangHooks()


class _Layer:
    """The MLA layer whose forward method runs now (``layer_id``), or None:
    the call tag of the seams it calls. A plain object, not a thread-local,
    so that torch.compile traces its reads and writes."""

    tag: int | None = None


#: The layer of the running MLA forward method (set by :func:`in_layer`).
LAYER = _Layer()


def in_layer(original: Callable, attention: Any, *args: Any, **kwargs: Any) -> Any:
    """Around SGLang's ``forward_absorb_prepare`` / ``forward_absorb_core``
    (``DeepseekMLAForwardMixin``, which issue the query gather and the
    combine): the attention's ``layer_id`` is the call tag of the seams run
    inside, so that a layer skipped or reordered on one rank is named on
    every rank. Restored after, so a seam called from elsewhere is untagged."""
    layer_id = getattr(attention, "layer_id", None)
    before = LAYER.tag
    LAYER.tag = layer_id if isinstance(layer_id, int) and not isinstance(layer_id, bool) and layer_id >= 0 else None
    try:
        return original(attention, *args, **kwargs)
    finally:
        LAYER.tag = before


def configure(*, dcp_group: Callable[[], Any] | None = None, originals: dict[str, Callable] | None = None) -> None:
    """Set, without SGLang, what :func:`install` reads from it: the DCP group
    (``get_parallel().dcp_group``) and the fallbacks by name
    (``cp_lse_ag_out_rs_mla``, ``dcp_a2a_lse_reduce``,
    ``all_gather_q_for_mla_decode``)."""
    engine.configure(dcp_group, originals)


def workspaces() -> list[Any]:
    """Every workspace this face prepared in this process."""
    return face.workspaces()


def teardown() -> None:
    """Close every prepared workspace (collective: every DCP rank, at
    shutdown, outside capture) and forget them. Idempotent."""
    forget_early()
    face.teardown()


def forget_early() -> None:
    engine.early_rows.clear()
    engine.early.clear()


def check() -> None:
    """Raise if a live workspace of this face recorded a failure on this
    rank (a call failed, timed out or a peer aborted it): the core's
    :func:`~torch_sdcp.integrations._cache.check_live_workspaces`. Never
    synchronises (it reads the error record the kernels keep in host-mapped
    memory), so it costs microseconds per step and sees failures inside
    replayed CUDA graphs."""
    face.check()


def prepare(group: Any, *, max_rows: int, local_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
            device: Any, combine: bool = True, query: bool = True) -> dict[str, bool]:
    """Prepare (collectively: every rank of ``group``, same order) the
    workspaces of one MLA geometry: the Output/LSE combine of
    ``local_heads x N`` heads of ``kv_lora_rank`` and the query gather of
    ``local_heads`` heads of ``rope_dim + kv_lora_rank``, both for up to
    ``max_rows`` rows of ``dtype``. Returns which boundaries run on peer
    memory; the others keep SGLang's own path (logged once)."""
    g = face.group(group, "group")
    dev = normalise_device(device)
    done = {"output_lse": False, "query": False}
    if combine and dtype in OUTPUT_DTYPES:
        done["output_lse"] = face.try_prepare(
            "output_lse", g, {"total_heads": local_heads * g.world, "head_dim": kv_lora_rank, "dtype": dtype}, dev,
            max_rows, 1, _OWN_PATH)
    width = rope_dim + kv_lora_rank
    if query and query_direct(width, dtype):
        done["query"] = face.try_prepare("query", g, query_geometry(local_heads, width, dtype), dev, max_rows, 1,
                                          _OWN_PATH)
    return done



# ---------------------------------------------------------------------------
# The replacements: SGLang's signatures, shapes and layouts
# ---------------------------------------------------------------------------


def _fallback(name: str) -> Callable:
    original = engine.originals.get(name)
    return original if original is not None else _COLLECTIVE[name]


def _pg(cp_group: Any) -> Any:
    return getattr(cp_group, "device_group", cp_group)


def _collective_ag_rs(cp_attn_out, cp_attn_lse, cp_group, ctx=None, is_lse_base_on_e=False):
    from torch_sdcp import collective

    out = collective.lse_all_gather_correct_reduce_scatter(cp_attn_out, cp_attn_lse.float(),
                                                           base2=not is_lse_base_on_e, group=_pg(cp_group))
    return out.transpose(0, 1)  # the head-major [H/N, B, D] storage the collective wrote


def _collective_a2a(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=True, cuda_graph_buffers=None,
                    comm_backend="a2a"):
    from torch_sdcp import collective

    out = collective.lse_all_gather_correct_reduce_scatter(cp_attn_out, cp_attn_lse.float(),
                                                           base2=not is_lse_base_on_e, group=_pg(cp_group))
    return out.contiguous()


def _collective_query(q_nope_out, q_pe):
    from torch_sdcp import collective

    if engine.dcp_group is None:
        raise RuntimeError("torch_sdcp: all_gather_q_for_mla_decode has no DCP group: install() the plugin in "
                           "SGLang, or configure(dcp_group=...) first")
    combined = torch.cat([q_pe, q_nope_out], dim=-1)
    return _split(collective.all_gather_heads(combined, _pg(engine.dcp_group())), q_pe.shape[-1])


_COLLECTIVE: dict[str, Callable] = {"cp_lse_ag_out_rs_mla": _collective_ag_rs, "dcp_a2a_lse_reduce": _collective_a2a,
                                    "all_gather_q_for_mla_decode": _collective_query}
#: The SGLang functions this face replaces, by name (install() reads them as the fallbacks).
REPLACED = tuple(_COLLECTIVE)


def _combine_inputs(cp_attn_out: Tensor, cp_attn_lse: Tensor) -> tuple[Tensor, Tensor] | None:
    """(out [B, H, D], lse [B, H] fp32) as the peer path takes them, or None
    for what only SGLang's own function handles (another rank count, an fp8
    output, an LSE that is not [B, H] up to a 1-sized dimension)."""
    if cp_attn_out.dim() != 3 or cp_attn_out.dtype not in OUTPUT_DTYPES:
        return None
    lse = cp_attn_lse
    if lse.dim() == 3 and 1 in lse.shape[1:]:
        lse = lse.squeeze(-1) if lse.shape[-1] == 1 else lse.squeeze(1)
    if tuple(lse.shape) != tuple(cp_attn_out.shape[:2]):
        return None
    return cp_attn_out, lse


_SEAMS = {name: Seam("output_lse", name, _OWN_PATH, missing=f"{name} takes {_OWN_PATH} path")
          for name in ("cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce")}
_QUERY = Seam("query", "all_gather_q_for_mla_decode", _OWN_PATH, missing=f"the query gather takes {_OWN_PATH} path")


def _combine(name: str, cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any,
             is_lse_base_on_e: bool) -> Tensor | None:
    """The combine on the Output/LSE workspace: this rank's heads [B, H/N, D]
    contiguous, or None when the call takes SGLang's own function (a call
    this face does not cover, or the face's decision: logged, counted)."""
    group = face.group(cp_group, "cp_group")
    if group.world == 1:
        return None
    inputs = _combine_inputs(cp_attn_out, cp_attn_lse)
    if inputs is None:
        face.log_once("warning", ("uncovered", name, cp_attn_out.dtype, cp_attn_out.dim()), "torch_sdcp: %s of %s %s "
                  "with LSE %s is not covered; it takes %s path", name, list(cp_attn_out.shape), cp_attn_out.dtype,
                  list(cp_attn_lse.shape), _OWN_PATH)
        return None
    out, lse = inputs
    rows, heads, dim = out.shape
    if rows == 0:
        return None
    base = "e" if is_lse_base_on_e else "2"
    seam = _SEAMS[name]
    ws = face.workspace_for(seam, Site(group, {"total_heads": heads, "head_dim": dim, "dtype": out.dtype}, out.device),
                            rows)
    if ws is None:
        return None
    with face.counted(seam):
        return ws.combine(out.contiguous(), lse.float().contiguous(), lse_base=base, tag=LAYER.tag)


def cp_lse_ag_out_rs_mla(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, ctx: Any = None,
                         is_lse_base_on_e: bool = False) -> Tensor:
    """SGLang's ``cp_lse_ag_out_rs_mla`` (``--dcp-comm-backend ag_rs``) on peer
    memory: ``cp_attn_out [B, H, D]`` and ``cp_attn_lse [B, H]`` of this rank's
    KV shard -> this rank's heads, head-major ``[H/N, B, D]`` (the caller
    transposes; here a transposed view of contiguous ``[B, H/N, D]``, so the
    caller's transpose is contiguous). LSE base 2 unless ``is_lse_base_on_e``.
    NaN and +inf LSEs are empty shards, as in SGLang's kernel; ``ctx`` (its
    Triton kernel cache) is accepted and ignored."""
    args = (cp_attn_out, cp_attn_lse, cp_group, ctx, is_lse_base_on_e)
    out = _combine("cp_lse_ag_out_rs_mla", cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e)
    if out is None:
        return _fallback("cp_lse_ag_out_rs_mla")(*args)
    return out.transpose(0, 1)


def dcp_a2a_lse_reduce(cp_attn_out: Tensor, cp_attn_lse: Tensor, cp_group: Any, is_lse_base_on_e: bool = True,
                       cuda_graph_buffers: dict | None = None, comm_backend: str = "a2a") -> Tensor:
    """SGLang's ``dcp_a2a_lse_reduce`` (``--dcp-comm-backend a2a``) on peer
    memory: the same inputs as :func:`cp_lse_ag_out_rs_mla`, this rank's heads
    ``[B, H/N, D]`` contiguous. ``cuda_graph_buffers`` (SGLang's staging
    buffers) are not needed and ignored; ``comm_backend="fi_a2a"`` (FlashInfer's
    MNNVL kernel) runs SGLang's own function."""
    args = (cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e, cuda_graph_buffers, comm_backend)
    own = _fallback("dcp_a2a_lse_reduce")
    if comm_backend != "a2a" or cp_attn_lse.dtype != torch.float32:  # SGLang's own checks and kernels
        return own(*args)
    out = _combine("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e)
    return own(*args) if out is None else out


def _split(gathered: Tensor, rope_dim: int) -> tuple[Tensor, Tensor]:
    """(q_nope_out, q_pe) views of the gathered cat([q_pe, q_nope]) heads."""
    return gathered[..., rope_dim:], gathered[..., :rope_dim]


def all_gather_q_for_mla_decode(q_nope_out: Tensor, q_pe: Tensor) -> tuple[Tensor, Tensor]:
    """SGLang's ``all_gather_q_for_mla_decode`` on peer memory:
    ``q_nope_out [B, H, Dn]`` and ``q_pe [B, H, R]`` on every DCP rank ->
    ``(q_nope_out [B, N*H, Dn], q_pe [B, N*H, R])``, head ``src*H + h``, two
    views of one gathered ``cat([q_pe, q_nope])`` buffer, every non-NaN value
    bit-exact. SGLang's buffer is head-major ``[N*H, B, R+Dn]``, this one
    token-major ``[B, N*H, R+Dn]``: the same shapes, dtype and values, the
    last dimension contiguous in both (docs/SGLANG.md)."""
    own = _fallback("all_gather_q_for_mla_decode")
    if engine.dcp_group is None or q_nope_out.dim() != 3 or q_pe.dim() != 3 or q_nope_out.shape[:2] != q_pe.shape[:2] \
            or q_nope_out.dtype != q_pe.dtype or q_nope_out.shape[0] == 0:
        return own(q_nope_out, q_pe)
    group = face.group(engine.dcp_group(), "cp_group")
    if group.world == 1:
        return own(q_nope_out, q_pe)
    rows, heads, _ = q_nope_out.shape
    rope_dim = q_pe.shape[-1]
    width = rope_dim + q_nope_out.shape[-1]
    ws = face.workspace_for(_QUERY, Site(group, query_geometry(heads, width, q_pe.dtype), q_pe.device), rows)
    if ws is None:
        return own(q_nope_out, q_pe)
    with face.counted(_QUERY):
        return _split(ws.all_gather_heads(torch.cat([q_pe, q_nope_out], dim=-1), tag=LAYER.tag), rope_dim)

