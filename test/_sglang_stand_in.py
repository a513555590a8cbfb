"""A thin stand-in for the parts of SGLang 0.5.23 the SGLang plugin touches
(module paths, signatures, the call site's by-name imports, the runner's
pre-capture point, the step, the scheduler's event loops and result
processing, the server arguments' CLI, the shutdown call), whose DCP functions are
SGLang's own (sglang/srt/layers/dcp/comm.py and the Triton kernels of
sglang/kernels/ops/attention/dcp_kernels.py) written in plain torch, step by
step: the reference the plugin's results are compared with. Used by
test_sglang_plugin.py and test_sglang_graphs.py; holds no tests.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types

import torch
import torch.distributed as dist
from _engine_stand_in import InModules, all_gather_bytes, packages

H_LOC, D, R = 2, 32, 16  # local heads, kv_lora_rank, qk_rope_head_dim
MAX_BS, TOKENS_PER_REQ = 4, 4
BOUND = MAX_BS * TOKENS_PER_REQ  # SGLang's widest decode batch in rows

COMM = "sglang.srt.layers.dcp.comm"
FORWARD_MLA = "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla"
RUNNER = "sglang.srt.model_executor.runner.base_runner"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
RUNTIME = "sglang.srt.runtime_context"
REGISTRY = "sglang.srt.plugins.hook_registry"
SCHEDULER = "sglang.srt.managers.scheduler"
SERVER_ARGS = "sglang.srt.server_args"
MODULES = ("sglang", "sglang.version", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.dcp", COMM,
           RUNTIME, "sglang.srt.plugins", REGISTRY, "sglang.srt.model_executor", "sglang.srt.model_executor.runner",
           RUNNER, MODEL_RUNNER, "sglang.srt.distributed", PARALLEL_STATE, "sglang.srt.models",
           "sglang.srt.models.deepseek_common", "sglang.srt.models.deepseek_common.attention_forward_methods",
           FORWARD_MLA, "sglang.srt.managers", SCHEDULER, SERVER_ARGS)


# ---------------------------------------------------------------------------
# SGLang's DCP functions in plain torch (sglang/srt/layers/dcp/comm.py and
# sglang/kernels/ops/attention/dcp_kernels.py of 0.5.23)
# ---------------------------------------------------------------------------


class Coordinator:
    """The part of SGLang's GroupCoordinator the DCP functions use."""

    def __init__(self, pg):
        self.cpu_group = self.device_group = pg
        self.world_size = dist.get_world_size(pg)
        self.rank_in_group = dist.get_rank(pg)
        self.unique_name = "dcp:0"

    def all_gather(self, x, dim=-1):
        return all_gather_bytes(x, self.world_size, self.device_group, dim)

    def reduce_scatter_along_dim(self, x, dim=0):
        total = x.clone()
        dist.all_reduce(total, group=self.device_group)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def all_to_all_single(self, output, input_):
        dist.all_to_all_single(output, input_, group=self.device_group)


def _empty_to_neg_inf(x):
    return torch.where(torch.isnan(x) | (x == math.inf), -math.inf, x)


def ref_cp_lse_ag_out_rs_mla(cp_attn_out, cp_attn_lse, cp_group, ctx=None, is_lse_base_on_e=False):
    if cp_group.world_size == 1:
        return cp_attn_out
    cp_attn_lse = cp_attn_lse.to(torch.float32)
    n = cp_group.world_size
    lses = cp_group.all_gather(cp_attn_lse, dim=0).view((n,) + cp_attn_lse.shape)  # _ag_lse
    # _correct_attn_cp_out_kernel, every (b, h) at once
    exp, log = (torch.exp, torch.log) if is_lse_base_on_e else (torch.exp2, torch.log2)
    lse = _empty_to_neg_inf(lses)
    lse_max = lse.max(dim=0).values
    lse_max = torch.where(lse_max == -math.inf, 0.0, lse_max)
    final_lse = log(exp(lse - lse_max).sum(dim=0)) + lse_max
    factor = exp(_empty_to_neg_inf(lses[cp_group.rank_in_group] - final_lse))
    new_output = (cp_attn_out.float() * factor.unsqueeze(-1)).transpose(0, 1).contiguous()  # [H, B, D] fp32
    out = cp_group.reduce_scatter_along_dim(new_output, dim=0)
    return out.to(cp_attn_out.dtype)


