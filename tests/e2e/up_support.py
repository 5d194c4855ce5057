"""A ``ddq up`` started as a subprocess, watched through its control plane's HTTP API."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest


class UpProcess:
    """``ddq up`` (``argv``) on control-plane port ``port``; its output is collected as text."""

    def __init__(self, argv: Sequence[str], port: int, *, cwd: Path, env: Mapping[str, str]):
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [*argv, "--port", str(port), "--json"],
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out = self.err = ""

    def wait_for(self, ready: Callable[[], object], what: str, timeout_s: float = 90) -> None:
        """Poll ``ready`` (HTTP errors and bad JSON count as not yet) while it runs; on a
        timeout or an early exit, fail with its output."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(
                    f"{what}: not within {timeout_s} s (ddq up exit {self.proc.returncode}):\n"
                    f"{self.out[-4000:]}\n{self.err[-4000:]}"
                )
            time.sleep(0.5)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.base + path, timeout=10, **kwargs)

    def summary(self, timeout_s: float = 150) -> dict[str, Any]:
        """Wait for the run's end: exit 0 and its JSON summary (the last stdout line)."""
        self.out, self.err = self.proc.communicate(timeout=timeout_s)
        assert self.proc.returncode == 0, (
            f"ddq up exited {self.proc.returncode}:\n{self.out[-3000:]}\n{self.err[-3000:]}"
        )
        return dict(json.loads(self.out.strip().splitlines()[-1]))

    def stop(self) -> None:
        """Stop it as Ctrl-C does (SIGTERM: it stops its services and Redis), SIGKILL after
        45 s; a SIGKILL alone would leave its services running as orphans."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, err = self.proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.out, self.err = self.out + out, self.err + err


@contextmanager
def ddq_up(
    argv: Sequence[str], port: int, *, cwd: Path, env: Mapping[str, str]
) -> Iterator[UpProcess]:
    """A running ``ddq up``, killed on the way out if it still runs."""
    up = UpProcess(argv, port, cwd=cwd, env=env)
    try:
        yield up
    finally:
        if up.proc.poll() is None:
            up.stop()
