"""Reading an engine's sources with ``ast`` (the conformance tests): where a
function is defined and its parameter list as text, and the parsed modules
of an engine's installed sources. Imports neither torch nor the engine."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

import pytest


def find_definition(tree: ast.Module, module: str, path: str):
    """The FunctionDef (or ClassDef) of ``path`` ("f" or "Class.method") at
    the top level of ``tree``, the parsed source of ``module``; fails the test
    when it is missing."""
    body = tree.body
    node = None
    for part in path.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            # A re-export (from .x import f) is not a definition: report the module it really lives in.
            pytest.fail(f"{module} defines no {path} (missing: {part})")
        body = node.body
    return node


def param_list(fn: ast.FunctionDef) -> str:
    """The parameter list as text, annotations left out."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, defaults, strict=False):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=False):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return "(" + ", ".join(out) + ")"


class SourceTrees:
    """The parsed modules of an engine's installed sources (found, never
    imported): ``trees("pkg.mod")`` is its ``ast.Module``. Skips the calling
    test when the engine is absent or a stand-in of it is in sys.modules."""

    def __init__(self, package: str, engine: str, absent: str):
        self.package, self.engine, self.absent = package, engine, absent
        self.trees: dict = {}

    def root(self) -> str:
        mod = sys.modules.get(self.package)
        if mod is not None and getattr(mod, "__file__", None) is None:
            pytest.skip(f"a stand-in for {self.package} is in sys.modules")
        try:
            spec = importlib.util.find_spec(self.package)  # finds the package, does not import it
        except ValueError:
            pytest.skip(f"a stand-in for {self.package} is in sys.modules")
        if spec is None or spec.origin is None:
            pytest.skip(self.absent)
        return os.path.dirname(spec.origin)

    def __call__(self, module: str) -> ast.Module:
        if module not in self.trees:
            root, rel = self.root(), module.split(".")[1:]
            path = os.path.join(root, *rel) + ".py"
            if not os.path.exists(path):
                path = os.path.join(root, *rel, "__init__.py")
            if not os.path.exists(path):
                pytest.fail(f"{self.engine} has no module {module} (looked for {path})")
            with open(path, encoding="utf-8") as f:
                self.trees[module] = ast.parse(f.read(), filename=path)
        return self.trees[module]

    def version(self) -> str:
        """``__version__`` of the engine's ``_version.py``."""
        for node in ast.walk(self(f"{self.package}._version")):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str) and \
                    any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
                return node.value.value
        pytest.fail(f"no __version__ in {self.package}/_version.py")

