"""A run's SentencePiece tokenizer as a Hugging Face `transformers` tokenizer folder.

    python -m bov_jax.interop.hf_tokenizer --workdir=RUN --out=DIR
    python -m bov_jax.interop.hf_tokenizer --tokenizer=data/embedded/tokenizer --out=DIR

DIR gets tokenizer.json (the `tokenizers` pipeline), tokenizer_config.json (special tokens,
the chat template, model_max_length from the run's model.seq_len) and special_tokens_map.json,
so that `AutoTokenizer.from_pretrained(DIR)` (lm-evaluation-harness, guidellm, vLLM's
clients) encodes text to the project's ids:

    tokenizer(text, add_special_tokens=False).input_ids == project encode(text)
    tokenizer(text).input_ids == [0] + project encode(text)     (<|bos|> prepended)

The pipeline mirrors the project's SentencePiece BPE (bov_jax/data/tokenizer.py): " " becomes
U+2581, then BPE over characters with byte fallback. SentencePiece merges the adjacent pair
whose concatenation is the best-scored piece; the equivalent `tokenizers` merge list has one
merge per way of splitting each piece into two pieces, ranked by the joined piece's score.
`<|bos|>` (id 0) is BOS, EOS and the document separator, as in training. The specials are
added tokens, so a special's text in a prompt becomes its id (the project's encode reads it
as plain text); this is what lets a client render the chat template below to the ids the
server's /v1/chat/completions builds.

The chat template is nanochat's render_conversation, as the server's /v1/chat/completions
renders it: `<|bos|>`, then per user message `<|user_start|>CONTENT<|user_end|>`, per
assistant message `<|assistant_start|>CONTENT<|assistant_end|>`; system and developer
messages joined, each followed by a blank line, to the start of the next user message; then
messages alternate user, assistant from a user; content a string, null (empty) or a list of
text parts (nanochat's python and python_output parts wrapped in
`<|python_start|>..<|python_end|>` and `<|output_start|>..<|output_end|>`). The generation
prompt is `<|assistant_start|>`; with continue_final_message the last (assistant's) message
is left open. `<|bos|>` is written in the template, not taken from the `bos_token` variable,
which lm-eval's remote tokenizer (it renders the template from /tokenizer_info itself) does
not pass.
"""

from __future__ import annotations

from pathlib import Path

from sentencepiece import sentencepiece_model_pb2

from bov_jax import cli
from bov_jax.data.tokenizer import BOS, SPECIALS, load_tokenizer
from bov_jax.errors import DataError, UserError
from bov_jax.files import write_json_atomic, write_text_atomic

UNK = "<unk>"
SPACE = "\u2581"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_NORMAL = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL

CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'python' -%}{{ '<|python_start|>' + part['text'] + '<|python_end|>' }}"
    "{%- elif part['type'] == 'python_output' -%}"
    "{{ '<|output_start|>' + part['text'] + '<|output_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ raise_exception('unknown content part type ' + part['type']) }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system='', turn=0) -%}"
    "{{ '<|bos|>' }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ['system', 'developer'] -%}"
    "{%- set ns.system = ns.system + render(message['content']) + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- if message['role'] != ['user', 'assistant'][ns.turn % 2] -%}"
    "{{ raise_exception('messages must alternate user, assistant, user, ... (system messages "
    "join the next user message)') }}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '<|user_start|>' + ns.system + render(message['content']) + '<|user_end|>' }}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}"
    "{{ '<|assistant_start|>' + render(message['content']) }}"
    "{%- if not (loop.last and continue_final_message) -%}{{ '<|assistant_end|>' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- set ns.turn = ns.turn + 1 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system or not ns.turn -%}"
    "{{ raise_exception('a system message must be followed by a user message') }}{%- endif -%}"
    "{%- if add_generation_prompt and not continue_final_message -%}"
    "{{ '<|assistant_start|>' }}{%- endif -%}"
)


