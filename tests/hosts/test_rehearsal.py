"""The multi-host rehearsal: compose.yaml's deployment across network namespaces, with real P/D
between hosts, DNS scale-up and scale-down, a partitioned host and a slow link on each tier.

Every scenario runs greedy streams through the proxy and reports streams started / completed /
identical (to the same requests run before any fault) / errored.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.hosts.conftest import API_KEY, SERVED, Rehearsal
from tests.hosts.network import Host
from tests.proxy.conftest import engine_metric
from tokenline.launch.bench import sse
from tokenline.launch.bench.corpus import TEXTS
from tokenline.launch.process import Process

KV_MOVED = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
BASELINE: dict[tuple[int, int], str] = {}
"""The reference answer of stream i at max_tokens, run alone on the whole deployment (made by
the first test that needs it, whichever runs first: `references`)."""
SHORT = 48
LONG = 1500
"""The migration test's streams: ~4 s each at the tiny engine's ~400 tokens/s (prompt + output
within its 2,048), so that between every started stream showing output and the first one
ending there is time for many polls of the victim's metrics (at 400 tokens that window was
~1 s, and a CI run missed it)."""


def body(i: int, max_tokens: int = SHORT) -> dict[str, Any]:
    return {
        "model": SERVED,
        "messages": [{"role": "user", "content": TEXTS[i % len(TEXTS)] * (1 + i % 3)}],
        "max_tokens": max_tokens,
        # long streams run to max_tokens (no early EOS), so that the streams on a decode engine
        # killed mid-stream are still running when the kill comes, whichever engine they got
        "ignore_eos": max_tokens >= LONG,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Report:
    started: int = 0
    completed: int = 0
    identical: int = 0
    errored: int = 0
    errors: list[str] = field(default_factory=list)
    # content chunks each stream (by index) has received so far
    received: dict[int, int] = field(default_factory=dict)
    killed: bool = False  # the fault struck (a fault may find its moment never came)

    def show(self, scenario: str) -> str:
        line = (
            f"[rehearsal] {scenario}: started {self.started} completed {self.completed} "
            f"identical {self.identical} errored {self.errored}"
        )
        print(line, file=sys.stderr)
        return line


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    i: int,
    max_tokens: int = SHORT,
    received: dict[int, int] | None = None,
) -> str:
    """One greedy stream's text and usage, counting its content chunks in `received[i]`; an
    HTTP or in-band error raises."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reasoning: list[str] = []
    text: list[str] = []
    usage = None
    sent = body(i, max_tokens)
    async with session.post(url + "/v1/chat/completions", json=sent, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for payload in sse.aiter_payloads(resp):
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk["choices"]:  # reasoning (with parsers) and content
                reasoning += [c["delta"].get("reasoning") or ""]
                text += [c["delta"].get("content") or ""]
            if received is not None and chunk["choices"]:
                received[i] = received.get(i, 0) + 1
            usage = chunk.get("usage") or usage
    return json.dumps({"reasoning": "".join(reasoning), "text": "".join(text), "usage": usage})


async def references(r: Rehearsal, count: int, max_tokens: int = SHORT) -> None:
    """`BASELINE` for streams 0 to count-1, each missing one run alone, before any fault."""
    missing = [i for i in range(count) if (i, max_tokens) not in BASELINE]
    if not missing:
        return
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        for i in missing:  # one at a time: the reference texts
            BASELINE[i, max_tokens] = await stream(session, r.proxy.url, i, max_tokens)


async def workload(
    r: Rehearsal,
    count: int,
    fault: Callable[[], Awaitable[None]] | None = None,
    spacing: float = 0.05,
    max_tokens: int = SHORT,
    report: Report | None = None,
) -> Report:
    """`count` streams started `spacing` s apart, `fault` run once a third have started (and
    before the rest start), reported in `report` (a new one by default) as they go; compared
    with their `references` (made first if this is the first test to need them)."""
    await references(r, count, max_tokens)
    report = report or Report()
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int) -> None:
            report.started += 1
            try:
                text = await stream(session, r.proxy.url, i, max_tokens, report.received)
            except Exception as exc:  # a failed stream is a data point, not a test error
                report.errored += 1
                report.errors.append(repr(exc)[:300])
                return
            report.completed += 1
            report.identical += BASELINE.get((i, max_tokens)) == text

        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(one(i)))
            if fault is not None and i == count // 3:
                await asyncio.sleep(0.3)
                await fault()
            await asyncio.sleep(spacing)
        await asyncio.gather(*tasks)
    return report


