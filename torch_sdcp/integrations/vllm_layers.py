"""The vLLM layer that builds an ``MLADCPManager``, passed in rather than
guessed. vLLM's manager takes no layer argument; the two layer constructors
that build one (``MLAAttention.__init__`` and Kimi-K3's
``MultiHeadLatentAttention.__init__``, both taking their name as ``prefix``)
are wrapped by :func:`layer_constructor`: it binds the call's ``prefix``,
pushes the layer's call tag on a per-thread stack while the original runs,
and the manager's wrapped ``__init__`` reads the innermost one
(:func:`building_layer_tag`). Used by :mod:`torch_sdcp.integrations.vllm`;
never imports vLLM."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch_sdcp.integrations.vllm_config import layer_tag

__all__ = ["building_layer_tag", "layer_constructor", "layer_stack"]


def layer_stack(building: Any) -> list[int | None]:
    """The call tags of the wrapped layers this thread is building, outermost
    first (``building`` is a ``threading.local``)."""
    stack = getattr(building, "layers", None)
    if stack is None:
        stack = building.layers = []
    return stack


def building_layer_tag(building: Any) -> int | None:
    """The call tag of the innermost wrapped layer this thread is building:
    the tag of the manager it builds. None when no wrapped layer is being
    built (a manager built elsewhere calls untagged) or when its name has no
    layer index."""
    stack = getattr(building, "layers", None)
    return stack[-1] if stack else None


def layer_constructor(original: Callable, building: Any,
                      note: Callable[[str, int | None], None] | None = None) -> Callable:
    """``original`` (a layer's ``__init__`` that takes its name as ``prefix``)
    wrapped: the call's ``prefix``, bound by the original's signature
    (positional or keyword), gives the layer's call tag
    (:func:`~torch_sdcp.integrations.vllm_config.layer_tag`), on
    :func:`layer_stack` while the original runs."""
    signature = inspect.signature(original)
    if "prefix" not in signature.parameters:
        raise ValueError(f"torch_sdcp: a layer constructor wrapped for its call tag must take 'prefix', "
                         f"got {original.__qualname__}{signature}")
    default = signature.parameters["prefix"].default

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            prefix = signature.bind(self, *args, **kwargs).arguments.get("prefix", default)
        except TypeError:
            prefix = None  # the original raises its own error for these arguments
        stack = layer_stack(building)
        stack.append(layer_tag(prefix, note))
        try:
            return original(self, *args, **kwargs)
        finally:
            stack.pop()

    return init
