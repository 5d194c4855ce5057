"""Message authentication: Ed25519 signatures of who wrote what, checked before anything is used.

A party that can write to Redis but holds no key must not get a contribution merged, a global
fragment applied, a fault command obeyed or a heartbeat counted. Each writer signs what it
writes with its own private key; each reader checks it against the run's keyring (public keys
only) and refuses, with reason ``unauthenticated``, what does not verify:

================  ================================  ===============================================
signed by         what                              checked by
================  ================================  ===============================================
``learner.<id>``  contributions (entry and blob),   the synchronizer (``ops.read_contribution``),
                  its heartbeats                    the control plane, the synchronizer
``synchronizer``  global fragments (the ``down``    learners, the evaluator, ``ddq export``, a
                  entry and the Θ blob), its        synchronizer taking a fragment over (Θ blobs);
                  heartbeats                        the control plane, start waits
``control``       fault commands, its heartbeats    learners and synchronizers
================  ================================  ===============================================

Why Ed25519 and not HMAC: a reader holds only public keys, so a learner that can check the
synchronizer's global fragments still cannot forge one, and no learner can pass for another.
The ``cryptography`` package does the curve math; nothing here is our own crypto.

What is signed (``statement``): a domain tag, the kind of message, the run, the signer, the
stream or key it was written to, and the SHA-256 of the envelope (plus, for a blob, of its
payload). A signed entry copied to another stream, run or signer does not verify; replays of
the same entry are the readers' business (contribution dedupe by identity, global versions that
only move forward, fault commands by id and age).

Files (``ddq keys --out keys/``): ``keyring.json`` (the run's public keys; every host) and one
private key a principal, ``<principal>.key`` (PKCS#8 PEM, mode 0600; only the host that runs
it). ``auth.keys_dir`` in the config points every process at that directory; each loads the
keyring and its own key. Without ``auth.keys_dir`` nothing is signed or checked (the default of
a single-box run; ``ddq up`` makes keys for every run it starts).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import functools
import hashlib
import json
import os
import sys
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dd_queue.core.codec import TensorHeader
from dd_queue.errors import ConfigError, Unauthenticated
from dd_queue.keys import check_name
from dd_queue.wire import ENTRY_FIELD, BlobCheck, BlobSigner, entry_envelope

if TYPE_CHECKING:
    from dd_queue.config.schema import AuthConfig

__all__ = [
    "CONTROL",
    "KEYRING_FILE",
    "OPEN",
    "SIG_FIELD",
    "SYNCHRONIZER",
    "Auth",
    "FreshCommands",
    "KeyRing",
    "Refusals",
    "learner_principal",
    "principal_of",
    "principals",
    "register",
    "statement",
    "write_keys",
]

SIG_FIELD = "sig"
"""Stream-entry field holding the writer's signature of the entry (64 bytes)."""
KEYRING_FILE = "keyring.json"
KEYRING_FORMAT = "ddq.keyring.v1"
SYNCHRONIZER = "synchronizer"
CONTROL = "control"
SIG_BYTES = 64
_SEAL_MAGIC = b"DDQS"
_DOMAIN = b"ddq-auth-v1"


def learner_principal(learner_id: str) -> str:
    """The signer name of a learner: ``learner.<id>``."""
    return f"learner.{learner_id}"


def principal_of(role: str, member_id: str) -> str:
    """Who signs a member's heartbeat: ``learner.<id>``, ``synchronizer`` or ``control``."""
    return learner_principal(member_id) if role == "learner" else role


def statement(
    kind: str,
    *,
    run_id: str,
    principal: str,
    where: str,
    body: bytes | bytearray | memoryview,
    extra: bytes = b"",
) -> bytes:
    """The bytes a signature covers: domain, kind, run, signer, the stream or key written
    (``where``), SHA-256 of ``body`` and ``extra`` (e.g. a blob's reference or payload digest)."""
    digest = hashlib.sha256(body).digest()
    head = b"\n".join(s.encode() for s in (kind, run_id, principal, where))
    return b"\n".join((_DOMAIN, head, digest, hashlib.sha256(extra).digest()))


def _blob_statement(
    run_id: str, principal: str, blob_key: str, header: TensorHeader, payload: memoryview
) -> bytes:
    shape = repr(dataclasses.astuple(header)).encode()  # every field of the codec header
    return statement(
        "blob", run_id=run_id, principal=principal, where=blob_key, body=payload, extra=shape
    )


