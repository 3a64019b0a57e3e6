"""YAML + flags -> a stage config: HfArgumentParser as TRL users know it, unknown names with suggestions
(TRL's names too), values checked against the field types."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import HfArgumentParser

from rlhflab.config.stages import STAGES
from rlhflab.errors import UserInputError, writing
from rlhflab.trl_names import TRL_NAMES



def field_names(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls)]


def _closest(name: str, config_cls: type, flag: bool) -> str:
    """What to do about an unknown flag (`flag`) or YAML key: TRL's name for a field if it is one, else the
    closest field name."""
    names = field_names(config_cls)
    if name in TRL_NAMES:
        return _trl_hint(name, names, flag)
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else f"run with --help to list the {len(names)} valid keys"


def _trl_hint(name: str, names: list[str], flag: bool) -> str:
    """docs/coming-from-trl.md in one line: the field this stage has for TRL's `name`, or why there is none."""
    show = (lambda n: f"--{n}") if flag else (lambda n: f"'{n}'")
    counterpart = TRL_NAMES[name]
    if not counterpart.fields:
        return f"TRL's {show(name)} has no rlhflab counterpart: {counterpart.note}"
    here = [f for f in counterpart.fields if f in names]
    if not here:  # e.g. --reward_model_path on sft: say which stages take it rather than guess a neighbour
        stages = [stage for stage, cls in STAGES.items() if counterpart.fields[0] in field_names(cls)]
        return (f"TRL's {show(name)} is rlhflab's {show(counterpart.fields[0])}, which this stage does not take "
                f"(stages that do: {', '.join(stages) or 'none yet'})")
    if not counterpart.rename:  # the note says how the value changes
        return f"did you mean {show(here[0])}? (TRL's {show(name)}: {counterpart.note})"
    note = f": {counterpart.note}" if counterpart.note else ""
    return f"did you mean {show(here[0])}? (TRL's {show(name)} is rlhflab's {show(here[0])}{note})"


def _unknown(names: list[str], config_cls: type, what: str, where: str, flag: bool) -> UserInputError:
    """One error naming every unknown flag or key, each with its hint, so a TRL command is fixed in one pass."""
    def bare(name: str) -> str:
        return name.lstrip("-").split("=")[0].replace("-", "_")

    if len(names) == 1:
        return UserInputError(f"unknown {what} '{names[0]}'", where, _closest(bare(names[0]), config_cls, flag))
    listed = ", ".join(f"'{n}'" for n in names)
    hints = "".join(f"\n  {n.split('=')[0]}: {_closest(bare(n), config_cls, flag)}" for n in names)
    return UserInputError(f"unknown {what}s {listed}", where, f"for each:{hints}")


_EXAMPLES = {bool: "true", int: "10", float: "0.001", str: "some-text"}


def _coerce(name: str, value: Any, kind: Any, where: str) -> Any:
    """Check a YAML value against the field's type; ints are accepted for floats."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        if value not in typing.get_args(kind):
            raise UserInputError(f"'{name}' must be one of {list(typing.get_args(kind))}, got {value!r}", where)
        return value
    if origin is list:  # e.g. report's `runs`: a YAML list of strings
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserInputError(f"'{name}' should be a list of strings, got {value!r}", where,
                                 f"write e.g. {name}: [runs/a, runs/b]")
        return value
    if kind is float and isinstance(value, str):
        try:  # PyYAML reads 1e-4 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[kind]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, expected):
        raise UserInputError(
            f"'{name}' should be {kind.__name__}, got {type(value).__name__} {value!r}",
            where,
            f"write e.g. {name}: {_EXAMPLES[kind]}",
        )
    return float(value) if kind is float else value


def read_yaml_config(path: str, config_cls: type) -> dict[str, Any]:
    """Load a YAML mapping and check every key and value against `config_cls`."""
    file = Path(path)
    if not file.is_file():
        raise UserInputError(f"config file not found: {path}", "--config", "pass the path of an existing YAML file")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserInputError(f"not valid YAML ({err})", path, "fix the syntax or pass another file") from err
    if not isinstance(values, dict):
        raise UserInputError("a config file must be a mapping of field: value", path)
    sections = getattr(config_cls, "yaml_sections", ())  # keys its command reads itself (compare's per-method ones)
    return check_values({k: v for k, v in values.items() if k not in sections}, config_cls, path)


def check_values(values: dict[str, Any], config_cls: type, where: str) -> dict[str, Any]:
    """Check every key and value of a mapping (a YAML file, or one section of it) against `config_cls`."""
    names = field_names(config_cls)
    unknown = [str(key) for key in values if key not in names]
    if unknown:
        raise _unknown(unknown, config_cls, "config key", where, flag=False)
    hints = typing.get_type_hints(config_cls)
    return {key: _coerce(key, value, hints[key], f"{where}: {key}") for key, value in values.items()}


def build_parser(config_cls: type, prog: str) -> HfArgumentParser:
    parser = HfArgumentParser(config_cls, prog=prog, description=config_cls.__doc__, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file whose keys are the field names; flags override it")
    for action in parser._actions:  # HfArgumentParser gives --no_X the help of --X, which reads backwards
        if action.const is False and any(o.startswith("--no_") for o in action.option_strings):
            action.help = f"turn {action.dest} off (the same as --{action.dest} false)"
            action.default = argparse.SUPPRESS  # keeps "(default: False)" out of the help; --X holds the default
    return parser


def _stray_value(value: str, argv: list[str], prog: str) -> UserInputError:
    """A value no flag took, most often the second item of a TRL-style list (`--lora_target_modules q_proj v_proj`)."""
    before = [token for token in argv[: argv.index(value)] if token.startswith("--")] if value in argv else []
    if not before:
        return UserInputError(f"unexpected value '{value}'", prog, "give settings as --field value; --help lists them")
    return UserInputError(f"unexpected value '{value}' after {before[-1]}", prog,
                          "each flag takes one value; write lists comma-separated, e.g. --lora_target_modules "
                          "q_proj,v_proj (TRL's scripts take them space-separated)")


def parse_config(config_cls: type, argv: list[str], prog: str) -> Any:
    """Defaults < YAML file (`--config`) < command-line flags -> a frozen config."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    parser = build_parser(config_cls, prog)
    if known.config:
        parser.set_defaults(**read_yaml_config(known.config, config_cls))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:  # the values after an unknown flag land here too: name the flags
        flags = [token for token in unknown if token.startswith("--")]
        raise _unknown(flags, config_cls, "option", prog, flag=True) if flags else _stray_value(unknown[0], argv, prog)
    values = {k: v for k, v in vars(namespace).items() if k != "config"}
    return config_cls(**values)


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def write_config(config: Any, path: Path) -> None:
    """Write the effective config as YAML; it can be passed back with --config. Whole or not at all (a resume
    with changes rewrites it: a half-written one would make the run unresumable); a full disk or an I/O error
    is a `WriteFailed` naming it (exit code 5, issue 34)."""
    path = Path(path)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with writing(path.name, path, path.parent, len(text.encode())):
            tmp.write_text(text)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
