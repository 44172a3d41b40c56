"""Two simulated nodes on one machine: network namespaces joined by a veth pair.

Each "node" gets its own network stack and address (10.213.7.1 and .2 on a /24 that exists only
inside the two namespaces), so rendezvous, the store and gloo really cross an interface as they
would between hosts. Where namespaces cannot be made (not root, no iproute2, a sandbox without
CAP_NET_ADMIN) `make_nodes` falls back to two "nodes" on the loopback interface.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import dataclass

SUBNET = "10.213.7"


@dataclass
class SimNode:
    addr: str  # this node's address (what a real node would advertise)
    netns: str | None = None  # namespace name; None on the loopback fallback
    ifname: str = "lo"  # the interface gloo should use
    hostname: str | None = None  # its own host name (a UTS namespace) where unshare exists

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` as run on this node."""
        if not self.netns:
            return cmd
        if self.hostname:
            sh = 'hostname "$0" && exec "$@"'
            cmd = ["unshare", "--uts", "sh", "-c", sh, self.hostname, *cmd]
        return ["ip", "netns", "exec", self.netns, *cmd]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """`nodes[i]` for node i; `endpoint` for the rendezvous (on node 0); `close()` cleans up."""

    def __init__(self, n: int = 2):
        self.created: list[str] = []
        self.nodes: list[SimNode] = []
        self.isolated = False
        if os.geteuid() == 0 and shutil.which("ip") and n == 2:
            try:
                self._make_netns()
                self.isolated = True
            except (subprocess.SubprocessError, OSError):
                self.close()
        if not self.isolated:
            self.nodes = [SimNode("127.0.0.1") for _ in range(n)]
            self.endpoint = f"127.0.0.1:{_free_port()}"
        else:
            self.endpoint = f"{self.nodes[0].addr}:29400"

    def _make_netns(self) -> None:
        tag = uuid.uuid4().hex[:6]
        names = [f"dtrain-{tag}-{i}" for i in range(2)]
        veths = [f"dt{tag}{i}" for i in range(2)]  # <= 15 characters, as Linux requires
        for ns in names:
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        # Created inside namespace 0 and one end moved to namespace 1: nothing is ever added
        # to, or addressed in, the machine's own network namespace.
        _ip("-n", names[0], "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        _ip("-n", names[0], "link", "set", veths[1], "netns", names[1])
        for i, (ns, veth) in enumerate(zip(names, veths)):
            addr = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            host = f"node{i}" if shutil.which("unshare") else None
            self.nodes.append(SimNode(addr, ns, veth, hostname=host))
        if shutil.which("ping"):  # the two stacks must reach each other before a test relies on it
            cmd = ["ip", "netns", "exec", names[0], "ping", "-c", "1", "-W", "5", f"{SUBNET}.2"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def node_env(self, i: int) -> dict:
        """What a launcher (Slurm, Kubernetes, launch/multinode.sh) would set on node i."""
        node = self.nodes[i]
        # torchrun hosts the rendezvous store where the endpoint names its own machine, judged
        # by host name; the namespaces share one (and on loopback both nodes would match), so
        # say which node hosts it.
        return {
            "LOCAL_ADDR": node.addr,
            "GLOO_SOCKET_IFNAME": node.ifname,
            "RDZV_CONF": f"is_host={int(i == 0)}",
        }

    def close(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()
