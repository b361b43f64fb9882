"""A small real network on one machine, to measure jaxring across processes.

Usage (as root):
    python benchmarks/netns.py --nodes 4 --rate 1gbit -- SCRIPT [ARGS...]
    python benchmarks/netns.py --nodes 2 --rate 1gbit --check

Builds one network namespace per process, each with its own address
(10.77.0.1, 10.77.0.2, ...) on a veth pair to a bridge that lives in a hub
namespace of its own, so nothing outside the namespaces is touched and the
traffic stays on their addresses. With --rate, each link is limited in both
directions with the `tbf` qdisc (a full-duplex link of that rate). Then it
runs `python -m jaxring.launch -n NODES SCRIPT ARGS` with process i in
namespace i and jax.distributed's coordinator on node 0. Everything is
removed afterwards, also on Ctrl-C or SIGTERM.

--check measures the network itself (one TCP stream from node 1 to node 0)
and prints it, to compare a benchmark's busbw with the link's real rate.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

SUBNET = "10.77.0"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Network:
    """Namespaces n0..n{N-1} on a bridge in a hub namespace; removed on exit."""

    def __init__(self, nodes: int, rate: str | None, burst: str = "256kb"):
        self.tag = f"jr{os.getpid()}"
        self.hub = f"{self.tag}hub"
        self.nodes = [f"{self.tag}n{i}" for i in range(nodes)]
        self.rate, self.burst = rate, burst

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate:
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                self.burst,
                "latency",
                "50ms",
            )

    def _build(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "netns", "exec", self.hub, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", self.hub, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            # Created inside the hub, the node's end is then moved into ns.
            sh(
                "ip",
                "netns",
                "exec",
                self.hub,
                "ip",
                "link",
                "add",
                f"h{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"e{i}",
            )
            sh(
                "ip",
                "netns",
                "exec",
                self.hub,
                "ip",
                "link",
                "set",
                f"e{i}",
                "netns",
                ns,
                "name",
                "eth0",
            )
            sh("ip", "netns", "exec", self.hub, "ip", "link", "set", f"h{i}", "master", "br0", "up")
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "ip",
                "addr",
                "add",
                f"{self.address(i)}/24",
                "dev",
                "eth0",
            )
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # node -> bridge
            self._shape(self.hub, f"h{i}")  # bridge -> node
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts.
            # Gloo (JAX's CPU collectives) advertises the address its host
            # name resolves to, so in each namespace it must be the node's.
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(f"{etc}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")

    def remove(self) -> None:
        for ns in [*self.nodes, self.hub]:
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def exec_prefix(self) -> str:
        # Each namespace is a host of its own: its processes must not reach
        # the others through shared memory, past the tbf-limited links.
        node = f"{self.tag}n{{rank}}"
        return f"ip netns exec {node} env JAXRING_HOST_ID={node}"


def check_rate(net: Network, seconds: float = 3.0) -> float:
    """One TCP stream node 1 -> node 0 for `seconds`; returns bytes/s."""
    port = 29400
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            net.nodes[0],
            sys.executable,
            "-c",
            "import socket,sys\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{net.address(0)}',{port}));s.listen(1);c,_=s.accept();n=0\n"
            "b=bytearray(1<<20)\n"
            "while True:\n r=c.recv_into(b)\n if not r: break\n n+=r\n"
            "print(n)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    client = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            net.nodes[1],
            sys.executable,
            "-c",
            "import socket,time\n"
            f"c=socket.create_connection(('{net.address(0)}',{port}));b=bytes(1<<20)\n"
            f"t=time.time()\nwhile time.time()-t<{seconds}: c.sendall(b)\n"
            "c.close();print(time.time()-t)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    received = int(server.communicate(timeout=30)[0])
    return received / float(client.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate", default=None, help="tbf rate of every link, e.g. 1gbit")
    ap.add_argument("--check", action="store_true", help="measure the link, then exit")
    ap.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="-- SCRIPT [ARGS]: run under jaxring.launch, one process per node",
    )
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/netns.py needs root (network namespaces)")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.check and not command:
        ap.error("give --check or a script to run")

    def on_signal(signum, frame):
        raise KeyboardInterrupt  # unwinds through Network.__exit__

    signal.signal(signal.SIGTERM, on_signal)
    with Network(args.nodes, args.rate) as net:
        if args.check:
            rate = check_rate(net)
            print(
                f"link {args.rate or 'unlimited'}: one TCP stream moves "
                f"{rate / 1e9:.3f} GB/s ({rate * 8 / 1e9:.3f} Gbit/s)"
            )
            return 0
        launcher = [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            str(args.nodes),
            "--devices-per-process",
            "1",
            "--coordinator",
            f"{net.address(0)}:29500",
            "--prefix-command",
            net.exec_prefix(),
            *command,
        ]
        return subprocess.run(launcher).returncode


if __name__ == "__main__":
    sys.exit(main())
