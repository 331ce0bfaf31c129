"""The authors' checkpoints without torch: the .pt format, safe unpickling, the tiktoken
tokenizer, and `python -m bov_jax.interop import` end to end against the npz path."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tiktoken
from helpers import randomize, tiny_config, tiny_model, tokens

from bov_jax.data.tiktoken_tokenizer import TiktokenTokenizer
from bov_jax.evals.bpb import evaluate_model
from bov_jax.inference.texts import sample_text
from bov_jax.interop.checkpoints import export_npz, import_npz, load_state_dict, state_dict
from bov_jax.interop.safe_pickle import UnsafePickleError
from bov_jax.interop.torch_format import read_state_dict, write_state_dict

REPO = Path(__file__).resolve().parents[1]
SPECIALS = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
# The reference's split regex (spec 6.1): GPT-4's, with numbers of 1-2 digits.
SPLIT_PATTERN = (
    r"'(?i:[sdmt]|ll|ve|re)",
    r"[^\r\n\p{L}\p{N}]?+\p{L}+",
    r"\p{N}{1,2}",
    r" ?[^\s\p{L}\p{N}]++[\r\n]*",
    r"\s*[\r\n]",
    r"\s+(?!\S)",
    r"\s+",
)
VOCAB = 384  # 256 bytes + 119 merges + 9 specials
MODEL = dict(depth=4, vocab_size=VOCAB, short_window=0, table_dtype="bfloat16")
PROMPT = "The meaning of the"


def tiny_encoding() -> tiktoken.Encoding:
    """A byte-level BPE like the reference's (bytes are ids 0..255, specials last)."""
    ranks = {bytes([i]): i for i in range(256)}
    letters = b" etaoinshrdlucmfw"
    pairs = (bytes([a, b]) for a in letters for b in letters)
    for pair in pairs:
        if len(ranks) == VOCAB - len(SPECIALS):
            break
        ranks[pair] = len(ranks)
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIALS)}
    pattern = "|".join(SPLIT_PATTERN)
    return tiktoken.Encoding(
        "tiny", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )


def source_model():
    model = tiny_model("d12_bov", seed=3, **MODEL)
    randomize(model, seed=4)
    return model


def logits(model) -> np.ndarray:
    return np.asarray(model(tokens(vocab=VOCAB)))


# ---------------------------------------------------------------------------------------------
# The .pt format and the restricted unpickler


def test_pt_round_trip_is_bit_exact_and_laid_out_like_torch(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((5, 3)).astype(np.float32),
        "table": rng.standard_normal((7, 4)).astype(ml_dtypes.bfloat16),
        "scalar": np.asarray([0.25], np.float32),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
    }
    path = tmp_path / "model_000005.pt"
    write_state_dict(path, tensors)
    back = read_state_dict(path)
    assert list(back) == list(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name].view(np.uint8), value.view(np.uint8))
    with zipfile.ZipFile(path) as archive:
        infos = {i.filename: i for i in archive.infolist()}
        assert {"model_000005/data.pkl", "model_000005/byteorder", "model_000005/version"} <= set(
            infos
        )
        for info in infos.values():
            assert info.compress_type == zipfile.ZIP_STORED
            data_start = info.header_offset + 30 + len(info.filename) + len(info.extra)
            assert data_start % 64 == 0, info.filename


def test_strided_views_are_rebuilt_from_their_storage(tmp_path):
    """A transposed tensor, size (3, 4) with stride (1, 3), as torch saves a .T view."""
    storage = np.arange(12, dtype=np.float32)
    payload = (
        b"\x80\x02ccollections\nOrderedDict\n)R(X\x01\x00\x00\x00t"
        b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
        b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQ"
        b"K\x00K\x03K\x04\x86K\x01K\x03\x86\x89ccollections\nOrderedDict\n)RtRu."
    )
    path = tmp_path / "strided.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/data/0", storage.tobytes())
        archive.writestr("archive/version", "3\n")
    np.testing.assert_array_equal(read_state_dict(path)["t"], storage.reshape(4, 3).T)


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("kind", ["reduce", "global"])
def test_malicious_pickles_are_refused_and_run_nothing(tmp_path, kind):
    marker = tmp_path / "pwned"
    payload = (
        pickle.dumps({"w": _Exploit(marker)}, protocol=2)
        if kind == "reduce"
        else b"\x80\x02cbuiltins\neval\nX\x0b\x00\x00\x00print('hi')\x85R."
    )
    path = tmp_path / "model_000001.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model_000001/data.pkl", payload)
        archive.writestr("model_000001/version", "3\n")
    global_name = "posix.system" if kind == "reduce" else "builtins.eval"
    with pytest.raises(UnsafePickleError, match=rf"{path}.*refusing.*{global_name}"):
        read_state_dict(path)
    tokenizer_file = tmp_path / "tokenizer.pkl"
    tokenizer_file.write_bytes(payload)
    with pytest.raises(UnsafePickleError, match="tiktoken.core.Encoding"):
        TiktokenTokenizer(tokenizer_file.read_bytes(), str(tokenizer_file))
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# The tokenizer backend


