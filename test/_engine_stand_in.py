"""Small helpers the engine stand-ins (_vllm_stand_in.py, _sglang_stand_in.py)
are built from: module packages, a raw-bytes all_gather over gloo, a context
that puts stand-in modules into sys.modules and restores them, a log
collector. Holds no tests."""

from __future__ import annotations

import logging
import sys
import types

import torch
import torch.distributed as dist


def packages(names):
    """{name: an empty module}, each a package so that dotted imports resolve."""
    mods = {name: types.ModuleType(name) for name in names}
    for mod in mods.values():
        mod.__path__ = []
    return mods


def all_gather_bytes(x, world, group, dim=-1):
    """``torch.cat`` of every rank's ``x`` along ``dim``, moved as raw bytes
    (gloo has no float8, not every build has bf16)."""
    x = x.contiguous()
    raw = x.view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(parts, raw, group=group)
    return torch.cat([p.view(x.dtype) for p in parts], dim=dim)


class InModules:
    """Context manager: ``mods`` in sys.modules, the previous entries restored after."""

    def __init__(self, mods):
        self.mods = mods

    def __enter__(self):
        self.saved = {name: sys.modules.get(name) for name in self.mods}
        sys.modules.update(self.mods)
        return self

    def __exit__(self, *exc):
        for name, mod in self.saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


class Collect(logging.Handler):
    """Every record as (level name, message)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))
