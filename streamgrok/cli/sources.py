"""Where command-line settings may also come from: `STREAMGROK_*` environment variables and a
`--config FILE` (TOML or YAML). Precedence: the command line, then the environment, then the
file, then the built-in default."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "STREAMGROK_"
NOT_SETTINGS = {"help", "version", "config", "command", "bench"}
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action) -> str:
    """The environment twin of a flag: `--kv-budget` is `STREAMGROK_KV_BUDGET`."""
    return ENV_PREFIX + action.dest.upper()


def settings(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The flags of one (sub)command that take a setting (not help, version or positionals)."""
    for action in parser._actions:
        if action.option_strings and action.dest not in NOT_SETTINGS \
                and not isinstance(action, argparse._SubParsersAction):
            yield action


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (nested) sub-command parser with its path: ("serve",), ("bench", "kv")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from subcommands(sub, (*path, name))


def read_config(path: str) -> dict[str, Any]:
    """A TOML or YAML file of settings: flag names as keys (`kv-budget` or `kv_budget`),
    optionally under a section named after the command (`[serve]`)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config: no such file: {path}")
    text = file.read_text()
    if file.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"--config {path}: not valid YAML: {exc}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of settings")
    return data


def apply_sources(parser: argparse.ArgumentParser, config: Mapping[str, Any],
                  environ: Mapping[str, str] = os.environ) -> None:
    """Set each sub-command's defaults from `config` (flat keys apply to every command that
    has the flag; a `[serve]` or `[bench.kv]` section to that command only) and then from the
    environment. Unknown config keys and values that do not convert are errors naming them."""
    used: set[tuple[str, ...]] = set()
    for path, sub in subcommands(parser):
        section = _section(config, path)
        for action in settings(sub):
            keys = _keys(action)
            used |= {(k,) for k in keys if k in config}
            used |= {(*path, k) for k in keys if k in section}
            for source, value in (("config", _lookup(config, keys)),
                                  (f"config [{'.'.join(path)}]", _lookup(section, keys)),
                                  (env_name(action), environ.get(env_name(action)))):
                if value is not None:
                    action.default = _convert(action, value, source)
                    action.required = False
    unknown = [".".join(key) for key in _leaves(config) if key not in used]
    if unknown:
        raise ValueError(f"--config: unknown settings: {', '.join(sorted(unknown))}")


def _keys(action: argparse.Action) -> set[str]:
    return {action.dest, action.dest.replace("_", "-"),
            *(o.lstrip("-") for o in action.option_strings)}


def _section(config: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any]:
    table: Any = config
    for name in path:
        table = table.get(name) if isinstance(table, Mapping) else None
    return table if isinstance(table, Mapping) else {}


def _leaves(table: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in table.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key)


def _lookup(table: Mapping[str, Any], keys: set[str]) -> Any:
    return next((table[k] for k in keys if k in table and not isinstance(table[k], dict)),
                None)


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    """A config or environment value as the flag's own type (checked against its choices)."""
    flag = action.option_strings[-1]
    try:
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            text = str(value).lower()
            if text not in TRUE | FALSE:
                raise ValueError(f"expected true or false, got {value!r}")
            on = text in TRUE
            return on if isinstance(action, argparse._StoreTrueAction) else not on
        if isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else str(value).split("\n")
            return [_one(action, item) for item in items if str(item) != ""]
        return _one(action, value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{source} (for {flag}): {exc}") from None


def _one(action: argparse.Action, value: Any) -> Any:
    converted = action.type(value) if action.type is not None and isinstance(value, str) \
        else (action.type(value) if action.type is not None else str(value))
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    return converted
