"""Call tags (docs/PROTOCOL.md "Failure behaviour"): every call method takes
an optional ``tag`` (for example the layer index), carried in the call
header and compared by every peer. Two host-backend ranks, every peer op of
every family (the cross-family table, _family_calls.py):

- calls whose tags differ (or one untagged) poison the workspace on every
  rank, each naming both tags and the peer; so does a call that one rank
  skips (the next call's tag differs), where calls of one shape would pair
  wrongly without an error;
- a tag that is not one (out of range, negative, a bool, a string) is
  refused before anything is published: a void call, the workspace stays
  usable and the peer is told;
- a void call with a valid tag carries it: the peers still compare it;
- tagged and untagged calls give identical results.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_workers
from _family_calls import ROWS, op_calls
from _helpers import HOST, expect_failure, rank_candidates, rank_partials, requires_gpus

LIMIT = 2**23 - 1  # the first tag that is not one (torch_sdcp._checks.CALL_TAG_LIMIT)


def _families(rank, mode="host"):
    """op: (create, call(ws, **tag) -> a tensor of its result), for every peer
    op of every family (the cross-family table, _family_calls.py)."""
    return {op: (calls.make, calls.good) for op, calls in op_calls(rank, mode).items()}


def _mismatch(mine, theirs):
    """The message both ranks raise for rank 0's ``mine`` against rank 1's ``theirs``."""
    def text(tag):
        return "no call tag" if tag is None else f"call tag {tag}"
    return f"rank 0 called with {text(mine)}, rank 1 with {text(theirs)}; every rank must make the same calls in " \
           "the same order"


def _checked(wrong, case, fn):
    try:
        fn()
    except Exception as e:
        wrong.append(f"{case}: {type(e).__name__}: {e}")


def _mismatch_worker(rank, world, tags, skip, mode="host"):
    """Per family: a tagged call that pairs, then rank 0 calls with tags[0]
    and rank 1 with tags[1] (with ``skip``: rank 1 skips the call tagged 1 of
    layers 0, 1, 2, so its call tagged 2 meets rank 0's call tagged 1). Both
    raise the named mismatch (CUDA: at the next check()) and are poisoned."""
    import torch.distributed as dist

    wrong = []
    for name, (make, call) in _families(rank, mode).items():
        if mode != "host" and name in ("query_publish", "query_release"):  # the release would meet the failure
            continue
        ws = make()

        def case(ws=ws, call=call):
            want = call(ws)
            assert torch.equal(call(ws, tag=0), want), "a tagged call differs from the untagged one"
            if skip:  # layers 0, 1, 2 on rank 0; rank 1 skips layer 1
                assert torch.equal(call(ws, tag=0), want)
                expect_failure(ws, mode, lambda: call(ws, tag=1 if rank == 0 else 2),
                               r"call mismatch \(.*\): " + _mismatch(1, 2))
            else:
                expect_failure(ws, mode, lambda: call(ws, **({} if tags[rank] is None else {"tag": tags[rank]})),
                               r"call mismatch \(.*\): " + _mismatch(*tags))
            with pytest.raises(RuntimeError, match="is poisoned"):
                call(ws, tag=3)

        _checked(wrong, name, case)
        ws.close()
        dist.barrier()
    return wrong


@pytest.mark.parametrize("tags", [(7, 8), (None, 3), (5, None)], ids=["7-8", "untagged-3", "5-untagged"])
def test_a_tag_mismatch_is_named_on_every_rank(tags):
    results = run_workers(_mismatch_worker, 2, args=(tags, False), timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


def test_a_skipped_call_is_named_on_every_rank_at_the_next_call():
    results = run_workers(_mismatch_worker, 2, args=(None, True), timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


@pytest.mark.parametrize("mode", [pytest.param("cuda_shared", marks=requires_gpus(1)),
                                  pytest.param("cuda", marks=requires_gpus(2))])
@pytest.mark.parametrize("skip", [False, True], ids=["7-8", "skipped"])
def test_tags_on_cuda(mode, skip):
    """The same on the CUDA kernels (the tag compared by the header lanes)."""
    results = run_workers(_mismatch_worker, 2, args=((7, 8), skip, mode), timeout=600)
    assert results == [[], []], "\n".join(results[0] + results[1])


BAD_TAGS = [(LIMIT, repr(LIMIT)), (-1, "-1"), (True, "bool"), ("3", "str"), (2.0, "float")]


def _bad_tag_worker(rank, world):
    """Per family, per bad tag on rank 1 (rank 0 tags the call 5): rank 1
    raises its ValueError naming 'tag', rank 0 VoidedCallError naming rank 1;
    neither is poisoned and the next tagged calls pair and are right."""
    import torch.distributed as dist

    import torch_sdcp

    wrong = []
    for name, (make, call) in _families(rank).items():
        ws = make()
        want = call(ws, tag=4)
        for bad, shown in BAD_TAGS:
            def case(ws=ws, call=call, bad=bad, shown=shown, want=want):
                dist.barrier()
                if rank == 1:
                    with pytest.raises(ValueError, match=r"argument 'tag': expected None or an int in \[0, "
                                                         rf"{LIMIT}\), got {shown}$"):
                        call(ws, tag=bad)
                else:
                    with pytest.raises(torch_sdcp.VoidedCallError, match=r"rank 1 voided call .*\[rank 1: "
                                                                         r"ValueError: torch_sdcp: argument 'tag'"):
                        call(ws, tag=5)
                assert not ws.poisoned
                ws.check()
                assert torch.equal(call(ws, tag=6), want), "the next call is wrong"

            _checked(wrong, f"{name}: tag {shown}", case)
            if ws.poisoned:
                break
        ws.close()
        dist.barrier()
    return wrong


def test_a_bad_tag_is_a_void_call_on_every_family():
    results = run_workers(_bad_tag_worker, 2, timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _void_keeps_tag_worker(rank, world):
    """Rank 1's merge voids (ids of the wrong dtype) with a valid tag: the
    placeholder carries it. Against rank 0's same tag the call is void (the
    workspace usable); against another tag it is a tag mismatch on both."""
    import torch.distributed as dist

    import torch_sdcp

    scores, ids = rank_candidates(ROWS, 8, seed=rank)
    ws = torch_sdcp.TopKWorkspace(None, 4, 4, candidates_per_rank=8, timeout_s=60, **HOST)
    want = ws.merge(scores, ids, tag=1)
    if rank == 1:
        with pytest.raises(ValueError, match="argument 'ids'"):
            ws.merge(scores, ids.long(), tag=2)
    else:
        with pytest.raises(torch_sdcp.VoidedCallError, match="rank 1 voided call"):
            ws.merge(scores, ids, tag=2)
    assert not ws.poisoned
    assert torch.equal(ws.merge(scores, ids, tag=3), want)
    dist.barrier()
    if rank == 1:  # its placeholder (tag 5) meets the peer's tag 4: no void call; its own error, poisoned
        with pytest.raises(ValueError, match="argument 'ids'"):
            ws.merge(scores, ids.long(), tag=5)
    else:
        with pytest.raises(RuntimeError, match=_mismatch(4, 5)):
            ws.merge(scores, ids, tag=4)
    assert ws.poisoned
    ws.close()
    return True


def test_a_void_call_carries_its_valid_tag():
    assert run_workers(_void_keeps_tag_worker, 2, timeout=120) == [True, True]


def _over_bound_worker(rank, world):
    """Calls over max_rows take the collective path after an agreement on the
    group's store: the tags are part of it. Same tags: the right result.
    Different tags (or one untagged): the mismatch is named on every rank
    and no rank enters a collective."""
    import torch.distributed as dist

    import torch_sdcp

    po, pl = rank_partials(6, seed=rank)  # 6 rows > max_rows 4
    want = torch_sdcp.collective.lse_all_gather_correct_reduce_scatter(po, pl)
    wrong = []
    for mine in ((3, 4), (None, 5)):
        ws = torch_sdcp.OutputLSEWorkspace(None, 4, 8, 64, timeout_s=60, **HOST)

        def case(ws=ws, mine=mine):
            assert torch.equal(ws.combine(po, pl, tag=2), want)
            tag = mine[rank]
            ranks = ", ".join(f"rank {r}: combine\\(\\) with 6 rows"
                              + ("" if mine[r] is None else f" \\(call tag {mine[r]}\\)") for r in range(2))
            with pytest.raises(RuntimeError, match=rf"call mismatch on the collective path .*: {ranks}; no rank "
                                                   "entered a collective"):
                ws.combine(po, pl, **({} if tag is None else {"tag": tag}))

        _checked(wrong, f"tags {mine}", case)
        ws.close()
        dist.barrier()
    return wrong


def test_tags_are_compared_on_the_collective_path_over_the_bound():
    results = run_workers(_over_bound_worker, 2, timeout=300)
    assert results == [[], []], "\n".join(results[0] + results[1])
