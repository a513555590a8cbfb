"""The vLLM plugin against the installed vLLM's sources, read with ``ast``
WITHOUT importing vLLM (importing it needs its CUDA stack): the version,
every function the plugin replaces, wraps, mirrors or calls (module path and
parameter list, defaults included), the MLADCPManager attributes the patched
methods read, the call shapes at vLLM's call sites, and the functions that
build an MLADCPManager (the wrapped layer constructors only). Skipped when vLLM is
not installed; CI does not depend on vLLM.

Run against a throwaway copy:

    pip install --no-deps --target /tmp/vllm033 vllm==0.33.0     # or vllm==0.34.0
    PYTHONPATH=$PWD:/tmp/vllm033 python -m pytest -q test/test_vllm_conformance.py

Each version is checked against its own series' table
(``torch_sdcp.integrations.vllm_versions``).

``SDCP_VLLM_CHECK_ANY_VERSION=1`` runs the checks on a version the plugin
does not (yet) support, to see what a new release changed.
"""

from __future__ import annotations

import ast
import os
import sys

import pytest
from _ast_helpers import SourceTrees, find_definition, param_list

from torch_sdcp.integrations import vllm as plugin

_tree = SourceTrees("vllm", "vLLM", "vLLM is not installed")
_vllm_dir = _tree.root


@pytest.fixture(scope="module")
def version():
    v = _tree.version()
    if not plugin.supported_version(v) and os.environ.get("SDCP_VLLM_CHECK_ANY_VERSION") != "1":
        pytest.skip(f"vLLM {v} is installed; the plugin supports {plugin.SUPPORTED_VLLM_VERSIONS} "
                    "(SDCP_VLLM_CHECK_ANY_VERSION=1 checks it anyway)")
    return v


def _find(module: str, path: str):
    return find_definition(_tree(module), module, path)


_params = param_list


def _table(version):
    """The signature table of the installed version's series (0.34's for a version the plugin refuses)."""
    return plugin.VLLM_SIGNATURES_BY_SERIES[plugin.series_of(version) or plugin.SUPPORTED_VLLM_SERIES[-1]]


_ALL_TARGETS = sorted({t for table in plugin.VLLM_SIGNATURES_BY_SERIES.values() for t in table})


@pytest.mark.parametrize("target", _ALL_TARGETS, ids=lambda t: f"{t[0]}:{t[1]}")
def test_signature(version, target):
    table = _table(version)
    if target not in table:
        pytest.skip(f"not in the table of vLLM {version}")
    module, path = target
    fn = _find(module, path)
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)), f"{module}.{path} is not a function"
    assert _params(fn) == table[target], f"vLLM {version}: {module}.{path} changed"


def test_patched_targets_are_checked(version):
    table = _table(version)
    for target in plugin.PATCHED:
        assert target in table or target[1] == "_get_direct_dcp_topk_workspace", target


def _self_attribute_assigned(node: ast.AST) -> list:
    names = []
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for t in targets:
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
            names.append(t.attr)
    return names


def test_manager_attributes_set_before_the_hooks(version):
    """The patched _init_combine/_init_query_gather read these attributes:
    MLADCPManager.__init__ must set them before it calls either hook."""
    init = _find("vllm.v1.attention.ops.dcp", "MLADCPManager.__init__")
    assigned: list = []
    hooks_seen = {}
    for stmt in init.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and \
                    node.func.attr in ("_init_combine", "_init_query_gather"):
                hooks_seen.setdefault(node.func.attr, list(assigned))
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            assigned += _self_attribute_assigned(stmt)
    assert set(hooks_seen) == {"_init_combine", "_init_query_gather"}, hooks_seen
    series = plugin.series_of(version) or plugin.SUPPORTED_VLLM_SERIES[-1]
    for hook, before in hooks_seen.items():
        missing = [a for a in plugin.MANAGER_ATTRIBUTES_BY_SERIES[series][hook] if a not in before]
        assert not missing, f"MLADCPManager.__init__ sets {missing} after calling {hook}"


