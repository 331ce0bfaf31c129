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

import errno
import os
import sys
from collections.abc import Callable

from absl import app, flags

from bov_jax.errors import UserError

flags.DEFINE_bool("debug", False, "Show the full traceback of user errors.")

# OSErrors that mean "the disk or the directory will not take this": the user fixes those.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


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


def parse_flags(
    argv: list[str], check_argv: Callable[[list[str]], None] | None = None
) -> list[str]:
    """absl's flag parsing, after `check_argv(argv)` (e.g. the config's key check), with
    config-file problems turned into UserErrors."""
    if check_argv is not None:
        check_argv(argv)
    try:
        return app.parse_flags_with_usage(argv)
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


def run(
    main: Callable[[list[str]], object],
    check_argv: Callable[[list[str]], None] | None = None,
) -> None:
    """absl's app.run(main), with user errors printed as one line and their exit status.

    Covers flag and config parsing (`check_argv` runs on the raw argv first), UserErrors,
    missing files and full-disk / read-only OSErrors.
    """
    app.run(
        lambda argv: guarded(main, argv, debug=debug_enabled(argv)),
        flags_parser=lambda argv: guarded(parse_flags, argv, check_argv, debug=debug_enabled(argv)),
    )


def run_argparse(main: Callable[[], object]) -> None:
    """The same boundary for an argparse command line: main() reads sys.argv, from which a
    `--debug` flag is taken out first."""
    debug = "--debug" in sys.argv
    if debug:
        sys.argv.remove("--debug")
    guarded(main, debug=debug or debug_enabled([]))
