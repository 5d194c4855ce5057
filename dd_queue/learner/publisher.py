"""Turn a snapshot into a published contribution: Δ_p, error feedback, codec, ``send_contribution``.

Runs on the background sender, never on the training thread.

Outer gradient (DiLoCo sign, Douillard et al., arXiv 2311.08105): Δ_p = Θ_p(base) − θ_p, taken
against the fragment's base version; the synchronizer re-anchors it (docs/protocol.md).

Error feedback (Seide et al. 2014; Karimireddy et al., arXiv 1901.09847): with a lossy codec
(bf16, int8, int4) the learner sends x = Δ_p + r_p and keeps r_p ← x − decode(encode(x)), so
the quantization error of one contribution is added to the fragment's next one instead of
being lost. The residual is committed only after a successful send: a contribution that never
left (dropped, or Redis down) does not shift it. int4's ~11 % error per message needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import numpy as np

from dd_queue.auth import OPEN, Auth
from dd_queue.bus import Bus, ops
from dd_queue.core.codec import CodecSpec, DecodeLimits, EncodedTensor, decode, encode
from dd_queue.learner.exchange import Float32Array, Snapshot
from dd_queue.messages import Contribution

log = logging.getLogger("dd_queue.learner")

LOSSY_CODECS = frozenset({"bf16", "int8", "int4"})
_NO_LIMITS = DecodeLimits()  # decoding our own payload: the defaults (2 GiB) never bind


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PublishSettings:
    """What every contribution of one learner shares.

    Attributes:
        run_id: The run.
        learner_id: The sender.
        config_digest: Digest of the sender's config (the synchronizer compares it).
        codec: Contribution codec.
        error_feedback: Carry lossy codecs' residuals (ignored for fp32).
        ttl_s: Expiry of the payload blob, seconds.
        maxlen: Approximate cap of the ``up`` stream.
        auth: The learner's key: every contribution (entry and blob) is signed with it.
    """

    run_id: str
    learner_id: str
    config_digest: str
    codec: CodecSpec
    error_feedback: bool
    ttl_s: float
    maxlen: int | None
    auth: Auth = OPEN


class ContributionEncoder:
    """Δ_p with error feedback, encoded; keeps one residual per fragment.

    Args:
        codec: The contribution codec.
        error_feedback: Keep residuals (only lossy codecs have any).
    """

    def __init__(self, codec: CodecSpec, *, error_feedback: bool) -> None:
        self.codec = codec
        self.feedback = error_feedback and codec.name in LOSSY_CODECS
        self._residual: dict[int, Float32Array] = {}

    def encode(self, snapshot: Snapshot) -> tuple[EncodedTensor, Float32Array | None]:
        """Encode Δ_p (+ residual) of a snapshot.

        Returns:
            The encoded payload and the new residual to ``commit`` once it is sent (None
            without error feedback).
        """
        if snapshot.ready is not None:
            snapshot.ready()  # the asynchronous device-to-host copy of θ_p
        theta = snapshot.values.numpy()
        x = np.subtract(snapshot.base, theta, dtype=np.float32)
        residual = self._residual.get(snapshot.fragment_id)
        if self.feedback and residual is not None:
            x += residual
        encoded = encode(x, self.codec)
        if not self.feedback:
            return encoded, None
        x -= decode(encoded.header, encoded.payload, limits=_NO_LIMITS)  # x becomes the residual
        return encoded, x

    def commit(self, fragment_id: int, residual: Float32Array | None) -> None:
        """Keep ``residual`` for the fragment's next contribution (after a successful send)."""
        if residual is not None:
            self._residual[fragment_id] = residual

    def residual(self, fragment_id: int) -> Float32Array | None:
        """The residual the next contribution of ``fragment_id`` will carry."""
        return self._residual.get(fragment_id)


def corrupt(encoded: EncodedTensor) -> EncodedTensor:
    """A copy of the payload with one byte flipped (fault ``corrupt``: the checksum fails)."""
    data = bytearray(encoded.payload)
    if data:
        data[len(data) // 2] ^= 0xFF
    return EncodedTensor(encoded.header, memoryview(data))


def send(
    bus: Bus,
    settings: PublishSettings,
    snapshot: Snapshot,
    encoded: EncodedTensor,
    new_tokens: int,
    tokens: Mapping[str, int],
) -> str:
    """Publish one contribution (blob + ``up`` entry in one round trip); returns the entry id.
    ``new_tokens``: the part of ``snapshot.n_tokens`` no earlier send carried; ``tokens``: the
    learner's token counts due, added in the same round trip (token fate)."""
    msg = Contribution(
        run_id=settings.run_id,
        config_digest=settings.config_digest,
        learner_id=settings.learner_id,
        fragment_id=snapshot.fragment_id,
        round_id=snapshot.round_id,
        base_version=snapshot.base_version,
        n_steps=snapshot.n_steps,
        n_tokens=snapshot.n_tokens,
        tensor=encoded.header,
        created_at_s=time.time(),
        new_tokens=new_tokens,
    )
    entry_id, _ = ops.send_contribution(
        bus,
        msg,
        encoded,
        ttl_s=settings.ttl_s,
        maxlen=settings.maxlen,
        auth=settings.auth,
        tokens=tokens,
    )
    return entry_id


__all__ = ["LOSSY_CODECS", "ContributionEncoder", "PublishSettings", "corrupt", "send"]
