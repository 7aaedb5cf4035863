"""Command-line options built from config structs: each default lives in the struct alone."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import msgspec
import pytest

from tokenline.launch.cli import parser as tokenline_parser
from tokenline.proxy import config as proxy
from tokenline.services.derender import config as derender
from tokenline.services.render import config as render
from tokenline.shared.config import CommandLine, Option, Port, Positive, attribute_docs


class Toy(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    """The name; 100% required."""
    count: Positive = 2
    ratio: Annotated[float, msgspec.Meta(gt=0, description="a described ratio")] = 0.5
    mode: Literal["a", "b"] = "a"
    verbose: bool = False
    colour: bool = True
    """Colour the output."""
    tags: tuple[str, ...] = ()
    urls: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)] = ("http://x",)
    port: Port | None = None
    secret: dict[str, int] = {}


TOY = CommandLine(
    Toy,
    {
        "tags": Option(flag="--tag"),
        "urls": Option(env="TOY_URLS", sep=",", nargs="*", parse=lambda u: u.rstrip("/")),
        "port": Option(env="TOY_PORT"),
    },
    exclude={"secret"},
)


def toy_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    TOY.add_arguments(p, env or {})
    return p


def toy(*argv: str, env: Mapping[str, str] | None = None, **values: Any) -> Toy:
    return TOY.build(toy_parser(env).parse_args(argv), **values)


def usage_error(p: argparse.ArgumentParser, argv: list[str], capsys: Any) -> str:
    with pytest.raises(SystemExit) as exc:
        p.parse_args(argv)
    assert exc.value.code == 2
    return str(capsys.readouterr().err)


def test_no_arguments_give_the_struct_defaults() -> None:
    assert toy("--name", "n") == Toy(name="n")
    assert vars(toy_parser().parse_args(["--name", "n"])) == {"name": "n"}


def test_every_field_shape() -> None:
    got = toy(
        "--name=n",
        "--count=3",
        "--ratio=1.5",
        "--mode=b",
        "--verbose",
        "--no-colour",
        "--tag",
        "x",
        "y",
        "--urls",
        "http://a/, http://b",
        "http://c/",
        "--port=0",
    )
    assert got == Toy(
        name="n",
        count=3,
        ratio=1.5,
        mode="b",
        verbose=True,
        colour=False,
        tags=("x", "y"),
        urls=("http://a", "http://b", "http://c"),
        port=0,
    )


def test_excluded_fields_come_from_the_struct_or_build() -> None:
    assert "secret" not in TOY.flags and TOY.excluded == {"secret"}
    assert toy("--name", "n", secret={"a": 1}).secret == {"a": 1}
    assert toy("--name", "n", count=9).count == 9  # values passed to build win


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "0"], "argument --count: invalid value '0': Expected `int` >= 1"),
        (["--count", "two"], "argument --count: invalid value 'two': Expected `int`"),
        (["--ratio", "0"], "argument --ratio: invalid value '0': Expected `float` > 0.0"),
        (["--mode", "c"], "argument --mode: invalid choice: 'c'"),
        (["--port", "65536"], "argument --port: invalid value '65536': Expected `int` <= 65535"),
        (["--urls"], "argument --urls: invalid value []: Expected `array` of length >= 1"),
        (["--urls", ","], "argument --urls: invalid value [',']: Expected `array` of length"),
    ],
)
def test_bad_values_are_usage_errors(argv: list[str], message: str, capsys: Any) -> None:
    assert message in usage_error(toy_parser(), ["--name", "n", *argv], capsys)


def test_required_fields_are_required(capsys: Any) -> None:
    assert "the following arguments are required: --name" in usage_error(toy_parser(), [], capsys)


def test_environment_fallback() -> None:
    env = {"TOY_URLS": "http://e1/,http://e2", "TOY_PORT": "9"}
    assert toy("--name", "n", env=env).urls == ("http://e1", "http://e2")
    assert toy("--name", "n", env=env).port == 9
    assert toy("--name", "n", "--urls", "http://cli", "--port", "1", env=env).port == 1
    assert toy("--name", "n", "--urls", "http://cli", env=env).urls == ("http://cli",)
    assert toy("--name", "n", env={"TOY_PORT": ""}).port is None  # empty is unset


def test_a_bad_environment_value_names_the_variable() -> None:
    p = toy_parser({"TOY_PORT": "http"})  # building the parser does not fail
    with pytest.raises(SystemExit, match=r"^TOY_PORT: invalid value 'http': Expected `int"):
        TOY.build(p.parse_args(["--name", "n"]))
    p = toy_parser({"TOY_URLS": " , "})
    with pytest.raises(SystemExit, match=r"TOY_URLS: .* length >= 1"):
        TOY.build(p.parse_args(["--name", "n"]))


def test_help_comes_from_docstrings_meta_and_defaults() -> None:
    text = toy_parser().format_help()
    assert "The name; 100% required" in text  # % escaped for argparse
    assert "a described ratio (default: 0.5)" in text
    assert "Colour the output (default: True)" in text
    assert "(or TOY_URLS, comma-separated; default: http://x)" in text
    assert "--tag TAG [TAG ...]" in text and "--colour, --no-colour" in text


def test_attribute_docs_are_inherited_and_overridden() -> None:
    docs = attribute_docs(render.RenderConfig)
    assert docs["model"] == "Model directory (HF layout)."  # from ModelService
    assert docs["workers"].startswith("Threads or processes")


class Nested(msgspec.Struct):
    inner: Toy


@pytest.mark.parametrize(
    ("options", "exclude", "error"),
    [
        ({}, (), TypeError),  # a nested struct has no flag form
        ({"nope": Option()}, {"inner"}, ValueError),
        ({"inner": Option()}, {"inner"}, ValueError),
        ({"inner": Option(sep=",", parse=str)}, (), ValueError),
    ],
)
def test_mistakes_in_the_options_fail_at_import(
    options: dict[str, Option], exclude: set[str], error: type[Exception]
) -> None:
    with pytest.raises(error):
        CommandLine(Nested, options, exclude)


# The real configs.


@dataclass(frozen=True)
class Service:
    module: ModuleType
    cls: type[msgspec.Struct]
    argv: list[str]  # the required flags
    required: dict[str, Any]  # ... and the fields they set


SERVICES = {
    "render": Service(render, render.RenderConfig, ["--model", "m"], {"model": "m"}),
    "derender": Service(derender, derender.DerenderConfig, ["--model", "m"], {"model": "m"}),
    "proxy": Service(
        proxy,
        proxy.ProxyConfig,
        ["--render", "http://r", "--derender", "http://d", "--decode", "http://g", "--open"],
        {
            "render_urls": ("http://r",),
            "derender_urls": ("http://d",),
            "decode_urls": ("http://g",),
            "open": True,
        },
    ),
}
FLAGS = {  # the names compose.yaml, the k8s manifest, launch/up.py and users already use
    "render": "--model --served-model-name --max-model-len --host --port --cpu-policy "
    "--executor --workers "
    "--chat-template --trust-request-chat-template --max-stops --max-stop-chars --max-choices "
    "--max-logprob-entries --enable-auto-tool-choice --tool-call-parser --reasoning-parser",
    "derender": "--model --served-model-name --max-model-len --host --port --cpu-policy "
    "--workers --threads "
    "--enable-auto-tool-choice --tool-call-parser --reasoning-parser",
    "proxy": "--render --derender --prefill --decode --models-file --store --store-ttl "
    "--host --port --cpu-policy --generate-tokens-only "
    "--api-key-file --open --generate-api-key-file "
    "--derender-transport --derender-batch-wait --prefill-first-token --no-prefill-first-token "
    "--routing --kv-events-offset --kv-events-ipc --prefix-hash-seed --skip-prefill-within "
    "--routing-cap --routing-half-life --routing-stream-cost --routing-compute-cost "
    "--health-interval --max-in-flight --max-queued "
    "--max-body-bytes --connect-timeout "
    "--hop-timeout --first-token-timeout --stream-idle-timeout --drain-timeout",
}


def service_parser(name: str, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    module = SERVICES[name].module
    p = argparse.ArgumentParser(prog=name)
    if module is proxy:
        proxy.add_arguments(p, env or {})
    else:
        module.add_arguments(p)
    return p


@pytest.mark.parametrize("name", SERVICES)
def test_service_defaults_are_the_structs(name: str) -> None:
    s = SERVICES[name]
    assert s.module.from_args(service_parser(name).parse_args(s.argv)) == s.cls(**s.required)


@pytest.mark.parametrize("name", SERVICES)
def test_service_fields_are_all_exposed_or_excluded(name: str) -> None:
    cli = SERVICES[name].module.CLI
    assert set(cli.flags) | cli.excluded == {f.name for f in msgspec.structs.fields(cli.cls)}
    assert not set(cli.flags) & cli.excluded
    options = {s for a in service_parser(name)._actions for s in a.option_strings}
    refused = {"--api-key"} if name == "proxy" else set()  # kept only to refuse a key in argv
    assert options - {"-h", "--help"} - refused == set(FLAGS[name].split())


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("render", ["--workers", "0"]),
        ("render", ["--executor", "fork"]),
        ("render", ["--port", "-1"]),
        ("render", ["--max-model-len", "0"]),
        ("render", ["--chat-template", "/no/such/template.jinja"]),
        ("derender", ["--workers", "0"]),
        ("derender", ["--threads", "0"]),
        ("derender", ["--port", "65536"]),
        ("derender", ["--cpu-policy", "fifo"]),
        ("render", ["--tool-call-parser", "nope"]),
        ("derender", ["--reasoning-parser", "nope"]),
        ("proxy", ["--health-interval", "0"]),
        ("proxy", ["--max-in-flight", "0"]),
        ("proxy", ["--derender-transport", "grpc"]),
        ("proxy", ["--port", "http"]),
        ("proxy", ["--render"]),
    ],
)
def test_service_bad_values_are_refused(name: str, argv: list[str], capsys: Any) -> None:
    argv = [*SERVICES[name].argv, *argv]
    assert "error: argument" in usage_error(service_parser(name), argv, capsys)


def test_auto_tool_choice_needs_a_tool_parser() -> None:
    args = service_parser("render").parse_args(["--model", "m", "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit, match="requires --tool-call-parser"):
        render.from_args(args)


def test_render_reads_the_chat_template_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    args = service_parser("render").parse_args(["--model", "m", "--chat-template", str(path)])
    assert render.from_args(args).chat_template == "{{ messages }}"


def test_served_model_names_keep_vllms_flag() -> None:
    argv = ["--model", "m", "--served-model-name", "a", "b"]
    config = derender.from_args(service_parser("derender").parse_args(argv))
    assert config.served_model_names == ("a", "b") and config.names == ("a", "b")


PROXY_ENV = {
    "TOKENLINE_RENDER_URLS": "http://r1/, http://r2",
    "TOKENLINE_DERENDER_URLS": "http://d",
    "TOKENLINE_PREFILL_URLS": "",
    "TOKENLINE_DECODE_URLS": "http://g",
    "TOKENLINE_MODELS_FILE": "",
    "TOKENLINE_STORE": "",
    "TOKENLINE_STORE_TTL": "60",
    "TOKENLINE_PORT": "9000",
    "TOKENLINE_API_KEY": "k",
    "TOKENLINE_GENERATE_API_KEY": "g",
}
KEY_FILE_VARS = {"TOKENLINE_API_KEY_FILE", "TOKENLINE_GENERATE_API_KEY_FILE", "TOKENLINE_OPEN"}
ROUTING_VARS = {
    f"TOKENLINE_ROUTING_{name}" for name in ("CAP", "HALF_LIFE", "STREAM_COST", "COMPUTE_COST")
}


def test_proxy_environment() -> None:
    assert set(proxy.ENV) == set(PROXY_ENV) | KEY_FILE_VARS | ROUTING_VARS
    config = proxy.from_args(service_parser("proxy", PROXY_ENV).parse_args([]))
    assert config.render_urls == ("http://r1", "http://r2") and config.prefill_urls == ()
    assert (config.port, config.api_key, config.generate_api_key) == (9000, "k", "g")
    assert config.store_ttl == 60
    argv = ["--render", "http://cli,http://cli2/", "--port", "1"]
    config = proxy.from_args(service_parser("proxy", PROXY_ENV).parse_args(argv))
    assert config.render_urls == ("http://cli", "http://cli2") and config.port == 1


def test_proxy_needs_each_pool() -> None:
    args = service_parser("proxy").parse_args(["--render", "http://r", "--decode", "http://g"])
    with pytest.raises(SystemExit, match=r"--derender \(or TOKENLINE_DERENDER_URLS\) is required"):
        proxy.from_args(args)


def test_a_bad_proxy_variable_does_not_break_other_subcommands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENLINE_PORT", "eighty")
    args = tokenline_parser().parse_args(["render", "--model", "m"])
    assert render.from_args(args).port == render.RenderConfig(model="m").port
    args = tokenline_parser().parse_args(["proxy", *SERVICES["proxy"].argv])
    with pytest.raises(SystemExit, match="TOKENLINE_PORT: invalid value 'eighty'"):
        proxy.from_args(args)


# The proxy is closed by default; keys come from files or the environment, never argv.

POOLS = SERVICES["proxy"].argv[:-1]  # the required flags, without --open


def proxy_config(argv: list[str], env: Mapping[str, str] | None = None) -> proxy.ProxyConfig:
    return proxy.from_args(service_parser("proxy", env or {}).parse_args([*POOLS, *argv]))


def test_proxy_refuses_to_start_without_a_key_unless_open() -> None:
    with pytest.raises(SystemExit, match=r"runs closed and has no API key.*--open"):
        proxy_config([])
    with pytest.raises(SystemExit, match="runs closed"):
        proxy_config([], {"TOKENLINE_OPEN": "0", "TOKENLINE_API_KEY": " "})
    assert proxy_config([], {"TOKENLINE_OPEN": "1"}).api_key is None
    assert proxy_config(["--open"]).open


def test_proxy_reads_keys_from_files_or_the_environment(tmp_path: Path) -> None:
    key, generate = tmp_path / "key", tmp_path / "generate"
    key.write_text("s3cret\n")
    generate.write_text("g3n")
    argv = ["--api-key-file", str(key), "--generate-api-key-file", str(generate)]
    config = proxy_config(argv)
    assert (config.api_key, config.generate_api_key, config.open) == ("s3cret", "g3n", False)
    env = {"TOKENLINE_API_KEY_FILE": str(key), "TOKENLINE_GENERATE_API_KEY": "g"}
    assert (proxy_config([], env).api_key, proxy_config([], env).generate_api_key) == (
        "s3cret",
        "g",
    )
    assert proxy_config([], {"TOKENLINE_API_KEY": "e"}).api_key == "e"


def test_proxy_key_mistakes_are_refused(tmp_path: Path, capsys: Any) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = usage_error(service_parser("proxy"), [*POOLS, "--api-key", "s3cret"], capsys)
    assert "--api-key is gone" in refused and "s3cret" not in refused
    empty_file = ["--api-key-file", str(empty)]
    assert "no key in" in usage_error(service_parser("proxy"), [*POOLS, *empty_file], capsys)
    missing = ["--api-key-file", str(tmp_path / "missing")]
    assert "No such file" in usage_error(service_parser("proxy"), [*POOLS, *missing], capsys)
    key = tmp_path / "key"
    key.write_text("k")
    both = {"TOKENLINE_API_KEY": "a", "TOKENLINE_API_KEY_FILE": str(key)}
    with pytest.raises(SystemExit, match="TOKENLINE_API_KEY and --api-key-file both"):
        proxy_config([], both)
    with pytest.raises(SystemExit, match="TOKENLINE_API_KEY_FILE: no key in"):
        proxy_config([], {"TOKENLINE_API_KEY_FILE": str(empty)})
    with pytest.raises(SystemExit, match="contradict"):
        proxy_config(["--open"], {"TOKENLINE_API_KEY": "a"})
