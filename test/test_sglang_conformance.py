"""The SGLang plugin against SGLang's sources, read with ``ast`` WITHOUT
importing SGLang (importing it needs its CUDA stack): the version, every
function the plugin replaces, hooks or calls (parameter lists, defaults
included), the return layouts of the replaced functions, the call sites and
their by-name imports, the pre-capture point, the shutdown call, the plugin
group and its error handling, and that two-batch overlap runs its micro-batches
on one thread and stream. Skipped when SGLang's sources are not importable; CI
does not depend on SGLang.

    pip install --no-deps --target /tmp/sglang0523 sglang==0.5.23
    PYTHONPATH=/tmp/sglang0523 python -m pytest -q test/test_sglang_conformance.py

``SDCP_SGLANG_CHECK_ANY_VERSION=1`` runs the checks on another version.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest
from _ast_helpers import SourceTrees, find_definition, param_list

from torch_sdcp.integrations import sglang as face
from torch_sdcp.integrations import sglang_step as face_step
from torch_sdcp.integrations._engine import accepted_version

COMM = "sglang.srt.layers.dcp.comm"
CALL_SITES = ("sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla",
              "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla_rocm")
REPLACED = ("cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce", "all_gather_q_for_mla_decode")


_tree = SourceTrees("sglang", "SGLang", "SGLang's sources are not importable")
_sglang_dir = _tree.root


@pytest.fixture(scope="module")
def version():
    v = _tree.version()
    checked_anyway = os.environ.get("SDCP_SGLANG_CHECK_ANY_VERSION") == "1"
    if not accepted_version(v, face.SUPPORTED_SGLANG_VERSIONS) and not checked_anyway:
        pytest.skip(f"SGLang {v} is importable; the plugin supports {face.SUPPORTED_SGLANG_VERSIONS}")
    return v


def _find(module: str, path: str):
    return find_definition(_tree(module), module, path)


_params = param_list


def _text(fn) -> str:
    return ast.unparse(fn)


@pytest.mark.parametrize("target", sorted(face.SGLANG_SIGNATURES), ids=lambda t: f"{t[0]}:{t[1]}")
def test_signature(version, target):
    module, path = target
    fn = _find(module, path)
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)), f"{module}.{path} is not a function"
    assert _params(fn) == face.SGLANG_SIGNATURES[target], f"SGLang {version}: {module}.{path} changed"


def test_replacements_take_sglangs_parameters(version):
    import inspect

    for name in REPLACED:
        ours = inspect.signature(getattr(face, name))
        text = "(" + ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                               for p in ours.parameters.values()) + ")"
        assert text == face.SGLANG_SIGNATURES[(COMM, name)], name


def test_every_hook_target_is_checked(version):
    for target, _, _ in face.HOOKS:
        module, name = target.rsplit(".", 1)
        if module.rsplit(".", 1)[1][:1].isupper():  # a method: module.Class.name
            module, cls = module.rsplit(".", 1)
            name = f"{cls}.{name}"
        assert (module, name) in face.SGLANG_SIGNATURES, target


def test_return_layouts(version):
    """ag_rs: the head-major [H, B, D] fp32 correction, reduce-scattered on
    dim 0 ([H/N, B, D]), cast once; a2a: the local Triton combine's
    [B, H/N, D]; the query: cat([q_pe, q_nope]) head-major, gathered on dim 0,
    split and transposed into (q_nope_out, q_pe)."""
    ag = _text(_find(COMM, "cp_lse_ag_out_rs_mla"))
    for piece in ("cp_attn_out.new_empty(cp_attn_out.transpose(0, 1).shape, dtype=torch.float32)",
                  "cp_group.reduce_scatter_along_dim(out, dim=0)", "return out.to(cp_attn_out.dtype)",
                  "if cp_group.world_size == 1:\n        return cp_attn_out"):
        assert piece in ag, piece
    a2a = _text(_find(COMM, "dcp_a2a_lse_reduce"))
    for piece in ("if comm_backend == 'fi_a2a':", "dcp_lse_combine_triton(recv_output, recv_lse, "
                  "is_lse_base_on_e=is_lse_base_on_e)", "return combined"):
        assert piece in a2a, piece
    q = _text(_find(COMM, "all_gather_q_for_mla_decode"))
    for piece in ("torch.cat([q_pe.transpose(0, 1), q_nope_out.transpose(0, 1)], dim=-1)",
                  "group.all_gather(combined, dim=0)",
                  "gathered.split([d_pe, d_nope], dim=-1)", "return (q_nope_out, q_pe)",
                  "group = get_parallel().dcp_group"):
        assert piece in q, piece


def test_empty_shards_as_the_plugin_reads_them(version):
    """SGLang's kernels treat NaN and +inf LSEs as empty shards (weight 0), as
    the workspace does."""
    from_kernels = ast.unparse(_tree("sglang.kernels.ops.attention.dcp_kernels"))
    assert from_kernels.count("(lse != lse) | (lse == float('inf'))") >= 1
    assert "acc = acc / tl.maximum(weight_sum, 1.0)" in from_kernels


def _imports_by_name(module: str) -> set:
    # From comm.py or from the package that re-exports it (sglang/srt/layers/dcp/__init__.py).
    return {a.asname or a.name for n in ast.walk(_tree(module)) if isinstance(n, ast.ImportFrom)
            and n.module in (COMM, COMM.rsplit(".", 1)[0]) for a in n.names}


@pytest.mark.parametrize("module", CALL_SITES)
def test_call_sites(version, module):
    """The call sites import the three by name (SGLang's hook registry
    rewrites such bindings), pass what the replacements take, and transpose
    the ag_rs result right away."""
    assert set(REPLACED) <= _imports_by_name(module)
    assert set(REPLACED) <= _imports_by_name(COMM.rsplit(".", 1)[0]), "the package no longer re-exports comm.py's"
    tree = _tree(module)
    calls = {name: [] for name in REPLACED}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in calls:
            calls[node.func.id].append(node)
    assert all(calls.values()), {k: len(v) for k, v in calls.items()}
    for c in calls["cp_lse_ag_out_rs_mla"]:
        assert len(c.args) == 3 and {k.arg for k in c.keywords} <= {"is_lse_base_on_e"}, ast.unparse(c)
    for c in calls["dcp_a2a_lse_reduce"]:
        assert len(c.args) == 3 and {k.arg for k in c.keywords} <= {"is_lse_base_on_e", "comm_backend"}, \
            ast.unparse(c)
    for c in calls["all_gather_q_for_mla_decode"]:
        assert {k.arg for k in c.keywords} | {None} == {"q_nope_out", "q_pe", None} or len(c.args) == 2, \
            ast.unparse(c)
    for block in ast.walk(tree):
        body = getattr(block, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and \
                    isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "cp_lse_ag_out_rs_mla":
                after = ast.unparse(body[i + 1]) if i + 1 < len(body) else ""
                assert after == "attn_output = attn_output.transpose(0, 1)", f"{module}:{stmt.lineno}: {after}"


def test_call_site_reads_the_lse_base_per_backend(version):
    fn = _find(CALL_SITES[0], "is_mla_dcp_lse_base_on_e")
    assert "flashmla" in _text(fn), "base e for FlashMLA, base 2 otherwise"


def test_pre_capture_point(version):
    """The warm-up calls _pre_initialize_fi_a2a_workspace before autotune, and
    the decode graph runner warms up before it captures."""
    warmup = _text(_find("sglang.srt.model_executor.runner.base_runner", "BaseRunner._warmup"))
    assert "if mr.device != 'cuda':\n        return" in warmup and face_step._WARMED_UP_ON == ("cuda",)
    assert warmup.index("if mr.device != 'cuda'") < warmup.index("self._pre_initialize_fi_a2a_workspace()")
    assert warmup.index("self._pre_initialize_fi_a2a_workspace()") < warmup.index("should_run_flashinfer_autotune")
    capture = _text(_find("sglang.srt.model_executor.runner.decode_cuda_graph_runner",
                          "DecodeCudaGraphRunner._capture"))
    assert "self.warmup()" in capture
    rows = _text(_find("sglang.srt.model_executor.runner.base_runner", "BaseRunner._widest_decode_rows"))
    assert "return max(capture_bs) * tokens_per_req" in rows


def test_results_leave_after_the_steps_synchronisation(version):
    """Every event loop turns a batch's result into outputs through
    Scheduler.process_batch_result (the overlap loop one step late, after the
    next batch's run_batch), whose processors wait for copy_done before they
    stream any output: the plugin's check before it, after that wait, stops a
    failed step's outputs."""
    overlap = _text(_find("sglang.srt.managers.scheduler", "Scheduler.event_loop_overlap"))
    assert "self.process_batch_result(tmp_batch, tmp_result)" in overlap
    assert overlap.index("batch_result = self.run_batch(batch)") < overlap.rindex("pop_and_process()")
    normal = _text(_find("sglang.srt.managers.scheduler", "Scheduler.event_loop_normal"))
    assert normal.index("self.run_batch(batch)") < normal.index("self.process_batch_result(batch, result)")
    run = _text(_find("sglang.srt.managers.scheduler", "Scheduler.run_batch"))
    assert "batch_result.copy_done = self.device_module.Event()" in run
    processor = "sglang.srt.managers.scheduler_components.batch_result_processor"
    for name in ("process_batch_result_decode", "process_batch_result_prefill", "process_batch_result_idle"):
        text = _text(_find(processor, f"SchedulerBatchResultProcessor.{name}"))
        wait = text.index("result.copy_done.synchronize()")
        assert wait < text.index("self.output_streamer."), name
    dispatch = _text(_find("sglang.srt.managers.scheduler", "Scheduler.process_batch_result"))
    for name in ("process_batch_result_decode", "process_batch_result_prefill", "process_batch_result_idle"):
        assert f"self.batch_result_processor.{name}(batch, result)" in dispatch, name


def test_server_args_cli_hooks(version):
    """The plugin's options ride on ServerArgs: add_cli_args (a staticmethod
    on SGLang's parser), from_cli_args (a classmethod that keeps only the
    record's fields, so the options never reach the record) and
    resolved_dict (the server-args dump). The launchers load the plugins
    before they parse, except `sglang serve --help`, which prints before."""
    import torch_sdcp_plugins.sglang as entry

    module = "sglang.srt.server_args"
    expected = {"add_cli_args": ("(parser)", "staticmethod"), "from_cli_args": ("(cls, args)", "classmethod"),
                "resolved_dict": ("(self)", None)}
    for target, kind, _ in entry.CLI_HOOKS:
        name = target.rsplit(".", 1)[1]
        fn = _find(module, f"ServerArgs.{name}")
        params, decorator = expected[name]
        assert _params(fn) == params and kind == "AFTER", name
        assert [ast.unparse(d) for d in fn.decorator_list] == ([decorator] if decorator else []), name
    assert "hasattr(args, attr.name)" in _text(_find(module, "ServerArgs.from_cli_args"))
    prepare = _text(_find(module, "prepare_server_args"))
    assert prepare.index("ServerArgs.add_cli_args(parser)") < prepare.index("parser.parse_args(argv)") < \
        prepare.index("ServerArgs.from_cli_args(raw_args)")
    launch = ast.unparse(_tree("sglang.launch_server"))
    assert launch.index("load_plugins()") < launch.index("prepare_server_args(sys.argv[1:])")
    serve = _text(_find("sglang.cli.serve", "serve"))
    assert serve.index("'--help'") < serve.index("return") < serve.index("load_plugins()")
    engine = ast.unparse(_tree("sglang.srt.entrypoints.engine"))
    assert "server_args.resolved_dict()" in _text(_find("sglang.srt.entrypoints.engine", "_server_args_for_logging"))
    assert "logger.info(f'server_args={_server_args_for_logging(server_args)}')" in engine


def test_kv_pool_sized_in_alloc_memory_pool(version):
    """SGLang sizes the KV pool in ModelRunner.alloc_memory_pool from the free
    GPU memory less the --mem-fraction-static headroom (so the workspaces
    made before it are counted), the target's before the draft's, before the
    warm-up; with DCP there is no post-capture resize. The rows bound known
    before the pool bounds the warm-up's: get_batch_sizes_to_capture only
    filters the configured decode batch sizes (what it adds is no larger)."""
    mr = "sglang.srt.model_executor.model_runner"
    alloc = _text(_find(mr, "ModelRunner.alloc_memory_pool"))
    assert "self.kv_cache_configurator.configure(pre_model_load_memory=self.pre_model_load_memory)" in alloc
    profile = _text(_find("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator._profile_available_bytes"))
    assert "available_gpu_memory = get_available_gpu_memory(" in profile
    assert "slack_gb = pre_model_load_memory * (1 - get_schedule().mem_fraction_static)" in profile
    pools = _text(_find("sglang.srt.managers.scheduler", "Scheduler.init_memory_pools"))
    assert pools.index("self.init_target_memory_pool()") < pools.index("self.draft_worker.alloc_memory_pool(")
    init = _text(_find("sglang.srt.managers.scheduler", "Scheduler.init_model_worker"))
    assert init.index("self.init_tp_model_worker()") < init.index("self.init_memory_pools()") < \
        init.index("self.init_all_cuda_graphs()")
    planned = _text(_find("sglang.srt.arg_groups.overrides", "post_capture_kv_sizing_planned"))
    assert "if cfg.dcp_size != 1:\n        return False" in planned
    capture = _text(_find("sglang.srt.model_executor.runner.base_cuda_graph_runner", "get_batch_sizes_to_capture"))
    assert "capture_bs = list(get_exec().graph.cuda_graph_config.decode.bs)" in capture
    assert "if max(capture_bs) > num_max_requests:\n        capture_bs += [num_max_requests]" in capture
    assert "capture_bs = [bs for bs in capture_bs if bs <= num_max_requests]" in capture
    text = _text(_find(mr, "ModelRunner.__init__"))
    for attr in ("self.mem_fraction_static = ", "self.is_draft_worker = "):
        assert attr in text, attr
    assert "self.pre_model_load_memory = " in ast.unparse(_tree(mr))
    runtime = {n.name for n in _tree("sglang.srt.runtime_context").body if isinstance(n, ast.FunctionDef)}
    assert {"get_exec", "get_schedule", "get_parallel"} <= runtime


def test_parallel_context_fields(version):
    """The fields of get_parallel() the plugin reads, read by SGLang's own code."""
    used = set()
    for module in ("sglang.srt.model_executor.runner.base_runner", CALL_SITES[0]):
        for n in ast.walk(_tree(module)):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == \
                    "get_parallel":
                used.add(n.attr)
    assert {"dcp_enabled", "dcp_group", "dcp_comm_backend", "dcp_replicate_q_proj"} <= used, used


def test_model_attributes(version):
    init = _text(_find("sglang.srt.models.deepseek_v2", "DeepseekV2AttentionMLA.__init__"))
    for attr in ("self.dcp_size", "self.num_local_heads", "self.kv_lora_rank", "self.qk_rope_head_dim"):
        assert f"{attr} = " in init, attr


def test_shutdown_calls_abort_while_groups_live(version):
    fn = _text(_find("sglang.srt.managers.scheduler", "run_scheduler_process"))
    assert "abort_distributed_environment()" in fn and "load_plugins()" in fn


def test_plugin_group_and_errors_caught(version):
    tree = _tree("sglang.srt.plugins")
    values = {n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str)}
    assert "sglang.srt.plugins" in values
    load = _find("sglang.srt.plugins", "load_plugins")
    tries = [t for t in ast.walk(load) if isinstance(t, ast.Try) and "func()" in ast.unparse(t.body)]
    assert tries and any(ast.unparse(h.type) == "Exception" for h in tries[0].handlers)
    registry = _tree("sglang.srt.plugins.hook_registry")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "_propagate_patch" for n in ast.walk(registry))
    hook_types = _text(_find("sglang.srt.plugins.hook_registry", "HookType"))
    for kind in {k for _, k, _ in face.HOOKS}:
        assert f"{kind} = " in hook_types, kind


def test_two_batch_overlap_is_one_thread_one_stream(version):
    """One workspace set serves both micro-batches because SGLang interleaves
    their stages on one thread and one CUDA stream, in the same order on every
    rank."""
    for module in ("sglang.srt.batch_overlap.operations", "sglang.srt.batch_overlap.two_batch_overlap"):
        text = ast.unparse(_tree(module))
        for word in ("torch.cuda.stream(", "torch.cuda.Stream(", "threading", "Thread("):
            assert word not in text, (module, word)


def test_hooked_methods_are_not_overridden(version):
    """A hook on a base-class method reaches every runner only while no
    subclass defines its own."""
    root = os.path.join(_sglang_dir(), "srt")
    for name in ("_pre_initialize_fi_a2a_workspace", "_widest_decode_rows", "abort_distributed_environment",
                 "process_batch_result"):
        found = []
        for folder, _, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(folder, f), encoding="utf-8") as fh:
                        if f"def {name}(" in fh.read():
                            found.append(os.path.relpath(os.path.join(folder, f), root))
        assert len(found) == 1, (name, found)


def test_sglang_was_not_imported(version):
    assert "sglang" not in sys.modules, "the checks read SGLang's sources, they do not import them"