def proxy_metric(r: Rehearsal, name: str) -> float:
    """A metric of the proxy (closed: its /metrics wants the key like every other path)."""
    request = urllib.request.Request(
        r.proxy.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def work_done(r: Rehearsal, host: Host) -> float:
    """Requests (health checks aside) the service on `host` has served."""
    process = next(p for p in r.net.hosts[host.name].processes if p.name == host.name)
    service = r.service_of(host)
    if service.startswith("generate"):
        return engine_metric(process, "vllm:request_success_total")
    return engine_metric(process, f"tokenline_{service}_requests_total", "/v1/")


def served_by(derender: Process) -> float:
    return engine_metric(derender, "tokenline_derender_requests_total")


@pytest.fixture(autouse=True)
async def serving(rehearsal: Rehearsal) -> None:
    """Each test starts on the whole deployment in the proxy's rotation: a replica a test
    before it restarted (or left partitioned when it failed) is back first."""
    for service in ("render", "derender", "generate-prefill", "generate-decode"):
        await _until_serving(rehearsal, service, len(rehearsal.hosts[service]), within=120)


async def test_baseline_and_pd_moves_kv_between_hosts(rehearsal: Rehearsal) -> None:
    decodes = [rehearsal.processes[f"generate-decode-{i}"] for i in range(2)]
    moved = sum(engine_metric(d, *KV_MOVED) for d in decodes)
    for i in range(12):  # made here, by this test, whatever ran before it
        BASELINE.pop((i, SHORT), None)
    await references(rehearsal, 12)
    # the model writes something every time (so "identical" compares real text)
    assert all(json.loads(BASELINE[i, SHORT])["text"] for i in range(12))
    report = await workload(rehearsal, 12)
    report.show("P/D across hosts")
    assert (report.completed, report.identical, report.errored) == (12, 12, 0), report.errors
    assert sum(engine_metric(d, *KV_MOVED) for d in decodes) > moved  # KV pulled from prefill
    assert all(engine_metric(d, *KV_MOVED) > 0 for d in decodes)  # DNS spread the decodes


@pytest.mark.parametrize("service", ["render", "derender", "generate-decode"])
async def test_a_partitioned_host_loses_no_stream(rehearsal: Rehearsal, service: str) -> None:
    host = rehearsal.hosts[service][0]

    async def cut() -> None:
        host.partition()

    try:
        report = await workload(rehearsal, 12, cut)
    finally:
        host.partition(cut=False)
    report.show(f"partition of {host.name}")
    # render and derender calls on the cut host are given up as soon as its health checks
    # fail and retried on the other replica; decode streams migrate to the other engine
    assert (report.completed, report.identical, report.errored) == (12, 12, 0), report.errors
    await _until_serving(rehearsal, service, len(rehearsal.hosts[service]))


async def _until_serving(r: Rehearsal, service: str, count: int, within: float = 30) -> None:
    role = {"generate-decode": "decode", "generate-prefill": "prefill"}.get(service, service)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        for _ in range(int(within / 0.5)):
            async with session.get(r.proxy.url + "/health", headers=headers) as resp:
                pools = (await resp.json())["pools"]
            if pools[role]["healthy"] == count and pools[role]["replicas"] == count:
                return
            await asyncio.sleep(0.5)
    raise AssertionError(f"{service}: not {count} serving replicas after {within} s: {pools}")


async def test_dns_scale_up_then_down(rehearsal: Rehearsal) -> None:
    newcomer = rehearsal.start("derender", 2).wait_healthy(60)
    await _until_serving(rehearsal, "derender", 3, within=40)  # re-resolved, then checked
    before = served_by(newcomer)
    report = await workload(rehearsal, 12)
    report.show("after scale-up to 3 derenders")
    assert (report.completed, report.identical, report.errored) == (12, 12, 0), report.errors
    assert served_by(newcomer) > before  # the new replica takes traffic

    async def scale_down() -> None:
        rehearsal.retire("derender", 2)

    report = await workload(rehearsal, 12, scale_down)
    report.show("during scale-down to 2 derenders")
    assert (report.completed, report.identical, report.errored) == (12, 12, 0), report.errors
    await _until_serving(rehearsal, "derender", 2, within=40)


@pytest.mark.parametrize("service", ["render", "derender", "generate-decode"])
async def test_a_slow_link_on_each_tier_loses_nothing(rehearsal: Rehearsal, service: str) -> None:
    """One replica behind a relay adding 40 ms each way: answers unchanged, nothing lost."""
    target = rehearsal.hosts[service][0]
    relay = await asyncio.to_thread(rehearsal.slow_link, target, 0.04)
    before = work_done(rehearsal, target)
    try:
        report = await workload(rehearsal, 12)
    finally:
        await asyncio.to_thread(rehearsal.fast_link, target, relay)
    report.show(f"slow link to {target.name}")
    assert (report.completed, report.identical, report.errored) == (12, 12, 0), report.errors
    # only the relay reaches it now (its own address is out of DNS): traffic took the slow link
    assert work_done(rehearsal, target) > before


@pytest.mark.parametrize("victim", ["render-1", "derender-1", "generate-prefill-0"])
async def test_a_dead_replica_loses_nothing(rehearsal: Rehearsal, victim: str) -> None:
    """SIGKILL of a render or derender replica, or of the only prefill engine, under load:
    calls on it go to the other replica (render, derender: pure hops) or decode-only (prefill),
    and every stream finishes identical. The replica is started again afterwards."""
    process = rehearsal.processes[victim]

    async def kill() -> None:
        process.stop(signal.SIGKILL)

    try:
        report = await workload(rehearsal, 12, kill)
    finally:
        if process.exited():  # (not if the workload failed before the kill)
            await asyncio.to_thread(lambda: process.start().wait_healthy(600))
    report.show(f"SIGKILL of {victim}")
    assert (report.completed, report.identical, report.errored) == (12, 12, 0), report.errors
    service = victim.rsplit("-", 1)[0]
    await _until_serving(rehearsal, service, len(rehearsal.hosts[service]), within=60)


ATTEMPTS = 3


def _killer(
    victim: Process, report: Report, seen: list[tuple[float, list[int], int]]
) -> Callable[[], Awaitable[None]]:
    """SIGKILL of `victim` once a stream runs on it and has sent output (else it reruns, not
    migrates): every stream started so far has reached its client, so whichever runs on the
    victim has (the rest start after the kill). The engine's own token count is not enough: a
    proxy lagging under the suite's load had once sent none of them. No kill (the round is
    then run again) if that moment never comes: every stream started has ended, or 60 s
    passed (under the suite's load one had shown 4 chunks for its 1,500 tokens)."""

    async def kill() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and report.completed < report.started:
            running = await asyncio.to_thread(engine_metric, victim, "vllm:num_requests_running")
            shown = [report.received.get(i, 0) for i in range(report.started)]
            seen[:] = [(running, shown, report.completed)]
            if running >= 1 and min(shown, default=0) >= 5:
                victim.stop(signal.SIGKILL)
                report.killed = True
                return
            await asyncio.sleep(0.05)

    return kill


async def test_decode_death_mid_stream_is_survived_by_migration(rehearsal: Rehearsal) -> None:
    """SIGKILL of one of the two decode engines while long streams run on both: every affected
    stream continues on the other one, identical to an unbroken run, usage counted once. The
    killed engine is started again afterwards."""
    # both decodes in the rotation (a test before may have partitioned decode-0): else every
    # stream may run on decode-1 and the kill hits an idle engine
    await _until_serving(rehearsal, "generate-decode", 2, within=60)
    await references(rehearsal, 6, LONG)
    victim = rehearsal.processes["generate-decode-0"]
    before = proxy_metric(rehearsal, "tokenline_proxy_migrations_total")

    seen: list[tuple[float, list[int], int]] = []
    try:
        for _ in range(ATTEMPTS):  # a round whose streams all end before the moment comes: again
            report = Report()
            kill = _killer(victim, report, seen)
            await workload(rehearsal, 6, kill, spacing=0.1, max_tokens=LONG, report=report)
            if report.killed:
                break
    finally:
        if victim.exited():
            await asyncio.to_thread(lambda: victim.start().wait_healthy(600))
    report.show("SIGKILL of generate-decode-0")
    assert (report.completed, report.identical, report.errored) == (6, 6, 0), report.errors
    # last seen: (the victim's running requests, chunks each stream had shown, completed)
    assert report.killed, f"no stream ran on the victim with output in {ATTEMPTS} rounds {seen}"
    assert proxy_metric(rehearsal, "tokenline_proxy_migrations_total") > before
    await _until_serving(rehearsal, "generate-decode", 2, within=60)
