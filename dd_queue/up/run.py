"""The ``ddq up`` orchestration: run dir, Redis, services, progress, two-stage stop, summary.

Children run in their own sessions, so a Ctrl-C in the terminal reaches only ``ddq up``, which
then stops them in order: first signal → SIGTERM every service (each finishes its step and
flushes) and wait; second signal (or a 30 s deadline) → SIGKILL. Redis stops last (SIGTERM
flushes the AOF), so the run directory can be resumed by hand.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Protocol

from dd_queue.auth import principals, write_keys
from dd_queue.bus import Bus, RedisBus
from dd_queue.config import DDQConfig
from dd_queue.errors import DDQError
from dd_queue.up.display import Display
from dd_queue.up.procs import Children, RedisServer, child_env, free_port
from dd_queue.up.progress import RunWatch
from dd_queue.up.summary import Summary

__all__ = ["UpOptions", "run_up"]

log = logging.getLogger("dd_queue.up")
STOP_TIMEOUT_S = 30.0
CHAOS_RATES_PER_MIN = {"stall": 1.0, "slow": 1.0, "drop": 0.5, "kill": 0.5}
"""The default chaos schedule of ``--chaos`` (mean faults per minute of each kind)."""


@dataclass(frozen=True)
class UpOptions:
    """What ``ddq up`` was asked for.

    Attributes:
        config: The YAML config path.
        learners: Learner processes to start (ids ``L0``, ``L1``, ...).
        duration_s: Stop after this long; 0 = until Ctrl-C.
        chaos: Start the default chaos schedule once the control plane is ready.
        port: Control plane port (0 = ``control.port`` if free, else a free one).
        runs_dir: Parent of the run directory.
        progress_s: Seconds between progress lines.
        export: Where to export the final global model once the services stopped (None: no
            export); ``export_format`` ``ddq`` (one safetensors file) or ``hf`` (a directory
            ``AutoModelForCausalLM.from_pretrained`` loads).
        init_from: Weights of the new run's first global model (``ddq synchronizer
            --init-from``: a ddq export, a Hugging Face directory or a safetensors file).
    """

    config: Path
    learners: int = 3
    duration_s: float = 0.0
    chaos: bool = False
    port: int = 0
    runs_dir: Path = Path("runs")
    progress_s: float = 5.0
    export: Path | None = None
    export_format: str = "ddq"
    init_from: Path | None = None


class _Signals:
    """Counts SIGINT/SIGTERM; the first one sets ``stop``."""

    def __init__(self) -> None:
        self.count, self.stop = 0, threading.Event()

    def install(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.stop.set()


def make_run_dir(runs_dir: Path, run_id: str, now: datetime | None = None) -> Path:
    """A new ``<runs_dir>/<run_id>-<UTC timestamp>/`` (a suffix makes it unique)."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%d-%H%M%S")
    base = runs_dir / f"{run_id}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path.resolve()


def pick_port(requested: int, configured: int) -> int:
    """``requested`` if given, else ``configured`` when it is free, else a free port."""
    if requested:
        return requested
    try:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", configured))
        return configured
    except OSError:
        return free_port()


