"""Numeric kernels of the codecs (``core.quantize``): raw bytes in, raw bytes out, no headers.

- Non-finite input and decoded values are refused with messages that say which side is wrong.
- Blockwise codes: the float32 path down to absmax 2^-100, a zero pad for int4's odd tail,
  scales checked against float32 max/(levels + 1), and codes kept undecoded in a given buffer.
- Byte planes: vectors longer than one chunk split and merge back, as flat uint8 arrays.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dd_queue.core.blockwise import Blockwise
from dd_queue.core.quantize import (
    absmax,
    check_finite,
    codes_into,
    codes_nbytes,
    decode_raw_into,
    encode_raw,
    raw_nbytes,
)
from dd_queue.errors import NonFiniteValues

CHUNK = 1 << 16
F32_MAX = float(np.finfo(np.float32).max)
SENT = "input holds NaN or Inf; it must not be sent (never merged)"
MERGED = "decoded payload holds NaN or Inf; it must not be merged"


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def sample(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 1e-3).astype(np.float32)


def test_absmax_is_the_largest_magnitude_and_zero_when_empty() -> None:
    assert absmax(np.array([-3.0, 2.0], np.float32)) == 3.0
    assert absmax(np.array([1.5, -0.5], np.float32)) == 1.5
    empty = absmax(np.empty(0, np.float32))
    assert empty == 0.0 and isinstance(empty, float)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_finite_returns_its_input_or_refuses_the_payload(bad: float) -> None:
    fine = np.ones((2, 3), np.float32)
    assert check_finite(fine) is fine
    values = np.ones((2, 3), np.float32)
    values[1, 2] = bad
    with pytest.raises(NonFiniteValues, match=exactly(MERGED)):
        check_finite(values)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_every_codec_refuses_non_finite_input_with_one_message(codec: str, bad: float) -> None:
    x = np.ones(20, np.float32)
    x[13] = bad
    block = 8 if codec.startswith("int") else 0
    for shuffle in (False, True) if block == 0 else (False,):
        with pytest.raises(NonFiniteValues, match=exactly(SENT)):
            encode_raw(x, codec, block, shuffle)


def int8_codes(x: np.ndarray) -> list[int]:
    raw = encode_raw(x, "int8", x.size, False)
    return raw[4:].view(np.int8).tolist()


def test_a_block_at_absmax_2_pow_minus_100_still_takes_the_float32_path() -> None:
    """x·127/absmax = 79.49999994 exactly: float32 rounds it to 79.5 (then rint to even, 80),
    the float64 path of smaller blocks keeps it below the tie (79)."""
    x = np.float32(10502273 * 2.0**-124)
    block = np.array([2.0**-100, x, -x], np.float32)
    assert int8_codes(block) == [127, 80, -80]
    assert int8_codes(block * np.float32(2.0**60)) == [127, 80, -80]
    assert int8_codes(block * np.float32(0.5)) == [127, 79, -79]


def test_int4_pads_an_odd_tail_with_a_zero_code() -> None:
    x = np.array([7.0, -7.0, 3.0], np.float32)
    raw = encode_raw(x, "int4", 8, False)
    assert raw.size == raw_nbytes("int4", 3, 8) == 6
    assert raw[:4].view("<f4").tolist() == [1.0]
    assert raw[4:].tolist() == [(-7 + 8) << 4 | (7 + 8), 8 << 4 | (3 + 8)]
    out = np.empty(3, np.float32)
    decode_raw_into(raw, out, "int4", 8, False)
    assert out.tolist() == [7.0, -7.0, 3.0]


def planes_of(words: np.ndarray) -> np.ndarray:
    return words.view(np.uint8).reshape(-1, words.itemsize).T.reshape(-1)


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_shuffled_planes_of_several_chunks_split_and_merge_back(codec: str) -> None:
    n = 2 * CHUNK + 3
    x = sample(n, seed=4)
    plain = encode_raw(x, codec, 0, False)
    shuffled = encode_raw(x, codec, 0, True)
    assert plain.shape == shuffled.shape == (raw_nbytes(codec, n, 0),)
    words = plain.view("<u4" if codec == "fp32" else "<u2")
    assert shuffled.tobytes() == planes_of(words).tobytes()
    for raw, shuffle in ((shuffled, True), (plain, False)):
        out = np.full(n, 7.0, np.float32)
        decode_raw_into(raw, out, codec, 0, shuffle)
        expected = x if codec == "fp32" else (words.astype(np.uint32) << 16).view(np.float32)
        assert bits(out) == bits(expected)


def test_unshuffled_fp32_decodes_by_copy_and_refuses_nan() -> None:
    x = np.array([1.5, -0.0, 2.0**-149, F32_MAX], np.float32)
    out = np.zeros(4, np.float32)
    decode_raw_into(encode_raw(x, "fp32", 0, False), out, "fp32", 0, False)
    assert bits(out) == bits(x)
    raw = np.array([1.0, np.nan], np.float32).view(np.uint8)
    with pytest.raises(NonFiniteValues, match=exactly(MERGED)):
        decode_raw_into(raw, np.empty(2, np.float32), "fp32", 0, False)


@pytest.mark.parametrize(("codec", "bound"), [("int8", 128), ("int4", 8)])
@pytest.mark.parametrize("scale", [np.nan, np.inf, "above"])
def test_scales_beyond_float32_max_over_levels_plus_one_are_refused(
    codec: str, bound: int, scale: float | str
) -> None:
    n, block = 16, 8
    raw = encode_raw(sample(n), codec, block, False)
    at_bound = np.float32(F32_MAX / bound)
    bad = np.nextafter(at_bound, np.float32(np.inf)) if scale == "above" else np.float32(scale)
    raw[4:8] = np.array([bad], "<f4").view(np.uint8)
    message = exactly(f"a block scale is NaN, Inf or above float32 max/{bound}")
    with pytest.raises(NonFiniteValues, match=message):
        decode_raw_into(raw, np.empty(n, np.float32), codec, block, False)
    with pytest.raises(NonFiniteValues, match=message):
        codes_into(raw, np.empty(codes_nbytes(n, block), np.uint8), n, codec, block)
    raw[4:8] = np.array([at_bound], "<f4").view(np.uint8)
    out = np.empty(n, np.float32)
    decode_raw_into(raw, out, codec, block, False)
    assert np.isfinite(out).all()


@pytest.mark.parametrize(
    ("n", "block", "expected"),
    [(10, 8, 4 * 2 + 10), (11, 8, 4 * 2 + 11 + 1), (16, 8, 4 * 2 + 16), (5, 1, 4 * 5 + 5 + 1)],
)
def test_codes_nbytes_counts_scales_codes_and_an_odd_pad(n: int, block: int, expected: int) -> None:
    got = codes_nbytes(n, block)
    assert got == expected and isinstance(got, int)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("n", [37, 40])
def test_codes_into_a_separate_buffer_decode_like_the_raw_bytes(codec: str, n: int) -> None:
    block = 8
    x = sample(n, seed=n)
    raw = encode_raw(x, codec, block, False)
    decoded = np.empty(n, np.float32)
    decode_raw_into(raw, decoded, codec, block, False)
    into = np.zeros(codes_nbytes(n, block), np.uint8)
    codes, scales = codes_into(raw, into, n, codec, block)
    assert codes.dtype == np.int8 and codes.shape == (n,)
    assert scales.dtype == np.float32 and scales.shape == (-(-n // block),)
    assert np.shares_memory(codes, into) and np.shares_memory(scales, into)
    assert bits(scales) == raw[: scales.nbytes].tobytes()
    assert np.abs(codes).max() == (127 if codec == "int8" else 7)
    got = Blockwise(codes, scales, block).dequantize(0, n, np.empty(n, np.float32))
    assert bits(got) == bits(decoded)


def test_int8_codes_into_the_buffer_that_already_holds_them() -> None:
    n, block = 37, 8
    raw = encode_raw(sample(n), "int8", block, False)
    into = np.zeros(codes_nbytes(n, block), np.uint8)
    into[: raw.size] = raw
    codes, scales = codes_into(into[: raw.size], into, n, "int8", block)
    assert codes.tobytes() == raw[4 * 5 :].tobytes() and bits(scales) == raw[:20].tobytes()
