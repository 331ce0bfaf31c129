"""Every command line goes through bov_jax/cli.py: `--help` of each command (each `__main__.py`
and each module run under `if __name__ == "__main__":`) exits 0 and lists every flag the command
defines, with its default; a bad flag, a bad value or a wrong subcommand ends in one `error:`
line and exit status 2."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bov_jax"


def runs_as_command(tree: ast.Module) -> bool:
    """The module has a top-level `if __name__ == "__main__":`."""
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(
            isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators
        )
        for node in tree.body
    )


def commands() -> dict[str, Path]:
    """`python -m` name -> file of every command in the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py" or runs_as_command(ast.parse(path.read_text())):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if path.name == "__main__.py" else parts)] = path
    return found


def defined_flag_names(tree: ast.AST) -> set[str]:
    """First (string) arguments of every flags.DEFINE_* / config_flags.DEFINE_* call in `tree`,
    including the names of a `for name in (...): DEFINE_alias(name.replace("_", "-"), name)`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            aliases = [n for n in ast.walk(node) if is_define(n)]
            for element in node.iter.elts:
                if aliases and isinstance(element, ast.Constant):
                    names.add(element.value.replace("_", "-"))
        if is_define(node) and isinstance(node.args[0], ast.Constant):
            names.add(node.args[0].value)
    return names


def is_define(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("DEFINE_")
        and bool(node.args)
    )


def command_flags(path: Path) -> set[str]:
    """The flags a command defines: in its own file, and in the functions it imports from the
    package (a shared `define_*` such as corpus_build.define_corpus_flags)."""
    tree = ast.parse(path.read_text())
    names = defined_flag_names(tree) | {"debug"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bov_jax."):
            source = REPO / Path(*node.module.split(".")).with_suffix(".py")
            if not source.is_file():
                continue
            imported = {alias.name for alias in node.names}
            for function in ast.parse(source.read_text()).body:
                if isinstance(function, ast.FunctionDef) and function.name in imported:
                    names |= defined_flag_names(function)
    return names


def environment() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )


# Runs `python -m MODULE ARGS...` for each JSON [module, args] of argv[1:] in a process forked
# from this one, as `python -m` would run it (runpy, the module as __main__, a fresh absl FLAGS):
# the libraries every command imports are imported once, here, not once per command. The
# package's own modules are not: each command imports them itself, in its own order. Prints a
# JSON list of [exit status, stdout, stderr].
FORKED_COMMANDS = """
import json, os, runpy, sys, tempfile
import absl.app, absl.flags, absl.logging, jax, jax.numpy, numpy, optax, flax.nnx
from jax import sharding
import ml_collections, orbax.checkpoint

def run(module, args):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            status = 1
            try:
                sys.argv = [module, *args]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                status = 0
            except SystemExit as exit:
                code = exit.code
                status = code if isinstance(code, int) else (0 if code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out.seek(0)
        err.seek(0)
        return [status, out.read().decode(), err.read().decode()]

print(json.dumps([run(*json.loads(command)) for command in sys.argv[1:]]))
"""


def run_forked(commands: list[tuple[str, list[str]]]) -> list[subprocess.CompletedProcess]:
    """run(module, *args) of each (module, args), in processes forked from one interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_COMMANDS, *(json.dumps(c) for c in commands)],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    return [
        subprocess.CompletedProcess(["python", "-m", module, *args], *result)
        for (module, args), result in zip(commands, results, strict=True)
    ]


def test_the_command_list_is_the_package_s():
    found = commands()
    assert {"bov_jax.main", "bov_jax.bench", "bov_jax.data.tokenizer"} <= set(found)
    assert "bov_jax.cli" not in found  # its docstring shows the pattern; it is no command
    assert len(found) >= 19
    assert command_flags(found["bov_jax.corpora.build_debmix"]) >= {"out", "work_dir", "work-dir"}
    assert command_flags(found["bov_jax.data.bench"]) >= {"seq_len", "seq-len", "workers"}


def test_help_of_every_command_exits_0_and_lists_every_flag():
    found = commands()
    done = dict(zip(found, run_forked([(module, ["--help"]) for module in found]), strict=True))
    for module, result in done.items():
        assert result.returncode == 0, (module, result.stderr[-2000:])
        doc = ast.get_docstring(ast.parse(found[module].read_text())) or ""
        assert result.stdout.startswith(doc.splitlines()[0]), module  # the module's docstring
        assert listed_flags(result.stdout) >= command_flags(found[module]), module


def test_help_run_forked_is_the_help_of_python_m():
    """The forked runs above print, and exit with, what `python -m` does."""
    module = "bov_jax.data.tokenizer"
    [forked] = run_forked([(module, ["--help"])])
    alone = run(module, "--help")
    assert (forked.returncode, forked.stdout) == (alone.returncode, alone.stdout)


def listed_flags(help_text: str) -> set[str]:
    """The flag names of a --help text: its `  --name, --alias (default: ...)` lines."""
    names = set()
    for line in help_text.split("\nflags:\n", 1)[1].splitlines():
        if line.startswith("  --"):
            spellings, default = line.strip().split(" (default: ", 1)
            assert default.endswith(")"), line
            names |= {
                name.strip().removeprefix("--[no]").removeprefix("--")
                for name in spellings.split(",")
            }
    return names


BAD_COMMAND_LINES = [
    ("bov_jax.report", ["--no_such_flag=1"], "Unknown command line flag 'no_such_flag'"),
    ("bov_jax.data.tokenizer", ["train", "--vocab_size=many"], "flag --vocab_size=many"),
    ("bov_jax.bench", ["--steps=1"], "expected a command, one of train, data; got nothing"),
    ("bov_jax.presets", ["extra"], "unexpected arguments: extra"),
    ("bov_jax.evals.bpb", [], "--workdir must have a value"),
    (
        "bov_jax.main",
        ["--config=configs/ablations.py:no_such_preset", "--workdir=unused"],
        "configs/ablations.py: unknown preset 'no_such_preset'; known presets: d12,",
    ),
]


@pytest.fixture(scope="module")
def bad_command_lines() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    commands = [(module, args) for module, args, _ in BAD_COMMAND_LINES]
    return {(m, *a): result for (m, a), result in zip(commands, run_forked(commands), strict=True)}


@pytest.mark.parametrize("module, args, expected", BAD_COMMAND_LINES)
def test_bad_command_lines_end_in_one_line_and_status_2(bad_command_lines, module, args, expected):
    result = bad_command_lines[(module, *args)]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
