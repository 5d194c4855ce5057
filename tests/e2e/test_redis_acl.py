"""Redis ACL users per role (``ddq acl``) on a real redis-server started with the aclfile.

A whole run with one user per role (synchronizer, learner L0, evaluator, control plane), each
a real ``ddq`` process logging in with its own password file: rounds merge with L0's
contributions and the evaluator reports, and the server's ``ACL LOG`` shows not one refusal
(the rules cover everything the roles do). Then the learner's user tries every write it must not
make, by hand and from a Lua script, and each one is refused with ``NOPERM``; a client that does
not log in gets ``NOAUTH``. The same run on a Redis Cluster whose every node loads the aclfile
(replicas log in as the admin): no node refuses anything either.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from dd_queue.keys import Keys
from tests.ci import require
from tests.e2e.services_support import DDQ, ROOT, Services
from tests.integration.conftest import require_redis_server
from tests.rediscluster import LocalCluster, redis_cli_path
from tests.redisproc import RedisProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RUN = "acl"


@pytest.fixture
def acl_dir(tmp_path: Path) -> Path:
    out = tmp_path / "acl"
    done = subprocess.run(
        [DDQ, "acl", "--config", "test", "--out", str(out), "--learners", "2", "--prefix", RUN,
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"DDQ__RUN__RUN_ID": RUN, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def acl_redis(acl_dir: Path) -> Iterator[RedisProcess]:
    require_redis_server()
    admin = _login("admin", acl_dir)  # the default user is off
    login = (admin["username"], admin["password"])
    with RedisProcess(extra_args=("--aclfile", str(acl_dir / "users.acl")), login=login) as server:
        yield server


def _login(role: str, acl_dir: Path) -> dict[str, str]:
    user = f"{RUN}-{role}"
    return {"username": user, "password": (acl_dir / f"{user}.password").read_text().strip()}


def _env(role: str, server: RedisProcess, acl_dir: Path) -> dict[str, str]:
    user = f"{RUN}-{role}"
    return {
        "DDQ__REDIS__URL": f"redis://{user}@127.0.0.1:{server.port}/0",
        "DDQ__REDIS__PASSWORD_FILE": str(acl_dir / f"{user}.password"),
    }


def test_a_run_with_one_user_per_role_and_no_refusal(
    tmp_path: Path, acl_dir: Path, acl_redis: RedisProcess
) -> None:
    services = Services(tmp_path, acl_redis.url, run_id=RUN)
    admin = acl_redis.client()
    try:
        admin.execute_command("ACL", "LOG", "RESET")
        services.start("synchronizer", env=_env("synchronizer", acl_redis, acl_dir))
        services.start("learner", "L0", env=_env("learner-L0", acl_redis, acl_dir))
        services.start("evaluator", env=_env("evaluator", acl_redis, acl_dir))
        services.start("control", env=_env("control", acl_redis, acl_dir))
        services.wait_for(services.merging, 180, "rounds merged with L0 and an eval, per-role")
        refusals = admin.execute_command("ACL", "LOG")
    finally:
        services.close()
        admin.close()
    assert refusals == [], refusals
    assert services.exit_codes == dict.fromkeys(("synchronizer", "L0", "evaluator", "control"), 0)


def test_a_run_on_a_cluster_with_one_user_per_role_and_no_refusal(
    tmp_path: Path, acl_dir: Path
) -> None:
    require_redis_server()
    require(redis_cli_path(), "redis-cli", "apt-get install redis-tools")
    admin = _login("admin", acl_dir)
    login = (admin["username"], admin["password"])
    with LocalCluster(aclfile=acl_dir / "users.acl", login=login) as cluster:
        services = Services(tmp_path, cluster.url, run_id=RUN)

        def env(role: str) -> dict[str, str]:
            user = f"{RUN}-{role}"
            return {
                "DDQ__REDIS__URL": cluster.url.replace("//", f"//{user}@", 1),
                "DDQ__REDIS__PASSWORD_FILE": str(acl_dir / f"{user}.password"),
            }

        for node in cluster.nodes:
            client = cluster.client(node.port)
            client.execute_command("ACL", "LOG", "RESET")
            client.close()
        try:
            services.start("synchronizer", env=env("synchronizer"))
            services.start("learner", "L0", env=env("learner-L0"))
            services.start("evaluator", env=env("evaluator"))
            services.start("control", env=env("control"))
            services.wait_for(services.merging, 180, "rounds merged on the cluster, per-role")
            refusals = {}
            for node in cluster.nodes:
                client = cluster.client(node.port)
                refusals[node.port] = client.execute_command("ACL", "LOG")
                client.close()
        finally:
            services.close()
    assert all(log == [] for log in refusals.values()), refusals
    assert services.exit_codes == dict.fromkeys(("synchronizer", "L0", "evaluator", "control"), 0)


def test_the_learner_user_is_refused_every_forbidden_write(
    acl_dir: Path, acl_redis: RedisProcess
) -> None:
    keys = Keys(RUN)
    learner = redis.Redis(host="127.0.0.1", port=acl_redis.port, **_login("learner-L0", acl_dir))
    forbidden = {
        "overwrite a global fragment": lambda: learner.set(keys.global_blob(0, 7, 1), b"x"),
        "write a momentum blob": lambda: learner.set(keys.momentum_blob(0, 7, 1), b"x"),
        "write fragment state": lambda: learner.set(keys.state(0), b"x"),
        "take a lease": lambda: learner.set(keys.lease(0), b"1:n:L0", nx=True, px=5000),
        "forge a version notice": lambda: learner.xadd(keys.down(0), {"v": 9}),
        "send a fault to everyone": lambda: learner.xadd(keys.control("all"), {"kind": "kill"}),
        "send a fault to a learner": lambda: learner.xadd(keys.control("L1"), {"kind": "kill"}),
        "send a fault to the synchronizer": lambda: learner.xadd(
            keys.control("synchronizer"), {"kind": "kill"}
        ),
        "write another learner's payload": lambda: learner.set(keys.up_blob(0, 3, "L1"), b"x"),
        "append a round record": lambda: learner.xadd(keys.rounds(0), {"r": 1}),
        "read the momentum": lambda: learner.get(keys.momentum_blob(0, 0, 1)),
        "flush the server": lambda: learner.flushall(),
        "take a lease from a script": lambda: learner.eval(
            "return redis.call('SET', KEYS[1], ARGV[1])", 1, keys.lease(0), "1:n:L0"
        ),
        "reconfigure the server": lambda: learner.config_set("appendonly", "no"),
    }
    refused = {}
    for what, attempt in forbidden.items():
        with pytest.raises(redis.ResponseError) as caught:
            attempt()
            pytest.fail(f"the learner user could {what}")
        refused[what] = str(caught.value)
    assert all("NOPERM" in m or "no permissions" in m for m in refused.values()), refused
    # What it may do, it can: its own payload, a contribution entry, a global read.
    assert learner.set(keys.up_blob(0, 3, "L0"), b"x", px=5000)
    assert learner.xadd(keys.up(0), {"m": b"x"})
    assert learner.get(keys.global_blob(0, 0, 1)) is None
    learner.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=acl_redis.port).set("k", "v")