def _gpu_count() -> int:
    if "CUDA_VISIBLE_DEVICES" in os.environ or shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _command(name: str, config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dd_queue.cli", name, "--config", str(config), *extra]


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def access_lines(port: int, token: str | None) -> list[str]:
    """The dashboard URL, the admin token and a curl example, as ``ddq up`` prints them.

    ``token`` is None when it is the user's own (``control.admin_token``, or its file): a
    configured secret is never printed, only a token generated for this run.
    """
    url = f"http://127.0.0.1:{port}/"
    if token is None:
        token = "<control.admin_token>"
    return [
        f"ddq up: dashboard {url}  admin token {token}",
        "ddq up: e.g. curl -X POST -H 'Authorization: Bearer "
        f"{token}' -H 'Content-Type: application/json' "
        f'-d \'{{"target": "L1", "kind": "stall", "duration_s": 10}}\' {url}api/faults',
    ]


def http_call(
    port: int, token: str, path: str, body: dict[str, object] | None = None
) -> tuple[int, str]:
    """One request to the control plane on ``127.0.0.1:<port>``: (status, text); 0 = no answer."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as exc:
        return 0, str(exc)


def start_chaos(port: int, token: str, duration_s: float) -> str:
    """Start the default chaos schedule (``duration_s``, 0 = an hour) through the API."""
    body = {
        "action": "start",
        "duration_s": duration_s or 3600.0,
        "rates_per_min": CHAOS_RATES_PER_MIN,
    }
    code, text = http_call(port, token, "/api/chaos", body)
    return f"started {CHAOS_RATES_PER_MIN}" if code in (200, 201) else f"failed {code}: {text}"


class _Up:
    """One ``ddq up`` run (see :func:`run_up`)."""

    def __init__(
        self,
        cfg: DDQConfig,
        opts: UpOptions,
        redis: RedisServer,
        env: dict[str, str],
        *,
        token_generated: bool,
    ):
        self.cfg, self.opts, self.redis = cfg, opts, redis
        self.config = opts.config.resolve()
        self.token = env["DDQ__CONTROL__ADMIN_TOKEN"]
        self.token_generated = token_generated
        self.port = int(env["DDQ__CONTROL__PORT"])
        self.children = Children(redis.dir, env, Path.cwd())
        ids = [f"L{i}" for i in range(opts.learners)]
        self.summary = Summary(cfg.run.run_id, str(redis.dir), learners=ids)
        self.bus = RedisBus(redis.url, cfg.run.run_id, options=cfg.redis.options())
        self.watch = RunWatch(cfg, self.bus, self.summary)
        self.chaos_pending = opts.chaos

    def start(self) -> None:
        init = ("--init-from", str(self.opts.init_from)) if self.opts.init_from else ()
        argv = _command("synchronizer", self.config, *init)
        self.children.start("synchronizer", argv, restart=True)
        gpus = _gpu_count()
        for i, lid in enumerate(self.summary.learners):
            argv = _command("learner", self.config, "--learner-id", lid)
            if gpus:
                argv = ["env", f"CUDA_VISIBLE_DEVICES={i % gpus}", *argv]
            self.children.start(lid, argv, restart=True)
        self.children.start("control", _command("control", self.config), restart=True)
        # with the others, not once the run exists: it waits for the run itself, and its first
        # score (version 0 or soon after) is the baseline that "the loss fell" compares with
        self.children.start("evaluator", _command("evaluator", self.config), restart=True)
        _out(f"ddq up: run {self.cfg.run.run_id} in {self.redis.dir} (logs: <name>.log there)")
        _out(f"ddq up: redis {self.redis.url} (AOF on); {len(self.summary.learners)} learners")
        for line in access_lines(self.port, self.token if self.token_generated else None):
            _out(line)

    def tick(self, started: float, note: Callable[[str], None] = _out) -> None:
        """Supervise, start late parts, poll the run; ``note`` shows what ``ddq up`` did."""
        for text in self.children.supervise():
            note(f"ddq up: {text}")
            if "stays down" in text:
                self.summary.notes.append(text)
        if self.chaos_pending and self._ready():
            self.chaos_pending = False
            note(f"ddq up: chaos {self._start_chaos()}")
        self.summary.wall_s = time.monotonic() - started
        self.watch.poll(time.time())

    def _ready(self) -> bool:
        return http_call(self.port, self.token, "/readyz")[0] == 200

    def _start_chaos(self) -> str:
        return start_chaos(self.port, self.token, self.opts.duration_s)

    def stop(self, signals: _Signals) -> None:
        """Two-stage stop of the services (second signal or deadline: SIGKILL), Redis last."""
        _out("ddq up: stopping (Ctrl-C again to kill at once)")
        self.children.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        first = signals.count
        while not self.children.wait(0.5):
            if signals.count > max(first, 1) or time.monotonic() > deadline:
                _out("ddq up: killing what is left")
                self.children.kill()
                break
        try:
            self.watch.poll(time.time())
        except Exception as exc:  # the summary still prints what was seen
            log.warning("up.final_poll failed: %s", exc)
        self.summary.restarts = self.children.restarts()
        self.bus.close()


class Watched(Protocol):
    """A started run that ``watch_until_done`` can drive (``_Up``, the in-process run)."""

    summary: Summary
    watch: RunWatch

    def tick(self, started: float, note: Callable[[str], None]) -> None: ...


def watch_until_done(run: Watched, opts: UpOptions, signals: _Signals) -> None:
    """Tick and show ``run`` until ``opts.duration_s`` or a signal; records which stopped it."""
    started = time.monotonic()
    with Display(run.watch, duration_s=opts.duration_s, every_s=opts.progress_s) as display:
        while not signals.stop.is_set():
            run.tick(started, display.note)
            display.update()
            if opts.duration_s and run.summary.wall_s >= opts.duration_s:
                break
            signals.stop.wait(0.5)
    run.summary.stopped_by = "signal" if signals.stop.is_set() else "duration"


def run_up(cfg: DDQConfig, opts: UpOptions, *, binary: str, environ: dict[str, str]) -> Summary:
    """Start everything, watch until the duration or a signal, stop, and return the summary.

    Args:
        cfg: The config as the children will see it (``environ`` overrides applied).
        opts: The command's options.
        binary: The redis-server path.
        environ: Base environment of the children.
    """
    signals = _Signals().install()
    run_dir = make_run_dir(opts.runs_dir, cfg.run.run_id)
    redis = RedisServer(binary, run_dir, password=cfg.redis.password).start()
    given = cfg.control.admin_token
    overrides = {
        "DDQ__REDIS__URL": redis.url,
        "DDQ__CONTROL__PORT": str(pick_port(opts.port, cfg.control.port)),
        "DDQ__CONTROL__ADMIN_TOKEN": secrets.token_urlsafe(24)
        if given is None
        else given.get_secret_value(),
    }
    overrides.update(tracking_overrides(cfg, run_dir))
    if cfg.redis.password is not None:  # a password in the user's URL is not in redis.url
        overrides["DDQ__REDIS__PASSWORD"] = cfg.redis.password.get_secret_value()
    if cfg.auth.keys_dir is None:  # every run signs its messages: keys of its own (mode 0600)
        learner_ids = [f"L{i}" for i in range(opts.learners)]
        keys_dir = run_dir / "keys"
        write_keys(keys_dir, cfg.run.run_id, principals(learner_ids))
        overrides["DDQ__AUTH__KEYS_DIR"] = str(keys_dir)
    env = child_env(environ, overrides)
    up = _Up(cfg, opts, redis, env, token_generated=given is None)
    try:
        up.start()
        watch_until_done(up, opts, signals)
    finally:
        up.stop(signals)
        try:
            if opts.export is not None:  # every service has stopped: this is the final model
                with closing(
                    RedisBus(redis.url, cfg.run.run_id, options=cfg.redis.options())
                ) as bus:
                    export_final(bus, cfg, opts, up.summary)
        finally:
            redis.stop()
    return up.summary


def tracking_overrides(cfg: DDQConfig, run_dir: Path) -> dict[str, str]:
    """``tracking.dir`` in the run directory (``tracking/``) when curves are on and the config
    names no directory of its own."""
    if not cfg.tracking.backends or cfg.tracking.dir is not None:
        return {}
    return {"DDQ__TRACKING__DIR": str(run_dir / "tracking")}


def export_final(bus: Bus, cfg: DDQConfig, opts: UpOptions, summary: Summary) -> None:
    """Export the run's final global model to ``opts.export`` (``ddq export``'s formats); the
    path goes to ``summary.exported``, a failure to its notes (the run itself stays done)."""
    from dd_queue.synchronizer.export import export_hf, export_model

    assert opts.export is not None
    write = export_hf if opts.export_format == "hf" else export_model
    try:
        write(bus, cfg, opts.export)
    except DDQError as exc:
        summary.notes.append(f"export to {opts.export} failed: {exc}")
        log.warning("up.export_failed %s: %s", opts.export, exc)
        return
    summary.exported = str(opts.export)
    _out(f"ddq up: exported the final global model to {opts.export} ({opts.export_format})")
