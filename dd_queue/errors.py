"""Every error dd_queue raises on purpose, in one tree.

Catch ``DDQError`` to catch them all. Each message says what went wrong *and what to do*.

    DDQError
    ├── ConfigError              invalid or unknown configuration (names the key's path)
    ├── ProtocolError            a message or payload that must not be used
    │   ├── CorruptPayload       truncated, bit-flipped, bad checksum, inconsistent lengths
    │   ├── IncompatibleMessage  wrong schema_version, run_id, codec or dtype
    │   ├── PayloadTooLarge      over a configured size limit (envelope, decompressed, elements)
    │   ├── NonFiniteValues      NaN or Inf where only finite numbers may appear
    │   └── Unauthenticated      no valid signature of the party that must have written it
    ├── BusError                 the Redis bus (or its in-memory twin) failed
    │   ├── InvalidArgument      a bus call got an argument Redis would refuse (also a ValueError)
    │   ├── NoGroup              internal: the server answered NOGROUP (the bus recreates the group)
    │   ├── BusUnavailable       the server could not be reached within the bounded retry time
    │   ├── LeaseLost            the caller no longer holds the lease it acted under (fenced)
    │   ├── BlobMissing          a referenced payload key has expired or was never written
    │   └── NotReady             a service's start wait ran out (Redis, the run, a synchronizer)
    ├── CoreError                invalid input to the pure algorithm core (shapes, weights, ...)
    └── Refused                  an operator request the control plane cannot carry out (HTTP 409)
        ├── NotFound             it names a learner or schedule nobody knows (HTTP 404)
        └── Conflict             it does not fit the run's state (HTTP 409)

Quorum shortfall, slow learners and abandoned rounds are *not* errors: they are ``Decision``s.

Exit codes of every ``ddq`` command and service (``exit_code``): 0 done or stopped cleanly;
2 a misconfiguration (``ConfigError``, ``ProtocolError``, ...): a restart would fail the same
way, so supervisors give up on it; 3 a dependency failed or stayed away (``BusError``: Redis
unreachable past its bound, a start wait that ran out, a lost lease): restart it later.
"""

from __future__ import annotations


class DDQError(Exception):
    """Root of every error that dd_queue raises deliberately."""


class ConfigError(DDQError):
    """The configuration is invalid; the message names the key's path and the fix."""


class ProtocolError(DDQError):
    """A wire message or payload must not be used. ``reason`` is a short machine-readable tag."""

    reason: str = "protocol"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class CorruptPayload(ProtocolError):
    """Bytes that do not decode: truncated, bit-flipped, bad checksum, inconsistent lengths."""

    reason = "corrupt"


class IncompatibleMessage(ProtocolError):
    """A well-formed message from another schema version, run, codec or dtype."""

    reason = "incompatible"


class PayloadTooLarge(ProtocolError):
    """A payload over a configured limit; raised before anything big is allocated."""

    reason = "too_large"


class NonFiniteValues(ProtocolError):
    """NaN or Inf in a tensor that must be finite (never merged)."""

    reason = "non_finite"


class Unauthenticated(ProtocolError):
    """A message or blob without a valid signature of the party that must have written it
    (``dd_queue.auth``): forged, replayed under another name, or from a member without a key."""

    reason = "unauthenticated"


class BusError(DDQError):
    """The bus failed in a way the caller must handle."""


class InvalidArgument(BusError, ValueError):
    """A bus call or commit op got an argument Redis would refuse: empty fields, a malformed
    stream id, an expiry or ``maxlen`` that is not positive, an empty key.

    Raised before anything is sent, so nothing was applied: fix the caller. It is a ``BusError``
    (the bus refused) and a ``ValueError`` (a bad argument).
    """


class NoGroup(BusError):
    """Internal to ``RedisBus``: the server answered NOGROUP (restart without persistence, stream
    deleted); the bus recreates the group and retries, or reads the group as empty."""


class BusUnavailable(BusError):
    """Redis could not be reached within the bounded retry time; check the server and the URL."""


class NotReplicated(BusError):
    """A fenced commit that ``redis.commit_replicas`` replicas did not confirm in time (or whose
    connection broke on the way): it may or may not survive a failover, so the caller rebuilds
    from what Redis holds instead of counting it as done."""


class LeaseLost(BusError):
    """The caller's lease (and fencing token) is no longer current; another owner took over."""


class BlobMissing(BusError):
    """A payload key referenced by a stream entry is gone (expired TTL or never written)."""


class NotReady(BusError):
    """What a service waits for at start (Redis, the run, a synchronizer) did not come in time."""


class CoreError(DDQError):
    """Invalid input to a pure core function (mismatched shapes, negative weights, ...)."""


class Refused(DDQError):
    """An operator request that cannot be carried out now; ``status_code`` is its HTTP status."""

    status_code = 409


class NotFound(Refused):
    """The request names a learner or schedule that the control plane does not know."""

    status_code = 404


class Conflict(Refused):
    """The request does not fit the run's state (target not live, chaos already running)."""


EXIT_MISCONFIGURED = 2
"""Exit code of a misconfiguration: fix it, a restart would fail the same way."""
EXIT_UNAVAILABLE = 3
"""Exit code of a failed or absent dependency (Redis, the run, a lease): restart later."""


def exit_code(exc: DDQError) -> int:
    """The process exit code for ``exc`` (module docstring): 3 for bus errors, else 2."""
    return EXIT_UNAVAILABLE if isinstance(exc, BusError) else EXIT_MISCONFIGURED


__all__ = [
    "EXIT_MISCONFIGURED",
    "EXIT_UNAVAILABLE",
    "BlobMissing",
    "BusError",
    "BusUnavailable",
    "ConfigError",
    "Conflict",
    "CoreError",
    "CorruptPayload",
    "DDQError",
    "IncompatibleMessage",
    "InvalidArgument",
    "LeaseLost",
    "NoGroup",
    "NonFiniteValues",
    "NotFound",
    "NotReady",
    "NotReplicated",
    "PayloadTooLarge",
    "ProtocolError",
    "Refused",
    "Unauthenticated",
    "exit_code",
]
