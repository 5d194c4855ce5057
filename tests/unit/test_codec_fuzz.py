"""Hostile payloads: every bad input raises the right ``DDQError``, never a bare exception.

Covers truncation, bit flips in payload and header, inconsistent lengths, zstd bombs (checked for
memory), wrong types and dtypes, NaN/Inf on the way in and (with a valid checksum) on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dd_queue.core import codec
from dd_queue.core.codec import CodecSpec, DecodeLimits, EncodedTensor, TensorHeader, decode, encode
from dd_queue.errors import (
    CoreError,
    CorruptPayload,
    DDQError,
    IncompatibleMessage,
    NonFiniteValues,
    PayloadTooLarge,
    ProtocolError,
)

LIMITS = DecodeLimits()
SPECS = [
    CodecSpec("fp32"),
    CodecSpec("fp32", zstd_level=1),
    CodecSpec("fp32", zstd_level=1, shuffle=True),
    CodecSpec("bf16"),
    CodecSpec("bf16", zstd_level=1, shuffle=True),
    CodecSpec("int8", block_size=64),
    CodecSpec("int8", block_size=64, zstd_level=3),
    CodecSpec("int4", block_size=8),
    CodecSpec("int4", block_size=8, zstd_level=1),
]
IDS = [f"{s.name}-z{s.zstd_level or 0}{'-shuffle' if s.shuffle else ''}" for s in SPECS]
MiB = 1 << 20


def sample(n: int = 300, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 1e-2).astype(np.float32)


def reseal(header: TensorHeader, raw: bytes) -> TensorHeader:
    """The header with a valid checksum for ``raw``: lets a test smuggle bad values past it."""
    h = header
    raw_u8 = np.frombuffer(raw, np.uint8)
    crc = codec._checksum(raw_u8, h.codec, h.n_elements, h.block_size, h.shuffle)
    return dataclasses.replace(h, checksum=crc)


def flip(data: bytes, bit: int) -> bytes:
    mutable = bytearray(data)
    mutable[bit // 8] ^= 1 << (bit % 8)
    return bytes(mutable)


# ----------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_truncated_payloads_are_corrupt(spec: CodecSpec) -> None:
    encoded = encode(sample(), spec)
    payload = bytes(encoded.payload)
    cuts = sorted({0, 1, 2, 3, 4, 5, 8, 13, len(payload) - 1, *range(0, len(payload), 17)})
    for cut in cuts:
        with pytest.raises(CorruptPayload):
            decode(encoded.header, payload[:cut], limits=LIMITS)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_trailing_bytes_are_rejected(spec: CodecSpec) -> None:
    encoded = encode(sample(), spec)
    for extra in (b"\x00", b"garbage!" * 3):
        with pytest.raises(CorruptPayload):
            decode(encoded.header, bytes(encoded.payload) + extra, limits=LIMITS)


def test_a_second_zstd_frame_is_too_much_output() -> None:
    encoded = encode(sample(), CodecSpec("int8", zstd_level=1))
    second = zstandard.ZstdCompressor(level=1).compress(bytes(1000))
    with pytest.raises(PayloadTooLarge):
        decode(encoded.header, bytes(encoded.payload) + second, limits=LIMITS)


# ----------------------------------------------------------------------------- bit flips


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.zstd_enabled], ids=str)
def test_every_single_bit_flip_in_a_raw_payload_is_caught(spec: CodecSpec) -> None:
    encoded = encode(sample(24), spec)
    payload = bytes(encoded.payload)
    for bit in range(8 * len(payload)):
        with pytest.raises(CorruptPayload, match="checksum"):
            decode(encoded.header, flip(payload, bit), limits=LIMITS)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.zstd_enabled], ids=str)
def test_bit_flips_in_a_zstd_payload_never_go_unnoticed(spec: CodecSpec) -> None:
    x = sample(24)
    encoded = encode(x, spec)
    reference = decode(encoded.header, encoded.payload, limits=LIMITS)
    payload = bytes(encoded.payload)
    for bit in range(8 * len(payload)):
        try:
            y = decode(encoded.header, flip(payload, bit), limits=LIMITS)
        except (CorruptPayload, PayloadTooLarge):
            continue
        # a flip zstd ignores (e.g. in an unused header bit) must leave the values intact
        np.testing.assert_array_equal(y.view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("field", ["n_elements", "block_size", "raw_nbytes", "checksum"])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_bit_flips_in_header_counts_are_caught(spec: CodecSpec, field: str) -> None:
    encoded = encode(sample(), spec)
    limits = DecodeLimits(max_payload_bytes=MiB, max_decompressed_bytes=MiB, max_elements=1 << 18)
    for bit in range(40):
        value = getattr(encoded.header, field) ^ (1 << bit)
        header = dataclasses.replace(encoded.header, **{field: value})
        with pytest.raises((CorruptPayload, PayloadTooLarge)):
            decode(header, encoded.payload, limits=limits)


@pytest.mark.parametrize(
    ("change", "payload_spec"),
    [
        ({"block_size": 257}, CodecSpec("int8")),  # same raw size for 1000 elements: seed catches
        ({"shuffle": False}, CodecSpec("bf16", zstd_level=1, shuffle=True)),
        ({"shuffle": True}, CodecSpec("bf16", zstd_level=1)),
        ({"codec": "bf16", "n_elements": 2000}, CodecSpec("fp32")),  # same raw bytes
        ({"zstd": True}, CodecSpec("fp32")),
        ({"zstd": False}, CodecSpec("fp32", zstd_level=1)),
        ({"codec": "int4"}, CodecSpec("int8")),
    ],
    ids=str,
)
def test_consistent_looking_header_changes_are_caught(
    change: dict[str, object], payload_spec: CodecSpec
) -> None:
    encoded = encode(sample(1000), payload_spec)
    header = dataclasses.replace(encoded.header, **change)  # type: ignore[arg-type]
    with pytest.raises(CorruptPayload):
        decode(header, encoded.payload, limits=LIMITS)


# ----------------------------------------------------------------------------- wrong lengths


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_lengths_inconsistent_with_the_header(spec: CodecSpec) -> None:
    encoded = encode(sample(), spec)
    h = encoded.header
    for header in (
        dataclasses.replace(h, raw_nbytes=h.raw_nbytes + 1),
        dataclasses.replace(h, n_elements=h.n_elements + 1),
        dataclasses.replace(h, n_elements=h.n_elements - 1),
    ):
        with pytest.raises(CorruptPayload):
            decode(header, encoded.payload, limits=LIMITS)
    # header and payload of different messages: element counts differ
    other = encode(sample(301), spec)
    with pytest.raises(CorruptPayload):
        decode(h, other.payload, limits=LIMITS)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"codec": "fp8"}, IncompatibleMessage),
        ({"codec": ""}, IncompatibleMessage),
        ({"dtype": "float64"}, IncompatibleMessage),
        ({"dtype": "bfloat16"}, IncompatibleMessage),
        ({"n_elements": -1}, CorruptPayload),
        ({"n_elements": "300"}, CorruptPayload),
        ({"n_elements": 300.0}, CorruptPayload),
        ({"block_size": True}, CorruptPayload),
        ({"block_size": 0}, CorruptPayload),
        ({"checksum": -1}, CorruptPayload),
        ({"checksum": 1 << 32}, CorruptPayload),
        ({"checksum": None}, CorruptPayload),
        ({"zstd": 1}, CorruptPayload),
        ({"shuffle": "no"}, CorruptPayload),
    ],
    ids=str,
)
def test_mistyped_or_unknown_header_fields(
    change: dict[str, object], error: type[Exception]
) -> None:
    encoded = encode(sample(), CodecSpec("int8"))
    header = dataclasses.replace(encoded.header, **change)  # type: ignore[arg-type]
    with pytest.raises(error):
        decode(header, encoded.payload, limits=LIMITS)


def test_payload_of_the_wrong_type() -> None:
    encoded = encode(sample(), CodecSpec("fp32"))
    for bad in (None, 12, "text", [1, 2, 3]):
        with pytest.raises(CoreError, match="bytes-like"):
            decode(encoded.header, bad, limits=LIMITS)  # type: ignore[arg-type]
    # any contiguous buffer works: here the raw bytes seen as a float32 numpy array
    as_array = np.frombuffer(bytes(encoded.payload), np.float32)
    np.testing.assert_array_equal(decode(encoded.header, as_array, limits=LIMITS), sample())  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- size limits, bombs


@functools.cache
def zeros_frame(n_bytes: int, *, declared: bool) -> bytes:
    """A zstd frame of ``n_bytes`` zeros (a few KB), with or without the content size."""
    compressor = zstandard.ZstdCompressor(level=1)
    stream = compressor.compressobj(size=n_bytes) if declared else compressor.compressobj()
    zeros = bytes(16 * MiB)
    parts = [stream.compress(zeros) for _ in range(n_bytes // len(zeros))]
    return b"".join([*parts, stream.flush()])


def bomb_header(raw_nbytes: int) -> TensorHeader:
    return TensorHeader(
        "fp32", raw_nbytes // 4, 0, zstd=True, shuffle=False, raw_nbytes=raw_nbytes, checksum=0
    )


def assert_bounded(call: object, *, limit_bytes: int) -> None:
    """Run ``call``; it must raise PayloadTooLarge without allocating (much) beyond the limit."""
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge):
            call()  # type: ignore[operator]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= limit_bytes + MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib < 256 * 1024


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_zstd_bomb_of_1_gib_is_refused_without_allocating_it(declared: bool) -> None:
    bomb = zeros_frame(1 << 30, declared=declared)
    assert len(bomb) < 64 * 1024
    header = bomb_header(4 * MiB)  # an honest-looking header; the frame lies
    limits = DecodeLimits(max_decompressed_bytes=64 * MiB)
    assert_bounded(lambda: decode(header, bomb, limits=limits), limit_bytes=4 * MiB)


def test_header_claiming_a_huge_raw_size_is_refused_before_decompression() -> None:
    bomb = zeros_frame(1 << 30, declared=True)
    limits = DecodeLimits(max_decompressed_bytes=64 * MiB)
    assert_bounded(lambda: decode(bomb_header(1 << 30), bomb, limits=limits), limit_bytes=0)


def test_zstd_frame_with_a_huge_window_is_refused() -> None:
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    frame = stream.compress(bytes(4096)) + stream.flush()
    assert zstandard.get_frame_parameters(frame).window_size == 1 << 27
    with pytest.raises(PayloadTooLarge, match="window"):
        decode(bomb_header(4096), frame, limits=LIMITS)


def test_payload_and_element_limits() -> None:
    encoded = encode(sample(1000), CodecSpec("fp32"))
    with pytest.raises(PayloadTooLarge, match="exceeds"):
        decode(encoded.header, encoded.payload, limits=DecodeLimits(max_payload_bytes=3999))
    with pytest.raises(PayloadTooLarge, match="max_elements"):
        decode(encoded.header, encoded.payload, limits=DecodeLimits(max_elements=999))
    with pytest.raises(PayloadTooLarge, match="max_decompressed_bytes"):
        decode(encoded.header, encoded.payload, limits=DecodeLimits(max_decompressed_bytes=3999))
    decode(encoded.header, encoded.payload, limits=DecodeLimits(4000, 4000, 1000))  # at the limit


# ----------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 150, 299])
def test_non_finite_input_is_refused(spec: CodecSpec, bad: float, where: int) -> None:
    x = sample()
    x[where] = bad
    with pytest.raises(NonFiniteValues):
        encode(x, spec)


def smuggle(spec: CodecSpec, edit: object) -> EncodedTensor:
    """Encode, let ``edit`` alter the raw bytes in place, then reseal the checksum."""
    encoded = encode(sample(64), spec)
    raw = bytearray(encoded.payload)
    edit(raw)  # type: ignore[operator]
    return EncodedTensor(reseal(encoded.header, bytes(raw)), memoryview(bytes(raw)))


def set_f32(offset: int, value: float) -> object:
    def edit(raw: bytearray) -> None:
        raw[offset : offset + 4] = np.array([value], "<f4").tobytes()

    return edit


@pytest.mark.parametrize(
    ("spec", "edit"),
    [
        (CodecSpec("fp32"), set_f32(8, np.nan)),
        (CodecSpec("fp32"), set_f32(252, -np.inf)),
        (CodecSpec("bf16"), lambda raw: raw.__setitem__(slice(2, 4), b"\x80\x7f")),  # +Inf
        (CodecSpec("bf16"), lambda raw: raw.__setitem__(slice(0, 2), b"\xc0\xff")),  # NaN
        (CodecSpec("int8", block_size=32), set_f32(0, np.nan)),  # a NaN scale
        (CodecSpec("int8", block_size=32), set_f32(4, np.inf)),
        (CodecSpec("int8", block_size=32), set_f32(4, 1e38)),  # q·s would overflow
        (CodecSpec("int8", block_size=32), set_f32(0, -np.nan)),
        (CodecSpec("int4", block_size=32), set_f32(0, np.nan)),
        (CodecSpec("int4", block_size=32), set_f32(4, 5e37)),  # > max/8: nibble −8 overflows
    ],
    ids=str,
)
def test_decoded_non_finite_values_are_refused_despite_a_valid_checksum(
    spec: CodecSpec, edit: object
) -> None:
    bad = smuggle(spec, edit)
    with pytest.raises(NonFiniteValues):
        decode(bad.header, bad.payload, limits=LIMITS)
    with pytest.raises(NonFiniteValues):  # also when decoding into a buffer
        decode(bad.header, bad.payload, out=np.empty(64, np.float32), limits=LIMITS)


def test_the_largest_legal_int8_scale_decodes_finite() -> None:
    bad = smuggle(
        CodecSpec("int8", block_size=32), set_f32(0, float(np.finfo(np.float32).max) / 128)
    )
    bad_raw = bytearray(bad.payload)
    bad_raw[8] = 0x80  # q = −128 in block 0
    sealed = reseal(bad.header, bytes(bad_raw))
    assert np.isfinite(decode(sealed, bytes(bad_raw), limits=LIMITS)).all()


# ----------------------------------------------------------------------------- random fuzz

header_values = st.one_of(
    st.integers(-3, 1 << 34),
    st.sampled_from([None, "x", 1.5, True, b"\x00"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(SPECS),
    cut=st.integers(0, 4000),
    flips=st.lists(st.integers(0, 8 * 4000), max_size=3),
    field=st.sampled_from(["none", "n_elements", "block_size", "raw_nbytes", "checksum", "codec"]),
    value=header_values,
    junk=st.binary(max_size=64),
)
def test_random_damage_never_escapes_the_error_tree(
    spec: CodecSpec, cut: int, flips: list[int], field: str, value: object, junk: bytes
) -> None:
    encoded = encode(sample(257, seed=cut), spec)
    payload = bytes(encoded.payload)[:cut] + junk[: cut % 3]
    for bit in flips:
        if bit < 8 * len(payload):
            payload = flip(payload, bit)
    header = encoded.header
    if field != "none":
        header = dataclasses.replace(header, **{field: value})  # type: ignore[arg-type]
    limits = DecodeLimits(max_payload_bytes=MiB, max_decompressed_bytes=MiB, max_elements=1 << 18)
    try:
        y = decode(header, payload, limits=limits)
    except ProtocolError:
        return
    except DDQError as exc:  # pragma: no cover - would be a wrong subclass
        pytest.fail(f"{type(exc).__name__} is not a ProtocolError: {exc}")
    assert y.dtype == np.float32 and np.isfinite(y).all()


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=600), spec=st.sampled_from(SPECS))
def test_random_bytes_with_a_valid_header(payload: bytes, spec: CodecSpec) -> None:
    header = encode(sample(100), spec).header
    with pytest.raises(ProtocolError):
        decode(header, payload, limits=LIMITS)
