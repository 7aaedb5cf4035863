"""The rehearsal deployment: compose.yaml's services, each on a host of its own.

Hosts: `prefill`, `decode-0` and `decode-1` (the generate pools), `render-0`/`render-1`,
`derender-0`/`derender-1` and `proxy`; each compose service name resolves to every host of
that service, as compose's DNS answers for replicas. The test process is the client, reaching
the proxy over the bridge. Started once for the module (three engines boot in ~1 minute).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.hosts.deployment import ServiceSpec, as_host_process, services
from tests.hosts.network import Host, Network, network
from tokenline.launch.process import Process, wait_all

ROOT = str(Path(__file__).resolve().parents[2])
SERVED = "tiny"
API_KEY = "rehearsal-key"
GENERATE_KEY = "rehearsal-generate-key"
RESOLVE_INTERVAL = 10.0  # the proxy's (ProxyConfig.resolve_interval)
REPLICAS = {"generate-prefill": 1, "generate-decode": 2, "render": 2, "derender": 2, "proxy": 1}
# Test-only settings on top of compose's: health checks and stream limits in seconds, so a
# partition is noticed while a test waits, not after compose's production intervals.
PROXY_EXTRA = ["--health-interval", "0.5", "--stream-idle-timeout", "20", "--hop-timeout", "10"]


@dataclass
class Rehearsal:
    net: Network
    specs: dict[str, ServiceSpec]
    hosts: dict[str, list[Host]] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)

    @property
    def proxy(self) -> Process:
        return self.processes["proxy-0"]

    def start(self, service: str, index: int) -> Process:
        """One more replica of `service` on a new host (it joins the service's name)."""
        spec = self.specs[service]
        host = self.net.host(f"{service}-{index}")
        argv = spec.argv + (PROXY_EXTRA if service == "proxy" else [])
        process = host.run(
            f"{service}-{index}", as_host_process(host.name, argv), spec.port, spec.env
        )
        if service == "proxy":
            process.ready = (200, 503)
        self.hosts.setdefault(service, []).append(host)
        self.net.name(service, self.hosts[service])
        self.processes[f"{service}-{index}"] = process
        return process.start()

    def retire(self, service: str, index: int) -> None:
        """Scale down: the replica leaves the name first, then stops."""
        name = f"{service}-{index}"
        host = self.net.hosts[name]
        self.hosts[service].remove(host)
        self.net.name(service, self.hosts[service])
        self.processes.pop(name).stop()

    def service_of(self, host: Host) -> str:
        return next(s for s, hosts in self.hosts.items() if host in hosts)

    def slow_link(self, target: Host, delay: float) -> Process:
        """`target` behind a delaying relay on a host of its own: the service's name resolves
        to the relay instead of `target` (and the proxy re-resolves within its interval)."""
        service = self.service_of(target)
        port = self.specs[service].port
        host = self.net.host(f"slow-{target.name}")
        argv = [sys.executable, "-m", "tests.hosts.relay", "--listen", f"0.0.0.0:{port}"]
        argv += ["--to", f"{target.address}:{port}", "--delay", str(delay)]
        relay = host.run(f"relay-{target.name}", argv, port, {**os.environ, "PYTHONPATH": ROOT})
        relay.start().wait_healthy(30)  # its /health is the target's, through the relay
        self.net.name(service, [host, *(h for h in self.hosts[service] if h is not target)])
        time.sleep(RESOLVE_INTERVAL + 2)
        return relay

    def fast_link(self, target: Host, relay: Process) -> None:
        self.net.name(self.service_of(target), self.hosts[self.service_of(target)])
        time.sleep(RESOLVE_INTERVAL + 2)
        relay.stop()


@pytest.fixture(scope="module")
def rehearsal(tiny_model: Path) -> Iterator[Rehearsal]:
    variables = {"TOKENLINE_API_KEY": API_KEY, "TOKENLINE_GENERATE_API_KEY": GENERATE_KEY}
    with network() as net:
        r = Rehearsal(net, services(str(tiny_model), SERVED, variables))
        backends = [
            r.start(service, i)
            for service, count in REPLICAS.items()
            if service != "proxy"
            for i in range(count)
        ]
        wait_all(backends, 600)
        r.start("proxy", 0).wait_healthy(60)
        yield r
