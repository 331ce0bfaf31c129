"""ClimbMix download planning, resuming, verification and parallelism against local files."""

import hashlib
import io
import threading

import pytest

from bov_jax.corpora import climbmix
from bov_jax.data.testing import write_corpus
from bov_jax.errors import DataError

URL = "https://example.invalid/climbmix"


class FakeServer:
    """Serves local files like the hub: Range requests, Content-Length, X-Linked-Etag."""

    def __init__(self, files, fail_first=(), cut_first=(), corrupt=()):
        self.files = files
        self.requests = []
        self._fail = set(fail_first)
        self._cut = set(cut_first)
        self._corrupt = set(corrupt)
        self._lock = threading.Lock()

    def __call__(self, url, start):
        name = url.rsplit("/", 1)[1]
        with self._lock:
            self.requests.append((name, start))
            if name in self._fail:
                self._fail.discard(name)
                raise ConnectionResetError(f"{name}: connection reset")
        data = self.files[name]
        body = data[start:]
        if name in self._corrupt:
            body = body[:-10] + b"x" * 10
        headers = {
            "Content-Length": str(len(body)),
            "X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"',
        }
        with self._lock:
            if name in self._cut:  # the connection drops after the first 1000 bytes
                self._cut.discard(name)
                body = body[:1000]
        return _Response(206 if start else 200, headers, body)


class _Response(io.BytesIO):
    def __init__(self, status, headers, body):
        super().__init__(body)
        self.status = status
        self.headers = headers


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Five small parquet shards named as ClimbMix's: 0, 1, 2, 3 and the validation shard."""
    corpus = write_corpus(tmp_path_factory.mktemp("hub"), train_shards=4, docs_per_shard=20)
    names = [climbmix.shard_name(i) for i in (0, 1, 2, 3, climbmix.MAX_SHARD)]
    return {name: path.read_bytes() for name, path in zip(names, sorted(corpus.glob("*.parquet")))}


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(climbmix.time, "sleep", lambda seconds: None)


def test_plan():
    assert climbmix.plan(3) == [0, 1, 2, 6542]
    for bad in (0, 6543):
        with pytest.raises(DataError, match="--num-shards must be in"):
            climbmix.plan(bad)


def test_parallel_download_verifies_and_keeps_the_val_shard_last(hub, tmp_path):
    server = FakeServer(hub)
    paths = climbmix.download(climbmix.plan(4), tmp_path, base_url=URL, workers=3, fetch=server)
    assert [p.name for p in sorted(tmp_path.glob("*.parquet"))][-1] == "shard_06542.parquet"
    assert all(p.read_bytes() == hub[p.name] for p in paths)
    assert not list(tmp_path.glob("*.part"))
    # A rerun verifies what is there and fetches nothing.
    again = FakeServer(hub)
    climbmix.download(climbmix.plan(4), tmp_path, base_url=URL, workers=3, fetch=again)
    assert again.requests == []


def test_resume_from_a_partial_file_and_retry_after_a_reset(hub, tmp_path):
    name, reset, cut = (climbmix.shard_name(i) for i in (1, 2, 3))
    half = len(hub[name]) // 2
    (tmp_path / f"{name}.part").write_bytes(hub[name][:half])
    server = FakeServer(hub, fail_first={reset}, cut_first={cut})
    climbmix.download([1, 2, 3], tmp_path, base_url=URL, workers=3, fetch=server)
    assert (name, half) in server.requests and (name, 0) not in server.requests
    assert server.requests.count((reset, 0)) == 2
    assert [r for r in server.requests if r[0] == cut] == [(cut, 0), (cut, 1000)]
    for n in (name, reset, cut):
        assert (tmp_path / n).read_bytes() == hub[n]


def test_corrupt_download_is_rejected(hub, tmp_path):
    server = FakeServer(hub, corrupt={climbmix.shard_name(0)})
    with pytest.raises(
        DataError, match=r"shard_00000.parquet: failed after 5 attempts: .*sha256 differs"
    ):
        climbmix.download([0], tmp_path, base_url=URL, workers=1, fetch=server)
    assert not (tmp_path / climbmix.shard_name(0)).exists()
    assert not (tmp_path / f"{climbmix.shard_name(0)}.part").exists()


def test_verify_names_the_problem(hub, tmp_path):
    path = tmp_path / climbmix.shard_name(3)
    path.write_bytes(hub[path.name])
    climbmix.verify(path, len(hub[path.name]), hashlib.sha256(hub[path.name]).hexdigest())
    with pytest.raises(DataError, match=f"{path}: {len(hub[path.name])} bytes, expected 5"):
        climbmix.verify(path, 5)
    path.write_bytes(hub[path.name][:100])
    with pytest.raises(DataError, match="is truncated or not a parquet file"):
        climbmix.verify(path)