def _calls_to(tree: ast.AST, attr: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
            yield node


def _dcp_manager_calls(module: str, attr: str):
    calls = []
    for node in _calls_to(_tree(module), attr):
        owner = node.func.value
        if isinstance(owner, ast.Attribute) and owner.attr == "dcp_manager":
            calls.append(node)
    return calls


@pytest.mark.parametrize("module", ["vllm.model_executor.layers.attention.mla_attention",
                                    "vllm.models.deepseek_v32.attention"])
def test_combine_and_query_gather_call_shapes(version, module):
    """Call sites pass what the plugin's partials accept:
    combine(out, lse, seq_lens=..., query_start_loc=...), query_gather(q)."""
    combines = _dcp_manager_calls(module, "combine")
    assert combines, f"{module}: no dcp_manager.combine call"
    for c in combines:
        assert len(c.args) == 2 and {k.arg for k in c.keywords} <= {"seq_lens", "query_start_loc"}, \
            f"{module}:{c.lineno}: {ast.unparse(c)}"
    for c in _dcp_manager_calls(module, "query_gather"):
        assert len(c.args) == 1 and not c.keywords, f"{module}:{c.lineno}: {ast.unparse(c)}"


def test_init_combine_picks_the_mirrored_functions(version):
    """_init_combine chooses between the two functions the plugin mirrors and
    binds cp_group and is_lse_base_on_e, as the plugin's partial does."""
    fn = _find("vllm.v1.attention.ops.dcp", "MLADCPManager._init_combine")
    names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    assert {"cp_lse_ag_out_rs", "dcp_a2a_lse_reduce"} <= names
    partials = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("partial")]
    assert any({k.arg for k in c.keywords} == {"cp_group", "is_lse_base_on_e"} for c in partials), \
        [ast.unparse(c) for c in partials]


def test_indexer_calls_the_merge_through_its_module_global(version):
    """Patching the module attribute reaches every call: the indexer calls
    _merge_dcp_topk_global by its global name and never aliases it."""
    tree = _tree(plugin._INDEXER)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "_merge_dcp_topk_global"]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "_merge_dcp_topk_global"]
    assert calls and len(uses) == len(calls), "the merge is referenced other than by calls"
    for c in calls:
        assert len(c.args) + len(c.keywords) in (6, 7, 9, 10), ast.unparse(c)


def test_plugin_group_name(version):
    tree = _tree("vllm.plugins")
    values = {n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    assert "vllm.general_plugins" in values


def test_default_row_bound_function_exists(version):
    """The manager's max_num_tokens (the plugin's bound) comes from here."""
    fn = _find("vllm.v1.attention.ops.dcp", "get_dcp_workspace_max_num_tokens")
    assert _params(fn) == "(vllm_config)"


def test_vllm_was_not_imported(version):
    assert "vllm" not in sys.modules, "the conformance checks must read vLLM's sources, not import them"


def test_step_errors_take_vllms_error_path(version):
    """The health check raises from an async output's get_output: vLLM's
    multiprocess executor calls it inside a try that turns the exception into
    the step's failure response."""
    fn = _find("vllm.v1.executor.multiproc_executor", "WorkerProc.enqueue_output")
    tries = [n for n in ast.walk(fn) if isinstance(n, ast.Try)]
    assert any(any(isinstance(c, ast.Call) and ast.unparse(c.func).endswith("get_output")
                   for stmt in t.body for c in ast.walk(stmt)) and t.handlers for t in tries), ast.unparse(fn)


def test_destroy_model_parallel_imported_by_name(version):
    """The executors reach destroy_model_parallel by a name the plugin patches
    (a re-export from vllm.distributed or the module attribute)."""
    tree = _tree("vllm.v1.executor.multiproc_executor")
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in
             ("vllm.distributed", "vllm.distributed.parallel_state") for a in n.names}
    assert "destroy_model_parallel" in names


def _manager_builders() -> list:
    """(module, "Class.method") of every function in vLLM's sources that calls MLADCPManager(...)."""
    found = []
    for folder, _, files in os.walk(_vllm_dir()):
        for file in sorted(files):
            path = os.path.join(folder, file)
            if not file.endswith(".py"):
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if "MLADCPManager(" not in text:
                continue
            rel = os.path.relpath(path, os.path.dirname(_vllm_dir()))[:-3].replace(os.sep, ".")
            for cls in ast.parse(text).body:
                for fn in (cls.body if isinstance(cls, ast.ClassDef) else []):
                    if isinstance(fn, ast.FunctionDef) and any(
                            isinstance(c, ast.Call) and ast.unparse(c.func) == "MLADCPManager" for c in ast.walk(fn)):
                        found.append((rel, f"{cls.name}.{fn.name}"))
    return sorted(found)


def test_managers_are_built_in_the_wrapped_layers(version):
    """The call tag is the layer's whose wrapped constructor builds the
    manager: vLLM builds MLADCPManager in those constructors only (a new
    builder would call untagged)."""
    layers = sorted(t for t in plugin.PATCHED if t[1] in plugin._LAYERS)
    assert _manager_builders() == layers
