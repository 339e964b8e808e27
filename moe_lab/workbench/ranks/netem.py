"""A network you can feel on one machine: ranks in network namespaces behind a limited link.

On one CPU box, gloo's "network" is the loopback device, which moves gigabytes per second by
copying memory — with the very cores that also run the experts. Communication there is not
waiting, it is more compute, so overlapping it with compute can only reshuffle the same
work: nothing to see. To make the all-to-all *wait* the way it waits on a real fabric, the
ranks need a link slower than their compute and a kernel that enforces it.

`EmulatedLink` builds one with the kernel's own tools, run as root (``ip`` and ``tc`` from
iproute2):

- one network namespace per rank, each with a single interface ``moe0`` holding the
  address ``10.213.0.<rank + 1>``;
- a hub namespace with a Linux bridge; every rank's ``moe0`` is one end of a veth pair whose
  other end is a port of that bridge — a switch with one cable per rank;
- a queueing discipline on both ends of every cable, so each rank has a full-duplex "NIC"
  of ``rate_mbit`` in each direction: ``netem`` (a rate) where the kernel has it, else
  ``tbf`` (a token bucket);
- jumbo frames (`MTU`, 9000 bytes, as data-centre fabrics use): the kernel's work per
  packet (bridge, queue, TCP acknowledgements) runs on the same cores as the experts, so
  with 1,500-byte frames a busy link slows the compute it is meant to overlap with — a cost
  of the emulation, not of the fabric it stands for. Six times fewer packets per byte keep
  that cost small (``python -m moe_lab bench ep`` shows it: compute during an overlapped
  step against compute alone).

Nothing is created in the machine's own namespace, and tearing down is deleting the
namespaces (their interfaces go with them). A rank process joins its namespace with
``setns(2)`` (`enter_namespace`) before it opens any socket, and gloo is told to use
``moe0`` (``GLOO_SOCKET_IFNAME``); `moe_lab.workbench.ranks.launch.run_ranks(..., link=link)` does
both.

Limits, stated where the figures are shown:

- It is TCP through the kernel: per-packet costs, TCP congestion control and the token
  bucket's burst shape the transfer; a real fabric (NVLink, InfiniBand with RDMA) moves
  data with no CPU in the way, at 100-1,000x this rate, with microsecond latency.
- Both ranks still share the same cores: gloo's copies and the kernel's TCP work take CPU
  time from the experts. With jumbo frames at a low rate this cost is small, but it is not
  zero.
- gloo opens one TCP connection per pair of ranks and sends its "ready to receive"
  notices in the same byte stream as the data, so when both directions start at once one
  can wait behind the other: an all-to-all gets between half and all of the link rate.
  We report what it got.
- Only the rate is limited: no latency is added.

`available()` says whether this machine can build the link (root, iproute2, namespaces,
veth, a bridge and ``tbf`` or ``netem``) and, when it cannot, why; callers then run on the
loopback device and say that the link is not emulated.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

from moe_lab.workbench.training.checkpoint import process_running

PREFIX = "moelab"  # namespace names: moelab-<pid>-<tag>-r<rank> and moelab-<pid>-<tag>-hub
IFNAME = "moe0"  # the rank's interface inside its namespace
SUBNET = "10.213.0"  # rank r is SUBNET.(r + 1)/24
MTU = 9000  # jumbo frames, as data-centre fabrics use (see above)
CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT_S = 20


class LinkUnavailable(RuntimeError):
    """The emulated link cannot be built here (not root, no iproute2, a kernel feature missing)."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LinkUnavailable(f"`{' '.join(args)}` failed: {exc}") from None
    if check and result.returncode != 0:
        raise LinkUnavailable(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """``(True, "netem" | "tbf")`` when the link can be built, else ``(False, why)``.

    Checked once per process by building (and deleting) a two-rank link.
    """
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "building network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found: install iproute2 (apt-get install -y iproute2)"
    try:
        with EmulatedLink(2, rate_mbit=100) as link:
            return True, link.qdisc
    except LinkUnavailable as exc:
        return False, str(exc)


def enter_namespace(name: str) -> None:
    """Move the calling thread (call it first thing in a fresh process) into namespace ``name``.

    Sockets opened afterwards, and threads started afterwards, live in that namespace.
    """
    path = f"/var/run/netns/{name}"  # made by the link this rank is launched on
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise LinkUnavailable(f"network namespace {name!r} not found ({path}): its EmulatedLink "
                              "is not set up, or was torn down") from None
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise LinkUnavailable(f"setns into {name!r} failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale() -> None:
    """Delete namespaces left by moe_lab processes that died without tearing down.
    Namespaces of live processes (another developer's run) are left alone."""
    for name in _namespaces():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit():
            if not process_running(int(parts[1])):
                _run("ip", "netns", "delete", name, check=False)


@dataclass
class EmulatedLink:
    """``world_size`` ranks, each in its own namespace behind a ``rate_mbit`` full-duplex link.

    Use as a context manager (``with EmulatedLink(2, rate_mbit=400) as link:``); `setup` and
    `teardown` may also be called directly; `available` first says whether this machine can
    build one. `qdisc` says which discipline was used.
    """

    world_size: int
    rate_mbit: float = 400.0
    # the start of its namespaces' names, PREFIX-<pid>-<random tag> (see PREFIX)
    stem: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}")
    qdisc: str = ""
    active: bool = False

    # names and addresses -------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.stem}-hub"

    def namespace(self, rank: int) -> str:
        """The namespace rank ``rank`` runs in."""
        return f"{self.stem}-r{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def describe(self) -> str:
        return (f"{self.world_size} ranks in network namespaces, each behind a "
                f"{self.rate_mbit:g} Mbit/s full-duplex link ({self.qdisc})")

    # building -------------------------------------------------------------------------
    def _shape(self, namespace: str, device: str) -> None:
        rate = f"{self.rate_mbit:g}mbit"
        # The queue holds about 20 ms of traffic (at least 100 packets), as a switch port
        # would; a deep queue would delay gloo's small control messages behind the data.
        packets = max(100, int(self.rate_mbit * 1e6 / 8 * 0.02 / MTU))
        if self.qdisc in ("", "netem"):
            result = _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device,
                          "root", "netem", "rate", rate, "limit", str(packets), check=False)
            if result.returncode == 0:
                self.qdisc = "netem"
                return
            if self.qdisc == "netem":
                raise LinkUnavailable(f"tc netem failed on {device}: {result.stderr.strip()}")
            self.qdisc = "tbf"
        # A token bucket: the burst must hold a few full-size packets (and no more: a
        # larger bucket lets a whole chunk through at memory speed); beyond 20 ms of
        # queued traffic it drops (TCP then backs off).
        burst = max(64 * 1024, 4 * MTU, int(self.rate_mbit * 1e6 / 8 * 0.002))
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root",
             "tbf", "rate", rate, "burst", str(burst), "latency", "20ms")

    def setup(self) -> EmulatedLink:
        if self.active:
            return self
        cleanup_stale()
        self.active = True
        atexit.register(self.teardown)
        try:
            hub = self.hub
            _run("ip", "netns", "add", hub)
            _run("ip", "-n", hub, "link", "set", "lo", "up")
            _run("ip", "-n", hub, "link", "add", "br0", "up", "type", "bridge")
            for rank in range(self.world_size):
                ns, port = self.namespace(rank), f"p{rank}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", "name", IFNAME, "netns", ns, "type", "veth",
                     "peer", "name", port, "netns", hub)
                _run("ip", "-n", hub, "link", "set", port, "mtu", str(MTU), "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", IFNAME)
                _run("ip", "-n", ns, "link", "set", IFNAME, "mtu", str(MTU), "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(ns, IFNAME)  # what the rank sends
                self._shape(hub, port)  # what the rank receives
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Delete the namespaces (and with them every interface and queue of the link)."""
        if not self.active:
            return
        for name in [self.namespace(r) for r in range(self.world_size)] + [self.hub]:
            _run("ip", "netns", "delete", name, check=False)  # one never made: a harmless error
        self.active = False
        atexit.unregister(self.teardown)

    def __enter__(self) -> EmulatedLink:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()
