"""``ddq up --duration 90 --learners 3 --track tensorboard,wandb --json`` as a user runs it:
the demo learns, and its curves are in TensorBoard and W&B.

The summary (last stdout line, JSON) must show merged rounds, a held-out loss that fell and a
merged contribution from every learner. Every process's TensorBoard event files and W&B offline
run, read back, hold its scalars and the run's config and digests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import import_or_require
from tests.e2e.test_dashboard import chromium_path
from tests.integration.conftest import require_redis_server
from tests.tracking_support import tb_hparams, tb_scalars, wandb_run, wandb_run_files

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_ddq_up_demo_learns(tmp_path: Path) -> None:
    require_redis_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "dd_queue.cli", "up",
            "--duration", "90", "--learners", "3", "--json", "--runs-dir", str(tmp_path),
            "--track", "tensorboard,wandb",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=270,
    )  # fmt: skip
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"ddq up exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    summary = json.loads(out[-1])
    assert any(line.startswith("[") and "rounds" in line for line in out), "no progress lines"
    assert summary["rounds_merged"] > 0, summary
    assert summary["evals"] >= 2, summary
    assert summary["loss_fell"] is True, summary
    assert summary["contributed"] == ["L0", "L1", "L2"], summary
    assert summary["stopped_by"] == "duration"
    assert 0.5 < summary["goodput"] <= 1.0 and 0.5 < summary["uptime"] <= 1.0, summary
    assert any(line.startswith("ddq up: redis server ") for line in out), "which Redis: not said"
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "appendonlydir").is_dir(), "Redis AOF not in the run dir"
    for name in ("synchronizer", "L0", "L1", "L2", "evaluator", "control"):
        assert (run_dir / f"{name}.log").stat().st_size > 0, name
    _check_tracking(run_dir / "tracking" / "demo", summary)
    _check_report(run_dir, summary, env)


TRAIN = {"loss", "lr", "tokens_per_s", "step_time_s", "tokens"}
ROUND = {"contributors", "tokens", "weight_max", "staleness_mean", "grace_window_s", "late"}


def _check_tracking(where: Path, summary: dict[str, object]) -> None:
    """Each process's curves, in TensorBoard and W&B, with the run's config and digests."""
    expected = {"learner-L0", "learner-L1", "learner-L2", "synchronizer-sync-0", "evaluator"}
    assert {p.name for p in where.iterdir()} == expected
    digests = set()
    for process in sorted(expected):
        scalars, hparams = tb_scalars(where / process), tb_hparams(where / process)
        assert hparams["process"] == process and hparams["run.run_id"] == "demo", hparams
        digests.add(hparams["run_digest"])
        (run_file,) = wandb_run_files(where / process)
        wb = wandb_run(run_file)
        assert wb["run"]["group"] == "demo" and wb["run"]["name"] == f"demo/{process}"
        assert wb["config"]["run_digest"] == hparams["run_digest"]
        logged = {k for row in wb["history"] for k in row if not k.startswith("_")}
        tb_names = set(scalars)
        assert tb_names <= logged, (process, tb_names - logged)  # the same curves in both
        if process.startswith("learner"):
            assert {f"train/{n}" for n in TRAIN} <= tb_names, tb_names
            steps = [s for s, _ in scalars["train/loss"]]
            assert len(steps) >= 5 and steps == sorted(steps) and steps[0] % 10 == 0, steps
            assert all(v > 0 for _, v in scalars["train/tokens_per_s"]), scalars
            first, last = scalars["train/loss"][0][1], scalars["train/loss"][-1][1]
            assert last < first, (process, first, last)  # the train loss fell
        elif process == "evaluator":
            assert {"eval/loss", "eval_by_tokens/loss"} <= tb_names, tb_names
            assert len(scalars["eval/loss"]) == summary["evals"], (scalars, summary)
            tokens = [s for s, _ in scalars["eval_by_tokens/loss"]]
            assert tokens == sorted(tokens) and tokens[-1] > 0, tokens
        else:
            versions = summary["versions"]
            assert isinstance(versions, dict)
            for p, seen in versions.items():  # every merged version logged once, in order
                steps = [s for s, _ in scalars[f"fragment{p}/contributors"]]
                assert steps == list(range(1, len(steps) + 1)) and len(steps) >= seen, steps
            assert {f"fragment0/{n}" for n in ROUND} <= tb_names, tb_names
            assert all(1 <= v <= 3 for _, v in scalars["fragment0/contributors"]), scalars
    assert len(digests) == 1, digests  # one run: one run digest everywhere


def _check_report(run_dir: Path, summary: dict[str, object], env: dict[str, str]) -> None:
    """``ddq report RUN_DIR`` writes one HTML file from the run's AOF and summary; it opens in
    headless Chromium with no request but its own file, no console error, and every panel."""
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    proc = subprocess.run(
        [sys.executable, "-m", "dd_queue.cli", "report", str(run_dir), "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    page_path = Path(written["report"])
    assert page_path == run_dir / "report.html"
    assert written["rounds"] >= summary["rounds_merged"] and written["evals"] == summary["evals"]
    assert written["merged_token_share"] == pytest.approx(summary["merged_token_share"], rel=0.05)
    sync_api = import_or_require("playwright.sync_api", "pip install -e '.[dev]'")
    requests: list[str] = []
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1400})
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(page_path.as_uri())
            for panel in ("#cards", "#loss", "#timeline", "#learners", "#token-fates"):
                assert page.locator(panel).is_visible(), panel
            assert page.locator("#loss circle").count() == summary["evals"]
            assert page.locator("#timeline rect.merge").count() >= 1
            for learner in ("L0", "L1", "L2"):
                assert page.locator(f"#learners td:text-is('{learner}')").count() == 1
                fate = page.locator(f"#token-fates tr:has(td:text-is('{learner}'))")
                assert fate.locator("td").last.inner_text().startswith("✓ balanced"), learner
            shot = run_dir / "report.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert requests == [page_path.as_uri()], requests  # nothing but the file itself
    assert not errors, errors
    if copy_to := os.environ.get("DDQ_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, copy_to)
