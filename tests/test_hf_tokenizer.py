"""The transformers tokenizer folder written from the embedded SentencePiece tokenizer gives the
project's ids and text (bov_jax/interop/hf_tokenizer.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import AutoTokenizer

from bov_jax.data import shards
from bov_jax.data.tokenizer import SPECIALS, load_tokenizer
from bov_jax.errors import DataError
from bov_jax.interop.hf_tokenizer import CHAT_TEMPLATE, FILES, export_hf_tokenizer

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"


@pytest.fixture(scope="module")
def project():
    return load_tokenizer(EMBEDDED / "tokenizer")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = export_hf_tokenizer(EMBEDDED / "tokenizer", tmp_path_factory.mktemp("hf"), 2048)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def val_texts() -> list[str]:
    (path,) = shards.split_files(EMBEDDED, "val")
    parquet = pq.ParquetFile(path)
    texts = []
    for group in range(parquet.num_row_groups):
        raw = shards.read_raw(parquet, group, path)
        texts += shards.decode_documents(raw, str(path), skip_bad=False)[0]
    return texts


def test_val_documents_encode_and_decode_as_the_project(project, hf, val_texts):
    assert len(val_texts) > 100
    mismatched = []
    for i, text in enumerate(val_texts):
        ids = project.encode_one(text)
        if hf(text, add_special_tokens=False).input_ids != ids:
            mismatched.append(i)
        assert hf.decode(ids) == project.decode(ids) == text
    assert mismatched == []


def test_special_tokens_are_the_projects(project, hf):
    assert hf.bos_token == hf.eos_token == "<|bos|>"
    assert hf.bos_token_id == hf.eos_token_id == project.bos_id == 0
    assert hf.convert_tokens_to_ids(list(SPECIALS)) == list(range(len(SPECIALS)))
    assert len(hf) == project.vocab_size
    text = "It is a truth universally acknowledged,\n\tthat  a single man 1789 \u00e9\U0001f600"
    ids = project.encode_one(text)
    assert hf(text).input_ids == [0, *ids]
    assert hf.decode([0, *ids, 0], skip_special_tokens=True) == text
    assert project.decode([0, *ids, 0]) == text


def render_conversation(project, messages: list[dict]) -> list[int]:
    """nanochat's Tokenizer.render_conversation (the ids, without the mask)."""
    special = {s: i for i, s in enumerate(SPECIALS)}
    if messages[0]["role"] == "system":
        joined = messages[0]["content"] + "\n\n" + messages[1]["content"]
        messages = [{"role": "user", "content": joined}, *messages[2:]]
    ids = [special["<|bos|>"]]
    for message in messages:
        content = message["content"]
        if message["role"] == "user":
            ids += [
                special["<|user_start|>"],
                *project.encode_one(content),
                special["<|user_end|>"],
            ]
            continue
        ids.append(special["<|assistant_start|>"])
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts:
            value = project.encode_one(part["text"])
            if part["type"] == "python":
                value = [special["<|python_start|>"], *value, special["<|python_end|>"]]
            elif part["type"] == "python_output":
                value = [special["<|output_start|>"], *value, special["<|output_end|>"]]
            ids += value
        ids.append(special["<|assistant_end|>"])
    return ids


CONVERSATIONS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a  novel by Jane Austen.\n"},
        {"role": "assistant", "content": " Emma."},
        {"role": "user", "content": "And 2+2?"},
    ],
    [
        {"role": "user", "content": "What is 12*13?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me compute. "},
                {"type": "python", "text": "12*13"},
                {"type": "python_output", "text": "156"},
                {"type": "text", "text": " It is 156."},
            ],
        },
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_nanochats_conversation(project, hf, messages):
    text = hf.apply_chat_template(messages, tokenize=False)
    assert hf(text, add_special_tokens=False).input_ids == render_conversation(project, messages)
    prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|assistant_start|>"


def render_template(messages: list[dict], **variables) -> str:
    """CHAT_TEMPLATE rendered by plain Jinja, as lm-eval's remote tokenizer does (no bos_token)."""
    return (
        ImmutableSandboxedEnvironment()
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, **variables)
    )


def test_chat_template_renders_the_text_it_is_documented_to():
    expected = (
        "<|bos|><|user_start|>You are terse.\n\nName a  novel by Jane Austen.\n<|user_end|>"
        "<|assistant_start|> Emma.<|assistant_end|><|user_start|>And 2+2?<|user_end|>"
    )
    assert render_template(CONVERSATIONS[1]) == expected


def test_chat_template_joins_system_and_developer_messages_to_the_next_user_message():
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": None},
        {"role": "system", "content": "S"},
        {"role": "developer", "content": [{"type": "text", "text": "D"}]},
        {"role": "user", "content": "B"},
    ]
    expected = (
        "<|bos|><|user_start|>A<|user_end|><|assistant_start|><|assistant_end|>"
        "<|user_start|>S\n\nD\n\nB<|user_end|><|assistant_start|>"
    )
    assert render_template(messages, add_generation_prompt=True) == expected


def test_chat_template_leaves_the_final_message_open_to_continue(hf):
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "It is"}]
    text = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text == "<|bos|><|user_start|>Q<|user_end|><|assistant_start|>It is"


def test_chat_template_rejects_messages_out_of_turn(hf):
    with pytest.raises(TemplateError, match="alternate"):
        hf.apply_chat_template([{"role": "assistant", "content": "hi"}], tokenize=False)


@pytest.mark.parametrize("roles", [["system"], ["user", "developer"]])
def test_chat_template_rejects_a_system_message_with_no_user_message_after_it(hf, roles):
    messages = [{"role": role, "content": "x"} for role in roles]
    with pytest.raises(TemplateError, match="followed by a user message"):
        hf.apply_chat_template(messages, tokenize=False)


def test_a_tokenizer_that_is_not_sentencepiece_is_refused(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="tokenizer.model"):
        export_hf_tokenizer(tmp_path, tmp_path / "out")


def run_command(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "bov_jax.interop.hf_tokenizer", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_command_writes_a_runs_tokenizer_with_its_context_length(tmp_path, project):
    record = dict(data=dict(tokenizer_dir=str(EMBEDDED / "tokenizer")), model=dict(seq_len=512))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(record))
    done = run_command(f"--workdir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(FILES)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf.model_max_length == 512
    assert hf("Sense and Sensibility").input_ids == [
        0,
        *project.encode_one("Sense and Sensibility"),
    ]


def test_the_command_needs_one_source(tmp_path):
    done = run_command(f"--out={tmp_path}")
    assert done.returncode == 2
    assert "exactly one of --workdir or --tokenizer" in done.stderr
