"""Prepare a data directory for an experiment: ClimbMix shards, tokenizer, token cache.

    python -m bov_jax.prepare --config=configs/d24_bov.py --data_dir=DIR \\
        [--num_shards=N] [--base_url=URL] [--config.<key>=<value> ...]

then train with `--config.data.data_dir=DIR` (and the same overrides). Config overrides work as
in bov_jax.main: the horizon (train.*) sets how many shards are fetched and model.vocab_size the
tokenizer's vocabulary. Four steps, each skipped when its result is already there:

1. shards: the train shards the horizon needs (`shards_for_tokens`: tokens x (1 + MARGIN) /
   TOKENS_PER_SHARD) unless --num_shards is given, plus the val shard; the count and size are
   printed before anything is fetched; the downloader (bov_jax/corpora/climbmix.py) resumes
   partial files and verifies each one.
2. tokenizer: DIR/tokenizer (or data.tokenizer_dir) trained at model.vocab_size on the train
   shards with the reference's budget (documents cropped to 10,000 characters, the first 2B
   characters; bov_jax/data/tokenizer.py).
3. token cache: DIR/token_cache (or data.cache_dir), bov_jax/data/token_cache.py.
4. DIR/prepared.json: what was prepared, and the train split's token count against the horizon.

On a DIR whose prepared.json matches the request, the command verifies the shards (size, sha256
of the whole file, footer), the tokenizer's digest and the cache, and does nothing else; a shard
that differs from its record is fetched again (and the token cache, named by the shards'
content, rebuilt). A shard whose pages do not decode stops any step that reads it with one line
naming the file and row group, exit 1.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from absl import flags
from ml_collections import config_flags

from bov_jax.accounting import training_plan
from bov_jax.config import define_config_flag, validate_config
from bov_jax.corpora import climbmix
from bov_jax.data import token_cache
from bov_jax.data.config import tokenizer_path
from bov_jax.data.identity import content_digests
from bov_jax.data.tokenizer import (
    REFERENCE_DOC_CHARS,
    REFERENCE_MAX_CHARS,
    Tokenizer,
    load_tokenizer,
    model_path,
    train_tokenizer,
)
from bov_jax.errors import DataError, UserError
from bov_jax.files import write_json_atomic

log = logging.getLogger("bov_jax.prepare")

# A ClimbMix shard holds at least 250M characters (spec 5.1), about 100 MB of zstd parquet.
# At the 4.8 characters per token that nanochat's tokenizers reach on web text (a 32768-token
# BPE compresses somewhat less, so a shard holds somewhat more tokens: the estimate errs
# towards more shards), a shard holds about 52M tokens.
SHARD_CHARS = 250_000_000
CHARS_PER_TOKEN = 4.8
TOKENS_PER_SHARD = int(SHARD_CHARS / CHARS_PER_TOKEN)
SHARD_BYTES = 100_000_000
# Extra shards for the tokens that best-fit packing crops away and for the estimate's error,
# so that the horizon stays within one epoch of the train split.
MARGIN = 0.2
RECORD = "prepared.json"
DIR_PLACEHOLDER = "DIR"


def shards_for_tokens(tokens: int) -> int:
    """Train shards for `tokens` training tokens: ceil(tokens x (1 + MARGIN) / TOKENS_PER_SHARD),
    at least 1 and at most the hub's MAX_SHARD."""
    return min(climbmix.MAX_SHARD, max(1, math.ceil(tokens * (1 + MARGIN) / TOKENS_PER_SHARD)))


def unprepared_reason(config: Any) -> str | None:
    """Why config.data cannot serve config.model (no shards, no tokenizer, a tokenizer of another
    vocab size), as a phrase; None when it can (validate_data_config checks the rest)."""
    data_dir = Path(config.data.data_dir)
    if not data_dir.is_dir():
        return f"data directory {data_dir} does not exist"
    if len(list(data_dir.glob("*.parquet"))) < 2:
        return f"data directory {data_dir} holds no train and val shards"
    file = model_path(tokenizer_path(config.data))
    if not file.is_file():
        return f"there is no tokenizer {file}"
    vocab = load_tokenizer(file).vocab_size
    if vocab != config.model.vocab_size:
        return (
            f"tokenizer {file} has vocab size {vocab} but model.vocab_size is "
            f"{config.model.vocab_size}"
        )
    return None


def prepare_command(argv: list[str]) -> tuple[str, bool]:
    """The `python -m bov_jax.prepare` command for a main command line `argv` (without the
    program): its --config and --config.<key> flags, data.data_dir as --data_dir (DIR when not
    given); and whether argv gave data.data_dir."""
    kept, data_dir = [], None
    args = iter(argv)
    for arg in args:
        name, has_value, value = arg.partition("=")
        if name == "--config.data.data_dir":
            data_dir = value if has_value else next(args, None)
            continue
        if name == "--config" and not has_value:  # --config FILE
            arg = f"--config={next(args, '')}"
        elif name != "--config" and not name.startswith("--config."):
            continue
        kept.append(arg)
    command = [
        "python",
        "-m",
        "bov_jax.prepare",
        *kept,
        f"--data_dir={data_dir or DIR_PLACEHOLDER}",
    ]
    return shlex.join(command), data_dir is not None