def test_tiktoken_pickle_loads_safely_and_token_bytes_follow_the_reference(tmp_path):
    encoding = tiny_encoding()
    tokenizer = TiktokenTokenizer(pickle.dumps(encoding), "tokenizer.pkl")
    text = "the cat sat on the mat, naïvely: 42 €"
    assert tokenizer.encode_one(text) == encoding.encode_ordinary(text)
    assert tokenizer.decode(tokenizer.encode_one(text)) == text
    assert tokenizer.vocab_size == VOCAB and tokenizer.bos_id == VOCAB - len(SPECIALS)
    token_bytes = tokenizer.token_bytes()
    assert np.all(token_bytes[VOCAB - len(SPECIALS) :] == 0)
    assert np.all(token_bytes[:128] == 1)  # ASCII bytes
    assert np.all(token_bytes[128:256] == 3)  # partial UTF-8: U+FFFD, the reference's quirk
    assert token_bytes[encoding.encode_single_token(b"th")] == 2
    restored = pickle.loads(pickle.dumps(tokenizer))  # grain workers
    assert restored.encode_one(text) == tokenizer.encode_one(text)


# ---------------------------------------------------------------------------------------------
# Imported models against the npz path


def test_pt_import_gives_the_logits_of_the_npz_path(tmp_path):
    source = source_model()
    write_state_dict(tmp_path / "model_000001.pt", state_dict(source))
    export_npz(source, str(tmp_path / "model.npz"))
    via_pt, via_npz = tiny_model("d12_bov", seed=8, **MODEL), tiny_model("d12_bov", seed=9, **MODEL)
    load_state_dict(via_pt, read_state_dict(tmp_path / "model_000001.pt"), "model_000001.pt")
    import_npz(via_npz, str(tmp_path / "model.npz"))
    np.testing.assert_array_equal(logits(via_pt), logits(via_npz))
    np.testing.assert_array_equal(logits(via_pt), logits(source))


@pytest.fixture(scope="module")
def authors_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint directory in the authors' layout (spec 9.2) from random weights."""
    directory = tmp_path_factory.mktemp("authors")
    write_state_dict(directory / "model_000007.pt", state_dict(source_model()))
    spec = source_model().spec
    meta = dict(
        step=7,
        val_bpb=3.2,
        model_type="gpt_base_v_from_value_emb_learn",
        model_config=dict(
            sequence_len=spec.seq_len,
            vocab_size=VOCAB,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            n_kv_head=spec.n_head,
            n_embd=spec.d_model,
            window_pattern="SSSL",
        ),
        user_config={},
    )
    (directory / "meta_000007.json").write_text(json.dumps(meta))
    (directory / "tokenizer.pkl").write_bytes(pickle.dumps(tiny_encoding()))
    return directory


