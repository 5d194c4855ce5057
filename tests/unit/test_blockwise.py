"""Blockwise codes (``core.blockwise``): kept int8/int4 payloads, against decoding them.

- A range of a ``Blockwise`` dequantises to the decoded vector's very bits; decode_delta checks
  what decode checks and raises what it raises.
- A merge from codes is deterministic, and equals the merge of the decoded vectors to float32
  rounding (CodesSum folds the block scales into its matmul; norms come from exact sums).
- Re-anchoring a Blockwise Δ gives the decoded Δ's bits; the buffer pool takes codes back.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.core.anchor import VersionRing, re_anchor
from dd_queue.core.blockwise import (
    EXACT_SQ_BLOCK,
    MAX_FOLDED_BLOCK,
    Blockwise,
    CodesSum,
    add_into,
    as_float32,
    values,
)
from dd_queue.core.codec import (
    CodecSpec,
    DecodeLimits,
    EncodedTensor,
    TensorHeader,
    codes_view,
    decode,
    decode_delta,
    encode,
    keeps_codes,
)
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.merge import ContributionData, merge_fragment, merge_weighted, segment_sq_norms
from dd_queue.errors import CoreError, CorruptPayload, NonFiniteValues, PayloadTooLarge
from dd_queue.synchronizer.buffers import BufferPool

LIMITS = DecodeLimits()
CODECS = st.sampled_from([("int8", 256), ("int8", 8), ("int8", 1000), ("int4", 64), ("int4", 8)])


def encoded(
    n: int, codec: str, block: int, seed: int = 0, zstd: int | None = None
) -> EncodedTensor:
    x = (np.random.default_rng(seed).standard_normal(n) * 1e-3).astype(np.float32)
    return encode(x, CodecSpec(codec, block_size=block, zstd_level=zstd))


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def layout(n: int, cuts: list[int]) -> Fragment:
    """A fragment of ``n`` elements cut into segments at ``cuts`` (the last one an embedding)."""
    edges = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    segs = tuple(
        Segment(f"s{i}", a, b, (b - a,), i == len(edges) - 2)
        for i, (a, b) in enumerate(itertools.pairwise(edges))
    )
    return Fragment(index=0, segments=segs, size=n)


@settings(max_examples=60, deadline=None)
@given(
    codec=CODECS,
    n=st.integers(2, 5000),
    zstd=st.sampled_from([None, 3]),
    data=st.data(),
)
def test_any_range_of_the_codes_dequantises_to_the_decoded_bits(
    codec: tuple[str, int], n: int, zstd: int | None, data: st.DataObject
) -> None:
    e = encoded(n, *codec, zstd=zstd)
    ref = decode(e.header, e.payload, limits=LIMITS)
    out = np.empty(n, np.float32)
    d = decode_delta(e.header, e.payload, out=out, limits=LIMITS)
    assert isinstance(d, Blockwise) and d.buffer is out
    assert bits(as_float32(d)) == bits(ref)
    again = codes_view(e.header, out)
    assert again.codes.tobytes() == d.codes.tobytes() and bits(again.scales) == bits(d.scales)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    piece = d.dequantize(start, stop, np.empty(stop - start, np.float32))
    assert bits(piece) == bits(ref[start:stop])
    assert bits(values(d, start, stop, np.empty(stop - start, np.float32))) == bits(piece)
    assert d.sq_sum(start, stop, np.empty(1024, np.float32)) == pytest.approx(
        float(np.dot(ref[start:stop].astype(np.float64), ref[start:stop].astype(np.float64))),
        rel=1e-6,
        abs=1e-30,
    )


def test_only_blockwise_payloads_with_room_keep_their_codes() -> None:
    assert keeps_codes(encoded(2, "int8", 8).header)
    assert not keeps_codes(encoded(1, "int8", 8).header)  # 4 + 1 bytes > 4
    for codec in ("fp32", "bf16"):
        e = encode(np.ones(10, np.float32), CodecSpec(codec))
        assert not keeps_codes(e.header)
        got = decode_delta(e.header, e.payload, limits=LIMITS)
        assert isinstance(got, np.ndarray) and got.tolist() == [1.0] * 10


def test_decode_delta_refuses_what_decode_refuses() -> None:
    e = encoded(1000, "int8", 256)
    header, payload = e.header, bytes(e.payload)
    bad_crc = dataclasses.replace(header, checksum=header.checksum ^ 1)
    nan_scale = bytearray(payload)
    nan_scale[0:4] = np.array([np.nan], np.float32).tobytes()
    crc_of_nan = encode_like(header, bytes(nan_scale))
    cases = [
        (bad_crc, payload, None),
        (header, payload[:-1], None),
        (header, payload, np.empty(999, np.float32)),
        (crc_of_nan, bytes(nan_scale), None),
    ]
    for h, p, out in cases:
        with pytest.raises(Exception) as inline:
            decode(h, p, out=out, limits=LIMITS)
        with pytest.raises(type(inline.value)) as kept:
            decode_delta(h, p, out=out, limits=LIMITS)
        assert str(kept.value) == str(inline.value)
    assert isinstance(inline.value, NonFiniteValues)
    with pytest.raises(PayloadTooLarge):
        decode_delta(header, payload, limits=dataclasses.replace(LIMITS, max_payload_bytes=10))
    with pytest.raises(CorruptPayload):
        decode_delta(bad_crc, payload, limits=LIMITS)


def encode_like(header: TensorHeader, payload: bytes) -> TensorHeader:
    """``header`` with the checksum of ``payload`` (an altered payload that passes its CRC)."""
    from dd_queue.core import codec

    h = header
    raw = np.frombuffer(payload, np.uint8)
    crc = codec._checksum(raw, h.codec, h.n_elements, h.block_size, h.shuffle)
    return dataclasses.replace(h, checksum=crc)


def test_blockwise_checks_its_arrays() -> None:
    q, s = np.zeros(10, np.int8), np.zeros(2, np.float32)
    Blockwise(q, s, 8)
    with pytest.raises(CoreError):
        Blockwise(q, np.zeros(3, np.float32), 8)
    with pytest.raises(CoreError):
        Blockwise(q.astype(np.int16), s, 8)
    with pytest.raises(CoreError):
        Blockwise(q, s.astype(np.float64), 8)
    with pytest.raises(CoreError):
        Blockwise(q, s, 8).dequantize(3, 11, np.empty(8, np.float32))


def sum_reference(
    deltas: list[Blockwise], coefs: np.ndarray, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """Σ_g c_g · Δ_g[start:stop] in float64, and Σ_g |c_g · Δ_g| (what rounding scales with:
    terms may cancel)."""
    total, magnitude = np.zeros(stop - start), np.zeros(stop - start)
    for d, c in zip(deltas, coefs, strict=True):
        term = float(c) * as_float32(d)[start:stop].astype(np.float64)
        total += term
        magnitude += np.abs(term)
    return total, magnitude


@settings(max_examples=40, deadline=None)
@given(
    block=st.sampled_from([8, 64, 256]),
    g=st.integers(1, 7),
    n=st.integers(1, 40_000),
    data=st.data(),
)
def test_codes_sum_matches_the_float64_sum_on_any_range(
    block: int, g: int, n: int, data: st.DataObject
) -> None:
    n = max(n, 2)
    deltas = [
        decode_delta(e.header, e.payload, limits=LIMITS)
        for e in (encoded(n, "int8", block, seed=k) for k in range(g))
    ]
    assert all(isinstance(d, Blockwise) for d in deltas)
    coefs = np.random.default_rng(n).random(g).astype(np.float32) + 0.1
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    summed = CodesSum(deltas)
    dst = np.full(stop - start, 0.25, np.float32)
    summed.into(dst, coefs, start, stop, add=False)
    ref, magnitude = sum_reference(deltas, coefs, start, stop)
    bound = 4e-7 * g * magnitude + 1e-37  # a few float32 roundings per term, per element
    assert (np.abs(dst - ref) <= bound).all()
    summed.into(dst, coefs, start, stop, add=True)
    assert (np.abs(dst - 2 * ref) <= 2 * bound).all()


def test_codes_sum_refuses_mixed_or_huge_blocks() -> None:
    a = decode_delta(encoded(100, "int8", 8).header, encoded(100, "int8", 8).payload, limits=LIMITS)
    b = decode_delta(
        encoded(100, "int8", 16).header, encoded(100, "int8", 16).payload, limits=LIMITS
    )
    with pytest.raises(CoreError):
        CodesSum([a, b])
    big = Blockwise(np.zeros(10_000, np.int8), np.zeros(2, np.float32), 8192)
    with pytest.raises(CoreError):
        CodesSum([big])


MIXES = [
    [("int8", 256)] * 5,
    [("int8", 256), ("int4", 64), ("fp32", 0), ("int8", 64), ("int8", 8192), ("bf16", 0)],
    [("int8", 8)],
]


@pytest.mark.parametrize("mix", MIXES, ids=["int8", "mixed", "one"])
@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_a_merge_from_codes_is_the_merge_of_the_decoded_vectors_to_rounding(
    mix: list[tuple[str, int]], rule: str
) -> None:
    n = 300_001  # segments cut blocks, several pieces each, an embedding at the end
    fragment = layout(n, [1000, 70_003, 231_000])
    rng = np.random.default_rng(1)
    codes, floats = [], []
    for k, (codec, block) in enumerate(mix):
        x = (rng.standard_normal(n) * 10.0 ** -(2 + k % 3)).astype(np.float32)
        e = encode(x, CodecSpec(codec, block_size=block or 256))
        codes.append(decode_delta(e.header, e.payload, limits=LIMITS))
        floats.append(decode(e.header, e.payload, limits=LIMITS))
    weights = rng.random(len(mix)) + 0.1
    a = merge_weighted(codes, weights, fragment, rule=rule)
    b = merge_weighted(floats, weights, fragment, rule=rule)
    for seg in fragment.segments:
        x, y = a.delta[seg.start : seg.stop], b.delta[seg.start : seg.stop]
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-6 * float(np.abs(y).max()))
    assert a.delta_norm == pytest.approx(b.delta_norm, rel=1e-5)
    assert a.weights == b.weights and a.fallback_segments == b.fallback_segments
    # deterministic, and the same with the norms computed ahead (as the fetch processes do)
    norms = [segment_sq_norms(d, fragment) for d in codes]
    again = merge_weighted(codes, weights, fragment, rule=rule, sq_norms=norms)
    assert bits(again.delta) == bits(a.delta)


def test_codes_norms_are_the_exact_norms_of_q_times_s() -> None:
    """Exact in float64 (to its rounding), so within float32 rounding of the decoded norms."""
    fragment = layout(70_000, [3, 999, 40_001])
    for codec, block in [("int8", 256), ("int8", EXACT_SQ_BLOCK * 2), ("int4", 8)]:
        e = encoded(70_000, codec, block)
        d = decode_delta(e.header, e.payload, limits=LIMITS)
        assert isinstance(d, Blockwise)
        exact_values = d.codes.astype(np.float64) * np.repeat(d.scales, block)[: d.size]
        decoded = decode(e.header, e.payload, limits=LIMITS).astype(np.float64)
        got = segment_sq_norms(d, fragment)
        for k, seg in enumerate(fragment.segments):
            x, y = exact_values[seg.start : seg.stop], decoded[seg.start : seg.stop]
            assert got[k] == pytest.approx(float(np.dot(x, x)), rel=1e-12)
            assert got[k] == pytest.approx(float(np.dot(y, y)), rel=1e-6)


def test_re_anchoring_codes_gives_the_decoded_bits() -> None:
    n = 5000
    ring = VersionRing(capacity=3, size=n)
    rng = np.random.default_rng(3)
    for v in range(3):
        ring.push(v, rng.standard_normal(n).astype(np.float32))
    e = encoded(n, "int8", 64)
    d = decode_delta(e.header, e.payload, limits=LIMITS)
    x = decode(e.header, e.payload, limits=LIMITS)
    a = re_anchor(ContributionData("L0", d, 10, 2, base_version=0), ring)
    b = re_anchor(ContributionData("L0", x, 10, 2, base_version=0), ring)
    assert a.contribution is not None and b.contribution is not None
    assert bits(a.contribution.delta) == bits(b.contribution.delta)
    dst = np.ones(n, np.float32)
    add_into(dst, d)
    assert bits(dst) == bits(np.float32(1) + x)
    with pytest.raises(CoreError):  # out may not overlap the codes
        re_anchor(ContributionData("L0", d, 10, 2, base_version=0), ring, out=d.buffer)


def test_merge_fragment_takes_codes_like_vectors() -> None:
    n = 4096
    fragment = layout(n, [1000])
    e = [encoded(n, "int8", 64, seed=k) for k in range(3)]
    codes = [decode_delta(x.header, x.payload, limits=LIMITS) for x in e]
    contribs = [ContributionData(f"L{k}", c, 100 * (k + 1), 4, 0) for k, c in enumerate(codes)]
    result = merge_fragment(contribs, fragment)
    assert result.kind == "merged" and np.isfinite(result.delta).all()
    short = Blockwise(np.zeros(n - 1, np.int8), np.zeros(-(-(n - 1) // 64), np.float32), 64)
    with pytest.raises(CoreError, match="blockwise codes of 4095"):
        merge_fragment([*contribs[:2], ContributionData("L9", short, 1, 1, 0)], fragment)
    with pytest.raises(CoreError, match="overlaps"):
        merge_fragment(contribs, fragment, out=codes[0].buffer)


def test_the_pool_takes_back_the_buffer_that_holds_codes() -> None:
    pool = BufferPool()
    out = pool.take(1000)
    e = encoded(1000, "int8", 256)
    d = decode_delta(e.header, e.payload, out=out, limits=LIMITS)
    pool.give([d])
    assert pool.take(1000) is out
    pool.give([Blockwise(np.zeros(4, np.int8), np.zeros(1, np.float32), 8)])  # no buffer: ignored


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


Q10, S2 = np.zeros(10, np.int8), np.zeros(2, np.float32)
BAD_BLOCKWISE = [
    (Q10.astype(np.int16), S2, 8, "Blockwise.codes must be a flat int8 array"),
    (Q10.reshape(2, 5), S2, 8, "Blockwise.codes must be a flat int8 array"),
    (Q10, S2.astype(np.float64), 8, "Blockwise.scales must be a flat float32 array"),
    (Q10, np.zeros(3, np.float32), 8, "10 codes in blocks of 8 need 2 scales, got 3"),
    (Q10, np.zeros(3, np.float32), 1, "10 codes in blocks of 1 need 10 scales, got 3"),
    (Q10, np.zeros(10, np.float32), 0, "10 codes in blocks of 0 need 10 scales, got 10"),
    (Q10, S2, 8.0, "10 codes in blocks of 8.0 need 2.0 scales, got 2"),
]


@pytest.mark.parametrize(("codes", "scales", "block", "message"), BAD_BLOCKWISE)
def test_blockwise_names_the_array_or_count_that_is_wrong(
    codes: np.ndarray, scales: np.ndarray, block: object, message: str
) -> None:
    with pytest.raises(CoreError, match=exactly(message)):
        Blockwise(codes, scales, block)  # type: ignore[arg-type]


def test_blocks_of_one_element_have_one_scale_each() -> None:
    d = Blockwise(np.array([1, -2, 3], np.int8), np.array([0.5, 2.0, 4.0], np.float32), 1)
    assert d.dequantize(0, 3, np.empty(3, np.float32)).tolist() == [0.5, -4.0, 12.0]


def test_dequantize_names_the_range_or_the_out_that_does_not_fit() -> None:
    d = Blockwise(np.zeros(10, np.int8), np.zeros(2, np.float32), 8)
    with pytest.raises(CoreError, match=exactly("range 3:11 is outside a vector of 10 elements")):
        d.dequantize(3, 11, np.empty(8, np.float32))
    with pytest.raises(CoreError, match=exactly("out must be float32 of shape (8,), got (7,)")):
        d.dequantize(2, 10, np.empty(7, np.float32))
    with pytest.raises(CoreError, match=exactly("out must be float32 of shape (8,), got (8,)")):
        d.dequantize(2, 10, np.empty(8, np.float64))  # type: ignore[arg-type]


def test_sq_sum_of_blocks_beyond_the_float32_exact_size_is_exact() -> None:
    """Σ q² = 4095·127² + 126² per block: odd and above 2^24, so no float32 sum can hold it."""
    block = 4 * EXACT_SQ_BLOCK
    codes = np.full(2 * block, 127, np.int8)
    codes[[5, block + 9]] = -126
    d = Blockwise(codes, np.array([1.0, 2.0], np.float32), block)
    per_block = (block - 1) * 127**2 + 126**2
    assert per_block > 2**24 and per_block % 2 == 1
    assert d.sq_sum(0, 2 * block, np.empty(block, np.float32)) == 5 * per_block
    edge = Blockwise(np.full(EXACT_SQ_BLOCK, -128, np.int8), np.ones(1, np.float32), EXACT_SQ_BLOCK)
    assert edge.sq_sum(0, EXACT_SQ_BLOCK, np.empty(EXACT_SQ_BLOCK, np.float32)) == 2.0**24


def test_codes_sum_names_a_mixed_group_and_folds_blocks_up_to_the_limit() -> None:
    def zeros(n: int, block: int) -> Blockwise:
        return Blockwise(np.zeros(n, np.int8), np.zeros(-(-n // block), np.float32), block)

    mixed = exactly("CodesSum needs codes of one block size and one length")
    with pytest.raises(CoreError, match=mixed):
        CodesSum([zeros(100, 8), zeros(100, 16)])
    with pytest.raises(CoreError, match=mixed):
        CodesSum([zeros(100, 8), zeros(101, 8)])
    too_big = exactly(f"block size 8192 is above {MAX_FOLDED_BLOCK}; dequantise instead")
    with pytest.raises(CoreError, match=too_big):
        CodesSum([zeros(10_000, 8192)])
    n = 2 * MAX_FOLDED_BLOCK + 5
    codes = np.random.default_rng(2).integers(-127, 128, n).astype(np.int8)
    d = Blockwise(codes, np.array([0.5, 0.25, 2.0], np.float32), MAX_FOLDED_BLOCK)
    dst = np.empty(n, np.float32)
    CodesSum([d]).into(dst, np.ones(1, np.float32), 0, n, add=False)
    assert bits(dst) == bits(as_float32(d))


def test_codes_sum_contracts_in_float32() -> None:
    """127·s1 − 103·s2 = 34.14439 exactly rounded; every float32 order of the two products
    (with or without FMA) gives 34.144394."""
    a = Blockwise(np.array([127, 0], np.int8), np.array([1.4237374], np.float32), 8)
    b = Blockwise(np.array([-103, 0], np.int8), np.array([1.4239831], np.float32), 8)
    exact = 127 * float(np.float32(1.4237374)) - 103 * float(np.float32(1.4239831))
    assert np.float32(exact) == np.float32(34.14439)
    summed = CodesSum([a, b])
    for add in (False, True):
        dst = np.zeros(2, np.float32)
        summed.into(dst, np.ones(2, np.float32), 0, 2, add=add)
        assert dst.tolist() == [float(np.float32(34.144394)), 0.0]


def test_add_into_names_a_mismatched_shape_and_adds_a_partial_last_piece() -> None:
    d = Blockwise(np.zeros(10, np.int8), np.zeros(2, np.float32), 8)
    with pytest.raises(
        CoreError, match=exactly("cannot add 10 elements to an array of shape (9,)")
    ):
        add_into(np.zeros(9, np.float32), d)
    n = (1 << 16) + 100
    e = encoded(n, "int8", 64)
    big = decode_delta(e.header, e.payload, limits=LIMITS)
    assert isinstance(big, Blockwise)
    dst = np.ones(n, np.float32)
    add_into(dst, big)
    assert bits(dst) == bits(np.float32(1) + decode(e.header, e.payload, limits=LIMITS))


def test_codes_sum_gives_whole_blocks_the_same_bits_from_any_aligned_start() -> None:
    """Only a range's own ends cut blocks: the tail of a long range, past several sub-pieces,
    is bit for bit the range that starts there."""
    n, block, g = 100_003, 8, 3
    rng = np.random.default_rng(5)
    group = [
        Blockwise(
            rng.integers(-127, 128, n).astype(np.int8),
            (rng.random(-(-n // block)) * 1e-3).astype(np.float32),
            block,
        )
        for _ in range(g)
    ]
    coefs = (rng.random(g) + 0.1).astype(np.float32)
    summed = CodesSum(group)
    full = np.empty(n, np.float32)
    summed.into(full, coefs, 0, n, add=False)
    for start in range(0, n, 1024 * block):
        part = np.empty(n - start, np.float32)
        summed.into(part, coefs, start, n, add=False)
        assert bits(part) == bits(full[start:])
