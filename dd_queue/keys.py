"""Every Redis key, stream and group name of dd_queue, built in this one module.

All keys start with ``ddq:<run_id>:``. Keys of one fragment carry a Redis Cluster hash tag naming
the fragment, ``{<run_id>.f<k>}``, so they share one slot: a round's fenced commit (one Lua
script) and the dead-letter move touch only those keys and stay single-shard on a Cluster. Only
the first ``{...}`` of a key counts as its tag, so the run id alone is never braced (that would
put a whole run on one shard). Run-wide keys that a script writes together (heartbeats) share the
tag ``{<run_id>.hb…}``.

The run-wide streams are placed away from fragment 0: the heartbeats (tag ``{R.hb}``, or
``{R.hb<n>}``) and the round openings (``ddq:R:open``, or ``ddq:R:{R.op<n>}:open``) hash to the
third of the slots after fragment 0's, the events (``ddq:R:events``, or
``ddq:R:{R.ev<n>}:events``) to the third after that, with the smallest ``n`` that lands there
(the plain name where it already does). On a cluster of 3 masters (an even split), a third is a
master, so fragment 0's master never carries them all. ``ddq slots`` shows where each lands.

Key table (``R`` = run id, ``k`` = fragment id, ``F`` = ``ddq:R:{R.fk}:``):

=====================================  ======  =================  ==================================
key                                    type    written by         content
=====================================  ======  =================  ==================================
``F up``                               stream  learners           one small entry per contribution
                                                                  (metadata + blob reference);
                                                                  read by group ``synchronizers``
``F blob:up:<round>:<learner>``        string  learners           contribution payload, chunk 0
                                                                  (``SET … PX``)
``<blob key>:c<i>``                    string  blob writer        payload chunk ``i ≥ 1`` (same tag)
``F global:<version>:t<token>``        string  synchronizer       global fragment Θ_p at a version;
                                                                  the lease token in the name makes
                                                                  a stale holder's staging harmless
``F momentum:<version>:t<token>``      string  synchronizer       outer Nesterov momentum
``F state``                            string  synchronizer       current version + blob refs,
                                                                  written only by a fenced commit
``F down``                             stream  synchronizer       one entry per global version
                                                                  (broadcast; read with ``XREAD``)
``F rounds``                           stream  synchronizer       round records, in the commit
``F dlq``                              stream  synchronizer       dead-lettered contributions
``F lease``                            string  synchronizer       ``<token>:<nonce>:<owner>`` with
                                                                  ``PX``; the nonce is new on every
                                                                  acquisition
``F lease:fence``                      string  lease acquire      last fencing token handed out
``F lease:commit:<commit id>``         string  fenced commit      result of a commit, for replay
                                                                  of a retried one (``PX``)
``ddq:R:{R.hb…}:seen``                 zset    every process      member → last beat (server ms)
``ddq:R:{R.hb…}:expiry``               zset    every process      member → expiry (server ms)
``ddq:R:{R.hb…}:data``                 hash    every process      member → heartbeat payload
``ddq:R:control:<target>``             stream  control plane      fault / operator commands
``ddq:R:[{R.ev<n>}:]events``           stream  everyone           dashboard event log
``ddq:R:[{R.op<n>}:]open``             stream  synchronizer       round openings (learners follow)
=====================================  ======  =================  ==================================

Group name: ``synchronizers`` (:data:`SYNC_GROUP`) on every ``up`` stream.

Identifiers that become part of a key (run id, learner id, command target, heartbeat member) must
match ``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}``: no braces (they would move the hash tag), no colons
(they separate key parts). A commit id is the last part of its key, so it may also hold colons
(``"<fragment>:<version>"``): ``[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}``.

Fencing tokens are at least the server's clock in microseconds when the lease is taken (and above
the last token of the ``fence`` key), so they keep growing across a Redis restart that lost the
counter, as long as the server's clock does not step back.
"""

from __future__ import annotations

import re

from redis.crc import key_slot

from dd_queue.errors import ConfigError

