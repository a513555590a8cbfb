"""How the vLLM plugin patches vLLM's attributes and undoes it: a target's
owner and current value, the copies other modules imported by name, the
restore, and a patch made when a module is imported (so that the module is
not imported to patch it). A patch is (owner, attribute name, original,
replacement). Used by :mod:`torch_sdcp.integrations.vllm`; never imports
vLLM."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["AfterImport", "by_name_copies", "patch", "resolve", "restore"]

Patch = tuple[Any, str, Any, Any]


def resolve(module: Any, path: str) -> tuple[Any, str, Any]:
    """(owner, attribute, current value) of ``path`` ("Class.method" or "function") in ``module``."""
    owner = module
    parts = path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    name = parts[-1]
    value = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return owner, name, value


def patch(module: Any, path: str, make: Callable[[Any], Any], patches: list[Patch],
          originals: dict[str, Any] | None = None) -> None:
    """``path`` in ``module`` replaced by ``make(original)``, recorded in
    ``patches`` (and the original in ``originals[path]``, before the
    replacement is in place). Raises, patching nothing, when ``path`` is
    missing or ``make`` raises."""
    owner, name, original = resolve(module, path)
    new = make(original)
    if originals is not None:
        originals[path] = original
    setattr(owner, name, new)
    patches.append((owner, name, original, new))


def by_name_copies(patches: list[Patch], originals: dict[str, Any], replacements: dict[str, Any],
                   names: Iterable[str]) -> list[Patch]:
    """The patches of the ``vllm.*`` modules (other than the patched owners)
    that imported one of ``names`` by name before now and hold its original."""
    homes = {id(owner) for owner, *_ in patches}
    out = []
    for mod in list(sys.modules.values()):
        if mod is None or id(mod) in homes or not getattr(mod, "__name__", "").startswith("vllm"):
            continue
        for name in names:
            if name in originals and getattr(mod, name, None) is originals[name]:
                out.append((mod, name, originals[name], replacements[name]))
    return out


def restore(patches: list[Patch], warn: Callable[[Any, str], None]) -> None:
    """Every original back, last patch first; an attribute replaced again
    since is left as it is and ``warn(owner, name)`` called."""
    for owner, name, original, new in reversed(patches):
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if current is new:
            setattr(owner, name, original)
        else:
            warn(owner, name)


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, with ``then(module)`` after its code ran."""

    def __init__(self, loader: Any, then: Callable[[Any], None]):
        self.loader, self.then = loader, then

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the module's loader's
        return getattr(self.loader, name)


class AfterImport(importlib.abc.MetaPathFinder):
    """In ``sys.meta_path`` (first, :meth:`now_or_later`): when module ``name``
    is imported, the other finders find it and ``then(module)`` runs once its
    code ran, before the import returns. ``then`` must not raise."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self.then)
                return spec
        return None

    @classmethod
    def now_or_later(cls, name: str, then: Callable[[Any], None]) -> AfterImport | None:
        """``then(module)`` now if ``name`` is imported (returns None), else
        when it is: returns the finder, in ``sys.meta_path`` until removed."""
        if name in sys.modules:
            then(sys.modules[name])
            return None
        finder = cls(name, then)
        sys.meta_path.insert(0, finder)
        return finder

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)
