"""Loading sweep files, and applying config overrides as `--config.<key>=<value>` does.

Config files load through `bov_jax.config.load_config_file`, as every command's. The sweep needs
the resolved config of every run before it launches anything (to validate it and to print its
horizon), and the same overrides are then passed to `bov_jax.main` as `--config.<key>=<value>`
flags, so both readings must agree: values are converted to the type of the key's default, as
ml_collections' flag parser does.
"""

from __future__ import annotations

import ast
import difflib
from typing import Any

import ml_collections

from bov_jax.errors import UserError


def parse_value(text: str, default: Any) -> Any:
    """The flag text `text` as the type of `default` (bool, int, float, str, tuple)."""
    if isinstance(default, bool):
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, tuple):
        return tuple(ast.literal_eval(text))
    return text


def apply_override(config: ml_collections.ConfigDict, override: str) -> tuple[str, Any]:
    """Apply 'train.num_steps=20' to `config` in place; returns (key, parsed value)."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise UserError(f"override {override!r}: expected key=value, e.g. train.num_steps=20")
    path = key.split(".")
    node = config
    for depth, part in enumerate(path):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
            close = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean {'.'.join([*path[:depth], close[0]])}?" if close else ""
            raise UserError(f"override {override!r}: unknown config key {key}{hint}")
        if depth < len(path) - 1:
            node = node[part]
    leaf = path[-1]
    try:
        value = parse_value(text, node[leaf])
    except (ValueError, SyntaxError) as err:
        raise UserError(f"override {override!r}: {err}") from err
    with node.unlocked():
        node[leaf] = value
    return key, value
