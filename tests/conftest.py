"""Session fixtures: offline models, and real vLLM servers shared by the whole run; and the
kind of every test, a marker given here at collection:

- `hosts`: under tests/hosts/ (network namespaces, root, engines of their own);
- `fleet`: the test, or a fixture it uses, requests `starts_vllm` (every fixture that starts a
  vLLM does, `fleet` among them, and so every pipeline in front of one), or is marked so;
- `slow`: marked so by hand: starts neither, but takes seconds (a child importing vLLM, a whole
  `tokenline up`, a sweep of every code point), too long for the fast run;
- `unit`: every other test. No vLLM engine, no network namespace: `pytest -m unit` is the fast
  run. A unit or slow test that starts either fails (tests/engine_guard.py).

Every vLLM a session needs is started at once on first use (each takes 20-45 s on this CPU),
and stopped at the end. A missing vLLM environment is an error, never a skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

from tests.engine_guard import Guard
from tokenline.launch import servers
from tokenline.launch.models.build import build
from tokenline.launch.models.lora import make_lora
from tokenline.launch.process import Process, start_all
from tokenline.shared.tokenizer import ModelTokenizer

if TYPE_CHECKING:
    from tests.proxy.conftest import Pipeline

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"  # tests keep their files in the repository's build/, wherever run from
MODEL_CACHE = Path(os.environ.get("TOKENLINE_MODEL_CACHE", BUILD / "models"))
HOSTS = Path(__file__).resolve().parent / "hosts"
KINDS = {
    "unit": "starts no server: no vLLM engine, no network namespace (the fast run)",
    "slow": "starts no vLLM engine and no namespace either, but is too slow for the fast run",
    "fleet": "starts real vLLM engines (it or a fixture it uses requests `starts_vllm`)",
    "hosts": "the multi-host rehearsal: network namespaces (root) and engines of its own",
}
"""Every test has one of these, given at collection (`pytest_collection_modifyitems`)."""
FAST_EXAMPLES = 10
settings.register_profile("fast", max_examples=FAST_EXAMPLES)
"""The fast run's Hypothesis profile (loaded by `-m unit`, or by --hypothesis-profile=fast):
every property test tries at most FAST_EXAMPLES examples, its own max_examples included. A run
without it tries what each test asks for (Hypothesis's 100 where it says nothing)."""
GUARD: list[Guard] = []
"""Keeps unit and slow tests from starting vLLM or a namespace (made once a run, in
`pytest_configure`)."""
SERVER_FREE = ("unit", "slow")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in KINDS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if not GUARD:
        GUARD.append(Guard())
    if config.option.markexpr == "unit" and not config.getoption("--hypothesis-profile"):
        settings.load_profile("fast")


def kind(item: pytest.Item) -> str:
    """The kind an unmarked test is (a `research` test is never `unit`: not in the fast run)."""
    if item.path.is_relative_to(HOSTS):
        return "hosts"
    if "starts_vllm" in getattr(item, "fixturenames", ()):
        return "fleet"
    return "research" if item.get_closest_marker("research") else "unit"


def _fewer_examples(item: pytest.Item) -> None:
    """Under the fast profile, a property test's own max_examples is capped at the profile's."""
    test = getattr(item, "obj", None)
    given = getattr(test, "_hypothesis_internal_use_settings", None)  # what @settings gave
    if given is not None and given.max_examples > FAST_EXAMPLES:
        test._hypothesis_internal_use_settings = settings(given, max_examples=FAST_EXAMPLES)


def _mark(item: pytest.Item) -> None:
    given = {m.name for m in item.iter_markers() if m.name in KINDS}
    found = kind(item)
    if found in ("fleet", "hosts") and given - {found}:
        raise pytest.UsageError(f"{item.nodeid} is marked {given}, but it is a {found} test")
    if not given and found in KINDS:
        item.add_marker(found)


@pytest.fixture(scope="session")
def starts_vllm() -> None:
    """Requested by every fixture that starts a vLLM engine (and by no other): the tests that
    use such a fixture are `fleet` tests. A test that starts one itself is marked `fleet`."""


@pytest.fixture(scope="session", autouse=True)
def workdir() -> Iterator[Path]:
    """Launch helpers (server logs) and the children tests start (`tokenline up`, benchmarks)
    write under the repository, not the current directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENLINE_WORKDIR", str(ROOT))
        yield ROOT


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build("tiny", MODEL_CACHE / "tiny")


@pytest.fixture(scope="session")
def qwen3_model() -> Path:
    return build("tiny-qwen3", MODEL_CACHE / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_loras(tiny_model: Path) -> tuple[Path, Path]:
    """Two LoRA adapters on the tiny model (seeds 1 and 2, rank 8, attention projections):
    each changes the greedy output, and not in the same way."""
    a1, a2 = (make_lora(tiny_model, MODEL_CACHE / f"tiny-lora-{s}", seed=s) for s in (1, 2))
    return a1, a2


@pytest.fixture(scope="session")
def qwen3_lora(qwen3_model: Path) -> Path:
    """A LoRA adapter on the tiny-qwen3 model (seed 1, rank 8, attention projections)."""
    return make_lora(qwen3_model, MODEL_CACHE / "tiny-qwen3-lora-1", seed=1)


@pytest.fixture(scope="session")
def tiny_tok(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


@pytest.fixture(scope="session")
def qwen3_tok(qwen3_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(qwen3_model)


HERMES_QWEN3 = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
)
"""Parser flags of the fleet's first parsing pair (Qwen3 as compose.yaml serves it)."""
CODER_R1 = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "qwen3_coder",
    "--reasoning-parser",
    "deepseek_r1",
)
"""The other pair: the XML tool parser and the legacy reasoning parser."""


