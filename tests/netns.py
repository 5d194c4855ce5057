"""A Linux network namespace joined to the host by a veth pair (for tests and bench_wan).

    with NetNamespace.create("ddq1") as ns:
        subprocess.run([*ns.wrap, "ip", "addr"])          # runs inside
        ns.limit("20mbit")                                # tc tbf, both directions

The namespace has its own address (``inside``) and reaches the host only at ``outside``, over
the veth; its 127.0.0.1 is its own. Needs root and iproute2; ``tc`` needs only ``tbf``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType

__all__ = ["NetNamespace", "netns_available"]


def netns_available() -> bool:
    """Whether this process may make namespaces (root and ``ip``)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class NetNamespace:
    """Namespace ``name``; the host's veth end ``host_end`` has ``outside``, its own ``inside``."""

    name: str
    host_end: str
    ns_end: str
    outside: str
    inside: str

    @classmethod
    def create(cls, tag: int | None = None) -> NetNamespace:
        """Make the namespace and the veth pair, addresses up (a /30 of 10.213.0.0/16)."""
        tag = os.getpid() % 50000 if tag is None else tag
        subnet = f"10.213.{tag % 250}"
        ns = cls(f"ddq{tag}", f"ddqh{tag}", f"ddqn{tag}", f"{subnet}.1", f"{subnet}.2")
        _ip("netns", "add", ns.name)
        try:
            _ip("link", "add", ns.host_end, "type", "veth", "peer", "name", ns.ns_end)
            _ip("link", "set", ns.ns_end, "netns", ns.name)
            _ip("addr", "add", f"{ns.outside}/30", "dev", ns.host_end)
            _ip("link", "set", ns.host_end, "up")
            _ip(*ns.inside_ip("addr", "add", f"{ns.inside}/30", "dev", ns.ns_end))
            _ip(*ns.inside_ip("link", "set", ns.ns_end, "up"))
            _ip(*ns.inside_ip("link", "set", "lo", "up"))
        except BaseException:
            ns.delete()
            raise
        return ns

    def inside_ip(self, *args: str) -> list[str]:
        return ["netns", "exec", self.name, "ip", *args]

    @property
    def wrap(self) -> list[str]:
        """Command-line prefix that runs a command inside."""
        return ["ip", "netns", "exec", self.name]

    def limit(self, rate: str | None, *, burst: str = "256kb", latency: str = "50ms") -> None:
        """Rate-limit both directions of the link with ``tc tbf`` (None: no limit)."""
        for cmd in (["tc"], [*self.wrap, "tc"]):
            dev = self.host_end if len(cmd) == 1 else self.ns_end
            subprocess.run([*cmd, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate is not None:
                subprocess.run(
                    [*cmd, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
                     burst, "latency", latency],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def __enter__(self) -> NetNamespace:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.delete()
