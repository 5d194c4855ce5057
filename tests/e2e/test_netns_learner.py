"""A learner on another host: its own Linux network namespace, joined by a veth pair, with its
own address and no route to the host's loopback. It reaches the run only over the veth, with
TLS (a certificate of the run's CA), its own Redis ACL user and its own signing key, as a
learner on another machine would. It contributes, is killed (kill -9), restarts, and contributes
again.

Needs root and iproute2 (``ip netns``); without them it skips with the reason, and fails under
CI, which runs as root.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dd_queue.auth import principals, write_keys
from tests.ci import require
from tests.e2e.services_support import DDQ, ROOT, Services
from tests.integration.conftest import require_redis_server
from tests.netns import NetNamespace, netns_available
from tests.redisproc import Pki, RedisProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

RUN = "netns"


@pytest.fixture
def netns() -> Iterator[NetNamespace]:
    require(
        netns_available(), "root and iproute2 (ip netns)", "run as root; apt-get install iproute2"
    )
    with NetNamespace.create() as ns:
        yield ns


def _reachable(ns: NetNamespace, host: str, port: int) -> bool:
    probe = (
        "import socket,sys\n"
        f"try: socket.create_connection(({host!r}, {port}), 2).close()\n"
        "except OSError: sys.exit(1)\n"
    )
    return subprocess.run([*ns.wrap, sys.executable, "-c", probe], timeout=30).returncode == 0


def test_a_learner_in_its_own_network_namespace_joins_over_tls_and_survives_a_kill(
    tmp_path: Path, netns: NetNamespace
) -> None:
    require_redis_server()
    pki = Pki.make(tmp_path / "pki", hosts=(netns.outside,))
    acl = tmp_path / "acl"
    subprocess.run(
        [DDQ, "acl", "--config", "test", "--out", str(acl), "--learners", "1", "--prefix", RUN],
        cwd=ROOT, check=True, capture_output=True,
        env={"DDQ__RUN__RUN_ID": RUN, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    keys = tmp_path / "keys"
    write_keys(keys, RUN, principals(["L0"]))

    def password(role: str) -> str:
        return str(acl / f"{RUN}-{role}.password")

    admin = (f"{RUN}-admin", (acl / f"{RUN}-admin.password").read_text().strip())
    binds = ("--bind", f"127.0.0.1 {netns.outside}")
    extra = ("--aclfile", str(acl / "users.acl"), *binds)
    with RedisProcess(tls=pki, login=admin, extra_args=extra) as server:
        # From inside, the host is only its veth address: 127.0.0.1 is the namespace's own.
        assert _reachable(netns, netns.outside, server.port)
        assert not _reachable(netns, "127.0.0.1", server.port)
        services = Services(tmp_path, server.url, run_id=RUN)
        services.env.update(
            DDQ__REDIS__TLS_CA_FILE=str(pki.ca_file),
            DDQ__REDIS__TLS_CERT_FILE=str(pki.client_cert),
            DDQ__REDIS__TLS_KEY_FILE=str(pki.client_key),
            DDQ__AUTH__KEYS_DIR=str(keys),
        )

        def login(role: str, host: str = "127.0.0.1") -> dict[str, str]:
            return {
                "DDQ__REDIS__URL": f"rediss://{RUN}-{role}@{host}:{server.port}/0",
                "DDQ__REDIS__PASSWORD_FILE": password(role),
            }

        far = login("learner-L0", netns.outside)
        try:
            for role in ("synchronizer", "evaluator", "control"):
                services.start(role, env=login(role))
            services.start("learner", "L0", env=far, wrap=netns.wrap)
            services.wait_for(services.merging, 240, "rounds merged with the far learner's work")
            first = services.http.get("/api/learners").json()[0]
            assert first["learner_id"] == "L0"

            services.procs["L0"].kill()  # kill -9 (ip netns exec execs the learner itself)
            services.procs["L0"].wait()
            services.start("learner", "L0", env=far, wrap=netns.wrap)
            restarted = services.procs["L0"].pid

            def merged_again() -> bool:
                (now,) = services.http.get("/api/learners").json()
                return bool(
                    now["pid"] == restarted
                    and now["contributions"]["merged"] > first["contributions"]["merged"] + 2
                )

            services.wait_for(merged_again, 240, "the restarted far learner merging again")
        finally:
            services.close()
        log = services.log("L0")
    assert services.exit_codes["synchronizer"] == 0 and services.exit_codes["control"] == 0
    assert services.exit_codes["L0"] == 0, log[-3000:]
    assert log.count("learner.joined") == 2, log[-3000:]  # joined, killed, joined again
