"""The error boundary every command line goes through.

A user error (a bad config key or value, a missing or damaged file, a checkpoint of another
run) is printed as one or two lines naming the file, key or value, and the command exits with
status 2; a bug still shows its traceback. `--debug` (or BOV_JAX_DEBUG=1) shows the traceback
of user errors too.

    from bov_jax import cli
    if __name__ == "__main__":
        cli.run(main)          # instead of absl.app.run(main)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from absl import app, flags

flags.DEFINE_bool("debug", False, "Show the full traceback of user errors.")


class UserError(Exception):
    """A mistake the user can fix; its message names the file, key or value and the fix."""


def debug_enabled() -> bool:
    env = os.environ.get("BOV_JAX_DEBUG", "").lower() not in ("", "0", "false")
    return env or (flags.FLAGS.is_parsed() and flags.FLAGS.debug)


def report(err: BaseException) -> None:
    """Print a user error as `error: <message>` on stderr."""
    print(f"error: {err}", file=sys.stderr)


def run(main: Callable[[list[str]], object]) -> None:
    """absl's app.run(main), with UserError printed as one line and exit status 2."""

    def guarded(argv: list[str]) -> object:
        try:
            return main(argv)
        except UserError as err:
            if debug_enabled():
                raise
            report(err)
            sys.exit(2)

    app.run(guarded)