SYNC_GROUP = "synchronizers"
"""Consumer group of the synchronizers on every fragment's ``up`` stream."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_COMMIT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_FENCED_BLOB = re.compile(r"(?:global|momentum):[0-9]+:t[0-9]+")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is safe inside a key, else raise.

    Args:
        kind: What the value names, for the message (``"run_id"``, ``"learner_id"``).
        value: The identifier.

    Returns:
        ``value`` unchanged.

    Raises:
        ConfigError: ``value`` is not 1-64 of letters, digits, ``_ . -``.
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(
            f"{kind} {value!r} must be 1-64 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit (no braces or colons: it becomes part of Redis keys)"
        )
    return value


def _check_int(kind: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{kind} must be a non-negative integer, got {value!r}")
    return value


def blob_chunk_key(blob_key: str, index: int) -> str:
    """Key of chunk ``index`` of a blob; chunk 0 is the blob key itself.

    Chunk keys extend the blob key, so they keep its hash tag (same Cluster slot).

    Args:
        blob_key: The blob's key (chunk 0).
        index: Chunk number, ``>= 0``.
    """
    return blob_key if _check_int("chunk index", index) == 0 else f"{blob_key}:c{index}"


def fence_key(lease_key: str) -> str:
    """Key of the fencing-token counter that belongs to a lease key (same hash tag)."""
    return f"{lease_key}:fence"


def check_commit_id(commit_id: str) -> str:
    """Return ``commit_id`` if it can name a commit marker key, else raise.

    Raises:
        ConfigError: not 1-128 of letters, digits, ``_ . : -`` starting with a letter or digit.
    """
    if not isinstance(commit_id, str) or not _COMMIT_ID.fullmatch(commit_id):
        raise ConfigError(
            f"commit_id {commit_id!r} must be 1-128 characters of letters, digits, '_', '.', "
            "':', '-', starting with a letter or digit (e.g. f'{fragment}:{version}')"
        )
    return commit_id


def commit_marker_key(lease_key: str, commit_id: str) -> str:
    """Key that remembers the result of commit ``commit_id`` under a lease (same hash tag)."""
    return f"{lease_key}:commit:{check_commit_id(commit_id)}"


def hash_tag(key: str) -> str | None:
    """The Redis Cluster hash tag of ``key`` (text inside the first non-empty ``{...}``)."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


