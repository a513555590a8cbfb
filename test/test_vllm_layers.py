"""The layer an MLADCPManager's calls are tagged with, on the vLLM stand-in
(_vllm_stand_in.py): the two layer constructors that build a manager
(MLAAttention, Kimi-K3's MultiHeadLatentAttention) are wrapped and pass
their ``prefix``; a manager built outside them calls untagged; the per-thread
stack of layers pops on every path; uninstall() restores the constructors;
Kimi-K3's module is patched when it is imported, never imported for it."""

from __future__ import annotations

import importlib
import sys
import threading
import types

import pytest
import torch
from _vllm_stand_in import H_LOC, KIMI_K3_MLA, MLA_ATTENTION, D, FakeVllm, Layer, W
from _vllm_stand_in import config as _config

from torch_sdcp.integrations.vllm_layers import building_layer_tag, layer_constructor


@pytest.fixture
def plugin(monkeypatch):
    """The plugin, with every workspace a stand-in on peer memory (so that the
    manager's partials are the plugin's and bind the call tag)."""
    import torch_sdcp.workspaces as wsmod
    from torch_sdcp.integrations import vllm as plugin

    class Peer:
        peer = True

        def __init__(self, *args, **kwargs):
            pass

        def close(self):
            self.peer = False

    for name in ("OutputLSEWorkspace", "QueryWorkspace", "ExchangeWorkspace", "TopKWorkspace"):
        monkeypatch.setattr(wsmod, name, type(name, (Peer,), {}))
    for name in ("SDCP_VLLM_SEAMS", "VLLM_USE_DIRECT_DCP_A2A", "VLLM_USE_DIRECT_DCP_Q_GATHER"):
        monkeypatch.delenv(name, raising=False)
    yield plugin
    plugin.teardown()


def _use_group(ns):
    ns.coordinator = types.SimpleNamespace(cpu_group=object(), world_size=2, rank_in_group=0, unique_name="dcp:0")


def _manager_kwargs():
    return dict(vllm_config=_config(), device="cpu", num_heads=H_LOC, query_head_dim=W, output_head_dim=D,
                query_dtype=torch.bfloat16, output_dtype=torch.bfloat16, padded_num_heads=None,
                is_lse_base_on_e=True, use_pcp=False)


def _tags(manager):
    return manager.combine.keywords["tag"], manager.query_gather.keywords["tag"]


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
@pytest.mark.parametrize("kimi", [False, True], ids=["MLAAttention", "Kimi-K3"])
@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
def test_manager_built_in_a_wrapped_layer_carries_its_tag(plugin, version, kimi, positional):
    with FakeVllm(version) as ns:
        _use_group(ns)
        assert plugin.install()
        for index in (4, 9):
            layer = Layer(ns, f"model.layers.{index}.self_attn.mla_attn", positional=positional, kimi=kimi,
                          **_manager_kwargs())
            assert layer.layer_name.startswith(f"model.layers.{index}.")  # the original ran with its arguments
            assert _tags(layer.dcp_manager) == (index, index)


def test_manager_built_outside_a_wrapped_layer_calls_untagged(plugin):
    with FakeVllm() as ns:
        _use_group(ns)
        assert plugin.install()
        prefix = "model.layers.5.self_attn.mla_attn"  # a name nearby is not the building layer's  # noqa: F841
        manager = ns.mods["vllm.v1.attention.ops.dcp"].MLADCPManager(**_manager_kwargs())
        assert _tags(manager) == (None, None)
        unnamed = Layer(ns, "", **_manager_kwargs())  # a wrapped layer without an index in its name
        assert _tags(unnamed.dcp_manager) == (None, None)


def test_nested_layers_and_errors_pop_the_stack():
    building = threading.local()
    seen = []

    class Attention:
        def __init__(self, prefix="", inner=None, fail=False):
            seen.append(building_layer_tag(building))
            if inner is not None:
                Attention(inner, fail=fail)
            seen.append(building_layer_tag(building))
            if fail:
                raise RuntimeError("the layer failed")

    Attention.__init__ = layer_constructor(Attention.__init__, building)
    Attention("model.layers.1.attn", "model.layers.2.attn.inner")
    assert seen == [1, 2, 2, 1] and building_layer_tag(building) is None
    with pytest.raises(RuntimeError, match="the layer failed"):
        Attention("model.layers.1.attn", "model.layers.2.attn.inner", fail=True)
    assert building.layers == [] and building_layer_tag(building) is None
    with pytest.raises(TypeError):  # arguments the constructor does not take: its own error, nothing left pushed
        Attention("model.layers.3.attn", bogus=1)
    assert building.layers == []
    # Another thread building nothing sees no layer while this one builds.
    other = []

    class Waiting:
        def __init__(self, prefix):
            thread = threading.Thread(target=lambda: other.append(building_layer_tag(building)))
            thread.start()
            thread.join()
            other.append(building_layer_tag(building))

    Waiting.__init__ = layer_constructor(Waiting.__init__, building)
    Waiting("model.layers.6.attn")
    assert other == [None, 6]


