"""Hosts on a private bridge, for the multi-host rehearsal: Linux network namespaces (root only).

Each `Host` is a network namespace with its own address on one bridge, as a container on a
compose network would be: its processes see only their own loopback and the bridge. Names
resolve through `Dns`, a small server on the bridge's own address that answers a name with
every address registered for it (several replicas: several addresses, as compose's DNS does).
`ip netns exec` mounts `/etc/netns/<namespace>/resolv.conf` over the host's, which is how each
namespace finds that server. Only this machine's own namespaces and a private 10.x subnet are
used; nothing here routes anywhere else.

A partition is a host's link set down; a slow link is a delaying relay (`tests/hosts/relay.py`)
on an address of its own, which the name then resolves to instead of the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tokenline.launch.process import Process
from tokenline.launch.servers import log_file

NETNS_ETC = Path("/etc/netns")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class Host:
    """One network namespace with one address on the bridge."""

    name: str
    address: str
    bridge: str
    processes: list[Process] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return f"tl-{self.name}"

    @property
    def link(self) -> str:
        """The bridge side of the host's veth pair (15 characters at most)."""
        return f"tl{self.address.rsplit('.', 1)[1]}{self.bridge[-3:]}"

    def create(self, nameserver: str) -> None:
        ns = self.namespace
        ip("netns", "add", ns)
        ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", self.link, "master", self.bridge)
        ip("link", "set", self.link, "up")
        ip("-n", ns, "addr", "add", f"{self.address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(f"nameserver {nameserver}\noptions timeout:1\n")
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address} {self.name}\n")

    def destroy(self) -> None:
        for process in self.processes:
            process.stop(grace=10)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)
        shutil.rmtree(NETNS_ETC / self.namespace, ignore_errors=True)

    def partition(self, cut: bool = True) -> None:
        """Cut (or restore) the host's only link: nothing in or out, as a pulled cable."""
        ip("link", "set", self.link, "down" if cut else "up")

    def run(
        self, name: str, argv: list[str], port: int, env: Mapping[str, str] | None = None
    ) -> Process:
        """`argv` inside this host, serving HTTP on its address and `port`."""
        process = Process(
            name,
            ["ip", "netns", "exec", self.namespace, *argv],
            port,
            env=env,
            output=log_file(f"hosts-{name}"),
            host=self.address,
        )
        self.processes.append(process)
        return process


class Dns:
    """Answers A queries for registered names (every address of a name), NXDOMAIN otherwise,
    and an empty answer for other types, so resolvers never wait on AAAA."""

    def __init__(self, address: str) -> None:
        self.records: dict[str, list[str]] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 53))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.lock = threading.Lock()

    def set(self, name: str, addresses: list[str]) -> None:
        with self.lock:
            self.records[name] = list(addresses)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.sock.close()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(512)
            except OSError:
                return  # closed
            answer = self.answer(query)
            if answer is not None:
                self.sock.sendto(answer, peer)

    def answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        ident, _flags, qdcount = struct.unpack(">HHH", query[:6])
        name, end = _qname(query, 12)
        if qdcount != 1 or end + 4 > len(query):
            return None
        qtype = struct.unpack(">H", query[end : end + 2])[0]
        question = query[12 : end + 4]
        with self.lock:
            found = self.records.get(name.rstrip(".").lower())
        if found is None:
            return struct.pack(">HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question
        addresses = found if qtype == 1 else []
        header = struct.pack(">HHHHHH", ident, 0x8180, 1, len(addresses), 0, 0)
        records = b"".join(
            b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 1, 4) + socket.inet_aton(a) for a in addresses
        )
        return header + question + records


def _qname(packet: bytes, offset: int) -> tuple[str, int]:
    labels = []
    while offset < len(packet) and (length := packet[offset]) != 0:
        labels.append(packet[offset + 1 : offset + 1 + length].decode(errors="replace"))
        offset += 1 + length
    return ".".join(labels), offset + 1


class Network:
    """A bridge with an address of its own (where `Dns` listens) and hosts on it."""

    def __init__(self, index: int = 77) -> None:
        self.bridge = f"tlbr{index}"
        self.prefix = f"10.{index}.0"
        self.gateway = f"{self.prefix}.1"
        self.hosts: dict[str, Host] = {}
        self.dns: Dns | None = None
        self._next = 10

    def up(self) -> Network:
        self._clear_leftovers()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        self.dns = Dns(self.gateway)
        self.dns.start()
        return self

    def _clear_leftovers(self) -> None:
        """What an interrupted run left: its namespaces (and their processes), links, bridge."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in (line.split()[0] for line in listed.splitlines() if line.startswith("tl-")):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith("tl") and name.endswith(self.bridge[-3:]):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def host(self, name: str) -> Host:
        """A new host on the bridge, its own name resolving to it."""
        assert self.dns is not None and name not in self.hosts
        host = Host(name, f"{self.prefix}.{self._next}", self.bridge)
        self._next += 1
        host.create(self.gateway)
        self.hosts[name] = host
        self.dns.set(name, [host.address])
        return host

    def name(self, service: str, hosts: list[Host]) -> None:
        """`service` resolves to every address of `hosts` (compose's DNS for replicas)."""
        assert self.dns is not None
        self.dns.set(service, [h.address for h in hosts])

    def down(self) -> None:
        for host in self.hosts.values():
            host.destroy()
        if self.dns is not None:
            self.dns.close()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


LOCK = Path("/run/lock/tokenline-rehearsal.lock")
LOCK_WAIT_S = 1800.0  # a whole rehearsal, engines' start-up included, under a busy machine


@contextmanager
def _alone(path: Path = LOCK, wait: float = LOCK_WAIT_S) -> Iterator[None]:
    """The machine's only rehearsal while held: `Network.up` clears every `tl-` namespace it
    finds as an interrupted run's leftovers, which would kill a rehearsal still running. A
    second one waits for the first to end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as lock:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                lock.seek(0)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another rehearsal holds {path}: {lock.read()}") from None
                time.sleep(1)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        yield  # the lock goes with the file's closing


@contextmanager
def network(index: int = 77) -> Iterator[Network]:
    if os.geteuid() != 0:
        raise RuntimeError("the multi-host rehearsal needs root (network namespaces)")
    with _alone():
        net = Network(index).up()
        try:
            yield net
        finally:
            net.down()