def ref_dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=True, cuda_graph_buffers=None,
                           comm_backend="a2a"):
    if cp_group.world_size == 1:
        return cp_attn_out
    assert comm_backend == "a2a", "the stand-in has no FlashInfer"
    n = cp_group.world_size
    b, h, d = cp_attn_out.shape
    hp = h // n
    lpd = torch.finfo(torch.float32).bits // torch.finfo(cp_attn_out.dtype).bits  # _lse_pack_dim
    send = torch.empty(n, b, hp, d + lpd, dtype=cp_attn_out.dtype)
    recv = torch.empty_like(send)
    # dcp_pack_a2a_send: head h goes to peer h // hp, LSE as fp32 words after the output
    send[:, :, :, :d] = cp_attn_out.view(b, n, hp, d).transpose(0, 1)
    send.view(torch.float32)[:, :, :, d // lpd] = cp_attn_lse.view(b, n, hp).transpose(0, 1)
    cp_group.all_to_all_single(recv.reshape(-1).view(torch.uint8), send.reshape(-1).view(torch.uint8))
    recv_output = recv[:, :b, :, :d]
    recv_lse = recv.view(torch.float32)[:, :b, :, d // lpd]
    # _dcp_lse_combine_kernel
    exp = torch.exp if is_lse_base_on_e else torch.exp2
    lse = _empty_to_neg_inf(recv_lse.float())
    lse_max = lse.max(dim=0).values
    lse_max = torch.where(lse_max == -math.inf, 0.0, lse_max)
    w = exp(lse - lse_max)
    acc = (recv_output.float() * w.unsqueeze(-1)).sum(dim=0) / torch.clamp(w.sum(dim=0), min=1.0).unsqueeze(-1)
    return acc.to(cp_attn_out.dtype)


def ref_all_gather_q_for_mla_decode(q_nope_out, q_pe, group):
    combined = torch.cat([q_pe.transpose(0, 1), q_nope_out.transpose(0, 1)], dim=-1)
    gathered = group.all_gather(combined, dim=0)
    q_pe, q_nope_out = gathered.split([q_pe.size(-1), q_nope_out.size(-1)], dim=-1)
    return q_nope_out.transpose(0, 1), q_pe.transpose(0, 1)


# ---------------------------------------------------------------------------
# The stand-in
# ---------------------------------------------------------------------------


def _stand_in_registry(mod):
    """SGLang's HookRegistry as far as the plugin uses it: REPLACE, BEFORE and
    AFTER hooks on dotted targets, applied with the by-name imports rewritten."""
    import enum
    import functools
    import pkgutil

    class HookType(enum.Enum):
        BEFORE, AFTER, REPLACE, AROUND = "before", "after", "replace", "around"

    class HookRegistry:
        hooks: list = []

        @classmethod
        def register(cls, target, hook, hook_type=HookType.AFTER):
            cls.hooks.append((target, hook, hook_type))

        @classmethod
        def apply_hooks(cls):
            for target, hook, kind in cls.hooks:
                path, name = target.rsplit(".", 1)
                owner = pkgutil.resolve_name(path)
                original = getattr(owner, name)
                raw = vars(owner).get(name) if isinstance(owner, type) else None
                if isinstance(raw, (classmethod, staticmethod)):  # kept as such, as SGLang's _apply_target does
                    original = raw.__func__

                def wrapper(*a, _o=original, _h=hook, _k=kind, **k):
                    if _k is HookType.REPLACE:
                        return _h(*a, **k)
                    if _k is HookType.AROUND:
                        return _h(_o, *a, **k)
                    if _k is HookType.BEFORE:
                        _h(*a, **k)
                        return _o(*a, **k)
                    result = _o(*a, **k)
                    _h(result, *a, **k)
                    return result

                wrapped = functools.wraps(original)(wrapper)
                if isinstance(raw, (classmethod, staticmethod)):
                    wrapped = type(raw)(wrapped)
                setattr(owner, name, wrapped)
                for m in list(sys.modules.values()):
                    for attr, value in list(vars(m).items()) if isinstance(m, types.ModuleType) else ():
                        if value is original and m is not owner:
                            setattr(m, attr, wrapped)
            cls.hooks = []

    mod.HookType, mod.HookRegistry = HookType, HookRegistry


def _real_registry():
    """SGLang's own hook_registry.py (standard library only) when its sources
    are importable, else None."""
    try:
        spec = importlib.util.find_spec("sglang")
    except ValueError:  # a stand-in without a spec is in sys.modules
        return None
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "srt", "plugins", "hook_registry.py")
    return path if os.path.exists(path) else None


def _fresh(cls):
    """A copy of ``cls`` with its own namespace (static and class methods
    included), as SGLang's hook registry finds them in a class's __dict__."""
    return type(cls.__name__, cls.__bases__, {k: v for k, v in vars(cls).items()
                                              if k not in ("__dict__", "__weakref__")})


def build_fake_sglang(version="0.5.23"):
    mods = packages(MODULES)
    ns = types.SimpleNamespace(mods=mods, calls=[], events=[])
    mods["sglang.version"].__version__ = version
    parallel = types.SimpleNamespace(dcp_enabled=True, dcp_group=None, dcp_comm_backend="ag_rs",
                                     dcp_replicate_q_proj=False)
    ns.parallel = parallel
    mods[RUNTIME].get_parallel = lambda: parallel
    # The resolved configuration bags the plugin reads before the KV pool exists.
    ns.graphs = types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
        decode=types.SimpleNamespace(bs=[1, 2, MAX_BS])))
    ns.schedule = types.SimpleNamespace(max_running_requests=None)
    mods[RUNTIME].get_exec = lambda: types.SimpleNamespace(graph=ns.graphs)
    mods[RUNTIME].get_schedule = lambda: ns.schedule
    ns.at_kv_sizing = lambda: None  # what a test looks at when SGLang measures the free memory

    comm = mods[COMM]

    def cp_lse_ag_out_rs_mla(cp_attn_out, cp_attn_lse, cp_group, ctx=None, is_lse_base_on_e=False):
        ns.calls.append("cp_lse_ag_out_rs_mla")
        return ref_cp_lse_ag_out_rs_mla(cp_attn_out, cp_attn_lse, cp_group, ctx, is_lse_base_on_e)

    def dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e=True, cuda_graph_buffers=None,
                           comm_backend="a2a"):
        ns.calls.append("dcp_a2a_lse_reduce")
        return ref_dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e, cuda_graph_buffers,
                                      comm_backend)

    def all_gather_q_for_mla_decode(q_nope_out, q_pe):
        ns.calls.append("all_gather_q_for_mla_decode")
        return ref_all_gather_q_for_mla_decode(q_nope_out, q_pe, parallel.dcp_group)

    comm.cp_lse_ag_out_rs_mla = cp_lse_ag_out_rs_mla
    comm.dcp_a2a_lse_reduce = dcp_a2a_lse_reduce
    comm.all_gather_q_for_mla_decode = all_gather_q_for_mla_decode
    fm = mods[FORWARD_MLA]  # the call site imported the three by name
    fm.cp_lse_ag_out_rs_mla, fm.dcp_a2a_lse_reduce = cp_lse_ag_out_rs_mla, dcp_a2a_lse_reduce
    fm.all_gather_q_for_mla_decode = all_gather_q_for_mla_decode

    class DeepseekMLAForwardMixin:
        """forward_mla.py's two methods that call the seams (the query gather,
        the combine); here each runs the ``forward_batch`` callable it is given."""

        def forward_absorb_prepare(self, positions, hidden_states, forward_batch, zero_allocator,
                                   llama_4_scaling=None, prev_topk_indices=None):
            return forward_batch()

        def forward_absorb_core(self, q_pe, k_pe, q_nope_out, k_nope, forward_batch, zero_allocator, positions,
                                topk_indices, llama_4_scaling, fusion_plan=None, attention_output_gate=None):
            return forward_batch()

    fm.DeepseekMLAForwardMixin = DeepseekMLAForwardMixin

    class BaseRunner:
        def __init__(self, model_runner):
            self.model_runner = model_runner

        def _pre_initialize_fi_a2a_workspace(self):
            ns.events.append("fi_a2a")

        def _widest_decode_rows(self):
            return MAX_BS * self.model_runner.decode_num_tokens_per_req()

    class ModelRunner:
        def __init__(self, model, is_draft_worker=False):
            self.model, self.device, self.is_draft_worker = model, "cpu", is_draft_worker
            self.model_config = types.SimpleNamespace(dtype=torch.bfloat16)
            self.max_running_requests = 64
            self.pre_model_load_memory, self.mem_fraction_static = 80.0, 0.85  # GB, fraction

        def alloc_memory_pool(self, memory_pool_config=None, *, draft_parallel_layout=None):
            # KVCacheConfigurator.configure -> _profile_available_bytes: the pool
            # is sized from the free memory measured here.
            ns.events.append(("kv-pool", ns.at_kv_sizing()))

        def decode_num_tokens_per_req(self, *, num_draft_tokens=None):
            return TOKENS_PER_REQ

        def forward(self, forward_batch, skip_attn_backend_init=None, pp_proxy_tensors=None,
                    reinit_attn_backend=False, split_forward_count=1):
            return forward_batch()

    mods[RUNNER].BaseRunner, mods[MODEL_RUNNER].ModelRunner = BaseRunner, ModelRunner
    mods[SCHEDULER].Scheduler = _fresh(Scheduler)  # hooks patch classes: one copy per stand-in
    mods[SERVER_ARGS].ServerArgs = _fresh(ServerArgs)
    mods[PARALLEL_STATE].abort_distributed_environment = lambda: ns.events.append("abort")

    path = _real_registry()
    if path is not None:
        spec = importlib.util.spec_from_file_location(REGISTRY, path)
        mods[REGISTRY] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[REGISTRY])
    else:
        _stand_in_registry(mods[REGISTRY])
    ns.real_registry = path is not None
    return ns


