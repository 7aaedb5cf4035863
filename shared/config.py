"""Command-line options built from a config Struct, so each default, choice and bound exists once.

A service's configuration is one frozen `msgspec.Struct` (C12). `CommandLine` reads its fields,
adds one argparse option per field, and builds the struct back from the parsed namespace:

    class RenderConfig(ModelService, frozen=True, kw_only=True):
        workers: Annotated[int, msgspec.Meta(ge=1)] = 2
        '''Threads or processes that template and tokenize.'''

    RENDER = CommandLine(RenderConfig, {"served_model_names": Option(flag="--served-model-name")})
    RENDER.add_arguments(parser)                # --workers WORKERS  Threads or ... (default: 2)
    config = RENDER.build(parser.parse_args())  # a RenderConfig

From each field alone:
- the flag is `--field-name`, required when the field has no default;
- `bool` is `--flag` (store_true) when its default is False, else `--flag/--no-flag`;
- `Literal[...]` gives the choices; `tuple[X, ...]` (or list, set) takes `nargs="+"` items;
- the help is the field's attribute docstring, or its `Meta(description=...)`, plus the default;
- every value, from the command line or the environment, goes through
  `msgspec.convert(text, field annotation, strict=False)`, so `Meta` bounds (`ge=1`, `le=65535`,
  `min_length=1`) are checked where the value arrives: a bad flag is an argparse error (exit 2),
  a bad environment variable a `SystemExit` that names it.

`Option` changes one field: another flag name, an environment variable read when the flag is
absent, `nargs="*"`, a separator that splits items (`--render a,b`), a flag given again adding
items (`repeat`), or a `parse` function run on each item's text first (render reads its
`--chat-template` file with one). `exclude` names fields kept off the command line: they take
the struct's default, or a value passed to `build`. A field whose type has no command-line form
(a dict, a nested struct) must be excluded or given `parse`; `CommandLine` refuses it otherwise,
so no field is forgotten.

Defaults never enter argparse (`argparse.SUPPRESS`): the namespace holds only what the command line
or the environment said, and the struct supplies the rest.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
import re
import textwrap
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args, get_origin

import msgspec
import msgspec.inspect as mi

S = TypeVar("S", bound=msgspec.Struct)

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
"""A TCP port; 0 asks the OS for a free one."""
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]

_SCALARS = (mi.IntType, mi.FloatType, mi.StrType, mi.LiteralType, mi.BoolType, mi.UnionType)
_SEQUENCES = (mi.VarTupleType, mi.ListType, mi.SetType, mi.FrozenSetType)
_SEPARATED = {",": "comma-separated", " ": "space-separated"}
_AT_FIELD = re.compile(r"^(?P<msg>.*) - at `\$\.(?P<name>\w+)[^`]*`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<name>\w+)`$")


@dataclass(frozen=True)
class Option:
    """How one field appears on the command line; every attribute is optional."""

    flag: str | None = None
    """The flag, when not `--field-name` (`--served-model-name` for `served_model_names`)."""
    env: str | None = None
    """An environment variable read when the flag is absent (an empty one counts as unset)."""
    help: str | None = None
    """Help text, when not the field's docstring or `Meta(description=...)`."""
    nargs: Literal["+", "*"] = "+"
    """Sequence fields: whether the flag may be given with no items."""
    sep: str | None = None
    """Sequence fields: also split each item, and the environment value, on this."""
    parse: Callable[[str], object] | None = None
    """Text -> value before validation, per item (OSError and ValueError become usage errors)."""
    repeat: bool = False
    """Sequence fields: the flag may be given again, its items adding up (`--model a --model
    b`); otherwise the last one given counts."""


@dataclass(frozen=True)
class _FromEnv:
    """A default taken from the environment, converted in `build`: a bad value in a variable
    another subcommand reads must not break this one's parser."""

    var: str
    text: str