@functools.lru_cache(maxsize=4096)
def _public(raw: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The run's public keys, by principal (picklable: raw 32-byte keys)."""

    run_id: str
    keys: Mapping[str, bytes]

    def verify(self, principal: str, data: bytes, signature: object) -> None:
        """Check ``signature`` of ``data`` by ``principal``.

        Raises:
            Unauthenticated: No signature, a principal without a key, or a bad signature.
        """
        raw = self.keys.get(principal)
        if raw is None:
            raise Unauthenticated(
                f"{principal} holds no key of run {self.run_id!r} (not a member: provision it "
                "with ddq keys)"
            )
        if not isinstance(signature, bytes | bytearray) or len(signature) != SIG_BYTES:
            raise Unauthenticated(f"no valid signature of {principal}")
        try:
            _public(raw).verify(bytes(signature), data)
        except InvalidSignature:
            raise Unauthenticated(f"signature of {principal} does not verify") from None

    @property
    def learners(self) -> frozenset[str]:
        """Learner ids that hold a key (the run's members)."""
        return frozenset(p.removeprefix("learner.") for p in self.keys if p.startswith("learner."))

    def to_json(self) -> str:
        keys = {p: base64.b64encode(k).decode() for p, k in sorted(self.keys.items())}
        return json.dumps({"format": KEYRING_FORMAT, "run_id": self.run_id, "keys": keys}, indent=2)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> KeyRing:
        """Parse a keyring file.

        Raises:
            ConfigError: Not a keyring, or a key that is not 32 bytes of base64.
        """
        try:
            data = json.loads(text)
            if data.get("format") != KEYRING_FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {KEYRING_FORMAT!r}")
            keys = {str(p): base64.b64decode(k, validate=True) for p, k in data["keys"].items()}
            if bad := [p for p, k in keys.items() if len(k) != 32]:
                raise ValueError(f"keys of {bad} are not 32 bytes")
            return cls(run_id=str(data["run_id"]), keys=keys)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{where} is not a dd_queue keyring: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Auth:
    """One process's view: the run's keyring (None: nothing is checked) and its own private
    key (None: it signs nothing). ``OPEN`` is the unauthenticated default."""

    keyring: KeyRing | None = None
    principal: str | None = None
    _key: Ed25519PrivateKey | None = field(default=None, repr=False, compare=False)

    @property
    def checks(self) -> bool:
        """Whether readers refuse what is not signed."""
        return self.keyring is not None

    def sign(self, data: bytes) -> bytes | None:
        """This process's signature of ``data`` (None without a key)."""
        return None if self._key is None else self._key.sign(data)

    def verify(self, principal: str, data: bytes, signature: object) -> None:
        """``KeyRing.verify`` when checking; nothing otherwise."""
        if self.keyring is not None:
            self.keyring.verify(principal, data, signature)

    # ── stream entries ───────────────────────────────────────────────────────────────────
    def sign_fields(
        self, kind: str, *, run_id: str, where: str, fields: Mapping[str, bytes], extra: bytes = b""
    ) -> dict[str, bytes]:
        """``fields`` plus this process's signature of the envelope in them (unchanged without
        a key). ``fields`` must hold the envelope (``ENTRY_FIELD``)."""
        out = dict(fields)
        if self._key is not None and self.principal is not None:
            data = statement(
                kind,
                run_id=run_id,
                principal=self.principal,
                where=where,
                body=fields[ENTRY_FIELD],
                extra=extra,
            )
            out[SIG_FIELD] = self._key.sign(data)
        return out

    def check_fields(
        self,
        kind: str,
        principal: str,
        *,
        run_id: str,
        where: str,
        fields: Mapping[Any, bytes],
        extra: bytes = b"",
    ) -> None:
        """Check an entry's signature by ``principal`` (nothing when not checking).

        Raises:
            Unauthenticated: Missing, of another principal, or not over these fields.
        """
        if self.keyring is None:
            return
        body = entry_envelope(fields)
        signature = fields.get(SIG_FIELD, fields.get(SIG_FIELD.encode()))
        data = statement(
            kind, run_id=run_id, principal=principal, where=where, body=body, extra=extra
        )
        self.keyring.verify(principal, data, signature)

    # ── blobs (the signature lives in the blob's header; dd_queue.wire) ─────────────────
    def blob_signer(self, run_id: str) -> BlobSigner | None:
        """Signs blobs this process writes (None without a key)."""
        key, principal = self._key, self.principal
        if key is None or principal is None:
            return None

        def sign(blob_key: str, header: TensorHeader, payload: memoryview) -> bytes:
            return key.sign(_blob_statement(run_id, principal, blob_key, header, payload))

        return sign

    def blob_check(self, run_id: str, principal: str) -> BlobCheck | None:
        """Checks that ``principal`` wrote a blob (None when not checking)."""
        keyring = self.keyring
        if keyring is None:
            return None

        def check(blob_key: str, header: TensorHeader, payload: memoryview, sig: bytes) -> None:
            data = _blob_statement(run_id, principal, blob_key, header, payload)
            keyring.verify(principal, data, sig)

        return check

    # ── stored bytes (heartbeats) ────────────────────────────────────────────────────────
    def seal(self, kind: str, *, run_id: str, where: str, data: bytes) -> bytes:
        """``data`` with this process's signature in front (unchanged without a key)."""
        if self._key is None or self.principal is None:
            return data
        sig = self._key.sign(
            statement(kind, run_id=run_id, principal=self.principal, where=where, body=data)
        )
        return _SEAL_MAGIC + sig + data

    @staticmethod
    def unsealed(data: bytes) -> tuple[bytes, bytes | None]:
        """``(data, signature)`` of sealed bytes; ``(data, None)`` for plain ones."""
        if data[:4] == _SEAL_MAGIC and len(data) >= 4 + SIG_BYTES:
            return data[4 + SIG_BYTES :], data[4 : 4 + SIG_BYTES]
        return data, None

    def check_sealed(
        self,
        kind: str,
        principal: str,
        *,
        run_id: str,
        where: str,
        data: bytes,
        signature: bytes | None,
    ) -> None:
        """Check what ``unsealed`` returned (nothing when not checking).

        Raises:
            Unauthenticated: Not sealed, or not by ``principal``.
        """
        if self.keyring is not None:
            body = statement(kind, run_id=run_id, principal=principal, where=where, body=data)
            self.keyring.verify(principal, body, signature)

    # ── loading ──────────────────────────────────────────────────────────────────────────
    @classmethod
    def load(cls, cfg: AuthConfig, run_id: str, principal: str | None) -> Auth:
        """This process's keys from ``cfg`` (``OPEN`` when ``keys_dir`` is unset).

        Args:
            cfg: The config's ``auth`` section.
            run_id: The run; the keyring must be of it.
            principal: Who this process signs as; None for a reader only (evaluator, export).

        Raises:
            ConfigError: A missing or foreign keyring, or (with a principal) no private key:
                the message says which file and how to make it.
        """
        if cfg.keys_dir is None:
            return OPEN
        ring_path = cfg.keys_dir / KEYRING_FILE
        try:
            keyring = KeyRing.from_json(ring_path.read_text(encoding="utf-8"), where=str(ring_path))
        except OSError as exc:
            raise ConfigError(
                f"auth.keys_dir: cannot read {ring_path} ({exc.strerror}); make it with "
                "ddq keys --out <dir>"
            ) from exc
        if keyring.run_id != run_id:
            raise ConfigError(
                f"auth.keys_dir: {ring_path} is the keyring of run {keyring.run_id!r}, not "
                f"{run_id!r}"
            )
        if principal is None:
            return cls(keyring=keyring)
        key_path = cfg.key_file or cfg.keys_dir / f"{principal}.key"
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except OSError as exc:
            raise ConfigError(
                f"auth: {principal} holds no key: cannot read {key_path} ({exc.strerror}); "
                f"provision it with ddq keys --out {cfg.keys_dir} (and copy only that file "
                "to the host that runs it)"
            ) from exc
        except ValueError as exc:
            raise ConfigError(f"auth: {key_path} is not a PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"auth: {key_path} is not an Ed25519 key")
        mine = key.public_key().public_bytes_raw()
        if keyring.keys.get(principal) != mine:
            raise ConfigError(
                f"auth: {key_path} is not the key {ring_path} names for {principal}; copy both "
                "from the same ddq keys run"
            )
        return cls(keyring=keyring, principal=principal, _key=key)


OPEN = Auth()
"""No keyring, no key: nothing signed, nothing checked."""


class Refusals:
    """Refused messages of one reader, counted by ``(kind, reason)``; reported in batches.

    ``add`` counts one and returns the counts to report when ``interval_s`` has passed since
    the last report (else an empty dict), so a flood of forgeries costs one event per pair
    and interval, not one per forgery; ``flush``, called on a reader's regular loop, returns
    what is still pending once the interval has passed.
    """

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.total: Counter[tuple[str, str]] = Counter()
        self._pending: Counter[tuple[str, str]] = Counter()
        self._next_s = float("-inf")

    def add(self, kind: str, reason: str, now_s: float) -> dict[tuple[str, str], int]:
        self.total[kind, reason] += 1
        self._pending[kind, reason] += 1
        if now_s < self._next_s:
            return {}
        return self.flush(now_s)

    def flush(self, now_s: float) -> dict[tuple[str, str], int]:
        """The pending counts, if the interval has passed and there are any (else empty)."""
        if now_s < self._next_s or not self._pending:
            return {}
        self._next_s = now_s + self.interval_s
        due, self._pending = dict(self._pending), Counter()
        return due


class FreshCommands:
    """Replay guard of signed fault commands: each ``fault_id`` once, and none older than
    ``max_age_s`` (a signed command copied back into a stream later is refused)."""

    def __init__(self, max_age_s: float, remember: int = 4096) -> None:
        self.max_age_s = max_age_s
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    def refusal(self, fault_id: str, issued_at_s: float, now_s: float) -> str | None:
        """Why the command is a replay, or None (then it is remembered)."""
        if fault_id in self._seen:
            return f"fault {fault_id!r} was received before (replayed)"
        age = now_s - issued_at_s
        if age > self.max_age_s:
            return f"fault {fault_id!r} was issued {age:.0f} s ago (> {self.max_age_s:g} s)"
        self._seen[fault_id] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return None


# ── provisioning (ddq keys) ──────────────────────────────────────────────────────────────


def write_keys(out: Path, run_id: str, principals: Sequence[str]) -> KeyRing:
    """Write ``out/keyring.json`` and ``out/<principal>.key`` (0600) for every principal.

    An existing key file is kept (re-running adds learners without changing anyone's key);
    the keyring is rewritten from all the key files there.
    """
    out.mkdir(parents=True, exist_ok=True)
    keys: dict[str, bytes] = {}
    for principal in principals:
        path = out / f"{principal}.key"
        if path.exists():
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ConfigError(f"{path} is not an Ed25519 key")
        else:
            key = Ed25519PrivateKey.generate()
            pem = key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
        keys[principal] = key.public_key().public_bytes_raw()
    for path in sorted(out.glob("*.key")):  # learners added by an earlier run stay members
        if path.stem not in keys:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if isinstance(key, Ed25519PrivateKey):
                keys[path.stem] = key.public_key().public_bytes_raw()
    ring = KeyRing(run_id=run_id, keys=keys)
    (out / KEYRING_FILE).write_text(ring.to_json() + "\n", encoding="utf-8")
    return ring


def principals(learner_ids: Sequence[str]) -> list[str]:
    """Every signer of a run: the synchronizer, the control plane and each learner."""
    for learner_id in learner_ids:
        check_name("learner_id", learner_id)
    return [SYNCHRONIZER, CONTROL, *(learner_principal(i) for i in learner_ids)]


def _cmd_keys(args: argparse.Namespace) -> int:
    from dd_queue.config import load_config

    cfg = load_config(args.config, os.environ)
    if args.learner_ids:
        ids = [i for i in args.learner_ids.split(",") if i]
    else:
        n = args.learners if args.learners is not None else cfg.membership.expected_learners
        if n < 1:
            sys.stderr.write(f"ddq keys: error: --learners must be >= 1, got {n}\n")
            return 2
        ids = [f"L{i}" for i in range(n)]
    try:
        ring = write_keys(args.out, cfg.run.run_id, principals(ids))
    except ConfigError as exc:
        sys.stderr.write(f"ddq keys: error: {exc}\n")
        return 2
    rows = [{"principal": p, "key_file": str(args.out / f"{p}.key")} for p in sorted(ring.keys)]
    for row in rows:
        sys.stdout.write(f"{row['principal']:<24} {row['key_file']}\n")
    sys.stdout.write(
        f"wrote {args.out / KEYRING_FILE} ({len(ring.keys)} keys of run {ring.run_id!r}): every "
        f"host gets the keyring, each host only its own .key; set DDQ__AUTH__KEYS_DIR=<dir>\n"
    )
    if args.json:
        sys.stdout.write(
            json.dumps(
                {"keyring": str(args.out / KEYRING_FILE), "run_id": ring.run_id, "keys": rows}
            )
            + "\n"
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from dd_queue.config import CONFIG_HELP

    p = sub.add_parser("keys", help="make the run's signing keys (one per learner and role)")
    p.add_argument("--config", default="base", help=CONFIG_HELP)
    p.add_argument("--out", type=Path, required=True, help="directory for keyring.json and keys")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--learners", type=int, help="learners L0..L{n-1} (default: expected_learners)"
    )
    group.add_argument("--learner-ids", help="comma-separated learner ids instead of L0..")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.set_defaults(func=_cmd_keys)