def run_module(*args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def npz_model_and_tokenizer(authors_checkpoint: Path, tmp_path: Path):
    """The same weights through the npz path, with the same tokenizer and eval data."""
    export_npz(source_model(), str(tmp_path / "model.npz"))
    model = tiny_model("d12_bov", seed=5, **MODEL)
    import_npz(model, str(tmp_path / "model.npz"))
    config = tiny_config("d12_bov", **MODEL)
    config.data.update(tokenizer_dir=str(authors_checkpoint / "tokenizer.pkl"), use_cache=False)
    tokenizer = TiktokenTokenizer(
        (authors_checkpoint / "tokenizer.pkl").read_bytes(), "tokenizer.pkl"
    )
    return model, tokenizer, config


def test_imported_checkpoint_evaluates_like_the_npz_path(authors_checkpoint, tmp_path):
    workdir = tmp_path / "imported"
    out = run_module(
        "bov_jax.interop",
        "import",
        f"--checkpoint_dir={authors_checkpoint}",
        f"--workdir={workdir}",
    )
    assert "imported step 7" in out
    config = json.loads((workdir / "config.json").read_text())
    assert config["data"]["tokenizer_dir"].endswith("tokenizer.pkl")
    assert config["model"]["table_dtype"] == "bfloat16"

    model, tokenizer, npz_config = npz_model_and_tokenizer(authors_checkpoint, tmp_path)
    bpb = json.loads(
        run_module(
            "bov_jax.evals.bpb", f"--workdir={workdir}", "--eval_tokens=256", "--batch_rows=2"
        )
    )
    want = evaluate_model(model, tokenizer, npz_config, eval_tokens=256, batch_rows=2)
    assert bpb["val_bpb"] == want["val_bpb"] and np.isfinite(want["val_bpb"])

    sample = run_module(
        "bov_jax.inference.sample",
        f"--workdir={workdir}",
        f"--prompt={PROMPT}",
        "--max_new_tokens=8",
    )
    assert sample.rstrip("\n") == PROMPT + sample_text(model, tokenizer, PROMPT, 8)


def test_export_writes_what_import_reads(authors_checkpoint, tmp_path):
    workdir = tmp_path / "imported"
    from bov_jax.interop.checkpoints import export_checkpoint, import_checkpoint

    import_checkpoint(authors_checkpoint, workdir)
    model_file = export_checkpoint(workdir, tmp_path / "exported")
    assert model_file.name == "model_000007.pt"
    original = read_state_dict(authors_checkpoint / "model_000007.pt")
    exported = read_state_dict(model_file)
    assert list(exported) == list(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype, name
        np.testing.assert_array_equal(exported[name].view(np.uint8), value.view(np.uint8))
    meta = json.loads((tmp_path / "exported" / "meta_000007.json").read_text())
    assert meta["model_type"] == "gpt_base_v_from_value_emb_learn"
    assert (tmp_path / "exported" / "tokenizer.pkl").read_bytes() == (
        authors_checkpoint / "tokenizer.pkl"
    ).read_bytes()
    jax.clear_caches()


def test_bad_checkpoint_directories_are_named(authors_checkpoint, tmp_path):
    from bov_jax.errors import UserError
    from bov_jax.interop.checkpoints import checkpoint_files, config_from_meta

    with pytest.raises(UserError, match=rf"{tmp_path} holds no model_<step>.pt"):
        checkpoint_files(tmp_path, None)
    with pytest.raises(UserError, match="meta_000003.json not found"):
        (tmp_path / "model_000003.pt").write_bytes(b"")
        checkpoint_files(tmp_path, None)
    meta = json.loads((authors_checkpoint / "meta_000007.json").read_text())
    with pytest.raises(UserError, match="model_type='gpt_made_up' is unknown"):
        config_from_meta({**meta, "model_type": "gpt_made_up"}, "float32", Path("meta.json"))
    del meta["model_config"]["n_layer"]
    with pytest.raises(UserError, match="meta.json: model_config lacks n_layer"):
        config_from_meta(meta, "float32", Path("meta.json"))
    assert checkpoint_files(authors_checkpoint, None)[0] == 7


def strided_checkpoint(directory: Path, size: tuple[int, int], stride: tuple[int, int]) -> Path:
    """An authors'-layout directory whose model_000001.pt holds one tensor `w` of the given
    size and stride over a storage of 12 float32s (integers pickled as 8-byte longs)."""

    def pair(values: tuple[int, int]) -> bytes:
        return (
            b"".join(b"\x8a\x08" + v.to_bytes(8, "little", signed=True) for v in values) + b"\x86"
        )

    payload = (
        b"\x80\x02ccollections\nOrderedDict\n)R(X\x01\x00\x00\x00w"
        b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
        b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQ"
        b"K\x00" + pair(size) + pair(stride) + b"\x89ccollections\nOrderedDict\n)RtRu."
    )
    directory.mkdir()
    with zipfile.ZipFile(directory / "model_000001.pt", "w") as archive:
        archive.writestr("model_000001/data.pkl", payload)
        archive.writestr("model_000001/data/0", np.arange(12, dtype=np.float32).tobytes())
        archive.writestr("model_000001/version", "3\n")
    (directory / "meta_000001.json").write_text("{}")
    (directory / "tokenizer.pkl").write_bytes(pickle.dumps(tiny_encoding()))
    return directory


@pytest.mark.parametrize(
    "size, stride",
    [((4, 3), (-128, 1)), ((4, 3), (-(2**30), 1)), ((2, 12), (2**62, 1)), ((4, 3), (4, 1))],
    ids=["negative", "far negative", "overflowing", "past the end"],
)
def test_strides_outside_the_storage_are_refused(tmp_path, size, stride):
    """torch.load refuses these; reading them as given read process memory or crashed."""
    source = strided_checkpoint(tmp_path / "authors", size, stride)
    done = subprocess.run(
        [sys.executable, "-m", "bov_jax.interop", "import", f"--checkpoint_dir={source}"]
        + [f"--workdir={tmp_path / 'imported'}"],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done.stderr
    assert "model_000001.pt: tensor w:" in done.stderr and "not read" in done.stderr
    assert not (tmp_path / "imported").exists()


def test_failed_import_leaves_nothing(authors_checkpoint, tmp_path):
    from bov_jax.errors import UserError
    from bov_jax.interop.checkpoints import import_checkpoint

    source = tmp_path / "authors"
    shutil.copytree(authors_checkpoint, source)
    meta = json.loads((source / "meta_000007.json").read_text())
    meta["model_config"]["n_layer"] += 1  # the weights are one layer short
    (source / "meta_000007.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="missing transformer.h.4"):
        import_checkpoint(source, tmp_path / "imported")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["authors"]