@dataclass(frozen=True)
class _Field:
    name: str
    key: str  # the struct's encode name
    annotation: Any
    kind: Literal["bool", "one", "many"]
    choices: tuple[Any, ...] | None
    default: Any  # msgspec.NODEFAULT when required
    doc: str
    option: Option

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    @property
    def required(self) -> bool:
        return self.default is msgspec.NODEFAULT

    def convert(self, given: str | Sequence[str]) -> Any:
        """Command-line or environment text -> a valid value of the field; ValueError if not."""
        if self.kind == "many":
            texts = [given] if isinstance(given, str) else list(given)
            raw: Any = [self._parse(t) for text in texts for t in self._split(text)]
        else:
            assert isinstance(given, str)
            raw = self._parse(given)
        try:
            return msgspec.convert(raw, self.annotation, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid value {given!r}: {exc}") from None

    def _split(self, text: str) -> list[str]:
        if self.option.sep is None:
            return [text]
        return [t.strip() for t in text.split(self.option.sep) if t.strip()]

    def _parse(self, text: str) -> object:
        if self.option.parse is None:
            return text
        try:
            return self.option.parse(text)
        except OSError as exc:
            raise ValueError(f"{exc.strerror or exc}: {text!r}") from None


class CommandLine(Generic[S]):
    """argparse options for the fields of the config Struct `cls`, and `cls` built back."""

    def __init__(
        self,
        cls: type[S],
        options: Mapping[str, Option] | None = None,
        exclude: Collection[str] = (),
    ) -> None:
        options = dict(options or {})
        names = {f.name for f in msgspec.structs.fields(cls)}
        if unknown := (set(options) | set(exclude)) - names:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        if both := set(options) & set(exclude):
            raise ValueError(f"{cls.__name__}: {sorted(both)} both excluded and given options")
        self.cls = cls
        self.excluded = frozenset(exclude)
        self._keys = {f.name: f.encode_name for f in msgspec.structs.fields(cls)}
        self._fields = _fields(cls, options, self.excluded)

    @property
    def flags(self) -> dict[str, str]:
        """Field name -> its flag, for every field on the command line."""
        return {f.name: f.flag for f in self._fields}

    @property
    def env_vars(self) -> dict[str, str]:
        """Environment variable -> the field it sets."""
        return {f.option.env: f.name for f in self._fields if f.option.env}

    def add_arguments(
        self, parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ
    ) -> None:
        """One option per field (`dest` is the field name); `env` is read for `Option.env`."""
        for f in self._fields:
            var = f.option.env
            parser.add_argument(
                f.flag,
                dest=f.name,
                default=_FromEnv(var, env[var]) if var and env.get(var) else argparse.SUPPRESS,
                required=f.required and not f.option.env,
                help=_help(f),
                **_action(f),
            )

    def build(self, args: argparse.Namespace, **values: Any) -> S:
        """The struct from what `args` holds, `values` (by field name) taking precedence.

        Raises SystemExit naming the flag or variable when a value is missing or invalid.
        """
        given = {self._keys[name]: value for name, value in values.items()}
        for f in self._fields:
            if f.name in values or not hasattr(args, f.name):
                continue
            value = getattr(args, f.name)
            if isinstance(value, _FromEnv):
                try:
                    value = f.convert(value.text)
                except ValueError as exc:
                    raise SystemExit(f"{value.var}: {exc}") from None
            given[f.key] = value
        try:
            return msgspec.convert(given, self.cls)
        except msgspec.ValidationError as exc:
            raise SystemExit(self._explain(str(exc))) from None

    def _explain(self, message: str) -> str:
        by_name = {f.name: f for f in self._fields}
        if (m := _MISSING_FIELD.match(message)) and (f := by_name.get(m["name"])):
            alternative = f" (or {f.option.env})" if f.option.env else ""
            return f"argument {f.flag}{alternative} is required"
        if (m := _AT_FIELD.match(message)) and (f := by_name.get(m["name"])):
            return f"argument {f.flag}: {m['msg']}"
        return f"{self.cls.__name__}: {message}"


def _fields(
    cls: type[msgspec.Struct], options: Mapping[str, Option], excluded: Collection[str]
) -> list[_Field]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    docs = attribute_docs(cls)
    annotations = {f.name: f.type for f in msgspec.structs.fields(cls)}
    out = []
    for field in (f for f in info.fields if f.name not in excluded):
        option = options.get(field.name, Option())
        kind, choices, description = _shape(field.type, option, f"{cls.__name__}.{field.name}")
        if choices is not None:  # in the order written, for --help
            choices = _literal_values(annotations[field.name]) or choices
        default = field.default
        if field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        out.append(
            _Field(
                name=field.name,
                key=field.encode_name,
                annotation=annotations[field.name],
                kind=kind,
                choices=choices,
                default=default,
                doc=description or docs.get(field.name, ""),
                option=option,
            )
        )
    return out


def _shape(
    t: mi.Type, option: Option, where: str
) -> tuple[Literal["bool", "one", "many"], tuple[Any, ...] | None, str | None]:
    """(kind, choices, Meta description) of a field type; TypeError if it has no flag form."""
    t, description = _unwrap(t)
    if isinstance(t, _SEQUENCES):
        item, _ = _unwrap(t.item_type)
        if option.parse is not None or isinstance(item, _SCALARS):
            return "many", None, description
    elif option.nargs != "+" or option.sep is not None:
        raise ValueError(f"{where}: nargs and sep are for sequence fields")
    elif isinstance(t, mi.BoolType):
        return "bool", None, description
    elif isinstance(t, mi.LiteralType):
        return "one", tuple(t.values), description  # sorted by msgspec; see _fields
    elif option.parse is not None or isinstance(t, _SCALARS):
        return "one", None, description
    raise TypeError(f"{where}: {t!r} has no command-line form; exclude it or give Option(parse=)")


def _unwrap(t: mi.Type) -> tuple[mi.Type, str | None]:
    """Strip `Annotated` metadata and `| None`, keeping the innermost description."""
    description = None
    while True:
        if isinstance(t, mi.Metadata):
            description = (t.extra_json_schema or {}).get("description", description)
            t = t.type
        elif isinstance(t, mi.UnionType) and sum(_is_none(x) for x in t.types) == 1:
            rest = [x for x in t.types if not _is_none(x)]
            if len(rest) != 1:
                return t, description
            t = rest[0]
        else:
            return t, description


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values of the `Literal` inside `annotation` (through `Annotated` and `| None`)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return get_args(annotation)
    if origin in (Annotated, Union, types.UnionType):
        return tuple(v for a in get_args(annotation) for v in _literal_values(a))
    return ()


def _is_none(t: mi.Type) -> bool:
    return isinstance(t, mi.NoneType)


def _action(f: _Field) -> dict[str, Any]:
    """The add_argument keywords that give the field's shape."""
    metavar = f.flag.lstrip("-").replace("-", "_").upper()
    if f.kind == "bool":
        return {"action": "store_true" if f.default is False else argparse.BooleanOptionalAction}
    if f.kind == "many":
        return {"action": _Many, "field": f, "nargs": f.option.nargs, "metavar": metavar}
    if f.choices is not None:
        # argparse checks the choices; its message lists them
        return {"type": type(f.choices[0]), "choices": f.choices}
    return {"type": _Convert(f), "metavar": metavar}


@dataclass(frozen=True)
class _Convert:
    """argparse `type=` for one field: its conversion, failures as usage errors."""

    field: _Field

    def __call__(self, text: str) -> Any:
        try:
            return self.field.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


class _Many(argparse.Action):
    """Stores a sequence field's items, split and converted, as one validated value."""

    def __init__(self, *args: Any, field: _Field, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.field = field

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        try:
            value = self.field.convert([str(v) for v in values or ()])
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        before = getattr(namespace, self.dest, None)
        if self.field.option.repeat and isinstance(before, tuple | list):
            value = (*before, *value)
        setattr(namespace, self.dest, value)


def _help(f: _Field) -> str | None:
    """The field's doc, then where else its value may come from and its default."""
    notes = []
    if f.option.env:
        sep = f.option.sep
        how = f", {_SEPARATED.get(sep, f'separated by {sep!r}')}" if sep else ""
        notes.append(f"or {f.option.env}{how}")
    if not (f.required or f.default is None or f.default is False or f.default == ()):
        shown = " ".join(map(str, f.default)) if f.kind == "many" else f.default
        notes.append(f"default: {shown}")
    text = (f.option.help or f.doc).rstrip(".")
    if notes:
        text = f"{text} ({'; '.join(notes)})".lstrip()
    return text.replace("%", "%%") or None  # argparse %-formats help


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (the string right after it), bases first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # builtins, or no source (a zipped install)
            continue
        body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, after in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs
