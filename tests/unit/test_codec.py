"""Properties of the tensor codecs: exactness, error bounds, zstd transparency, buffers."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dd_queue.core.blockwise import Blockwise, as_float32
from dd_queue.core.codec import (
    CODEC_NAMES,
    CodecSpec,
    DecodeLimits,
    TensorHeader,
    check_header,
    codes_view,
    decode,
    decode_delta,
    encode,
    encode_fp32_view,
    keeps_codes,
    raw_nbytes_for,
)
from dd_queue.errors import (
    CoreError,
    CorruptPayload,
    IncompatibleMessage,
    NonFiniteValues,
    PayloadTooLarge,
)

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


# ----------------------------------------------------------------------------- range ends, messages


def test_codec_spec_accepts_both_ends_of_its_ranges() -> None:
    assert CodecSpec("int8", block_size=8).block_size == 8
    assert CodecSpec("int4", block_size=1 << 20).block_size == 1 << 20
    assert CodecSpec(zstd_level=22).zstd_enabled
    assert not CodecSpec(zstd_level=0).zstd_enabled


def test_decode_limits_accept_one() -> None:
    limits = DecodeLimits(max_payload_bytes=1, max_decompressed_bytes=1, max_elements=1)
    assert dataclasses.astuple(limits) == (1, 1, 1)


@pytest.mark.parametrize(
    ("bad", "named"), [(np.ones(4, np.float64), "float64"), ([1.0, 2.0], "list")], ids=str
)
def test_encode_error_names_what_it_got(bad: object, named: str) -> None:
    with pytest.raises(CoreError, match=rf"float32 numpy array, got {named}; use x\.astype"):
        encode(bad, CodecSpec("fp32"))  # type: ignore[arg-type]


def test_unknown_codec_and_dtype_errors_name_the_value() -> None:
    known = r"this build knows \('fp32', 'bf16', 'int8', 'int4'\)"
    with pytest.raises(IncompatibleMessage, match=rf"unknown codec 'fp8'; {known}"):
        raw_nbytes_for("fp8", 10, 256)
    header = encode(np.ones(10, np.float32), CodecSpec("fp32")).header
    with pytest.raises(IncompatibleMessage, match=rf"unknown codec 'fp8'; {known}"):
        check_header(dataclasses.replace(header, codec="fp8"), LIMITS)
    with pytest.raises(IncompatibleMessage, match="dtype 'float64' is not supported"):
        check_header(dataclasses.replace(header, dtype="float64"), LIMITS)


def test_check_header_checksum_must_fit_in_32_bits() -> None:
    header = encode(np.ones(10, np.float32), CodecSpec("fp32")).header
    check_header(dataclasses.replace(header, checksum=(1 << 32) - 1), LIMITS)
    for checksum in (1 << 32, (1 << 33) - 1):
        with pytest.raises(CorruptPayload, match="header counts must be non-negative integers"):
            check_header(dataclasses.replace(header, checksum=checksum), LIMITS)


@pytest.mark.parametrize("flags", [{"zstd": 1}, {"shuffle": "no"}], ids=str)
def test_check_header_flags_must_be_booleans(flags: dict[str, object]) -> None:
    header = encode(np.ones(10, np.float32), CodecSpec("fp32")).header
    with pytest.raises(CorruptPayload, match="header zstd/shuffle must be booleans"):
        check_header(dataclasses.replace(header, **flags), LIMITS)  # type: ignore[arg-type]


def test_the_largest_block_size_passes_check_header_and_decodes() -> None:
    x = np.linspace(-1, 1, 10, dtype=np.float32)
    encoded = encode(x, CodecSpec("int8", block_size=1 << 20))
    assert encoded.header.block_size == 1 << 20
    check_header(encoded.header, LIMITS)
    y = decode(encoded.header, encoded.payload, limits=LIMITS)
    assert np.all(np.abs(y - x) <= block_bound(x, 1 << 20, 127))


@pytest.mark.parametrize(
    ("spec", "change"),
    [
        (CodecSpec("fp32"), {"shuffle": True}),  # shuffle without zstd
        (CodecSpec("int8", zstd_level=1), {"shuffle": True}),  # shuffle of a blockwise codec
    ],
    ids=["fp32-no-zstd", "int8-zstd"],
)
def test_check_header_rejects_shuffle_where_it_cannot_apply(
    spec: CodecSpec, change: dict[str, object]
) -> None:
    header = encode(np.ones(64, np.float32), spec).header
    with pytest.raises(
        CorruptPayload, match=f"block_size/shuffle/zstd are inconsistent with codec {spec.name}"
    ):
        check_header(dataclasses.replace(header, **change), LIMITS)  # type: ignore[arg-type]


def test_check_header_names_the_raw_size_the_counts_imply() -> None:
    header = encode(np.ones(10, np.float32), CodecSpec("fp32")).header
    with pytest.raises(CorruptPayload, match="raw_nbytes 41 != 40 implied by"):
        check_header(dataclasses.replace(header, raw_nbytes=41), LIMITS)


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (
            np.zeros(9, np.float32),
            CorruptPayload,
            "payload holds 10 elements, out holds 9: the message does not match the receiver's "
            "fragment size",
        ),
        (np.zeros(10, np.float64), CoreError, "out must be a float32 numpy array"),
        ([0.0] * 10, CoreError, "out must be a float32 numpy array"),
        (np.zeros(20, np.float32)[::2], CoreError, "out must be C-contiguous and writable"),
    ],
    ids=["size", "float64", "list", "strided"],
)
def test_bad_out_buffer_errors_say_what_is_wrong(
    out: object, error: type[Exception], message: str
) -> None:
    encoded = encode(np.ones(10, np.float32), CodecSpec("int8"))
    with pytest.raises(error, match=f"^{message}$"):
        decode(encoded.header, encoded.payload, out=out, limits=LIMITS)  # type: ignore[arg-type]


def test_payload_errors_say_what_is_wrong() -> None:
    encoded = encode(np.ones(10, np.float32), CodecSpec("fp32"))
    payload = bytes(encoded.payload)
    with pytest.raises(CorruptPayload, match="payload is 41 bytes, header says 40"):
        decode(encoded.header, payload + b"\0", limits=LIMITS)
    with pytest.raises(CoreError, match="payload must be bytes-like, got int"):
        decode(encoded.header, 12, limits=LIMITS)  # type: ignore[arg-type]
    strided = memoryview(np.frombuffer(payload * 2, np.uint8)[::2])
    with pytest.raises(CoreError, match=r"^payload must be a contiguous buffer$"):
        decode(encoded.header, strided, limits=LIMITS)


# ----------------------------------------------------------------------------- flat payloads


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_payload_of_multidimensional_input_is_a_flat_byte_view(codec: str) -> None:
    x = np.linspace(-1, 1, 200, dtype=np.float32).reshape(10, 20)
    encoded = encode(x, CodecSpec(codec, block_size=8))  # type: ignore[arg-type]
    flat = encode(x.reshape(-1), CodecSpec(codec, block_size=8))  # type: ignore[arg-type]
    assert encoded.payload.format == "B"
    assert encoded.payload.shape == (encoded.header.raw_nbytes,)
    assert encoded.header == flat.header
    assert bytes(encoded.payload) == bytes(flat.payload)


@pytest.mark.parametrize("shape", [(3,), (4, 5), (2, 3, 1)], ids=str)
def test_encode_fp32_view_is_encode_as_a_flat_read_only_byte_view(
    shape: tuple[int, ...],
) -> None:
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    view = encode_fp32_view(x)
    copied = encode(x, CodecSpec("fp32"))
    assert view.header == copied.header
    assert view.payload.format == "B" and view.payload.shape == (4 * x.size,)
    assert view.payload.readonly
    assert bytes(view.payload) == bytes(copied.payload)
    np.testing.assert_array_equal(decode(view.header, view.payload, limits=LIMITS), x.reshape(-1))


@pytest.mark.parametrize(
    "bad",
    [np.ones(4, np.float64), np.ones(8, np.float32)[::2], [1.0, 2.0]],
    ids=["float64", "strided", "list"],
)
def test_encode_fp32_view_rejects_what_it_cannot_view(bad: object) -> None:
    with pytest.raises(
        CoreError, match=r"^encode_fp32_view needs a C-contiguous float32 numpy array$"
    ):
        encode_fp32_view(bad)  # type: ignore[arg-type]


def test_encode_fp32_view_refuses_non_finite_input() -> None:
    message = r"^input holds NaN or Inf; it must not be sent \(never merged\)$"
    with pytest.raises(NonFiniteValues, match=message):
        encode_fp32_view(np.array([1.0, np.nan], np.float32))


# ----------------------------------------------------------------------------- decode_delta


def delta_header(codec: str, n: int, block_size: int) -> TensorHeader:
    return TensorHeader(codec, n, block_size, zstd=False, shuffle=False, raw_nbytes=0, checksum=0)


@pytest.mark.parametrize(
    ("codec", "n", "block_size", "expected"),
    [
        ("int8", 0, 1, True),  # no bytes fit in no bytes
        ("int8", 2, 1, False),  # 2 scales + 2 codes = 10 bytes > 8
        ("int8", 2, 2, True),  # 4 + 2 = 6 bytes ≤ 8
        ("int4", 2, 1, False),
        ("int8", 1, 8, False),  # 4 + 1 (+ 1 pad) > 4
        ("int8", 5, 0, False),
        ("fp32", 10, 0, False),
        ("bf16", 10, 0, False),
    ],
    ids=str,
)
def test_keeps_codes_is_whether_scales_and_codes_fit_in_the_float32_bytes(
    codec: str, n: int, block_size: int, expected: bool
) -> None:
    assert keeps_codes(delta_header(codec, n, block_size)) is expected


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_an_empty_blockwise_payload_keeps_its_codes(codec: str) -> None:
    encoded = encode(np.zeros(0, np.float32), CodecSpec(codec))  # type: ignore[arg-type]
    assert keeps_codes(encoded.header)
    delta = decode_delta(encoded.header, encoded.payload, limits=LIMITS)
    assert isinstance(delta, Blockwise) and delta.size == 0


@pytest.mark.parametrize(("codec", "n"), [("fp32", 10), ("bf16", 10), ("int8", 1)])
def test_decode_delta_without_codes_decodes_into_out(codec: str, n: int) -> None:
    x = np.linspace(-1, 1, n, dtype=np.float32)
    encoded = encode(x, CodecSpec(codec))  # type: ignore[arg-type]
    out = np.full(n, np.nan, np.float32)
    result = decode_delta(encoded.header, encoded.payload, out=out, limits=LIMITS)
    assert result is out
    np.testing.assert_array_equal(out, decode(encoded.header, encoded.payload, limits=LIMITS))


@pytest.mark.parametrize(("codec", "block_size"), [("int8", 64), ("int4", 8)])
@pytest.mark.parametrize("zstd_level", [0, 1])
def test_decode_delta_keeps_codes_in_an_out_of_any_shape(
    codec: str, block_size: int, zstd_level: int
) -> None:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    spec = CodecSpec(codec, block_size=block_size, zstd_level=zstd_level)  # type: ignore[arg-type]
    encoded = encode(x, spec)
    out = np.empty((10, 100), np.float32)
    delta = decode_delta(encoded.header, encoded.payload, out=out, limits=LIMITS)
    assert isinstance(delta, Blockwise) and delta.buffer is out
    reference = decode(encoded.header, encoded.payload, limits=LIMITS)
    np.testing.assert_array_equal(as_float32(delta).view(np.uint32), reference.view(np.uint32))
    again = codes_view(encoded.header, out)
    assert again.codes.tobytes() == delta.codes.tobytes()
    assert again.scales.tobytes() == delta.scales.tobytes()


def test_int8_codes_are_decompressed_straight_into_out() -> None:
    x = (np.random.default_rng(0).standard_normal(1 << 18) * 1e-3).astype(np.float32)
    encoded = encode(x, CodecSpec("int8", zstd_level=1))
    payload = bytes(encoded.payload)
    out = np.empty(x.size, np.float32)
    tracemalloc.start()
    try:
        decode_delta(encoded.header, payload, out=out, limits=LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < encoded.header.raw_nbytes // 8  # no temporary copy of the raw bytes


# ----------------------------------------------------------------------------- zstd framing


def zstd_frame(data: bytes, *, window_log: int = 12) -> bytes:
    """A zstd frame of ``data`` that declares no content size, with a ``2**window_log`` window."""
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=window_log)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return stream.compress(data) + stream.flush()


def zstd_header(raw_nbytes: int) -> TensorHeader:
    return TensorHeader(
        "fp32", raw_nbytes // 4, 0, zstd=True, shuffle=False, raw_nbytes=raw_nbytes, checksum=0
    )


@pytest.mark.parametrize(
    ("spec", "n", "raw_nbytes", "window_log"),
    [
        (CodecSpec("fp32", zstd_level=1), 1024, 4096, 12),
        (CodecSpec("int8", block_size=256, zstd_level=1), 4033, 4097, 13),
    ],
    ids=["fp32-4096", "int8-4097"],
)
def test_zstd_window_may_reach_the_raw_size_rounded_up_to_a_power_of_two(
    spec: CodecSpec, n: int, raw_nbytes: int, window_log: int
) -> None:
    x = np.linspace(-1, 1, n, dtype=np.float32)
    encoded = encode(x, spec)
    raw = bytes(encode(x, dataclasses.replace(spec, zstd_level=None)).payload)
    assert encoded.header.raw_nbytes == len(raw) == raw_nbytes
    reference = decode(encoded.header, encoded.payload, limits=LIMITS)
    y = decode(encoded.header, zstd_frame(raw, window_log=window_log), limits=LIMITS)
    np.testing.assert_array_equal(y.view(np.uint32), reference.view(np.uint32))
    too_wide = zstd_frame(raw, window_log=window_log + 1)
    with pytest.raises(
        PayloadTooLarge, match=f"zstd window of {2 << window_log} bytes for {raw_nbytes} raw"
    ):
        decode(encoded.header, too_wide, limits=LIMITS)


@pytest.mark.parametrize(
    ("max_decompressed_bytes", "error"), [(8192, CorruptPayload), (8191, PayloadTooLarge)]
)
def test_zstd_frame_declaring_another_size_is_too_large_only_beyond_the_limit(
    max_decompressed_bytes: int, error: type[Exception]
) -> None:
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(8192))
    assert zstandard.get_frame_parameters(frame).content_size == 8192
    limits = DecodeLimits(max_decompressed_bytes=max_decompressed_bytes)
    with pytest.raises(error, match="zstd frame declares 8192 bytes, header says 4096"):
        decode(zstd_header(4096), frame, limits=limits)


def reserved_block(frame: bytes) -> bytes:
    """``frame`` with its first block's type set to 3 (reserved): a corrupt zstd stream."""
    damaged = bytearray(frame)
    damaged[6] |= 0b110  # magic (4), frame header descriptor, window descriptor, block header
    return bytes(damaged)


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        (b"not a zstd frame", CorruptPayload, "payload is not a zstd frame: "),
        (zstd_frame(bytes(100)), CorruptPayload, "zstd data ends after 100 of 4096 bytes"),
        (
            zstd_frame(bytes(4097)),
            PayloadTooLarge,
            "zstd data decompresses to more than raw_nbytes=4096",
        ),
        (reserved_block(zstd_frame(bytes(4096))), CorruptPayload, "zstd data is corrupt: "),
    ],
    ids=["not-a-frame", "short", "long", "corrupt"],
)
def test_zstd_framing_errors_say_what_is_wrong(
    payload: bytes, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        decode(zstd_header(4096), payload, limits=LIMITS)


def test_a_payload_of_several_zstd_frames_decodes() -> None:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    encoded = encode(x, CodecSpec("int8", zstd_level=1))
    raw = bytes(encode(x, CodecSpec("int8")).payload)
    frames = zstd_frame(raw[:100], window_log=10) + zstd_frame(raw[100:], window_log=10)
    y = decode(encoded.header, frames, limits=LIMITS)
    np.testing.assert_array_equal(y, decode(encoded.header, encoded.payload, limits=LIMITS))