# ---------------------------------------------------------------------------
# The scheduler: its two event loops and result processing (SGLang 0.5.23's
# sglang/srt/managers/scheduler.py and scheduler_components/batch_result_processor.py)
# ---------------------------------------------------------------------------


class Device:
    """A GPU's work queue: what a forward launches completes later, in launch
    order, when a wait reaches it (an event's synchronize, a blocking copy).
    A failing collective records its error (in host-mapped memory) only when
    its kernel runs, so the host sees it only after such a wait."""

    def __init__(self):
        self.launched, self.done = [], 0

    def launch(self, kernel):
        self.launched.append(kernel)

    def complete(self, upto=None):
        upto = len(self.launched) if upto is None else upto
        while self.done < upto:
            self.launched[self.done]()
            self.done += 1


class Event:
    """``device_module.Event``: recorded after the work launched so far;
    ``synchronize()`` waits for that work."""

    def __init__(self, device):
        self.device, self.mark = device, None

    def record(self):
        self.mark = len(self.device.launched)

    def synchronize(self):
        self.device.complete(self.mark)


class BatchResult:
    """GenerationBatchResult as far as result processing reads it."""

    def __init__(self, next_token_ids):
        self.next_token_ids, self.copy_done = next_token_ids, None


class SchedulerBatchResultProcessor:
    """process_batch_result_decode: the step's own synchronisation first
    (``result.copy_done.synchronize()``, or, without copy_done, the blocking
    ``next_token_ids.tolist()`` on the scheduler's stream), then the outputs
    streamed to the detokenizer (``output_streamer.stream_output``)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def process_batch_result_decode(self, batch, result):
        if result.copy_done is not None:
            result.copy_done.synchronize()
        else:
            self.scheduler.device.complete()  # tolist() waits for the stream
        self.scheduler.outputs.append((batch, result.next_token_ids))


class Scheduler:
    """The two loops of Scheduler.run_event_loop. ``run_batch`` launches the
    forward (ModelRunner.forward) and, under overlap, records ``copy_done``
    after it (the device-to-host copy on the copy stream); the normal loop
    processes each batch's result right after its forward, the overlap loop
    (``event_loop_overlap``) one step late: batch N's result is processed
    (``pop_and_process``) after batch N+1's forward was launched."""

    def __init__(self, model_runner, device, enable_overlap):
        self.model_runner, self.device, self.enable_overlap = model_runner, device, enable_overlap
        self.batch_result_processor = SchedulerBatchResultProcessor(self)
        self.outputs = []  # what reached the detokenizer, in order

    def run_batch(self, batch):
        result = BatchResult(self.model_runner.forward(batch))
        if self.enable_overlap:
            result.copy_done = Event(self.device)
            result.copy_done.record()
        return result

    def process_batch_result(self, batch, result):
        self.batch_result_processor.process_batch_result_decode(batch, result)

    def event_loop_normal(self, batches):
        for batch in batches:
            result = self.run_batch(batch)
            self.process_batch_result(batch, result)

    def event_loop_overlap(self, batches):
        result_queue, last_batch = [], None
        for batch in list(batches) + [None]:
            if batch is not None:
                result_queue.append((batch, self.run_batch(batch)))
            if last_batch is not None:
                self.process_batch_result(*result_queue.pop(0))
            last_batch = batch


