"""A run over ``rediss://``: a private redis-server that serves TLS only and checks client
certificates (``tls-auth-clients yes``), certificates made by the test (a throwaway CA from
``trustme``), and every service as a real ``ddq`` process configured through ``redis.tls_*``.

Rounds merge with the learner's contributions and the evaluator reports, all over TLS; every
service exits 0 on SIGTERM. A plain-TCP client, a TLS client without a certificate and a TLS
client that does not trust the server's CA are all refused, and ``ddq wait`` says "TLS ...
failed" at once (exit 3) instead of waiting for a server that is up.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.e2e.services_support import DDQ, ROOT, Services
from tests.integration.conftest import require_redis_server
from tests.redisproc import Pki, RedisProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki.make(tmp_path / "pki")


@pytest.fixture
def tls_redis(pki: Pki) -> Iterator[RedisProcess]:
    require_redis_server()
    with RedisProcess(tls=pki) as server:
        yield server


def _tls_env(pki: Pki) -> dict[str, str]:
    return {
        "DDQ__REDIS__TLS_CA_FILE": str(pki.ca_file),
        "DDQ__REDIS__TLS_CERT_FILE": str(pki.client_cert),
        "DDQ__REDIS__TLS_KEY_FILE": str(pki.client_key),
    }


def test_a_run_over_tls_merges_rounds(tmp_path: Path, pki: Pki, tls_redis: RedisProcess) -> None:
    assert tls_redis.url.startswith("rediss://")
    services = Services(tmp_path, tls_redis.url, run_id="tls")
    services.env.update(_tls_env(pki))
    try:
        for role in ("synchronizer", "learner", "evaluator", "control"):
            services.start(role)
        services.wait_for(services.merging, 180, "rounds merged with L0 over TLS, and an eval")
    finally:
        services.close()
    assert services.exit_codes == dict.fromkeys(("synchronizer", "L0", "evaluator", "control"), 0)
    client = tls_redis.client()
    try:  # the server saw only TLS clients: its one port is the TLS port
        assert int(client.config_get("port")["port"]) == 0
        assert int(client.config_get("tls-port")["tls-port"]) == tls_redis.port
    finally:
        client.close()


def test_clients_without_tls_or_a_trusted_certificate_are_refused(
    pki: Pki, tls_redis: RedisProcess, tmp_path: Path
) -> None:
    attempts = {
        "plain TCP": {},
        "TLS without a client certificate": {"ssl": True, "ssl_ca_certs": str(pki.ca_file)},
        "TLS not trusting the server's CA": {
            "ssl": True,
            "ssl_certfile": str(pki.client_cert),
            "ssl_keyfile": str(pki.client_key),
        },
    }
    for what, kwargs in attempts.items():
        client = redis.Redis(host="127.0.0.1", port=tls_redis.port, socket_timeout=5, **kwargs)
        with pytest.raises(redis.ConnectionError):
            client.ping()
            pytest.fail(f"{what} was let in")
        client.close()
    assert tls_redis.client().ping()  # the server is up: the refusals were its doing

    env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    env.update(DDQ__REDIS__URL=tls_redis.url, DDQ__REDIS__TLS_CA_FILE=str(pki.ca_file))
    # No client certificate: the server refuses the handshake; waiting would not help.
    done = subprocess.run(
        [DDQ, "wait", "--config", "test", "--for", "redis", "--timeout-s", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "TLS to Redis at rediss://127.0.0.1" in done.stdout + done.stderr, done.stdout
    env.update(_tls_env(pki))
    done = subprocess.run(
        [DDQ, "wait", "--config", "test", "--for", "redis", "--timeout-s", "10"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