class Keys:
    """Builds the keys of one run. See the module docstring for the table.

    Args:
        run_id: The run's namespace; validated by :func:`check_name`.

    Raises:
        ConfigError: ``run_id`` is not a safe identifier.
    """

    __slots__ = ("_events", "_hb_tag", "_open", "prefix", "run_id")

    def __init__(self, run_id: str) -> None:
        self.run_id = check_name("run_id", run_id)
        self.prefix = f"ddq:{run_id}:"
        # The run-wide streams, placed away from fragment 0's third of the slots (see
        # _spread): heartbeats and openings in the next third, events in the one after.
        home = _third(self.fragment_tag(0))
        self._hb_tag = _spread(
            ["{" + f"{run_id}.hb{n or ''}" + "}" for n in range(_TRIES)], (home + 1) % 3
        )
        self._events = _spread(
            [f"{self.prefix}events"]
            + [f"{self.prefix}" + "{" + f"{run_id}.ev{n}" + "}:events" for n in range(1, _TRIES)],
            (home + 2) % 3,
        )
        self._open = _spread(
            [f"{self.prefix}open"]
            + [f"{self.prefix}" + "{" + f"{run_id}.op{n}" + "}:open" for n in range(1, _TRIES)],
            (home + 1) % 3,
        )

    def __repr__(self) -> str:
        return f"Keys({self.run_id!r})"

    def is_blob_key(self, key: str) -> bool:
        """Whether ``key`` is a blob key of this run: a fragment's ``blob:…`` key, or a staged
        ``global:<v>:t<token>`` / ``momentum:<v>:t<token>`` key. Readers check a reference
        taken from a stream entry with this before they read or delete anything."""
        head = f"{self.prefix}" + "{" + f"{self.run_id}.f"
        if not key.startswith(head):
            return False
        fragment, sep, rest = key[len(head) :].partition("}:")
        if not (sep and fragment.isdecimal() and fragment.isascii()) or "{" in rest:
            return False
        if rest.startswith("blob:"):
            return len(rest) > len("blob:") and "}" not in rest
        return _FENCED_BLOB.fullmatch(rest) is not None

    # ── per fragment (hash tag {<run>.f<k>}) ────────────────────────────────────────────────
    def fragment_tag(self, fragment_id: int) -> str:
        """``{<run>.f<k>}``: the Cluster hash tag shared by every key of one fragment."""
        return "{" + f"{self.run_id}.f{_check_int('fragment_id', fragment_id)}" + "}"

    def _fragment(self, fragment_id: int, suffix: str) -> str:
        return f"{self.prefix}{self.fragment_tag(fragment_id)}:{suffix}"

    def up(self, fragment_id: int) -> str:
        """Contribution stream of a fragment (read by group :data:`SYNC_GROUP`)."""
        return self._fragment(fragment_id, "up")

    def up_blob(self, fragment_id: int, round_id: int, learner_id: str) -> str:
        """Payload blob of one contribution (chunk 0; see :func:`blob_chunk_key`)."""
        round_id = _check_int("round_id", round_id)
        return self._fragment(
            fragment_id, f"blob:up:{round_id}:{check_name('learner_id', learner_id)}"
        )

    def global_blob(self, fragment_id: int, version: int, token: int) -> str:
        """Global fragment Θ_p at ``version``, staged by the lease holder with fencing ``token``."""
        version, token = _check_int("version", version), _check_int("token", token)
        return self._fragment(fragment_id, f"global:{version}:t{token}")

    def momentum_blob(self, fragment_id: int, version: int, token: int) -> str:
        """Outer momentum after ``version``, staged by the holder of fencing ``token``."""
        version, token = _check_int("version", version), _check_int("token", token)
        return self._fragment(fragment_id, f"momentum:{version}:t{token}")

    def state(self, fragment_id: int) -> str:
        """Synchronizer state of a fragment (version + blob refs), written by fenced commits."""
        return self._fragment(fragment_id, "state")

    def down(self, fragment_id: int) -> str:
        """Global-version notification stream of a fragment (broadcast reads)."""
        return self._fragment(fragment_id, "down")

    def rounds(self, fragment_id: int) -> str:
        """Round-record stream of a fragment (appended inside the round's commit)."""
        return self._fragment(fragment_id, "rounds")

    def dlq(self, fragment_id: int) -> str:
        """Dead-letter stream of a fragment's contributions."""
        return self._fragment(fragment_id, "dlq")

    def takes(self, fragment_id: int) -> str:
        """Pending entry id → how many takes of the fragment found it pending (poison pills)."""
        return self._fragment(fragment_id, "takes")

    def lease(self, fragment_id: int) -> str:
        """Lease key of a fragment; its fencing counter is :func:`fence_key` of it."""
        return self._fragment(fragment_id, "lease")

    # ── run-wide ────────────────────────────────────────────────────────────────────────────
    def _heartbeat(self, suffix: str) -> str:
        return f"{self.prefix}{self._hb_tag}:{suffix}"

    def heartbeat_pattern(self) -> str:
        """Glob of every heartbeat key (for ACL key patterns)."""
        return self._heartbeat("*")

    def heartbeat_seen(self) -> str:
        """Sorted set: member → server time of its last heartbeat (ms)."""
        return self._heartbeat("seen")

    def heartbeat_expiry(self) -> str:
        """Sorted set: member → server time its heartbeat expires (ms)."""
        return self._heartbeat("expiry")

    def heartbeat_data(self) -> str:
        """Hash: member → payload of its last heartbeat."""
        return self._heartbeat("data")

    def control(self, target: str) -> str:
        """Command stream of one target (a learner id, ``synchronizer``, ``all``)."""
        return f"{self.prefix}control:{check_name('target', target)}"

    def events(self) -> str:
        """Run-wide event stream shown on the dashboard."""
        return self._events

    def opened_rounds(self) -> str:
        """Run-wide stream of round openings ``{fragment_id, round_id, opened_at_s}``."""
        return self._open

    def counts(self, name: str) -> str:
        """Run-wide hash of counters kept across restarts: ``faults`` (sent, by kind),
        ``refused`` (messages refused, by ``reader|kind|reason``), ``tokens`` (the learners' token
        counts, by ``learner|kind``)."""
        return f"{self.prefix}counts:{check_name('counts name', name)}"


_TRIES = 64
_SLOTS = 16384


def _third(key: str) -> int:
    """Which third of the Cluster's slots ``key`` hashes to (0, 1 or 2)."""
    return key_slot(key.encode()) * 3 // _SLOTS


def _spread(candidates: list[str], third: int) -> str:
    """The first candidate name that hashes to ``third`` (the first one when none does).

    A cluster made by ``redis-cli --cluster create`` with 3 masters (or 3 × n) splits the slots
    evenly, so a third is a master: the run-wide streams then never share fragment 0's
    master. The first candidate is the name the key had before it was placed, kept where it
    already fits; on other splits the names still spread like any hash.
    """
    return next((c for c in candidates if _third(c) == third), candidates[0])


def names_fencing_token(key: str) -> bool:
    """Whether ``key`` is a staged blob named after a fencing token (``global:<v>:t<token>``,
    ``momentum:<v>:t<token>``): such keys are written only if absent (``SET NX``)."""
    return _FENCED_BLOB.fullmatch(key.rpartition("}:")[2]) is not None


__all__ = [
    "SYNC_GROUP",
    "Keys",
    "blob_chunk_key",
    "check_commit_id",
    "check_name",
    "commit_marker_key",
    "fence_key",
    "hash_tag",
    "names_fencing_token",
]