@dataclass
class Fleet:
    """The vLLM servers of a test session (all real)."""

    oracle: Process  # vllm serve --enable-scale-out on tiny: the oracle, and tokenline's engine
    bare: Process  # vllm serve --tokens-only on tiny: the generate tier without a tokenizer
    oracle_qwen3: Process
    render: Process  # vllm launch render on tiny
    render_qwen3: Process
    prefill: Process  # P/D pair on tiny as `tokenline generate` runs it, NixlConnector, pinned
    decode: Process  # to cores 0 and 1
    # vllm serve on tiny-qwen3 with HERMES_QWEN3, then CODER_R1: oracles, tokenline's engines
    # for those flags, and vLLM's render for them (a served engine answers /render too; a
    # `vllm launch render` each would cost a GB the fleet does not have)
    oracle_hermes: Process
    oracle_coder: Process

    @property
    def generate(self) -> Process:
        """tokenline's generate tier on tiny. It is the oracle's own engine, which tokenline
        asks for token IDs only (`detokenize: false`), as `tokenline generate` runs it: the
        same command line, so one process serves both and the fleet stays small."""
        return self.oracle

    def all(self) -> list[Process]:
        return [
            self.oracle,
            self.bare,
            self.oracle_qwen3,
            self.render,
            self.render_qwen3,
            self.prefill,
            self.decode,
            self.oracle_hermes,
            self.oracle_coder,
        ]


REUSE = Path(os.environ.get("TOKENLINE_FLEET_FILE", BUILD / "fleet.json"))


def _reused() -> Fleet | None:
    """Developer speed-up: with TOKENLINE_REUSE_FLEET=1 a fleet outlives the run and the next
    run reuses it (never in CI, which always starts its own)."""
    if os.environ.get("TOKENLINE_REUSE_FLEET") != "1" or not REUSE.exists():
        return None
    found = {k: Process(k, [], port) for k, port in json.loads(REUSE.read_text()).items()}
    if set(found) != set(Fleet.__dataclass_fields__):
        return None
    return Fleet(**found) if all(s.healthy() for s in found.values()) else None


