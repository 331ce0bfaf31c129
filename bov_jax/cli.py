"""The boundary every command line goes through: absl flags, help, and user errors.

A command module defines its flags in a `define_flags()` called only when it runs, so that
importing it defines none, and hands its main to `run`:

    from bov_jax import cli
    if __name__ == "__main__":
        define_flags()
        cli.run(main)          # instead of absl.app.run(main)

Flags are spelled with underscores (a dashed spelling kept as `flags.DEFINE_alias`), a
subcommand is a positional word (`run(main, commands=...)`), and every command has --debug.
--help (also -h, --helpshort, --helpfull) prints the module's docstring and every flag of
the command with its default, and exits 0. A bad flag (unknown, or a value that does not
parse) and any other user error (a bad config key or value, a missing or damaged file, a
checkpoint of another run, a full disk or a read-only directory) is printed as one `error:`
line naming the flag, file, key or value, and the command exits with the error's status (2
unless the error says otherwise); a bug still shows its traceback. --debug (or
BOV_JAX_DEBUG=1) shows the traceback of user errors too.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence

from absl import app, flags
from absl import logging as absl_logging

from bov_jax.errors import UserError

# OSErrors that mean "the disk or the directory will not take this": the user fixes those.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
HELP_ARGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")
PROJECT = "bov_jax"


def debug_enabled(argv: list[str] | None = None) -> bool:
    """BOV_JAX_DEBUG=1, or --debug (read from `argv` while the flags are not parsed yet)."""
    if os.environ.get("BOV_JAX_DEBUG", "").lower() not in ("", "0", "false"):
        return True
    if flags.FLAGS.is_parsed():
        return flags.FLAGS.get_flag_value("debug", False)
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


def log_plainly(level: int = logging.INFO) -> None:
    """Log records from `level` up as their bare message on stderr (logging.basicConfig),
    in place of the handler absl.app puts on the root logger; a no-op where the root logger
    has other handlers already (pytest's)."""
    logging.root.removeHandler(absl_logging.get_absl_handler())
    logging.basicConfig(level=level, format="%(message)s")


def quiet_libraries() -> None:
    """The project's log lines at INFO, every library's (orbax, absl, jax, uvicorn) from
    WARNING only, and TensorFlow's C++ log (tensorflow-datasets imports it) off."""
    log_plainly()
    logging.root.setLevel(logging.WARNING)
    logging.getLogger("bov_jax").setLevel(logging.INFO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def check_positional(argv: list[str], commands: Sequence[str]) -> None:
    """A command with subcommands takes exactly one positional word, one of `commands`; a
    command without any takes none."""
    if not commands and len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])} (--help lists the flags)")
    if commands and (len(argv) != 2 or argv[1] not in commands):
        got = " ".join(argv[1:]) or "nothing"
        raise UserError(f"expected a command, one of {', '.join(commands)}; got {got}")


def describe_default(flag: flags.Flag) -> str:
    """A flag's default as it would be typed: none, true/false, a comma list, a value."""
    value = flag.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    return repr(value) if isinstance(value, str) else str(value)


def flag_help(names: list[str], flag: flags.Flag) -> str:
    """Two lines for one flag: its spellings and default, then its help (and choices)."""
    spellings = ", ".join(f"--[no]{n}" if flag.boolean else f"--{n}" for n in names)
    choices = getattr(flag.parser, "enum_values", None)
    text = flag.help + (f" One of: {', '.join(choices)}." if choices else "")
    indent = " " * 6
    text = textwrap.fill(text, width=92, initial_indent=indent, subsequent_indent=indent)
    return f"  {spellings} (default: {describe_default(flag)})\n{text}"


def command_help(doc: str | None, everything: bool = False) -> str:
    """The command's docstring and every flag of the project's modules (with `everything`,
    the libraries' flags too), aliases beside the flag they stand for."""
    by_module = flags.FLAGS.flags_by_module_dict()
    chosen = {
        flag
        for module, module_flags in by_module.items()
        if everything or module.startswith(PROJECT) or module == sys.argv[0]
        for flag in module_flags
    }
    names: dict[str, list[str]] = {}
    for name in flags.FLAGS:  # every spelling, aliases included
        flag = flags.FLAGS[name]
        if flag in chosen:
            original = flag.help.removeprefix("Alias for --").removesuffix(".")
            names.setdefault(original if original in flags.FLAGS else name, []).append(name)
    lines = [
        flag_help(sorted(spellings, key=lambda n: n != original), flags.FLAGS[original])
        for original, spellings in sorted(names.items())
    ]
    return "\n".join([(doc or "").strip(), "", "flags:", *lines])


def parse_flags(
    argv: list[str],
    check_argv: Callable[[list[str]], None] | None = None,
    doc: str | None = None,
) -> list[str]:
    """absl's flag parsing: --help printed (exit 0); `check_argv(argv)` (e.g. the config's
    key check) first; a bad flag or config file a UserError."""
    options = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    asked = [arg for arg in options if arg in HELP_ARGS]
    if asked:
        print(command_help(doc, everything="--helpfull" in asked))
        sys.exit(0)
    if check_argv is not None:
        check_argv(argv)
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise UserError(f"{message} (--help lists the flags)") from err
    except Exception as err:  # a config file's own error, wrapped by ml_collections
        # Its last line names the cause. A KeyError's str() is the repr of its message.
        text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        cause = lines[-1] if lines else repr(err)
        cause = cause if len(cause) <= 150 else cause[:147] + "..."
        raise UserError(f"cannot load the config: {type(err).__name__}: {cause}") from err


def exit_now(err: BaseException, debug: bool = False) -> None:
    """End the process at once after `err`, as `guarded` would report it (one line for a user
    error, the traceback otherwise), skipping the exit handlers: for a multi-process run whose
    peers are gone or leaving, where jax.distributed's exit handler would wait for them."""
    user_error = os_user_error(err) if isinstance(err, OSError) else err
    if isinstance(user_error, UserError) and not debug:
        report(user_error)
        status = user_error.exit_status
    else:
        traceback.print_exception(err)
        status = 130 if isinstance(err, KeyboardInterrupt) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def guarded(call: Callable[..., object], *args: object, debug: bool = False) -> object:
    """call(*args), with a user error (or a user's OSError) printed as one line and the
    process ended with its exit status; with `debug`, or for any other error, it propagates."""
    try:
        return call(*args)
    except BrokenPipeError:  # the reader of stdout left (`| head`): end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (UserError, OSError) as err:
        user_error = os_user_error(err) if isinstance(err, OSError) else err
        if user_error is None or debug:
            raise
        report(user_error)
        sys.exit(user_error.exit_status)


def run(
    main: Callable[[list[str]], object],
    check_argv: Callable[[list[str]], None] | None = None,
    commands: Sequence[str] = (),
) -> None:
    """absl's app.run(main), with --debug, --help that exits 0, and user errors (bad flags
    included) printed as one line with their exit status.

    Covers flag and config parsing (`check_argv` runs on the raw argv first), the positional
    words (one of `commands`, which main reads as argv[1], or none), UserErrors, missing
    files and full-disk / read-only OSErrors. The help text is the docstring of main's module.
    """
    flags.DEFINE_bool("debug", False, "Show the full traceback of user errors.")
    doc = main.__globals__.get("__doc__")

    def checked_main(argv: list[str]) -> object:
        check_positional(argv, commands)
        return main(argv)

    app.run(
        lambda argv: guarded(checked_main, argv, debug=debug_enabled(argv)),
        flags_parser=lambda argv: guarded(
            parse_flags, argv, check_argv, doc, debug=debug_enabled(argv)
        ),
    )