# ---------------------------------------------------------------------------
# Server arguments (sglang/srt/server_args.py): a msgspec record whose fields
# are fixed when the module is imported; from_cli_args keeps only them
# ---------------------------------------------------------------------------


class ServerArgs:
    FIELDS = ("model_path", "dcp_comm_backend")

    def __init__(self, **fields):
        for name in self.FIELDS:
            setattr(self, name, fields.get(name))

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", type=str)
        parser.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a", "fi_a2a"], default="ag_rs")

    @classmethod
    def from_cli_args(cls, args):
        return cls(**{name: getattr(args, name) for name in cls.FIELDS if hasattr(args, name)})

    def resolved_dict(self):
        return {name: getattr(self, name) for name in self.FIELDS}


class MLA(torch.nn.Module):
    """The attributes of DeepseekV2AttentionMLA the plugin reads."""

    def __init__(self, dcp_size):
        super().__init__()
        self.dcp_size, self.num_local_heads, self.kv_lora_rank, self.qk_rope_head_dim = dcp_size, H_LOC, D, R


def decode_step(ns, q_nope_out, q_pe, attn_output, lse, is_lse_base_on_e, layer=None):
    """forward_mla.py's decode phase around the three seams, through the
    module's by-name bindings; with ``layer`` (an attention with a
    ``layer_id``), inside its ``forward_absorb_prepare`` (the query gather)
    and ``forward_absorb_core`` (the combine), as SGLang calls them."""
    fm, parallel = ns.mods[FORWARD_MLA], ns.parallel

    def gather():
        return fm.all_gather_q_for_mla_decode(q_nope_out=q_nope_out, q_pe=q_pe)

    def combine():
        n = parallel.dcp_group.world_size
        out = attn_output.view(-1, H_LOC * n, D)
        if parallel.dcp_comm_backend in ("a2a", "fi_a2a"):
            return fm.dcp_a2a_lse_reduce(out.contiguous(), lse.contiguous(), parallel.dcp_group,
                                         is_lse_base_on_e=is_lse_base_on_e, comm_backend=parallel.dcp_comm_backend)
        return fm.cp_lse_ag_out_rs_mla(out, lse, parallel.dcp_group, is_lse_base_on_e=is_lse_base_on_e).transpose(0, 1)

    if layer is None:
        (q_nope, pe), out = gather(), combine()
    else:
        mixin = fm.DeepseekMLAForwardMixin
        q_nope, pe = mixin.forward_absorb_prepare(layer, None, None, gather, None)
        out = mixin.forward_absorb_core(layer, pe, None, q_nope, None, combine, None, None, None, None)
    return q_nope, pe, out.view(-1, H_LOC, D)