def read_model(path: Path) -> sentencepiece_model_pb2.ModelProto:
    """The SentencePiece ModelProto of a tokenizer file or directory (checked as the project
    loads it: <|bos|> at id 0)."""
    tokenizer = load_tokenizer(path)
    if not tokenizer.path.endswith(".model"):
        raise DataError(
            f"tokenizer {tokenizer.path} is not a SentencePiece .model; only those convert"
        )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.path).read_bytes())
    spec, normalizer = proto.trainer_spec, proto.normalizer_spec
    expected = dict(
        model_type=(spec.model_type, spec.BPE),
        byte_fallback=(spec.byte_fallback, True),
        add_dummy_prefix=(normalizer.add_dummy_prefix, False),
        remove_extra_whitespaces=(normalizer.remove_extra_whitespaces, False),
        normalization_rule_name=(normalizer.name, "identity"),
        treat_whitespace_as_suffix=(spec.treat_whitespace_as_suffix, False),
        bos_id=(spec.bos_id, 0),
    )
    for key, (got, want) in expected.items():
        if got != want:
            raise DataError(f"tokenizer {tokenizer.path}: {key} is {got!r}, expected {want!r}")
    return proto


def bpe_merges(proto: sentencepiece_model_pb2.ModelProto) -> list[tuple[str, str]]:
    """Every (left, right) pair of normal pieces that joins to a normal piece, best-scored
    joined piece first (ties: lower id first, then the shorter left part)."""
    normal = {p.piece: i for i, p in enumerate(proto.pieces) if p.type == _NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-proto.pieces[i].score, i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer_json(proto: sentencepiece_model_pb2.ModelProto) -> str:
    """tokenizer.json of the `tokenizers` pipeline equivalent to the SentencePiece model."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=bpe_merges(proto), unk_token=UNK, byte_fallback=True)
    )
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in (*SPECIALS, UNK)]
    )
    return tokenizer.to_str(pretty=True)


def tokenizer_config(model_max_length: int | None) -> dict:
    """tokenizer_config.json: the class, special tokens, chat template and length."""
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=BOS,
        eos_token=BOS,
        unk_token=UNK,
        additional_special_tokens=list(SPECIALS[1:]),
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def export_hf_tokenizer(tokenizer: Path, out: Path, model_max_length: int | None = None) -> Path:
    """Writes the three files of a `transformers` tokenizer folder for `tokenizer` (a
    SentencePiece .model or its directory) into `out`; returns `out`."""
    proto = read_model(tokenizer)
    config = tokenizer_config(model_max_length)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / FILES[0], build_tokenizer_json(proto))
    write_json_atomic(out / FILES[1], config)
    keys = ("bos_token", "eos_token", "unk_token", "additional_special_tokens")
    write_json_atomic(out / FILES[2], {k: config[k] for k in keys})
    return out


def export_from_workdir(workdir: Path, out: Path) -> Path:
    """The run's tokenizer (its data.tokenizer_dir), with model_max_length = model.seq_len."""
    from bov_jax.data.config import tokenizer_path
    from bov_jax.evals.loading import load_config

    config = load_config(workdir)
    return export_hf_tokenizer(tokenizer_path(config.data), out, int(config.model.seq_len))


def define_flags() -> None:
    """The command's flags (defined only when run, so that importing this module defines none)."""
    from absl import flags

    flags.DEFINE_string(
        "workdir", None, "the run whose tokenizer to write (its data.tokenizer_dir)"
    )
    flags.DEFINE_string("tokenizer", None, "or: a SentencePiece tokenizer.model or its directory")
    flags.DEFINE_string("out", None, "the folder to write the transformers tokenizer into")


def main(argv: list[str]) -> None:
    from absl import flags

    del argv
    args = flags.FLAGS
    if not args.out or bool(args.workdir) == bool(args.tokenizer):
        raise UserError("give --out and exactly one of --workdir or --tokenizer")
    if args.workdir:
        out = export_from_workdir(Path(args.workdir), Path(args.out))
    else:
        out = export_hf_tokenizer(Path(args.tokenizer), Path(args.out))
    print(f"wrote {', '.join(FILES)} to {out}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
