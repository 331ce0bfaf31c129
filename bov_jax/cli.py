"""The error boundary every command line goes through.

A user error (a bad config key or value, a missing or damaged file, a checkpoint of another
run, a full disk or a read-only directory) is printed as one or two lines naming the file, key
or value, and the command exits with the error's status (2 unless the error says otherwise);
a bug still shows its traceback. `--debug` (or BOV_JAX_DEBUG=1) shows the traceback of user
errors too.

    from bov_jax import cli
    if __name__ == "__main__":
        cli.run(main)          # instead of absl.app.run(main)
"""

from __future__ import annotations

import difflib
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

from absl import app, flags

flags.DEFINE_bool("debug", False, "Show the full traceback of user errors.")

CONFIG_FLAG = "--config"
HELP_FLAGS = ("--help", "--helpshort", "--helpfull", "-?")
# OSErrors that mean "the disk or the directory will not take this": the user fixes those.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class UserError(Exception):
    """A mistake the user can fix; its message names the file, key or value and the fix."""

    exit_status = 2


def debug_enabled(argv: list[str] | None = None) -> bool:
    """BOV_JAX_DEBUG=1, or --debug (read from `argv` while the flags are not parsed yet)."""
    if os.environ.get("BOV_JAX_DEBUG", "").lower() not in ("", "0", "false"):
        return True
    if flags.FLAGS.is_parsed():
        return flags.FLAGS.debug
    return any(arg in ("--debug", "--debug=true", "--debug=True") for arg in argv or sys.argv)


def report(err: BaseException) -> None:
    """Print a user error as `error: <message>` on stderr."""
    print(f"error: {err}", file=sys.stderr)


def os_user_error(err: OSError) -> UserError | None:
    """A missing file, a full disk, a read-only or forbidden path as a UserError naming the
    path; None for other OSErrors (bugs keep their traceback)."""
    if err.errno in STORAGE_ERRNOS:
        where = err.filename or "a file"
        return UserError(
            f"cannot use {where}: {os.strerror(err.errno)}; free space or pick a writable path"
        )
    if isinstance(err, FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return UserError(str(err))
    return None


def config_key_paths() -> list[str]:
    """Every config key as a dotted path (train.num_steps, ...)."""
    from bov_jax.config import default_config, key_paths

    return sorted(key_paths(default_config()))


def unknown_key_message(key: str, known: list[str], where: str) -> str:
    """'unknown config key train.num_step (where); did you mean train.num_steps?'"""
    message = f"unknown config key {key} ({where})"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:  # a typo in the last part only: compare the leaf names
        leaves = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], leaves, 1)]
    if close:
        message += f"; did you mean {close[0]}?"
    return message + " (--show_config lists every key)"


def check_config_arguments(argv: list[str]) -> None:
    """Before absl loads the config: the file of --config exists, every --config.<key> is known."""
    known = None
    for arg in argv[1:]:
        name, _, value = arg.partition("=")
        if name == CONFIG_FLAG and value:
            path = Path(value.split(":", 1)[0])
            if not path.is_file():
                raise UserError(f"config file {path} not found (--config={value})")
        elif name.startswith(CONFIG_FLAG + "."):
            known = known if known is not None else config_key_paths()
            key = name[len(CONFIG_FLAG) + 1 :]
            if key not in known:
                raise UserError(unknown_key_message(key, known, arg))


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with config-file problems turned into UserErrors (and --help
    exiting with status 0)."""
    check_config_arguments(argv)
    try:
        return app.parse_flags_with_usage(argv)
    except SystemExit as err:  # absl ends --help with status 1; asking for help succeeds
        if err.code == 1 and any(arg in HELP_FLAGS for arg in argv[1:]):
            raise SystemExit(0) from None
        raise
    except (OSError, KeyError, AttributeError, TypeError, ValueError) as err:
        # ml_collections wraps a config file's own error in several layers; its last line
        # names the cause.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise UserError(f"cannot load the config: {lines[-1] if lines else err!r}") from err


def guarded(call: Callable[..., object], *args: object, debug: bool = False) -> object:
    """call(*args), with a user error (or a user's OSError) printed as one line and the
    process ended with its exit status; with `debug`, or for any other error, it propagates."""
    try:
        return call(*args)
    except (UserError, OSError) as err:
        user_error = os_user_error(err) if isinstance(err, OSError) else err
        if user_error is None or debug:
            raise
        report(user_error)
        sys.exit(user_error.exit_status)


def run(main: Callable[[list[str]], object]) -> None:
    """absl's app.run(main), with user errors printed as one line and their exit status.

    Covers flag and config parsing, UserErrors, missing files and full-disk / read-only
    OSErrors.
    """
    app.run(
        lambda argv: guarded(main, argv, debug=debug_enabled(argv)),
        flags_parser=lambda argv: guarded(parse_flags, argv, debug=debug_enabled(argv)),
    )


def run_argparse(main: Callable[[], object]) -> None:
    """The same boundary for an argparse command line: main() reads sys.argv, from which a
    `--debug` flag is taken out first."""
    debug = "--debug" in sys.argv
    if debug:
        sys.argv.remove("--debug")
    guarded(main, debug=debug or debug_enabled([]))