def step_inputs(world, rows, seed, dtype):
    """Every rank's step inputs: the query halves (q_nope_out head-major, as
    SGLang's bmm makes it), partial outputs with finite payloads and LSEs with
    empty shards (-inf, NaN, +inf) and an all-empty (row, head)."""
    g = torch.Generator().manual_seed(seed)
    per_rank = []
    heads = world * H_LOC
    for _ in range(world):
        q_nope = (torch.randn(H_LOC, rows, D, generator=g) * 3).to(torch.bfloat16).transpose(0, 1)
        q_pe = (torch.randn(rows, H_LOC, R, generator=g) * 3).to(torch.bfloat16)
        out = torch.randn(rows, heads, D, generator=g).to(dtype)
        lse = torch.randn(rows, heads, generator=g) * 3
        u = torch.rand(rows, heads, generator=g)
        lse = torch.where(u < 0.1, -math.inf, torch.where(u < 0.15, math.nan, torch.where(u < 0.2, math.inf, lse)))
        per_rank.append([q_nope, q_pe, out, lse])
    for p in per_rank:
        p[3][0, 0] = -math.inf  # every shard of (row 0, head 0) is empty
    return per_rank


def installed_fake_sglang():
    """The fake SGLang in sys.modules while a test runs (the tests' ``fake``
    fixture), and the SGLang face as a fresh process has it after."""
    from torch_sdcp.integrations import sglang as face

    ns = build_fake_sglang()
    with InModules(ns.mods):
        yield ns
        face.engine.installed = False
        face.engine.originals.clear()
        face.engine.dcp_group = None
        face.engine.early_rows.clear()
        face.engine.early.clear()
        face.face.forget()
