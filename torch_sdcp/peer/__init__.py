"""Peer-addressable memory: :class:`PeerArena`."""

from .arena import PeerArena

__all__ = ["PeerArena"]

# Fault injection for the tests: called with the name of each creation stage ("validate",
# "allocate", "exchange", "map", "probe") just before it runs. None in production.
_TEST_HOOK = None