def test_a_constructor_without_prefix_is_refused():
    class Unnamed:
        def __init__(self, name):
            pass

    with pytest.raises(ValueError, match="must take 'prefix'.*Unnamed"):
        layer_constructor(Unnamed.__init__, threading.local())


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_uninstall_restores_the_layer_constructors(plugin, version):
    with FakeVllm(version) as ns:
        mla = ns.mods[MLA_ATTENTION].MLAAttention
        kimi = ns.mods[KIMI_K3_MLA].MultiHeadLatentAttention
        before = mla.__dict__["__init__"], kimi.__dict__["__init__"]
        assert plugin.install()
        assert mla.__init__ is not before[0] and mla.__init__.__wrapped__ is before[0]
        assert kimi.__init__ is not before[1] and kimi.__init__.__wrapped__ is before[1]
        plugin.uninstall()
        assert (mla.__dict__["__init__"], kimi.__dict__["__init__"]) == before


_KIMI_SOURCE = '''
from vllm.v1.attention.ops.dcp import MLADCPManager


class MultiHeadLatentAttention:
    def __init__(self, config, prefix=""):
        self.dcp_manager = MLADCPManager(**config)
'''


@pytest.fixture
def kimi_on_disk(tmp_path):
    """The stand-in without Kimi-K3's module imported: its package finds
    ``mla.py`` (``source`` written there by the test) in ``tmp_path``."""

    def make(source, fake):
        del fake.ns.mods[KIMI_K3_MLA]
        fake.ns.mods["vllm.models.kimi_k3.nvidia"].__path__ = [str(tmp_path)]
        (tmp_path / "mla.py").write_text(source)
        importlib.invalidate_caches()

    yield make
    sys.modules.pop(KIMI_K3_MLA, None)


def test_kimi_layer_patched_when_its_module_is_imported(plugin, kimi_on_disk):
    fake = FakeVllm()
    kimi_on_disk(_KIMI_SOURCE, fake)
    with fake as ns:
        _use_group(ns)
        assert plugin.install()
        assert KIMI_K3_MLA not in sys.modules, "install() imported Kimi-K3's module"
        finder = plugin._state.at_import
        assert finder in sys.meta_path
        module = importlib.import_module(KIMI_K3_MLA)
        original = module.MultiHeadLatentAttention.__init__.__wrapped__
        layer = module.MultiHeadLatentAttention(_manager_kwargs(), "model.layers.12.self_attn")
        assert _tags(layer.dcp_manager) == (12, 12)
        plugin.uninstall()
        assert finder not in sys.meta_path
        assert module.MultiHeadLatentAttention.__dict__["__init__"] is original


def test_kimi_module_imported_after_uninstall_is_left_alone(plugin, kimi_on_disk):
    fake = FakeVllm()
    kimi_on_disk(_KIMI_SOURCE, fake)
    with fake:
        assert plugin.install()
        plugin.uninstall()
        module = importlib.import_module(KIMI_K3_MLA)
        assert not hasattr(module.MultiHeadLatentAttention.__init__, "__wrapped__")


def test_kimi_layer_that_cannot_be_wrapped_is_logged_not_raised(plugin, kimi_on_disk, collect):
    fake = FakeVllm()
    kimi_on_disk(_KIMI_SOURCE.replace('prefix=""', 'name=""'), fake)
    with fake:
        assert plugin.install()
        module = importlib.import_module(KIMI_K3_MLA)  # the import itself succeeds
        assert not hasattr(module.MultiHeadLatentAttention.__init__, "__wrapped__")
        assert plugin.is_installed()
    warnings = [m for lvl, m in collect.records if lvl == "WARNING" and "MultiHeadLatentAttention" in m]
    assert len(warnings) == 1 and "no layer tag" in warnings[0] and "prefix" in warnings[0], collect.records
