"""The references of torch_sdcp.reference, checked against independent brute
force (Python sorted(), complex numbers, float64 softmax) and against the CPU
operators (bit for bit where the contract says so)."""

import ast
import itertools
import math
import pathlib
import re

import pytest
import torch

import torch_sdcp
from torch_sdcp import _checks, semantics
from torch_sdcp import reference as ref
from torch_sdcp._checks import check_contiguous, check_dim, check_same_device, check_size

NOPE, ROPE = 512, 64
INF, NAN = math.inf, math.nan


def bits(t):
    """Raw bytes, so that NaN payloads and -0.0 compare exactly."""
    return t.contiguous().view(torch.uint8)


def assert_bitwise(a, b):
    """Identical bytes. The one allowance: a bf16 NaN may be encoded differently
    (torch's CPU float->bf16 cast writes 0xFFFF, c10::BFloat16 in the kernels
    0x7FC0, CUDA 0x7FFF); both sides must still be NaN at the same places.
    float8_e4m3fn NaNs (0x7F / 0xFF) are compared exactly."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.bfloat16:
        # On the raw bits (fast): NaN = exponent all ones, mantissa non-zero.
        ai, bi = a.view(torch.int16), b.view(torch.int16)
        a_nan, b_nan = (ai & 0x7FFF) > 0x7F80, (bi & 0x7FFF) > 0x7F80
        assert torch.equal(a_nan, b_nan), "NaN at different places"
        a, b = torch.where(a_nan, 0, ai), torch.where(b_nan, 0, bi)
    if not torch.equal(bits(a), bits(b)):
        diff = (bits(a) != bits(b)).reshape(a.shape[0], a.shape[1], -1).any(-1).nonzero()
        raise AssertionError(f"{diff.shape[0]} (row, head) pairs differ, first {diff[:5].tolist()}")


# ---------------------------------------------------------------------------
# Token ownership
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 3, 64])
def test_token_ownership_round_trip(world_size, interleave):
    n, i = world_size, interleave
    total = n * i * 5 + i + 1  # ends with a partial round
    owned = {r: [] for r in range(n)}
    for g in range(total):
        r = ref.token_owner(g, n, i)
        j = ref.token_local_index(g, n, i)
        assert 0 <= r < n
        assert ref.token_global_index(j, r, n, i) == g
        owned[r].append(j)
    # Each rank's local indices are dense: 0, 1, 2, ... in global order.
    for r in range(n):
        assert owned[r] == list(range(len(owned[r])))
    # Blocks of I consecutive tokens share an owner, owners go round-robin.
    assert [ref.token_owner(g, n, i) for g in range(total)] == [(g // i) % n for g in range(total)]
    # Tensors (int64 and int32) agree with ints.
    for dtype in (torch.int64, torch.int32):
        g = torch.arange(total, dtype=dtype)
        r, j = ref.token_owner(g, n, i), ref.token_local_index(g, n, i)
        assert r.tolist() == [ref.token_owner(x, n, i) for x in range(total)]
        assert j.tolist() == [ref.token_local_index(x, n, i) for x in range(total)]
        assert torch.equal(ref.token_global_index(j, r, n, i), g)
        assert torch.equal(ref.token_global_index(j, 0, n, i)[r == 0], g[r == 0])


def test_token_ownership_validation():
    with pytest.raises(ValueError, match=r"torch_sdcp: argument 'world_size': expected world_size >= 1, got 0"):
        ref.token_owner(3, 0)
    with pytest.raises(ValueError, match=r"argument 'interleave': expected interleave >= 1, got -2"):
        ref.token_local_index(3, 2, -2)
    with pytest.raises(ValueError, match=r"argument 'world_size': expected world_size to be an int, got float"):
        ref.token_owner(3, 2.0)
    with pytest.raises(ValueError, match=r"argument 'rank': expected rank < world_size = 2, got 2"):
        ref.token_global_index(0, 2, 2)
    with pytest.raises(ValueError, match=r"argument 'g': expected g >= 0, got -1"):
        ref.token_owner(-1, 2)
    with pytest.raises(ValueError, match=r"argument 'g': expected an integer tensor, got dtype torch.float32"):
        ref.token_owner(torch.ones(3), 2)


# ---------------------------------------------------------------------------
# Query producer
# ---------------------------------------------------------------------------


def make_cache(max_pos, rope, dtype, base=10000.0):
    """vLLM layout: row p = cat(cos(p * f), sin(p * f))."""
    inv_freq = 1.0 / base ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype).contiguous()


def make_query(rows, heads, gen, scale=3.0, strided=False, max_pos=4096):
    """bf16 ql_nope / q_pe, positions; strided=True gives views that are
    non-contiguous in dims 0 and 1 (unit stride in the last dim)."""
    if strided:
        # Head-major storage, transposed; nope and rope share one row buffer.
        base = (torch.randn(heads, rows + 3, NOPE + ROPE + 8, generator=gen) * scale).bfloat16()
        q = base.transpose(0, 1)[1:rows + 1]
        ql_nope, q_pe = q[..., :NOPE], q[..., NOPE + 8:]
        assert not ql_nope.is_contiguous() and not q_pe.is_contiguous()
        positions = torch.randint(0, max_pos, (2 * rows,), generator=gen, dtype=torch.int32)[::2]
    else:
        ql_nope = (torch.randn(rows, heads, NOPE, generator=gen) * scale).bfloat16()
        q_pe = (torch.randn(rows, heads, ROPE, generator=gen) * scale).bfloat16()
        positions = torch.randint(0, max_pos, (rows,), generator=gen)
    return ql_nope, q_pe, positions


# (out_dtype, q_scale): bf16, fp8 with no scale, fp8 with a scale that
# saturates a good share of the values, fp8 with a scale > 1.
QUERY_OUTPUTS = [
    (torch.bfloat16, None),
    (torch.float8_e4m3fn, None),
    (torch.float8_e4m3fn, 1.0 / 64),
    (torch.float8_e4m3fn, 3.0),
]


@pytest.mark.parametrize("rows,heads", [(1, 8), (8, 16), (17, 32), (64, 8), (128, 16), (128, 32), (17, 8)])
def test_query_ref_matches_op(rows, heads):
    gen = torch.Generator().manual_seed(rows * 1000 + heads)
    caches = {dt: make_cache(4096, ROPE, dt) for dt in (torch.float32, torch.bfloat16)}
    for strided in (False, True):
        ql_nope, q_pe, positions = make_query(rows, heads, gen, strided=strided)
        for (out_dtype, scale), neox, cache_dtype in itertools.product(QUERY_OUTPUTS, (False, True), caches):
            q_scale = None if scale is None else torch.tensor([scale], dtype=torch.float32)
            cache = caches[cache_dtype]
            want = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, q_scale, neox, out_dtype)
            got = torch.ops.sdcp.query_rope_quant(ql_nope, q_pe, positions, cache, q_scale, neox, out_dtype)
            assert want.shape == (rows, heads, NOPE + ROPE)
            assert_bitwise(want, got)
            if scale == 1.0 / 64:  # the saturating case really saturates
                assert (want.float().abs() == 448.0).any()


def test_query_ref_matches_op_special_values():
    """inf / NaN / -0.0 / huge inputs: still bit for bit (NaN stays NaN, fp8 saturates)."""
    gen = torch.Generator().manual_seed(7)
    rows, heads = 9, 8
    ql_nope, q_pe, positions = make_query(rows, heads, gen, scale=1.0)
    specials = torch.tensor([INF, -INF, NAN, -0.0, 0.0, 3.0e38, -3.0e38, 1e-40], dtype=torch.bfloat16)
    ql_nope[0, :, :8] = specials
    q_pe[1, :, :8] = specials
    q_pe[2, :, 32:40] = specials  # the NeoX partners of the first columns
    cache = make_cache(4096, ROPE, torch.float32)
    cache[positions[3]] = torch.tensor([INF, NAN] * (ROPE // 2))
    for (out_dtype, scale), neox in itertools.product(QUERY_OUTPUTS, (False, True)):
        q_scale = None if scale is None else torch.tensor([scale], dtype=torch.float32)
        want = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, q_scale, neox, out_dtype)
        got = torch.ops.sdcp.query_rope_quant(ql_nope, q_pe, positions, cache, q_scale, neox, out_dtype)
        assert want.float().isnan().any()
        assert_bitwise(want, got)


def brute_force_rope(ql_nope, q_pe, positions, cache, neox):
    """Per element, in Python complex128: pair (x0, x1) as x0 + i*x1 times
    cos + i*sin. Returns a float64 [T, H, Dn + R] tensor."""
    rows, heads, rope = q_pe.shape
    half = rope // 2
    pe = q_pe.double().tolist()
    cs = cache.double().tolist()
    out = torch.empty(rows, heads, NOPE + rope, dtype=torch.float64)
    out[..., :NOPE] = ql_nope.double()
    for t in range(rows):
        row = cs[int(positions[t])]
        for h in range(heads):
            x = pe[t][h]
            for j in range(half):
                i0, i1 = (j, j + half) if neox else (2 * j, 2 * j + 1)
                z = complex(x[i0], x[i1]) * complex(row[j], row[half + j])
                out[t, h, NOPE + i0] = z.real
                out[t, h, NOPE + i1] = z.imag
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_query_ref_vs_complex_rope(neox, cache_dtype):
    gen = torch.Generator().manual_seed(11 + neox)
    rows, heads = 5, 3
    ql_nope, q_pe, positions = make_query(rows, heads, gen)
    cache = make_cache(4096, ROPE, cache_dtype)
    exact = brute_force_rope(ql_nope, q_pe, positions, cache, neox)
    # The fp32 values: two rounded products and one rounded sum per element.
    fp32 = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, None, neox, torch.float32)
    torch.testing.assert_close(fp32.double(), exact, rtol=1e-6, atol=1e-5)
    assert torch.equal(fp32[..., :NOPE], ql_nope.float())  # the nope part is copied exactly
    # bf16: within one bf16 rounding of the exact value.
    bf16 = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, None, neox, torch.bfloat16)
    err = (bf16.double() - exact).abs()
    assert (err <= exact.abs() * (2.0**-8 + 1e-6) + 1e-5).all()
    # fp8: saturate(x / scale) within one e4m3 rounding (3 mantissa bits).
    scale = 0.125
    fp8 = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, torch.tensor([scale]), neox,
                                   torch.float8_e4m3fn)
    target = (exact / scale).clamp(-448.0, 448.0)
    err = (fp8.double() - target).abs()
    assert (err <= target.abs() * (2.0**-4 + 1e-6) + 2.0**-10).all()
    # RoPE rotates each pair: its norm is kept.
    x = q_pe.double()
    r = exact[..., NOPE:]
    if neox:
        n_in = x[..., :32] ** 2 + x[..., 32:] ** 2
        n_out = r[..., :32] ** 2 + r[..., 32:] ** 2
    else:
        n_in = x[..., 0::2] ** 2 + x[..., 1::2] ** 2
        n_out = r[..., 0::2] ** 2 + r[..., 1::2] ** 2
    tol = 1e-2 if cache_dtype == torch.bfloat16 else 1e-6  # cos, sin rounded to the cache dtype
    torch.testing.assert_close(n_out, n_in, rtol=tol, atol=tol)


def test_query_position_zero_is_identity():
    gen = torch.Generator().manual_seed(3)
    ql_nope, q_pe, _ = make_query(4, 8, gen)
    cache = make_cache(16, ROPE, torch.float32)
    out = ref.query_rope_quant_ref(ql_nope, q_pe, torch.zeros(4, dtype=torch.long), cache)
    assert torch.equal(out, torch.cat([ql_nope, q_pe], dim=-1))


def test_query_gathered_layout():
    gen = torch.Generator().manual_seed(5)
    n, hl = 3, 4
    ql_nope, q_pe, positions = make_query(6, n * hl, gen)
    cache = make_cache(4096, ROPE, torch.float32)
    for out_dtype, scale in QUERY_OUTPUTS:
        q_scale = None if scale is None else torch.tensor([scale])
        full = ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, q_scale, False, out_dtype)
        parts = [ref.query_rope_quant_ref(ql_nope[:, r * hl:(r + 1) * hl], q_pe[:, r * hl:(r + 1) * hl],
                                          positions, cache, q_scale, False, out_dtype) for r in range(n)]
        gathered = ref.query_gathered_layout(parts)
        assert_bitwise(gathered, full)
        for r in range(n):  # head src_rank * H_loc + h
            assert_bitwise(gathered[:, r * hl + 1], parts[r][:, 1])


def test_query_validation():
    gen = torch.Generator().manual_seed(0)
    ql_nope, q_pe, positions = make_query(2, 2, gen, max_pos=8)
    cache = make_cache(8, ROPE, torch.float32)
    with pytest.raises(ValueError, match=r"argument 'ql_nope': expected dtype torch.bfloat16, got dtype torch.float32"):
        ref.query_rope_quant_ref(ql_nope.float(), q_pe, positions, cache)
    with pytest.raises(ValueError, match=r"argument 'q_scale': expected None for a non-fp8 output"):
        ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"argument 'q_pe': expected an even, positive last dimension, got 63"):
        ref.query_rope_quant_ref(ql_nope, q_pe[..., :63], positions, cache[:, :63])
    with pytest.raises(ValueError, match=r"argument 'positions': expected values in \[0, 8\)"):
        ref.query_rope_quant_ref(ql_nope, q_pe, positions + 8, cache)
    with pytest.raises(ValueError, match=r"argument 'out_dtype'"):
        ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"argument 'q_scale': expected one element, got shape \[2\]"):
        ref.query_rope_quant_ref(ql_nope, q_pe, positions, cache, torch.ones(2), False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"argument 'per_rank_outputs\[1\]': expected shape"):
        ref.query_gathered_layout([torch.zeros(2, 2, 4), torch.zeros(2, 3, 4)])


# ---------------------------------------------------------------------------
# Top-K
# ---------------------------------------------------------------------------


def brute_force_topk(scores, ids, k):
    """Python sorted() over (class, score, -id) tuples, largest first: valid
    numbers, then valid NaNs; -0.0 == 0.0 in Python; the lower id wins ties."""
    out = []
    for srow, irow in zip(scores.tolist(), ids.tolist(), strict=False):
        cands = []
        for s, i in zip(srow, irow, strict=False):
            if i < 0:
                continue
            cands.append(((0, 0.0, -i) if math.isnan(s) else (1, s, -i), i))
        cands.sort(key=lambda c: c[0], reverse=True)
        picked = [i for _, i in cands[:k]]
        out.append(picked + [-1] * (k - len(picked)))
    return torch.tensor(out, dtype=torch.int32).reshape(len(out), k)


SPECIAL_SCORES = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 2.5]
SPECIAL_IDS = [-1, -2, -(2**31), 0, 1, 2, 7, 2**31 - 1, 2**31 - 2, 2**31 - 3]


def topk_case(kind, rows, m, gen):
    """Adversarial candidate sets."""
    if kind == "random":
        scores = torch.randn(rows, m, generator=gen)
        ids = torch.randperm(10 * m + 1, generator=gen)[:m].int().expand(rows, m).clone()
    elif kind == "all_equal":
        scores = torch.full((rows, m), 0.5)
        ids = torch.stack([torch.randperm(m, generator=gen) for _ in range(rows)]).int()
    elif kind == "specials":
        pick = torch.randint(0, len(SPECIAL_SCORES), (rows, m), generator=gen)
        scores = torch.tensor(SPECIAL_SCORES)[pick]
        pick = torch.randint(0, len(SPECIAL_IDS), (rows, m), generator=gen)
        ids = torch.where(torch.rand(rows, m, generator=gen) < 0.5, torch.tensor(SPECIAL_IDS, dtype=torch.int32)[pick],
                          torch.randint(0, 50, (rows, m), generator=gen, dtype=torch.int32))
    elif kind == "all_nan":
        scores = torch.full((rows, m), NAN)
        ids = torch.randint(-2, 40, (rows, m), generator=gen, dtype=torch.int32)
    elif kind == "all_invalid":
        scores = torch.randn(rows, m, generator=gen)
        ids = torch.full((rows, m), -1, dtype=torch.int32)
    elif kind == "signed_zero":
        scores = torch.where(torch.rand(rows, m, generator=gen) < 0.5, -0.0, 0.0)
        ids = torch.randint(-1, 3 * m, (rows, m), generator=gen, dtype=torch.int32)
    elif kind == "few_valid":
        scores = torch.randn(rows, m, generator=gen)
        ids = torch.where(torch.rand(rows, m, generator=gen) < 0.8, -1,
                          torch.randint(0, 2**31 - 1, (rows, m), generator=gen, dtype=torch.int32))
    else:
        raise AssertionError(kind)
    return scores.float().contiguous(), ids.int().contiguous()


TOPK_KINDS = ["random", "all_equal", "specials", "all_nan", "all_invalid", "signed_zero", "few_valid"]


@pytest.mark.parametrize("kind", TOPK_KINDS)
def test_topk_ref_vs_brute_force(kind):
    gen = torch.Generator().manual_seed(TOPK_KINDS.index(kind))
    for rows, m, k in [(1, 1, 1), (3, 16, 4), (4, 33, 33), (2, 40, 64), (5, 64, 17), (1, 0, 3), (2, 128, 128)]:
        empty = (torch.empty(rows, 0), torch.empty(rows, 0, dtype=torch.int32))
        scores, ids = topk_case(kind, rows, m, gen) if m else empty
        want = brute_force_topk(scores, ids, k)
        got = ref.topk_select_ref(scores, ids, k)
        assert torch.equal(got, want), (rows, m, k, scores, ids, got, want)
        assert torch.equal(torch.ops.sdcp.topk_select(scores, ids, k), want), (rows, m, k)


def test_topk_order_details():
    s = torch.tensor([[NAN, -INF, -0.0, 0.0, 1.0, 1.0, 5.0, INF, NAN]])
    i = torch.tensor([[3, 9, 8, 4, 6, 2, -1, 2**31 - 1, 0]], dtype=torch.int32)
    # inf first; 1.0 twice (lower id first); zeros tie (lower id first);
    # -inf; NaNs last (lower id first); the invalid 5.0 never.
    want = [[2**31 - 1, 2, 6, 4, 8, 9, 0, 3, -1, -1]]
    assert ref.topk_select_ref(s, i, 10).tolist() == want
    assert torch.ops.sdcp.topk_select(s, i, 10).tolist() == want
    assert ref.topk_select_ref(s, i, 3).tolist() == [want[0][:3]]


@pytest.mark.parametrize("rows", [1, 128])
@pytest.mark.parametrize("k", [512, 1024, 2048])
def test_topk_ref_matches_op_large(rows, k):
    gen = torch.Generator().manual_seed(rows + k)
    m = 2 * k
    # Quantised scores: many ties; ids unique per row with a few invalid.
    scores = (torch.randn(rows, m, generator=gen) * 4).round() / 4
    scores[:, :: 97] = NAN
    scores[:, 5:: 131] = -0.0
    scores[:, 7:: 151] = -INF
    ids = torch.stack([torch.randperm(8 * m, generator=gen)[:m] * 64 + 5 for _ in range(rows)]).int()
    ids[:, 3:: 17] = -1
    ids[:, 0] = 2**31 - 1
    got = torch.ops.sdcp.topk_select(scores, ids, k)
    want = ref.topk_select_ref(scores, ids, k)
    assert torch.equal(got, want)
    assert torch.equal(want[:1], brute_force_topk(scores[:1], ids[:1], k))
    # Non-contiguous rows (unit stride in the last dim) select the same.
    wide_s = torch.full((rows, m + 8), 9.0)
    wide_i = torch.full((rows, m + 8), 1, dtype=torch.int32)
    wide_s[:, 8:], wide_i[:, 8:] = scores, ids
    assert torch.equal(torch.ops.sdcp.topk_select(wide_s[:, 8:], wide_i[:, 8:], k), want)
    assert torch.equal(ref.topk_select_ref(wide_s[:, 8:], wide_i[:, 8:], k), want)


def test_topk_merge_ref():
    gen = torch.Generator().manual_seed(99)
    rows, c, k = 6, 48, 64
    shards = [topk_case(kind, rows, c, gen) for kind in ("random", "specials", "all_invalid", "few_valid")]
    want = brute_force_topk(torch.cat([s for s, _ in shards], 1), torch.cat([i for _, i in shards], 1), k)
    assert torch.equal(ref.topk_merge_ref(shards, k), want)
    # The merged set and order do not depend on the shard order: every rank
    # sees the same result whatever order it reads the owners in.
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2]):
        assert torch.equal(ref.topk_merge_ref([shards[p] for p in perm], k), want)
    # An empty (all-invalid) shard changes nothing; M < k pads with -1.
    assert torch.equal(ref.topk_merge_ref(shards[2:3], 5), torch.full((rows, 5), -1, dtype=torch.int32))
    assert (ref.topk_merge_ref(shards[:1], 2 * c)[:, c:] == -1).all()


def test_topk_validation():
    s, i = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"torch_sdcp: argument 'k': expected k >= 1, got 0"):
        ref.topk_select_ref(s, i, 0)
    with pytest.raises(ValueError, match=r"argument 'ids': expected dtype torch.int32, got dtype torch.int64"):
        ref.topk_select_ref(s, i.long(), 1)
    with pytest.raises(ValueError, match=r"argument 'ids': expected size 4 at dim 1, got 3 \(shape \[2, 3\]\)"):
        ref.topk_select_ref(s, i[:, :3], 1)
    with pytest.raises(ValueError, match=r"argument 'shards': expected at least one"):
        ref.topk_merge_ref([], 1)


# ---------------------------------------------------------------------------
# Output / LSE combine
# ---------------------------------------------------------------------------


def softmax_combine64(partial_out, partial_lse, base2):
    """Independent fp64 reference: w = softmax of the sanitised LSEs over the
    shards; rows with no non-empty shard are 0 / -inf."""
    l = partial_lse.double()
    l = torch.where(l.isnan() | (l == INF), -INF, l)
    scale = math.log(2.0) if base2 else 1.0  # 2^x = e^(x ln 2)
    empty = (l == -INF).all(0)
    safe = torch.where(empty, 0.0, l)  # keep softmax finite on empty rows
    w = torch.softmax(safe * scale, dim=0)
    w = torch.where(empty | (l == -INF), 0.0, w)
    lse = torch.where(empty, -INF, torch.logsumexp(safe * scale, dim=0) / scale)
    o = partial_out.double()
    out = torch.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(0)
    mag = torch.where(w[..., None] > 0, (w[..., None] * o).abs(), 0.0).sum(0)  # error scale
    return out, lse, mag


def lse_case(n, rows, heads, dim, dtype, gen, specials=True):
    """Random partials; specials add NaN/+inf/-inf LSE entries (with NaN
    payloads), fully empty (row, head) pairs and very unequal shards."""
    out = torch.randn(n, rows, heads, dim, generator=gen)
    lse = torch.randn(n, rows, heads, generator=gen) * 3 + 8
    if specials:
        u = torch.rand(n, rows, heads, generator=gen)
        lse = torch.where(u < 0.08, NAN, lse)
        lse = torch.where((u >= 0.08) & (u < 0.16), INF, lse)
        lse = torch.where((u >= 0.16) & (u < 0.24), -INF, lse)
        empty_shard = u < 0.24
        out = torch.where(empty_shard[..., None] & (torch.rand(n, rows, heads, 1, generator=gen) < 0.5), NAN, out)
        # Every shard empty for a few (row, head) pairs.
        lse[:, 0, 0] = torch.tensor([NAN, INF, -INF] * n)[:n]
        lse[:, -1, -1] = -INF
        out[:, -1, -1] = INF
        if n > 1:  # one dominant shard, the rest 40 nats below
            lse[:, 0, -1] = 10.0
            lse[0, 0, -1] = 50.0
            out[:, 0, -1] = torch.randn(n, dim, generator=gen)  # weighted: finite payloads
    return out.to(dtype).contiguous(), lse.contiguous()


@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_lse_ref_vs_float64_softmax(n, base2):
    gen = torch.Generator().manual_seed(n * 10 + base2)
    rows, heads, dim = 7, 6, 32
    po, pl = lse_case(n, rows, heads, dim, torch.float32, gen)
    want_out, want_lse, mag = softmax_combine64(po, pl, base2)
    for fn, tol in ((ref.lse_combine_ref, 1e-5), (ref.lse_combine_ref64, 1e-12)):
        out, lse = fn(po, pl, base2)
        assert lse.dtype == (torch.float32 if fn is ref.lse_combine_ref else torch.float64)
        assert out.shape == (rows, heads, dim) and lse.shape == (rows, heads)
        assert not out.isnan().any()  # zero-weight NaN payloads never leak
        torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
        assert ((out.double() - want_out).abs() <= tol * mag + 1e-30).all()
    # Empty (row, head) pairs: out exactly 0 (+0.0), lse -inf.
    for fn in (ref.lse_combine_ref, ref.lse_combine_ref64):
        out, lse = fn(po, pl, base2)
        for t, h in ((0, 0), (rows - 1, heads - 1)):
            assert lse[t, h] == -INF
            assert torch.equal(bits(out[t, h]), bits(torch.zeros(dim, dtype=out.dtype)))


def test_lse_ref_bf16_output_rounds_once():
    gen = torch.Generator().manual_seed(1)
    po, pl = lse_case(4, 9, 8, 64, torch.bfloat16, gen)
    out, lse = ref.lse_combine_ref(po, pl)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # One rounding of the fp32 accumulation: equal to the fp32 combine of the
    # same bf16 payloads, rounded.
    out32, lse32 = ref.lse_combine_ref(po.float(), pl)
    assert torch.equal(bits(out), bits(out32.to(torch.bfloat16)))
    assert torch.equal(lse, lse32)


def test_lse_zero_weight_payload_never_read():
    """A shard whose fp32 weight underflows to 0 (or is empty) contributes an
    exact 0 even with a NaN / inf payload; a weighted NaN does propagate."""
    d = 8
    po = torch.stack([torch.ones(1, 3, d), torch.full((1, 3, d), NAN), torch.full((1, 3, d), INF)])
    pl = torch.tensor([[[0.0, 0.0, 0.0]], [[-200.0, -INF, NAN]], [[-300.0, INF, -INF]]])
    for dtype in (torch.float32, torch.bfloat16):
        for base2 in (False, True):
            out, lse = ref.lse_combine_ref(po.to(dtype), pl, base2)
            got, got_lse = torch.ops.sdcp.lse_combine(po.to(dtype).contiguous(), pl, base2)
            for o in (out, got):
                assert torch.equal(o.float(), torch.ones(1, 3, d))
            assert torch.equal(lse, torch.zeros(1, 3)) and torch.equal(got_lse, torch.zeros(1, 3))
    # A non-zero weight on a NaN payload is not hidden.
    pl[1, 0, 0] = 0.0
    assert ref.lse_combine_ref(po, pl)[0][0, 0].isnan().all()
    assert torch.ops.sdcp.lse_combine(po, pl, False)[0][0, 0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("base2", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_lse_op_matches_ref64(n, base2, dtype):
    gen = torch.Generator().manual_seed(n + 100 * base2)
    rows, heads, dim = 5, 16, 64
    po, pl = lse_case(n, rows, heads, dim, dtype, gen)
    out, lse = torch.ops.sdcp.lse_combine(po, pl, base2)
    want_out, want_lse = ref.lse_combine_ref64(po, pl, base2)
    _, _, mag = softmax_combine64(po, pl, base2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    empty = want_lse == -INF
    assert torch.equal(lse == -INF, empty)
    torch.testing.assert_close(lse.double()[~empty], want_lse[~empty], rtol=1e-5, atol=1e-6)
    # Within one rounding to the output dtype of the fp64 value (fp32
    # accumulation error on top).
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
    err = (out.double() - want_out).abs()
    assert (err <= half_ulp * want_out.abs() + 1e-5 * mag + 1e-30).all(), err.max()
    assert (out[empty] == 0).all()
    # The fp32 reference is within the same bounds (it is not bitwise equal to
    # the op: the exp/log implementations differ).
    ref_out, ref_lse = ref.lse_combine_ref(po, pl, base2)
    torch.testing.assert_close(ref_lse.double()[~empty], want_lse[~empty], rtol=1e-5, atol=1e-6)
    assert ((ref_out.double() - want_out).abs() <= half_ulp * want_out.abs() + 1e-5 * mag + 1e-30).all()


def test_output_lse_shard():
    out, lse = torch.randn(3, 12, 4), torch.randn(3, 12)
    for n in (1, 2, 3, 4, 6, 12):
        parts = [ref.output_lse_shard(out, lse, r, n) for r in range(n)]
        assert torch.equal(torch.cat([p[0] for p in parts], 1), out)
        assert torch.equal(torch.cat([p[1] for p in parts], 1), lse)
    o, l = ref.output_lse_shard(out, None, 1, 3)
    assert l is None and torch.equal(o, out[:, 4:8])
    with pytest.raises(ValueError, match=r"argument 'out': expected heads divisible by the world size 5, got 12"):
        ref.output_lse_shard(out, lse, 0, 5)
    with pytest.raises(ValueError, match=r"argument 'rank': expected an int in \[0, 2\), got 2"):
        ref.output_lse_shard(out, lse, 2, 2)


def test_lse_validation():
    with pytest.raises(ValueError, match=r"argument 'partial_lse': expected size 3 at dim 2, got"):
        ref.lse_combine_ref(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match=r"argument 'partial_out': expected 4 dimensions, got 3 \(shape \[1, 3, 4\]\)"):
        ref.lse_combine_ref(torch.zeros(1, 3, 4), torch.zeros(1, 3))


def _message(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def test_python_checks_word_errors_as_the_ops_do():
    # One wording (csrc/checks.cpp): the references, the collective paths and
    # the ops refuse the same bad input with the same text.
    s, i = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int32)
    for bad in ((s, i[:, :3]), (s[0], i), (s, i[0])):
        python = _message(lambda: ref.topk_select_ref(*bad, 1))
        assert python == _message(lambda: torch.ops.sdcp.topk_select(*bad, 1))
        assert re.search(r"expected (size 4 at dim 1, got 3 \(shape \[2, 3\]\)|2 dimensions, got 1 \(shape \[4\]\))$",
                         python), python
    out, lse = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    for bad in ((out, lse[:, :2].contiguous()), (out[0], lse)):
        assert (_message(lambda: ref.lse_combine_ref(bad[0][None], bad[1][None]))
                == _message(lambda: torch.ops.sdcp.lse_combine(bad[0][None], bad[1][None], False)))
    nope, pe = torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 3, 4, dtype=torch.bfloat16)
    args = (nope, pe, torch.zeros(1, dtype=torch.long), torch.zeros(4, 4))
    assert (_message(lambda: ref.query_rope_quant_ref(*args))
            == _message(lambda: torch.ops.sdcp.query_rope_quant(*args, None, False, torch.bfloat16))
            == "torch_sdcp: argument 'q_pe': expected size 2 at dim 1, got 3 (shape [1, 3, 4])")
    strided = torch.zeros(4, 2).t()
    with pytest.raises(ValueError, match=r"^torch_sdcp: argument 'x': expected a contiguous tensor, got strides "
                                         r"\[1, 2\] for shape \[2, 4\]$"):
        check_contiguous(strided, "x")
    with pytest.raises(ValueError, match=r"argument 'b': expected device cpu \(that of 'a'\), got device meta$"):
        check_same_device(torch.zeros(1, device="meta"), "b", torch.zeros(1), "a")
    with pytest.raises(ValueError, match=r"argument 'scores': expected 2 dimensions \[T, C\], got 1 \(shape \[4\]\)"):
        check_dim(s[0], "scores", 2, "[T, C]")
    with pytest.raises(ValueError, match=r"argument 'x': expected 3 or 4 dimensions, got 2"):
        check_dim(s, "x", (3, 4))
    with pytest.raises(ValueError, match=r"argument 'o': expected size 5 at dim 2 \(head_dim\), got 8 \(shape"):
        check_size(out, "o", 2, 5, "head_dim")


def test_production_modules_do_not_import_the_oracle():
    # reference is the test oracle: what production computes in PyTorch lives
    # in torch_sdcp.semantics, its checks in torch_sdcp._checks.
    root = pathlib.Path(torch_sdcp.__file__).parent
    for name in ("_checks.py", "ops.py", "collective.py", "semantics.py"):
        tree = ast.parse((root / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                     for a in n.names}
        assert not any("reference" in m for m in imported), (name, sorted(imported))
    assert ref.token_owner is semantics.token_owner and ref.mask_empty_shards is semantics.mask_empty_shards
    assert ref.check_mask_args is _checks.check_mask_args
