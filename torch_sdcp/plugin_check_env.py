"""What an engine decides before the plugin runs, for ``plugin_check``:
whether its plugin list loads the plugin, and whether the installed
release is one the plugin patches. Neither imports the engine."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass

__all__ = ["PLUGIN_NAME", "engine_environment"]

#: The plugin's entry-point name in both engines' groups (setup.py's entry_points).
PLUGIN_NAME = "torch_sdcp"


@dataclass(frozen=True)
class _Engine:
    name: str  # as users write it
    package: str  # the distribution whose version is checked
    plugins_env: str  # the engine's list of plugins to load
    empty_is_all: bool  # whether an empty list means every plugin (SGLang) or none (vLLM)


_ENGINES = {
    "vllm": _Engine("vLLM", "vllm", "VLLM_PLUGINS", empty_is_all=False),
    "sglang": _Engine("SGLang", "sglang", "SGLANG_PLUGINS", empty_is_all=True),
}


def _allowed(engine: _Engine, value: str) -> bool:
    """Whether the engine's plugin list ``value`` loads the plugin: vLLM
    splits it on ',' and loads only those names; SGLang strips each name
    and loads every plugin when the list is empty."""
    if engine.empty_is_all:
        names = {x.strip() for x in value.split(",") if x.strip()}
        return not names or PLUGIN_NAME in names
    return PLUGIN_NAME in value.split(",")


def _supported(engine: str, version: str) -> tuple[bool, tuple[str, ...]]:
    if engine == "vllm":
        from torch_sdcp.integrations.vllm_versions import SUPPORTED_VLLM_VERSIONS, supported_version

        return supported_version(version), SUPPORTED_VLLM_VERSIONS
    from torch_sdcp.integrations._engine import accepted_version
    from torch_sdcp.integrations.sglang import SUPPORTED_SGLANG_VERSIONS

    return accepted_version(version, SUPPORTED_SGLANG_VERSIONS), SUPPORTED_SGLANG_VERSIONS


def engine_environment(engine: str) -> tuple[list[str], bool]:
    """(lines, whether the engine would run without the plugin) for
    ``engine`` (``"vllm"`` or ``"sglang"``): a plugin list that leaves the
    plugin out, and an installed release the plugin refuses."""
    e = _ENGINES[engine]
    lines, without = [], False
    value = os.environ.get(e.plugins_env)
    if value is not None and not _allowed(e, value):
        lines.append(f"{e.plugins_env}={value!r} leaves the plugin out: {e.name} would not load it, so nothing "
                     f"would be replaced and no start-up line logged (add {PLUGIN_NAME} to the comma-separated list)")
        without = True
    try:
        version = importlib.metadata.version(e.package)
    except importlib.metadata.PackageNotFoundError:
        lines.append(f"{e.name} is not installed here: its version is not checked")
        return lines, without
    ok, supported = _supported(engine, version)
    if ok:
        lines.append(f"{e.name} {version} is installed: the plugin supports it")
    else:
        lines.append(f"{e.name} {version} is installed: the plugin would refuse it and replace nothing (it supports "
                     f"{', '.join(supported)})")
        without = True
    return lines, without
