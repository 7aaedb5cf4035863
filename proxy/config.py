"""Proxy configuration: one frozen object, from the command line or the environment."""

from __future__ import annotations

import argparse
import os
from argparse import SUPPRESS
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from tokenline.proxy.routing.cache_aware import Policy
from tokenline.shared.config import CommandLine, NonNegative, Option, Port, Positive, Seconds
from tokenline.shared.cpu import CpuPolicy

Urls = Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
REPLICAS = "replica URLs; a hostname with several addresses is several replicas"


class ServedModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model behind the proxy: its served name and the replicas of its four pools."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    render: Urls
    derender: Urls
    decode: Urls
    prefill: tuple[str, ...] = ()


class ModelsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`--models-file`: `{"models": [{"name": ..., "render": [urls], "derender": [...],
    "prefill": [...], "decode": [...]}, ...]}`; the first is the default model."""

    models: Annotated[tuple[ServedModel, ...], msgspec.Meta(min_length=1)]


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Field order is --help's order (kw_only: required fields need not come first).
    render_urls: Urls = ()  # given: at least one (or a models file instead)
    derender_urls: Urls = ()
    prefill_urls: tuple[str, ...] = ()
    """Empty: decode instances prefill for themselves."""
    decode_urls: Urls = ()
    models_file: str | None = None
    """Several models: a JSON file naming each model's replicas (`{"models": [{"name",
    "render", "derender", "prefill", "decode"}, ...]}`, the first the default), instead of
    --render, --derender, --prefill and --decode for one model. A request goes to the pools of
    the model it names (or of the base model of the LoRA adapter it names)."""
    models: tuple[ServedModel, ...] = ()
    """The models of `models_file` (read by `from_args`)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: Port = 8000
    """Port to listen on."""
    cpu_policy: CpuPolicy = "batch"
    """How the kernel schedules the proxy: batch (Linux SCHED_BATCH: its wake-ups never
    preempt a running process, such as vLLM's API server on a shared core) or normal
    (`shared/cpu.py`)."""
    generate_tokens_only: bool = False
    """The generate pools run vLLM with `--tokens-only` (no tokenizer): requests that need one
    (structured outputs, bad_words) are refused with a 400 before any engine work."""
    api_key: str | None = None
    """Clients must send `Authorization: Bearer <key>`. From a file or the environment, never
    the command line (where `ps` shows it); without one the proxy refuses to start unless
    `open`."""
    open: bool = False
    """Serve without an API key, on purpose (anyone who reaches the port may use it)."""
    generate_api_key: str | None = None
    """Sent as `Authorization: Bearer <key>` on every call to a generate replica (vLLM's
    `--api-key` / VLLM_API_KEY); render and derender never see it."""
    derender_transport: Literal["http", "batched"] = "http"
    """How stream chunks reach derender: http (vLLM's routes, one call per chunk; any
    vLLM-compatible derender) or batched (the chunks of every stream in one call per derender
    replica, `derender_batch_wait`, over one batch socket per replica; tokenline's derender
    only)."""
    derender_batch_wait: Seconds = 0.006
    """batched: longest a call waits for the chunks other streams get in the same engine step
    (a batch goes as soon as every stream's chunk is in). vLLM's API server writes a step's
    chunks one stream after another: at 16 streams on the 2-core box they reached the proxy
    over 4-6 ms, so 2 ms cut each step into two batches of ~9 and ~6 (6 ms: one of ~14, and
    ~25% less proxy + derender CPU per token)."""
    prefill_first_token: bool = True
    """P/D: a stream shows the first token as soon as the prefill leg has it, instead of
    after the decode leg has pulled the KV and sampled the same token again (which is then
    checked and dropped). Sampling requests without a seed get one for both legs, so that the
    two engines draw the same first token (`proxy/flow/first_token.py`)."""
    routing: Policy = "cache-aware"
    """How a generate replica (decode, and P/D's prefill leg) is chosen: cache-aware (the
    prompt's prefix each replica is expected to hold, against its load: uncached prompt tokens
    in flight and requests running; block size and hash algorithm read from each engine's
    /metrics, a replica that disagrees with its pool kept out), least-loaded (requests in
    flight) or round-robin."""
    kv_events_offset: Port | None = None
    """The generate engines publish vLLM's KV events (`--kv-events-config`) on their HTTP port
    plus this offset, and replay them one port above; the proxy then follows what each engine
    stores and evicts. Unset: routing knows what the proxy sent where, lately."""
    kv_events_ipc: str | None = None
    """Instead of `kv_events_offset`: the generate engines run on this machine and publish
    their KV events on unix sockets in this directory, named by their HTTP port (`<port>`,
    replayed from `<port>.replay`; `tokenline up`, `tokenline generate --kv-events-ipc`)."""
    prefix_hash_seed: str | None = None
    """The generate engines' PYTHONHASHSEED, if they set one: vLLM seeds block hashes with it."""
    skip_prefill_within: NonNegative = 256
    """P/D, cache-aware: a prompt whose decode replica is expected to hold all of it but at
    most this many tokens runs decode-only there, without a prefill leg (0: never)."""
    routing_cap: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    """Cache-aware: a replica takes a prompt only if its standing after (the prompt tokens
    sent there lately, decayed, plus its running streams) is at most this many times the
    pool's mean; a conversation's home (the replica that alone holds most of the prompt: its
    history) only needs to be within it before taking the turn. The balance under one hot
    prefix."""
    routing_half_life: Seconds = 300.0
    """Cache-aware: seconds over which the prompt tokens sent to a replica count half as
    much toward its standing (how long the cap remembers finished work)."""
    routing_stream_cost: Annotated[float, msgspec.Meta(ge=0)] = 64.0
    """Cache-aware: prompt tokens of work one running stream weighs as, in a replica's load
    and standing."""
    routing_compute_cost: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    """Cache-aware: what a prompt token a replica would compute (not cached there) weighs
    against a token of work already in flight; above 1, a prompt goes where its prefix is
    cached rather than follow the moment's load."""
    health_interval: Seconds = 2.0
    """Seconds between health checks of each replica."""
    max_in_flight: Positive = 1024
    """Requests served at once; more wait in a queue served by priority."""
    max_queued: NonNegative = 1024
    """Requests waiting for a slot; more are refused with 429 and Retry-After."""
    max_body_bytes: Positive = 32 * 1024 * 1024
    """Largest request body accepted; larger ones are refused with 413."""
    resolve_interval: Seconds = 10.0
    retry_attempts: Positive = 3
    retry_timeout: Seconds = 10.0
    connect_timeout: Seconds = 3.0
    """Seconds to open a connection to any replica."""
    hop_timeout: Seconds = 60.0
    """Seconds render or derender may take to answer one call (then: another replica)."""
    first_token_timeout: Seconds = 600.0
    """Seconds generate may take to start answering (a whole answer: to finish it)."""
    stream_idle_timeout: Seconds = 120.0
    """Seconds a generate stream may stay silent between chunks before it counts as hung."""
    drain_timeout: Seconds = 30.0
    """Seconds requests in flight get to finish after SIGTERM (new ones get 503 meanwhile);
    then the rest are cut and aborted upstream."""
    store: str = "responses.db"
    """Where `/v1/responses` keeps stored responses (per API key): a SQLite file (a path,
    relative to the working directory, made on first use) for one proxy, or a PostgreSQL URL
    (postgresql://user:password@host/db, from TOKENLINE_STORE: not `ps`-visible) that the
    proxies of one deployment share. The schema migrates itself."""
    store_ttl: NonNegative = 30 * 24 * 3600
    """Seconds a stored response is kept after its creation (30 days, as OpenAI keeps them);
    an expired one is not found, and is purged. 0: kept until deleted."""


def _url(text: str) -> str:
    return text.rstrip("/")


def read_key(path: str) -> str:
    """A key from a file (a mounted Secret), without the trailing newline editors add."""
    with open(path, encoding="utf-8") as f:
        key = f.read().strip()
    if not key:
        raise ValueError(f"no key in {path!r}")
    return key


def _replicas(role: str) -> Option:
    return Option(
        flag=f"--{role}",
        env=f"TOKENLINE_{role.upper()}_URLS",
        help=f"{role} {REPLICAS}",
        nargs="*",
        sep=",",
        parse=_url,
    )


def _key_file(field: str, whose: str) -> Option:
    flag = field.replace("_", "-")
    return Option(
        flag=f"--{flag}-file",
        env=f"TOKENLINE_{field.upper()}_FILE",
        help=f"a file holding {whose}; TOKENLINE_{field.upper()} may hold the key itself",
        parse=read_key,
    )


CLI = CommandLine(
    ProxyConfig,
    {f"{role}_urls": _replicas(role) for role in ("render", "derender", "prefill", "decode")}
    | {
        "port": Option(env="TOKENLINE_PORT"),
        "models_file": Option(env="TOKENLINE_MODELS_FILE"),
        "store": Option(env="TOKENLINE_STORE"),
        "store_ttl": Option(env="TOKENLINE_STORE_TTL"),
        "open": Option(env="TOKENLINE_OPEN"),
        **{
            f"routing_{name}": Option(env=f"TOKENLINE_ROUTING_{name.upper()}")
            for name in ("cap", "half_life", "stream_cost", "compute_cost")
        },
        "api_key": _key_file("api_key", "the key clients must send"),
        "generate_api_key": _key_file("generate_api_key", "the key generate replicas require"),
    },
    # Tuning kept off the command line until someone needs it: each would be one more flag.
    exclude={
        "models",
        "resolve_interval",
        "retry_attempts",
        "retry_timeout",
    },
)

KEY_VARS = {"TOKENLINE_API_KEY": "api_key", "TOKENLINE_GENERATE_API_KEY": "generate_api_key"}
"""Keys given as they are, in the environment (a key never goes on the command line)."""
ENV = CLI.env_vars | KEY_VARS
"""Environment variable -> the field it sets (compose.yaml and the k8s manifest use these)."""
_KEYS_FROM_ENV = "keys_from_env"  # the namespace attribute add_arguments leaves them in
CLOSED = (
    "the proxy runs closed and has no API key: give it one in a file (--api-key-file or "
    "TOKENLINE_API_KEY_FILE, e.g. a mounted Secret) or in TOKENLINE_API_KEY, or serve "
    "without one on purpose with --open (TOKENLINE_OPEN=1)"
)


class _NoKeyOnTheCommandLine(argparse.Action):
    """`--api-key` used to take the key itself: refused by name (argparse would otherwise
    read it as an abbreviation of --api-key-file), without echoing the value."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(
            "--api-key is gone: a key on the command line shows in `ps`. Put it in a file "
            "(--api-key-file, TOKENLINE_API_KEY_FILE) or in TOKENLINE_API_KEY"
        )


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    CLI.add_arguments(parser, env)
    parser.add_argument(
        "--api-key",
        nargs="?",
        action=_NoKeyOnTheCommandLine,
        dest="refused_api_key",
        default=SUPPRESS,
        help=SUPPRESS,
    )
    keys = {field: env[var] for var, field in KEY_VARS.items() if env.get(var, "").strip()}
    parser.set_defaults(**{_KEYS_FROM_ENV: keys})


def from_args(args: argparse.Namespace) -> ProxyConfig:
    """The config, closed unless told otherwise: SystemExit without a key and without `open`."""
    keys: dict[str, str] = getattr(args, _KEYS_FROM_ENV, {})
    for field in keys:
        if hasattr(args, field):
            var = next(v for v, f in KEY_VARS.items() if f == field)
            raise SystemExit(f"{var} and {CLI.flags[field]} both give a key: give one")
    config = CLI.build(args, **{field: key.strip() for field, key in keys.items()})
    config = with_models(config)
    if config.api_key is None and not config.open:
        raise SystemExit(CLOSED)
    if config.api_key is not None and config.open:
        raise SystemExit("--open (TOKENLINE_OPEN) and an API key contradict each other")
    return config


FLAT = ("render_urls", "derender_urls", "prefill_urls", "decode_urls")


def with_models(config: ProxyConfig) -> ProxyConfig:
    """`config` with the models of its models file read in; SystemExit for a file that cannot
    be read, for both a file and replica flags, or for neither."""
    flat = [CLI.flags[f] for f in FLAT if getattr(config, f)]
    if config.models_file is None:
        envs = {field: var for var, field in CLI.env_vars.items()}
        for f in FLAT:
            if f != "prefill_urls" and not getattr(config, f):
                raise SystemExit(
                    f"argument {CLI.flags[f]} (or {envs[f]}) is required "
                    "(or --models-file, for several models)"
                )
        return config
    if flat:
        raise SystemExit(f"--models-file names every model's replicas: drop {', '.join(flat)}")
    return msgspec.structs.replace(config, models=read_models(config.models_file))


def read_models(path: str) -> tuple[ServedModel, ...]:
    try:
        with open(path, "rb") as f:
            found = msgspec.json.decode(f.read(), type=ModelsFile)
    except OSError as exc:
        raise SystemExit(f"--models-file {path!r}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:  # ValidationError included
        raise SystemExit(f"--models-file {path!r}: {exc}") from None
    names = [m.name for m in found.models]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise SystemExit(f"--models-file {path!r}: model {dup[0]!r} is named twice")
    return tuple(
        msgspec.structs.replace(
            m,
            render=tuple(map(_url, m.render)),
            derender=tuple(map(_url, m.derender)),
            prefill=tuple(map(_url, m.prefill)),
            decode=tuple(map(_url, m.decode)),
        )
        for m in found.models
    )


def served_models(config: ProxyConfig) -> tuple[ServedModel | None, ...]:
    """The models to serve: the models file's, else one unnamed model of the replica flags
    (None: its name is whatever its render replicas serve)."""
    return config.models or (None,)