def check_prepared(config: Any, argv: list[str]) -> None:
    """Raise a one-line DataError naming the prepare command unless config.data can serve the
    config's model; for main, before anything is compiled. `argv`: main's command line."""
    reason = unprepared_reason(config)
    if reason is None:
        return
    command, has_data_dir = prepare_command(argv)
    then = "then rerun" if has_data_dir else f"then add --config.data.data_dir={DIR_PLACEHOLDER}"
    raise DataError(f"the data is not prepared: {reason}; run `{command}`, {then}")


@dataclass(frozen=True)
class Request:
    """What to prepare: the data config (data_dir set to DIR), the vocab, the shard indices."""

    data_cfg: Any
    vocab_size: int
    indices: list[int]
    horizon_tokens: int
    config_ref: str

    @property
    def data_dir(self) -> Path:
        return Path(self.data_cfg.data_dir)

    def as_record(self) -> dict[str, Any]:
        return {
            "config": self.config_ref,
            "vocab_size": self.vocab_size,
            "shards": [climbmix.shard_name(i) for i in self.indices],
            "horizon_tokens": self.horizon_tokens,
        }


def missing_shards(request: Request) -> list[int]:
    """The requested shard indices not yet in DIR (a `.part` file counts as missing)."""
    return [i for i in request.indices if not (request.data_dir / climbmix.shard_name(i)).exists()]


def describe_download(request: Request, missing: list[int]) -> str:
    """'N train shards + the val shard for ... into DIR: M to fetch, about X GB ...'."""
    return (
        f"{len(request.indices) - 1} train shards + the val shard for "
        f"{request.horizon_tokens / 1e9:.3g}B training tokens into {request.data_dir}: "
        f"{len(missing)} to fetch, about {len(missing) * SHARD_BYTES / 1e9:.1f} GB "
        f"(~{SHARD_BYTES / 1e6:.0f} MB per shard)"
    )


def shard_record(request: Request) -> list[dict[str, Any]]:
    """[{name, bytes, sha256}] of the requested shards, each verified (a readable text shard);
    sha256 is of the whole file, what a rerun checks each shard against."""
    paths = [request.data_dir / climbmix.shard_name(index) for index in request.indices]
    for path in paths:
        climbmix.verify(path)
    digests = content_digests(paths)
    return [{"name": p.name, "bytes": p.stat().st_size, "sha256": digests[p]} for p in paths]


def ensure_tokenizer(request: Request, threads: int) -> Tokenizer:
    """The data config's tokenizer, trained first (reference budget) if it does not exist."""
    path = tokenizer_path(request.data_cfg)
    if not model_path(path).is_file():
        log.info(
            "training the tokenizer (vocab %d) on the train shards' first %.0fM characters",
            request.vocab_size,
            REFERENCE_MAX_CHARS / 1e6,
        )
        train_tokenizer(
            request.data_dir,
            request.vocab_size,
            path,
            num_threads=threads,
            doc_chars=REFERENCE_DOC_CHARS,
            max_chars=REFERENCE_MAX_CHARS,
        )
    return load_tokenizer(path, request.vocab_size, threads)


