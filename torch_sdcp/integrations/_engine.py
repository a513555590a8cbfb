"""What the two engine plugins (vLLM: :mod:`.vllm`, SGLang: :mod:`.sglang`)
share beyond the core (:mod:`._face`): their logger, the options of the
workspaces they create, what their calls read from the engine
(:class:`EngineHooks`), the query boundary of an already-roped query, the
version policy, the start-up line per DCP group and the ``require`` mode.
A face keeps only what differs between engines. Nothing here imports an
engine."""

from __future__ import annotations

import importlib
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from torch_sdcp_settings import EngineSettings

__all__ = ["EngineHooks", "SeamPlan", "accepted_version", "engine_logger", "query_geometry", "workspace_options"]


class EngineHooks:
    """What a face's calls read from its engine, set by the face's install()
    or configure(): the engine's own functions by name (the fallbacks) and
    the engine's DCP group (a callable returning it)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.originals: dict[str, Callable] = {}
        self.dcp_group: Callable[[], Any] | None = None

    def configure(self, dcp_group: Callable[[], Any] | None, originals: dict[str, Callable] | None) -> None:
        with self.lock:
            if dcp_group is not None:
                self.dcp_group = dcp_group
            if originals:
                self.originals.update(originals)


def query_geometry(local_heads: int, width: int, dtype: torch.dtype) -> dict:
    """The query boundary of a query the engine already roped (vLLM's
    ``[T, H_loc, W]``, SGLang's ``cat([q_pe, q_nope])``): gather-only
    (``rope_dim`` 0)."""
    return {"local_heads": local_heads, "nope_dim": width, "rope_dim": 0, "out_dtype": dtype,
            "rope_style": "interleaved"}


def engine_logger(engine: str, init_logger: str | None = None) -> Callable[[], logging.Logger]:
    """A logger factory: under the engine's own logger (``<engine>.torch_sdcp``)
    when the engine is loaded, so that its handlers and levels apply (through
    ``<init_logger>.init_logger`` where the engine has one), ``torch_sdcp``
    otherwise."""

    def make() -> logging.Logger:
        if engine not in sys.modules:
            return logging.getLogger("torch_sdcp")
        if init_logger is not None:
            try:
                return importlib.import_module(init_logger).init_logger(f"{engine}.torch_sdcp")
            except Exception:
                pass
        return logging.getLogger(f"{engine}.torch_sdcp")

    return make


def workspace_options(settings: EngineSettings) -> Callable[[], dict]:
    """The options of the workspaces a plugin creates: its settings' wait
    bound, and ``fallback=True`` so that a group without peer memory gives a
    workspace in collective mode, which the face then refuses (the engine
    keeps its own path)."""
    return lambda: {"timeout_s": settings.timeout_s(), "fallback": True}


def accepted_version(version: str, pinned: tuple[str, ...], patch_series: str | None = None) -> bool:
    """The version policy of a plugin: a release whose conformance checks
    passed (``pinned``), its post releases (``0.5.23.post1``), and, with
    ``patch_series``, that series' patch releases; a local suffix (``+cu130``)
    is ignored. Anything else is refused."""
    base = version.split("+")[0]
    release = re.sub(r"\.post\d+$", "", base)
    if release in pinned:
        return True
    return patch_series is not None and re.fullmatch(re.escape(patch_series) + r"\.\d+", release) is not None


class SeamPlan:
    """The decisions of one DCP group's seams (seam -> on, why, and the flag
    or setting that turns it on), logged as one start-up line; in the
    ``require`` mode a seam that the user asked for and that stays the
    engine's fails start-up with that line."""

    def __init__(self, settings: EngineSettings, group: str, world: int) -> None:
        self.settings = settings
        self.group = group
        self.world = world
        self.seams: dict[str, tuple[bool, str, str]] = {}
        self.inapplicable: set[str] = set()

    def decide(self, seam: str, on: bool, why: str, enable: str = "", applies: bool = True) -> None:
        """``seam`` is on or off for ``why``; ``enable``: the flag or setting
        that would turn it on; ``applies`` False: the model has no such call
        (no sparse indexer), which the ``require`` mode does not refuse."""
        self.seams[seam] = (on, why, enable)
        if not applies:
            self.inapplicable.add(seam)

    def line(self) -> str:
        parts = []
        for seam, (on, why, enable) in self.seams.items():
            how = f" [to turn it on: {enable}]" if enable and not on else ""
            parts.append(f"{seam} {'ON' if on else 'off'} ({why}){how}")
        return (f"torch_sdcp: {self.settings.engine} DCP group {self.group} (world {self.world}): "
                + "; ".join(parts))

    def refused(self) -> list[str]:
        """The seams selected by the settings that stay the engine's."""
        selected = self.settings.seams()
        return [s for s, (on, _, _) in self.seams.items() if not on and s in selected and s not in self.inapplicable]

    def emit(self, log: Callable[..., Any]) -> None:
        """Log the line (``log(level, msg)``); raise it in the ``require``
        mode when a selected seam stays the engine's."""
        text = self.line()
        refused = self.refused()
        if refused and self.settings.required():
            raise RuntimeError(f"{text}. {self.settings.ENABLE}=require: the seam(s) {', '.join(refused)} "
                               "cannot be taken; start-up stops (set it to 1 to run with the engine's own paths)")
        # A seam the settings select that stays the engine's is a warning (seen at --log-level warning).
        log("warning" if refused else "info", text)
