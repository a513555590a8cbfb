"""The family table (torch_sdcp/families.py) drives what is written out
beside it: the cross-family call table of the tests covers every peer op of
every family, and the workspace exports that type checkers read equal the
records."""

from __future__ import annotations

import ast
import inspect

import pytest
from _family_calls import NO_VOID_CALL, PEER_OPS, op_calls

import torch_sdcp
import torch_sdcp.workspaces
from torch_sdcp.families import FAMILIES


def test_every_peer_op_of_every_family_has_its_calls():
    """A peer op without a row here would run in none of test_call_tags.py,
    test_void_calls.py and test_op_arguments.py: a new family's ops need theirs."""
    table = op_calls(0)
    assert set(table) == set(PEER_OPS), (f"peer ops without calls: {sorted(set(PEER_OPS) - set(table))}; "
                                         f"calls of no peer op: {sorted(set(table) - set(PEER_OPS))}")
    for op, calls in table.items():
        assert callable(calls.make) and callable(calls.good), op
        assert calls.arguments, f"{op}: no argument error of the op itself"
        assert bool(calls.void) == (op not in NO_VOID_CALL), f"{op}: a void call, or why it has none"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_the_written_out_exports_are_the_records(family):
    """torch_sdcp.workspaces imports every workspace class by name, so that
    type checkers see it; torch_sdcp hands it on lazily, and names it for
    type checkers under TYPE_CHECKING."""
    cls = family.load()
    assert getattr(torch_sdcp.workspaces, family.workspace) is cls
    assert family.workspace in torch_sdcp.workspaces.__all__
    assert getattr(torch_sdcp, family.workspace) is cls and family.workspace in torch_sdcp.__all__


def _imported(module, *, type_checking: bool) -> dict[str, str]:
    """name -> the module it is imported from, in ``module``'s own source (only
    under ``if TYPE_CHECKING:`` with ``type_checking``)."""
    tree = ast.parse(inspect.getsource(module))
    body = tree.body
    if type_checking:
        body = [node for stmt in tree.body if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "TYPE_CHECKING"
                for node in stmt.body]
    return {alias.asname or alias.name: node.module for node in body if isinstance(node, ast.ImportFrom)
            for alias in node.names if node.module}


def test_no_export_beside_the_records():
    """Every workspace class written out in torch_sdcp.workspaces is a
    record's, from the record's module; torch_sdcp's type-checking names are
    exactly what its __getattr__ hands on."""
    workspaces = _imported(torch_sdcp.workspaces, type_checking=False)
    written = {name: module for name, module in workspaces.items() if name.endswith("Workspace")
               and name != "PeerWorkspace"}
    assert written == {family.workspace: family.module for family in FAMILIES}
    lazy = _imported(torch_sdcp, type_checking=True)
    assert set(lazy) == set(torch_sdcp._LAZY) | set(torch_sdcp._LAZY_MODULES)
    assert {name: lazy[name] for name in torch_sdcp._LAZY} == torch_sdcp._LAZY
