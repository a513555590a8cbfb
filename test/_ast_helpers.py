"""Reading an engine's sources with ``ast`` (the conformance tests): where a
function is defined and its parameter list as text. Imports neither torch
nor the engine."""

from __future__ import annotations

import ast

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
    for arg, default in zip(positional, defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return "(" + ", ".join(out) + ")"