def split_tokens(cache_dir: Path, tokenizer: Tokenizer) -> dict[str, int]:
    """{split: about how many tokens} of a built token cache (BOS included): its records'
    bytes (dataset_info.json) over the bytes of an id."""
    info = json.loads((cache_dir / "dataset_info.json").read_text())
    itemsize = token_cache.id_dtype(tokenizer.vocab_size).itemsize
    return {s["name"]: int(s["numBytes"]) // itemsize for s in info["splits"]}


def recorded(request: Request) -> dict[str, Any] | None:
    """DIR/prepared.json if it describes this request, else None."""
    path = request.data_dir / RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    wanted = request.as_record()
    same = all(record.get(k) == wanted[k] for k in ("vocab_size", "shards"))
    return record if same else None


def damaged_shards(request: Request, record: dict[str, Any]) -> list[str]:
    """The shards of `record` that are present but not as recorded: another size, another
    sha256 of their content (records written before sha256 was recorded: their size only),
    or a footer that does not read. Missing ones are not listed (they are fetched anyway)."""
    present = [f for f in record["files"] if (request.data_dir / f["name"]).is_file()]
    digests = content_digests([request.data_dir / f["name"] for f in present])
    damaged = []
    for entry in present:
        path = request.data_dir / entry["name"]
        sha256 = entry.get("sha256", digests[path])
        if path.stat().st_size != entry["bytes"] or digests[path] != sha256:
            damaged.append(entry["name"])
            continue
        try:
            climbmix.verify(path)
        except DataError:
            damaged.append(entry["name"])
    return damaged


def verify_prepared(request: Request, record: dict[str, Any]) -> bool:
    """Whether every shard (by size and content), the tokenizer and the cache of `record` are
    in place as recorded."""
    names = [f["name"] for f in record["files"]]
    if not all((request.data_dir / name).is_file() for name in names):
        return False
    if damaged_shards(request, record):
        return False
    tokenizer = load_tokenizer(tokenizer_path(request.data_cfg), request.vocab_size)
    if tokenizer.sha256 != record["tokenizer_sha256"]:
        return False
    return token_cache.built_cache(request.data_cfg, tokenizer) is not None


def remove_damaged(request: Request, record: dict[str, Any] | None) -> list[str]:
    """Delete the shards that differ from `record` (`damaged_shards`), so that they are fetched
    again; their names."""
    damaged = damaged_shards(request, record) if record is not None else []
    for name in damaged:
        log.warning("%s differs from %s (size or sha256): fetching it again", name, RECORD)
        (request.data_dir / name).unlink()
    return damaged


def prepare(request: Request, base_url: str, workers: int, threads: int) -> dict[str, Any]:
    """Shards, tokenizer, token cache and DIR/prepared.json for `request`; returns the record.
    A DIR already prepared for the same request is verified and left as it is."""
    record = recorded(request)
    if record is not None and verify_prepared(request, record):
        print(f"{request.data_dir} is ready (verified {RECORD}: shards, tokenizer, token cache)")
        return record
    remove_damaged(request, record)
    missing = missing_shards(request)
    print(describe_download(request, missing), flush=True)
    if missing:
        climbmix.download(missing, request.data_dir, base_url=base_url, workers=workers)
    files = shard_record(request)
    tokenizer = ensure_tokenizer(request, threads)
    tokens = split_tokens(token_cache.ensure_cache(request.data_cfg, tokenizer), tokenizer)
    record = {
        **request.as_record(),
        "files": files,
        "tokenizer": str(model_path(tokenizer_path(request.data_cfg))),
        "tokenizer_sha256": tokenizer.sha256,
        "split_tokens": tokens,
        "epochs_of_train_split": request.horizon_tokens / max(1, tokens["train"]),
    }
    write_json_atomic(request.data_dir / RECORD, record)
    print(
        f"{request.data_dir} is ready: {tokens['train'] / 1e9:.3g}B train tokens for a horizon of "
        f"{request.horizon_tokens / 1e9:.3g}B ({record['epochs_of_train_split']:.2f} epochs)"
    )
    if record["epochs_of_train_split"] > 1:
        log.warning(
            "the horizon is %.2f epochs of the train split; --num_shards=%d would keep it in one",
            record["epochs_of_train_split"],
            math.ceil((len(request.indices) - 1) * record["epochs_of_train_split"] * (1 + MARGIN)),
        )
    return record


def request_from_flags(
    config: Any, data_dir: str, num_shards: int | None, config_ref: str
) -> Request:
    """The Request of a validated config: data_dir set, the shards from the horizon unless
    `num_shards` is given."""
    config.unlock()
    config.data.data_dir = str(Path(data_dir).resolve())
    config.lock()
    tokens = training_plan(config).tokens
    count = num_shards if num_shards is not None else shards_for_tokens(tokens)
    return Request(config.data, config.model.vocab_size, climbmix.plan(count), tokens, config_ref)


def define_flags() -> None:
    """The command's flags (defined on use: main imports this module for check_prepared)."""
    define_config_flag()
    flags.DEFINE_string("data_dir", None, "Directory to prepare (shards, tokenizer, token cache).")
    flags.DEFINE_integer(
        "num_shards", None, "Train shards to fetch (default: from the config's horizon)."
    )
    flags.DEFINE_string("base_url", climbmix.BASE_URL, "Where the ClimbMix shards are served.")
    flags.DEFINE_integer("workers", 8, "Parallel downloads.")
    flags.DEFINE_integer(
        "threads", os.cpu_count() or 1, "Threads training the tokenizer and encoding the cache."
    )


def main(argv: list[str]) -> None:
    f = flags.FLAGS
    del argv  # cli.run refuses positional arguments
    for name in ("config", "data_dir"):
        if not f[name].present:
            raise UserError(f"--{name} is required (--help explains the flags)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", force=True)
    logging.getLogger("bov_jax").setLevel(logging.INFO)
    config = f.config
    validate_config(config)
    config_ref = config_flags.get_config_filename(f["config"])
    request = request_from_flags(config, f.data_dir, f.num_shards, config_ref)
    prepare(request, f.base_url, f.workers, f.threads)


if __name__ == "__main__":
    from bov_jax import cli
    from bov_jax.config import check_config_arguments

    define_flags()
    cli.run(main, check_argv=check_config_arguments)
