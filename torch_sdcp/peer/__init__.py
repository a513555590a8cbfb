"""Peer-addressable memory: :class:`PeerArena`.

A ``PeerArena`` gives every rank of a process group ``nbytes_per_rank`` bytes that it owns and
maps the memory of every rank into every process at ``base + r * stride``: one contiguous
virtual range, rank-major, so kernels take one pointer and one stride. Creation is collective
and so is every failure of it; every blocking wait is bounded by ``timeout_s``.

Modules: ``arena`` (PeerArena, its views and close), ``plan`` (argument checks, backend choice),
``backend`` (the MemoryBackend interface) with ``cuda_vmm`` (CUDA VMM, through ``cuda_driver``) and ``host_shm``
(memfd shared memory), ``store_sync`` (one
agreement on the group's c10d store: ``StoreSync``), ``agreements`` (the creation agreements,
a creation error posted to the peers), ``groups`` (the groups agreed over: refused ones,
:class:`GroupOutOfStepError`), ``group_order`` (the one order of the collective-path sections
of a group: ``GroupOrder``), ``timeout`` (``timeout_s`` and ``SDCP_TIMEOUT_S``),
``fd_exchange`` (SCM_RIGHTS over private AF_UNIX sockets, SO_PEERCRED checks), ``lifetime``
(reference counting, interpreter exit) and ``dlpack`` (tensors with an explicit device).

The contract (descriptor exchange, credentials, view lifetime, teardown) is described in
docs/DESIGN.md, section "Peer-addressable objects".
"""

from .arena import PeerArena
from .groups import GroupOutOfStepError

__all__ = ["GroupOutOfStepError", "PeerArena"]

# Fault injection for the tests: called with the name of each creation stage ("validate",
# "allocate", "exchange", "map", "probe") just before it runs. None in production.
_TEST_HOOK = None
