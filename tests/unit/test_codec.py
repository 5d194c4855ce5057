"""Properties of the tensor codecs: exactness, error bounds, zstd transparency, buffers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dd_queue.core.codec import (
    CODEC_NAMES,
    CodecSpec,
    DecodeLimits,
    TensorHeader,
    check_header,
    decode,
    encode,
    raw_nbytes_for,
)
from dd_queue.errors import CoreError, CorruptPayload, NonFiniteValues

LIMITS = DecodeLimits()
PROPERTY = settings(max_examples=60, deadline=None)

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
# int8/int4 reject |x| ≥ 2^126 (documented); stay below it
blockwise32 = st.floats(
    min_value=-(2.0**125), max_value=2.0**125, width=32, allow_nan=False, allow_subnormal=True
)
# 0x7F7F7FFF is the largest float32 that rounds to a finite bf16
BF16_SAFE_MAX = float(np.array([0x7F7F7FFF], np.uint32).view(np.float32)[0])
bf16_safe32 = st.floats(
    min_value=-BF16_SAFE_MAX,
    max_value=BF16_SAFE_MAX,
    width=32,
    allow_nan=False,
    allow_subnormal=True,
)


def vectors(elements: st.SearchStrategy[float], max_size: int = 700) -> st.SearchStrategy:
    return hnp.arrays(np.float32, st.integers(0, max_size), elements=elements)


def roundtrip(x: np.ndarray, spec: CodecSpec) -> np.ndarray:
    encoded = encode(x, spec)
    return decode(encoded.header, bytes(encoded.payload), limits=LIMITS)


def block_bound(x: np.ndarray, block_size: int, levels: int) -> np.ndarray:
    """Per-element bound s/2 + 2^-21·absmax + 2^-140 with s = absmax/levels (module docstring)."""
    n_blocks = -(-x.size // block_size)
    padded = np.zeros(n_blocks * block_size, np.float64)
    padded[: x.size] = np.abs(x.astype(np.float64))
    absmax = np.repeat(padded.reshape(n_blocks, block_size).max(axis=1), block_size)[: x.size]
    return absmax / levels / 2 + absmax * 2.0**-21 + 2.0**-140


# ----------------------------------------------------------------------------- exactness


@PROPERTY
@given(x=vectors(finite32), zstd_level=st.sampled_from([0, 1, 3]), shuffle=st.booleans())
def test_fp32_roundtrip_is_bit_exact(x: np.ndarray, zstd_level: int, shuffle: bool) -> None:
    spec = CodecSpec("fp32", zstd_level=zstd_level, shuffle=shuffle and zstd_level > 0)
    y = roundtrip(x, spec)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))


def test_fp32_keeps_negative_zero_subnormals_and_extremes() -> None:
    info = np.finfo(np.float32)
    special = [-0.0, 0.0, info.smallest_subnormal, -info.smallest_subnormal, info.tiny, info.max]
    x = np.array([*special, -info.max, 1e-40, 3.0e38], dtype=np.float32)
    for zstd_level in (0, 1):
        y = roundtrip(x, CodecSpec("fp32", zstd_level=zstd_level))
        np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))


@PROPERTY
@given(x=vectors(bf16_safe32), zstd_level=st.sampled_from([0, 1]), shuffle=st.booleans())
def test_bf16_matches_torch_round_to_nearest_even(
    x: np.ndarray, zstd_level: int, shuffle: bool
) -> None:
    spec = CodecSpec("bf16", zstd_level=zstd_level, shuffle=shuffle and zstd_level > 0)
    y = roundtrip(x, spec)
    reference = torch.from_numpy(x.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(y.view(np.uint32), reference.view(np.uint32))


@PROPERTY
@given(x=vectors(bf16_safe32))
def test_bf16_relative_error_is_at_most_2_pow_minus_8(x: np.ndarray) -> None:
    y = roundtrip(x, CodecSpec("bf16"))
    x64, err = x.astype(np.float64), np.abs(y.astype(np.float64) - x.astype(np.float64))
    normal = np.abs(x64) >= np.finfo(np.float32).tiny
    assert np.all(err[normal] <= 2.0**-8 * np.abs(x64[normal]))
    assert np.all(err[~normal] <= 2.0**-134)


def test_bf16_ties_round_to_even() -> None:
    # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: rounds to the even one (1.0)
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8)], dtype=np.float32)
    np.testing.assert_array_equal(roundtrip(x, CodecSpec("bf16")), [1.0, 1 + 2.0**-6, -1.0])


def test_bf16_rejects_values_that_round_to_inf() -> None:
    x = np.array([3.3961776e38], dtype=np.float32)
    assert torch.isinf(torch.from_numpy(x).to(torch.bfloat16)).all()  # the reference agrees
    with pytest.raises(NonFiniteValues, match="bf16"):
        encode(x, CodecSpec("bf16"))


# ----------------------------------------------------------------------------- error bounds


@PROPERTY
@given(
    x=vectors(blockwise32),
    codec=st.sampled_from(["int8", "int4"]),
    block_size=st.sampled_from([8, 9, 64, 100, 256]),
    zstd_level=st.sampled_from([0, 1]),
)
def test_blockwise_error_is_within_half_a_step(
    x: np.ndarray, codec: str, block_size: int, zstd_level: int
) -> None:
    spec = CodecSpec(codec, block_size=block_size, zstd_level=zstd_level)  # type: ignore[arg-type]
    y = roundtrip(x, spec)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    levels = 127 if codec == "int8" else 7
    assert np.all(err <= block_bound(x, block_size, levels))


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_blockwise_bound_on_outer_gradient_scale_data(codec: str) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(10_000) * 1e-3).astype(np.float32)
    x[::97] *= 50  # outliers make some blocks coarse
    y = roundtrip(x, CodecSpec(codec, block_size=64))  # type: ignore[arg-type]
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= block_bound(x, 64, 127 if codec == "int8" else 7))


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_blockwise_handles_zero_and_subnormal_blocks(codec: str) -> None:
    tiny = np.finfo(np.float32).smallest_subnormal
    x = np.zeros(40, np.float32)
    x[8:16] = np.array([tiny, -tiny, 3 * tiny, 0, 0, 0, 0, 1e-39])  # subnormal: float64 path
    x[16:24] = 2.0**-110  # absmax below 2^-100: float64 path
    x[24:32] = [1.0, -1.0, 0.5, 0, 0, 0, 0, 0]
    y = roundtrip(x, CodecSpec(codec, block_size=8))  # type: ignore[arg-type]
    assert np.all(
        np.abs(y.astype(np.float64) - x) <= block_bound(x, 8, 127 if codec == "int8" else 7)
    )
    np.testing.assert_array_equal(y[:8], 0.0)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_blockwise_rejects_values_beyond_2_pow_126(codec: str) -> None:
    x = np.array([1.0, 2.0**126], dtype=np.float32)
    with pytest.raises(NonFiniteValues, match="fp32"):
        encode(x, CodecSpec(codec))  # type: ignore[arg-type]


def test_blockwise_largest_accepted_values_decode_finite() -> None:
    x = np.array([np.nextafter(np.float32(2.0**126), np.float32(0)), -1.0], dtype=np.float32)
    for codec in ("int8", "int4"):
        y = roundtrip(x, CodecSpec(codec))
        assert np.isfinite(y).all()


# ----------------------------------------------------------------------------- zstd, sizes


@PROPERTY
@given(
    x=vectors(st.floats(-1.0, 1.0, width=32)),
    codec=st.sampled_from(CODEC_NAMES),
    level=st.sampled_from([1, 3, 19]),
)
def test_zstd_is_transparent(x: np.ndarray, codec: str, level: int) -> None:
    plain = encode(x, CodecSpec(codec))  # type: ignore[arg-type]
    packed = encode(x, CodecSpec(codec, zstd_level=level))  # type: ignore[arg-type]
    assert dataclasses.replace(packed.header, zstd=False) == plain.header  # same checksum
    a = decode(plain.header, plain.payload, limits=LIMITS)
    b = decode(packed.header, packed.payload, limits=LIMITS)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize(
    ("codec", "n", "block_size", "expected"),
    [
        ("fp32", 10, 256, 40),
        ("bf16", 10, 256, 20),
        ("int8", 512, 256, 2 * 4 + 512),
        ("int8", 513, 256, 3 * 4 + 513),
        ("int4", 64, 64, 4 + 32),
        ("int4", 65, 64, 2 * 4 + 33),
        ("int8", 0, 256, 0),
    ],
)
def test_raw_sizes(codec: str, n: int, block_size: int, expected: int) -> None:
    assert raw_nbytes_for(codec, n, block_size) == expected
    spec = CodecSpec(codec, block_size=block_size)  # type: ignore[arg-type]
    encoded = encode(np.ones(n, np.float32), spec)
    assert encoded.header.raw_nbytes == encoded.payload.nbytes == expected


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("zstd_level", [0, 1])
def test_empty_vector(codec: str, zstd_level: int) -> None:
    x = np.zeros(0, np.float32)
    y = roundtrip(x, CodecSpec(codec, zstd_level=zstd_level))  # type: ignore[arg-type]
    assert y.shape == (0,) and y.dtype == np.float32


def test_int8_size_matches_research_figure() -> None:
    encoded = encode(np.ones(1 << 16, np.float32), CodecSpec("int8", block_size=256))
    assert encoded.payload.nbytes / (1 << 16) == pytest.approx(1.015625)


# ----------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("zstd_level", [0, 1])
def test_decode_into_out_returns_that_array(codec: str, zstd_level: int) -> None:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    encoded = encode(x, CodecSpec(codec, zstd_level=zstd_level))  # type: ignore[arg-type]
    out = np.full((10, 100), np.nan, np.float32)  # any shape with the right element count
    result = decode(encoded.header, encoded.payload, out=out, limits=LIMITS)
    assert result is out
    np.testing.assert_array_equal(
        out.reshape(-1), decode(encoded.header, encoded.payload, limits=LIMITS)
    )


def test_fp32_decode_without_out_is_a_zero_copy_view() -> None:
    x = np.arange(100, dtype=np.float32)
    payload = bytes(encode(x, CodecSpec("fp32")).payload)
    header = encode(x, CodecSpec("fp32")).header
    y = decode(header, payload, limits=LIMITS)
    assert not y.flags.writeable and not y.flags.owndata  # a view of the immutable payload
    np.testing.assert_array_equal(y, x)


def test_decode_into_torch_tensor_memory() -> None:
    x = np.linspace(0, 1, 257, dtype=np.float32)
    target = torch.empty(257)
    encoded = encode(x, CodecSpec("bf16"))
    decode(encoded.header, encoded.payload, out=target.numpy(), limits=LIMITS)
    np.testing.assert_allclose(target.numpy(), x, rtol=2.0**-8)


def test_payload_never_aliases_the_input() -> None:
    x = np.arange(64, dtype=np.float32)
    for codec in CODEC_NAMES:
        encoded = encode(x, CodecSpec(codec))
        before = bytes(encoded.payload)
        x += 1
        assert bytes(encoded.payload) == before


def test_non_contiguous_and_multidimensional_input() -> None:
    base = np.arange(200, dtype=np.float32).reshape(10, 20)
    for x in (base, base[:, ::2], base.T):
        y = roundtrip(x, CodecSpec("fp32"))
        np.testing.assert_array_equal(y, x.reshape(-1))


@pytest.mark.parametrize(
    ("out", "error"),
    [
        (np.zeros(9, np.float32), CorruptPayload),
        (np.zeros(10, np.float64), CoreError),
        (np.zeros(20, np.float32)[::2], CoreError),
        ([0.0] * 10, CoreError),
    ],
)
def test_bad_out_buffers(out: object, error: type[Exception]) -> None:
    encoded = encode(np.ones(10, np.float32), CodecSpec("int8"))
    with pytest.raises(error):
        decode(encoded.header, encoded.payload, out=out, limits=LIMITS)  # type: ignore[arg-type]


def test_read_only_out_is_rejected() -> None:
    encoded = encode(np.ones(10, np.float32), CodecSpec("fp32"))
    out = np.zeros(10, np.float32)
    out.flags.writeable = False
    with pytest.raises(CoreError, match="writable"):
        decode(encoded.header, encoded.payload, out=out, limits=LIMITS)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "fp16"},
        {"block_size": 4},
        {"block_size": (1 << 20) + 1},
        {"block_size": 256.0},
        {"block_size": True},
        {"zstd_level": -1},
        {"zstd_level": 23},
        {"name": "int8", "zstd_level": 1, "shuffle": True},
        {"name": "bf16", "zstd_level": 0, "shuffle": True},
    ],
)
def test_codec_spec_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(CoreError, match="CodecSpec"):
        CodecSpec(**kwargs)  # type: ignore[arg-type]


def test_codec_spec_zstd_off_spellings() -> None:
    assert not CodecSpec(zstd_level=None).zstd_enabled
    assert not CodecSpec(zstd_level=0).zstd_enabled
    assert CodecSpec(zstd_level=1).zstd_enabled


@pytest.mark.parametrize("field", ["max_payload_bytes", "max_decompressed_bytes", "max_elements"])
@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_decode_limits_reject_bad_values(field: str, value: object) -> None:
    with pytest.raises(CoreError, match=field):
        DecodeLimits(**{field: value})  # type: ignore[arg-type]


def test_encode_rejects_wrong_input_types() -> None:
    for bad in (np.ones(4, np.float64), np.ones(4, np.float16), [1.0, 2.0], np.ones(4, ">f4")):
        with pytest.raises(CoreError, match="float32"):
            encode(bad, CodecSpec("fp32"))  # type: ignore[arg-type]


def test_check_header_accepts_what_encode_produces() -> None:
    for codec in CODEC_NAMES:
        header = encode(np.ones(300, np.float32), CodecSpec(codec)).header
        check_header(header, LIMITS)
        assert isinstance(header, TensorHeader) and header.dtype == "float32"


# ----------------------------------------------------------------------------- checksum


@given(data=st.binary(max_size=5000), seed=st.integers(0, 2**32 - 1))
def test_checksum_is_zlibs_crc32(data: bytes, seed: int) -> None:
    """The fast CRC-32 gives zlib's values (payloads of any sender stay valid)."""
    import zlib

    from dd_queue.core import codec

    assert codec._crc32(data, seed) == zlib.crc32(data, seed)
    assert codec._crc32(memoryview(data), seed) == zlib.crc32(data, seed)


def test_checksum_uses_isal_where_installed() -> None:
    """isal is a dependency on the platforms with wheels: the slow fallback must not hide."""
    pytest.importorskip("isal", reason="no isal wheel on this platform: zlib's crc32 is used")
    from isal import isal_zlib

    from dd_queue.core import codec

    assert codec._crc32 is isal_zlib.crc32
