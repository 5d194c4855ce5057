"""The ACL rules of ``ddq acl`` as data: which keys each role may read or write, matched the way
Redis matches key patterns (glob; ``{`` is a plain character), without a server. The real server
check is ``tests/e2e/test_redis_acl.py``."""

from __future__ import annotations

import stat
from fnmatch import fnmatchcase

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.acl import EXPLAINED, aclfile, password_hash, roles, write_users
from dd_queue.cli import main as ddq_main
from dd_queue.errors import ConfigError
from dd_queue.keys import Keys, blob_chunk_key

RUN = "r1"
KEYS = Keys(RUN)


def _may(role_name: str, key: str, mode: str) -> bool:
    """Whether the user of ``role_name`` may ``mode`` ("R" or "W") ``key``."""
    (role,) = [r for r in roles(RUN, ["L0", "L1"]) if r.user == f"{RUN}-{role_name}"]
    for rule in role.keys:
        if rule.startswith("%"):
            modes, _, pattern = rule[1:].partition("~")
        else:
            modes, pattern = "RW", rule.removeprefix("~")
        if mode in modes and fnmatchcase(key, pattern):
            return True
    return False


ids = st.integers(0, 10**6)


@given(fragment=st.integers(0, 63), round_id=ids, version=ids, token=ids, chunk=st.integers(0, 9))
def test_a_learner_writes_only_its_own_payloads_and_contributions(
    fragment, round_id, version, token, chunk
):
    own = blob_chunk_key(KEYS.up_blob(fragment, round_id, "L0"), chunk)
    assert _may("learner-L0", own, "W") and _may("learner-L0", own, "R")
    assert _may("learner-L0", KEYS.up(fragment), "W")
    assert _may("learner-L0", KEYS.global_blob(fragment, version, token), "R")
    other = blob_chunk_key(KEYS.up_blob(fragment, round_id, "L1"), chunk)
    never = [
        other,
        KEYS.global_blob(fragment, version, token),
        KEYS.momentum_blob(fragment, version, token),
        KEYS.state(fragment),
        KEYS.lease(fragment),
        KEYS.lease(fragment) + ":fence",
        KEYS.down(fragment),
        KEYS.rounds(fragment),
        KEYS.dlq(fragment),
        KEYS.control("all"),
        KEYS.control("L0"),
        KEYS.control("synchronizer"),
        KEYS.opened_rounds(),
        Keys("r10").up(fragment),  # another run whose id extends this one
    ]
    assert [k for k in never if _may("learner-L0", k, "W")] == []
    assert not _may("learner-L0", KEYS.momentum_blob(fragment, version, token), "R")
    assert not _may("learner-L0", KEYS.control("L1"), "R")


@given(fragment=st.integers(0, 63), version=ids, token=ids)
def test_the_synchronizer_owns_fragments_and_the_control_plane_owns_commands(
    fragment, version, token
):
    for key in (KEYS.state(fragment), KEYS.lease(fragment), KEYS.dlq(fragment),
                KEYS.global_blob(fragment, version, token), KEYS.opened_rounds()):  # fmt: skip
        assert _may("synchronizer", key, "W")
        assert not _may("control", key, "W") and _may("control", key, "R")
        assert not _may("evaluator", key, "W")
    assert _may("control", KEYS.control("L3"), "W") and not _may(
        "synchronizer", KEYS.control("all"), "W"
    )
    assert _may("evaluator", KEYS.events(), "W") and _may("evaluator", KEYS.down(fragment), "R")
    assert not _may("evaluator", KEYS.up(fragment), "W")
    assert not _may("synchronizer", Keys("other").state(fragment), "R")


def test_the_aclfile_turns_the_default_user_off_and_holds_no_password(tmp_path):
    users = roles(RUN, ["L0"])
    passwords = {r.user: f"pw-{r.user}-0123456789" for r in users}
    text = aclfile(users, passwords)
    assert text.splitlines()[0] == "user default off"
    assert all(p not in text for p in passwords.values())
    assert all(password_hash(p) in text for p in passwords.values())
    for role in users:  # keyless writes (FLUSHALL, CONFIG) only for admin: commands are listed
        line = next(x for x in text.splitlines() if x.startswith(f"user {role.user} "))
        assert "-@all" in line and ("+@all" in line) == (role.role == "admin")


def test_write_users_keeps_existing_passwords_and_private_files(tmp_path):
    users = roles(RUN, ["L0", "L1"])
    first = write_users(tmp_path, users)
    before = {u: p.read_text() for u, p in first.items()}
    again = write_users(tmp_path, users)
    assert {u: p.read_text() for u, p in again.items()} == before
    for path in [*again.values(), tmp_path / "users.acl"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    explained = (tmp_path / EXPLAINED).read_text()
    assert all(f"## {r.user} ({r.role})" in explained for r in users)
    assert all(g.reason in explained for r in users for g in r.grants)


def test_bad_names_and_counts_are_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="learner_id 'L:0'"):
        roles(RUN, ["L:0"])
    assert ddq_main(["acl", "--config", "test", "--out", str(tmp_path), "--learners", "0"]) == 2
    assert "--learners must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "users.acl").exists()