STARTED: list[Fleet] = []
"""The fleet this session started (stopped after its last user: `pytest_runtest_teardown`)."""
LAST_USER: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Mark each test with its kind (before `-m` selects on it); then, once the tests are
    selected and in the order they will run (shuffled by --random-order), remember the last one
    that needs the fleet: the tests after it (`tokenline up` with its own engines) get the
    memory nine vLLMs hold."""
    fast = settings.get_current_profile_name() == "fast"
    for item in items:
        _mark(item)
        if fast:
            _fewer_examples(item)
    yield
    users = [item for item in items if "fleet" in getattr(item, "fixturenames", ())]
    LAST_USER[:] = users[-1:]


def _server_free(item: pytest.Item) -> str | None:
    return next((k for k in SERVER_FREE if item.get_closest_marker(k) is not None), None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if _server_free(item):
        GUARD[0].arm(item.nodeid)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if LAST_USER and item is LAST_USER[0] and nextitem is not None:
        for fleet in STARTED:
            for server in fleet.all():
                server.stop()
    yield
    if _server_free(item) and (started := GUARD[0].disarm()):
        pytest.fail(
            f"{item.nodeid} is a {_server_free(item)} test, which starts no vLLM engine and no "
            "network namespace; it started "
            + "; ".join(started)
            + ". A test that starts vLLM requests the `starts_vllm` fixture or is marked "
            "`fleet` (tests/conftest.py)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def fleet(starts_vllm: None, tiny_model: Path, qwen3_model: Path) -> Iterator[Fleet]:
    if (reused := _reused()) is not None:
        yield reused
        return
    f = Fleet(
        oracle=servers.oracle("vllm-oracle-tiny", tiny_model, "tiny"),
        bare=servers.tokens_only("vllm-tokens-only-tiny", tiny_model, "tiny"),
        oracle_qwen3=servers.oracle("vllm-oracle-qwen3", qwen3_model, "tiny-qwen3"),
        render=servers.vllm_render("vllm-render-tiny", tiny_model, "tiny"),
        render_qwen3=servers.vllm_render("vllm-render-qwen3", qwen3_model, "tiny-qwen3"),
        prefill=servers.generate_role("vllm-prefill-tiny", tiny_model, "prefill", "0"),
        decode=servers.generate_role("vllm-decode-tiny", tiny_model, "decode", "1"),
        oracle_hermes=servers.oracle(
            "vllm-oracle-hermes", qwen3_model, "tiny-qwen3", *HERMES_QWEN3
        ),
        oracle_coder=servers.oracle("vllm-oracle-coder", qwen3_model, "tiny-qwen3", *CODER_R1),
    )
    try:
        start_all(f.all(), 900)  # nine vLLMs booting at once on a small CPU
    except BaseException:
        # a fleet that failed to start is stopped even when it would have been reused: left
        # running, its survivors hold the memory the next attempt needs
        for server in f.all():
            server.stop()
        raise
    if os.environ.get("TOKENLINE_REUSE_FLEET") == "1":
        REUSE.write_text(json.dumps({k: v.port for k, v in vars(f).items()}))
        yield f
        return
    STARTED.append(f)
    try:
        yield f
    finally:
        for server in f.all():
            server.stop()


SMOLLM2 = "smollm2"
"""The real model's served name (`tokenline make-model smollm2`, SmolLM2-135M-Instruct, float32)."""
SMOLLM2_START_S = 900.0  # vLLM loads ~540 MB of float32 weights, on a CPU shared with the suite


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    return build(SMOLLM2, MODEL_CACHE / SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_engine(starts_vllm: None, smollm2_model: Path) -> Iterator[Process]:
    """One `vllm serve --enable-scale-out` on the real model: monolithic vLLM through its OpenAI
    routes (the oracle), and tokenline's generate tier through its token routes."""
    engine = servers.oracle("vllm-oracle-smollm2", smollm2_model, SMOLLM2).start()
    try:
        engine.wait_healthy(SMOLLM2_START_S)
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def smollm2_pipeline(smollm2_model: Path, smollm2_engine: Process) -> Iterator[Pipeline]:
    from tests.proxy.conftest import start_pipeline  # (that module imports this one)

    p = start_pipeline(SMOLLM2, smollm2_model, [smollm2_engine.url], served=SMOLLM2)
    try:
        yield p
    finally:
        for s in p.all():
            s.stop()
