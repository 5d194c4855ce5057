"""The README's "Run the services separately" commands work in the order written and in any
other: learner first, evaluator first, control plane first. Whatever started early waits (and
says so in its log) instead of exiting; every order converges to a run whose rounds merge with
the learner's contributions and whose evaluator reports; a SIGTERM then stops each service with
exit code 0."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.services_support import Services
from tests.integration.conftest import require_redis_server
from tests.redisproc import RedisProcess

pytestmark = pytest.mark.timeout(400)

ORDERS = {
    "as-written": ("synchronizer", "learner", "evaluator", "control"),
    "learner-first": ("learner", "control", "evaluator", "synchronizer"),
    "evaluator-first": ("evaluator", "learner", "synchronizer", "control"),
    "control-first": ("control", "learner", "evaluator", "synchronizer"),
}
UP = {
    "synchronizer": r"synchronizer\.started",
    "learner": r"learner\.config digest",
    "evaluator": r"evaluator\.(waiting|ready)|eval\.done",
    "control": r"Uvicorn running",
}
WAITED = {
    "learner": r"learner\.waiting_for_globals 0/2 fragments published",
    "evaluator": r"evaluator\.waiting for run 'order' to be created",
}


@pytest.mark.parametrize("order", list(ORDERS), ids=list(ORDERS))
def test_every_start_order_converges_to_a_merging_run(tmp_path: Path, order: str) -> None:
    require_redis_server()
    roles = ORDERS[order]
    with RedisProcess() as server:
        services = Services(tmp_path, server.url)
        try:
            for role in roles:
                name = services.start(role)
                services.wait_log(name, UP[role], 120)
            services.wait_for(services.merging, 180, "a merging run with an evaluation")
            before_sync = roles[: roles.index("synchronizer")]
            for role in before_sync:
                if role in WAITED:  # it started before the run existed: it waited, said so
                    name = "L0" if role == "learner" else role
                    assert re.search(WAITED[role], services.log(name)), role
        finally:
            services.close()
    assert services.exit_codes == dict.fromkeys(["synchronizer", "L0", "evaluator", "control"], 0)
