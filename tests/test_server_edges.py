"""The server's edges as a new user meets them (issue 53), on 127.0.0.1, bounded in time: a
body too large (413) while streams go on, cold start (warm-up before ready), a lone
surrogate, shutdown by signal (a bounded drain), start-up checks and log, and the error
shape of 404/405/415 and bad bytes. Servers in this process share one started server; the
`python -m bov_jax.serve` tests share one tiny trained workdir."""

import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers import randomize, tiny_model

from bov_jax.data.config import EMBEDDED_DIR
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.errors import UserError
from bov_jax.inference import engine as engine_module
from bov_jax.inference import paged
from bov_jax.inference.engine import Engine, EngineConfig
from bov_jax.inference.layout import CacheLayout
from bov_jax.serve import __main__ as command
from bov_jax.serve import running, warmup
from bov_jax.serve.running import running_server

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = load_tokenizer(EMBEDDED_DIR / "tokenizer")
PROMPT = "The old man looked at the sea and"
CONFIG = EngineConfig(page_size=16, max_seqs=2, chunk=2, max_context=16)  # 3 step shapes
TIMEOUT_S = 60
# the commands run from other folders: this checkout's package first on their path
PATH = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": PATH}


def served_model():
    model = tiny_model("d12_bov", depth=2, vocab_size=TOKENIZER.vocab_size)
    randomize(model, seed=3)
    return model


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=TIMEOUT_S)


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S * 2
    while health(url).status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(request):
    """(base URL, engine, the warm-up's release): the engine warms up once released (the
    first test to need a warm server releases it)."""
    release = threading.Event()

    def held(engine: Engine, stopping) -> None:
        release.wait(TIMEOUT_S)
        warmup.compile_steps(engine, stopping)

    engine = Engine(served_model(), CONFIG, TOKENIZER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(running, "compile_steps", held)
        with running_server(engine, TOKENIZER, "tiny", warmup=True) as url:
            yield url, engine, release


@pytest.fixture
def warm(server):
    url, engine, release = server
    release.set()
    wait_ready(url)
    return url, engine


def complete(url: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)


def assert_openai_error(answer: httpx.Response, status: int, param: str | None = None) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


# -- 2. cold start -----------------------------------------------------------------------


def test_health_is_503_until_the_warm_up_compiled_every_step_shape(server):
    url, engine, release = server
    assert health(url).status_code == 503 and health(url).json() == {"status": "warming up"}
    release.set()
    wait_ready(url)
    assert health(url).json() == {"status": "ok"}
    compiled = paged.forward_step._cache_size()
    assert len(warmup.step_shapes(engine)) <= engine.shape_bound()
    timings = []
    for prompt in (PROMPT, "A", "The sea"):  # new prompt lengths, pages
        start = time.monotonic()
        assert complete(url, prompt=prompt, max_tokens=5).status_code == 200
        timings.append(time.monotonic() - start)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # every batch slot filled
        answers = list(pool.map(lambda i: complete(url, seed=i, temperature=1.0), range(3)))
    assert [a.status_code for a in answers] == [200] * 3
    assert paged.forward_step._cache_size() == compiled  # nothing compiled after ready
    assert timings[0] <= 2 * timings[1] + 0.25


# -- 1. a body past the limit ------------------------------------------------------------


def test_an_8_mb_prompt_gets_413_while_health_and_streams_go_on(warm):
    url, _ = warm
    big = {"model": "tiny", "prompt": "x" * (8 << 20)}
    stream_body = {"model": "tiny", "prompt": "A", "max_tokens": 12, "stream": True}
    stream_body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=stream_body, timeout=TIMEOUT_S) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            refused = pool.submit(httpx.post, f"{url}/v1/completions", json=big, timeout=60)
            waits = []
            while not refused.done():
                start = time.monotonic()
                assert health(url).status_code == 200
                waits.append(time.monotonic() - start)
            error = assert_openai_error(refused.result(), 413)
        assert "1,048,576" in error["message"]
        assert waits and max(waits) < 0.5
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]


def test_a_chunked_body_past_the_limit_gets_413(warm):
    url, _ = warm

    def pieces():
        for _ in range(40):
            yield b"x" * 65536

    answer = httpx.post(
        f"{url}/v1/completions",
        content=pieces(),
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert_openai_error(answer, 413)


# -- 3. a lone surrogate; 7. error shapes ------------------------------------------------


def same_connection_answers(url: str, requests: list[tuple[str, str, bytes, str]]) -> list:
    """[(status, body, socket reused)] of requests sent one after another on one keep-alive
    connection (http.client would reconnect silently: the socket's identity tells)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    answers, sock = [], None
    for method, path, body, kind in requests:
        connection.request(method, path, body=body, headers={"Content-Type": kind})
        response = connection.getresponse()
        data = response.read()
        answers.append((response.status, json.loads(data), sock is None or connection.sock is sock))
        sock = connection.sock
    connection.close()
    return answers


def test_a_lone_surrogate_is_a_400_naming_the_prompt_and_the_connection_survives(warm):
    url, _ = warm
    bad = b'{"model": "tiny", "prompt": "abc \\ud800 def", "max_tokens": 2}'
    paired = b'{"model": "tiny", "prompt": "ok \\ud83d\\ude00", "max_tokens": 2}'
    kind = "application/json"
    answers = same_connection_answers(
        url,
        [("POST", "/v1/completions", bad, kind), ("POST", "/v1/completions", paired, kind)],
    )
    (status, body, _), (second, _, reused) = answers
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "\\ud800" in body["error"]["message"] and "character 4" in body["error"]["message"]
    assert second == 200 and reused


def test_a_failing_route_is_a_json_500_and_the_connection_survives(warm, monkeypatch):
    url, _ = warm

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(TOKENIZER, "encode_one", broken)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    (status, error, _), (second, _, reused) = same_connection_answers(
        url,
        [
            ("POST", "/v1/completions", body, "application/json"),
            ("GET", "/v1/models", b"", "application/json"),
        ],
    )
    assert status == 500 and error["error"]["type"] == "server_error"
    assert "a bug" not in error["error"]["message"]  # the traceback goes to the log only
    assert second == 200 and reused


@pytest.mark.parametrize(
    "method, path, content, kind, status",
    [
        (
            "POST",
            "/v1/completions",
            b"model=tiny&prompt=hi",
            "application/x-www-form-urlencoded",
            415,
        ),
        ("POST", "/v1/completions", b"{}", "text/plain", 415),
        ("GET", "/v1/nothing", b"", None, 404),
        ("DELETE", "/v1/completions", b"", None, 405),
        (
            "POST",
            "/v1/completions",
            b'{"model": "tiny", "prompt": "\xff\xfe"}',
            "application/json",
            400,
        ),
    ],
)
def test_every_error_is_in_openais_shape(warm, method, path, content, kind, status):
    url, _ = warm
    headers = {"Content-Type": kind} if kind else {}
    answer = httpx.request(
        method, f"{url}{path}", content=content, headers=headers, timeout=TIMEOUT_S
    )
    error = assert_openai_error(answer, status)
    assert error["type"] == "invalid_request_error"
    if status == 405:
        assert "POST" in error["message"] and answer.headers["allow"] == "POST"
    if status == 400:
        assert "UTF-8" in error["message"]


# -- 4. a drain and a second signal, in this process -------------------------------------


def test_a_second_signal_ends_every_stream_with_an_error_event_and_done(monkeypatch):
    engine = Engine(served_model(), CONFIG, TOKENIZER)
    step = engine.step

    def slow_step():  # streams outlive the test's signals on any machine
        time.sleep(0.5)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    loop, app = running.application(engine, TOKENIZER, "tiny", warmup=False)
    sock = running.bound_socket("127.0.0.1", 0)
    server = running.DrainingServer(running.uvicorn_config(app), loop, app, drain_s=60)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = running.base_url(sock)
    try:
        while not server.started:
            time.sleep(0.01)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream_events, url, i) for i in range(3)]
            while loop.in_flight < 3:
                time.sleep(0.01)
            server.handle_exit(signal.SIGTERM, None)
            assert health(url).json() == {"status": "draining"}
            assert_openai_error(complete(url), 503)
            server.handle_exit(signal.SIGTERM, None)
            events = [s.result(timeout=TIMEOUT_S) for s in streams]
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        sock.close()
        loop.stop()
    for received in events:
        assert received[-1] == "[DONE]" and "error" in json.loads(received[-2])
        assert "stopped" in json.loads(received[-2])["error"]["message"]


def stream_events(url: str, seed: int, max_tokens: int = 5) -> list[str]:
    """The data of every server-sent event of one streamed completion."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    body.update(seed=seed, ignore_eos=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as s:
        return [line.removeprefix("data: ") for line in s.iter_lines() if line]


# -- 6. start-up checks, in this process -------------------------------------------------


def flag_values(**values) -> SimpleNamespace:
    defaults = dict(
        workdir=None,
        checkpoint_dir=None,
        step=None,
        model_name=None,
        max_context=None,
        allow_long_context=False,
        chunk=8,
        cache_gib=None,
    )
    return SimpleNamespace(**{**defaults, **values})


def test_a_context_past_the_trained_one_is_refused_unless_allowed():
    assert command.checked_context(flag_values(), 128) == 128
    with pytest.raises(UserError, match="--max_context=256 is past the 128 positions"):
        command.checked_context(flag_values(max_context=256), 128)
    assert command.checked_context(flag_values(max_context=256, allow_long_context=True), 128)


def test_a_workdir_without_a_checkpoint_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with (
        pytest.raises(UserError, match="holds no checkpoint"),
        command.run_folder(flag_values(workdir=str(tmp_path))),
    ):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_the_least_cache_is_one_sequence_decoding_and_one_prefilling():
    spec = served_model().spec
    layout = CacheLayout.build(spec, 8)
    least = layout.pages_for(1, 64, 8)
    need = sum(n * layout.page_bytes(g) for g, n in enumerate(least))
    assert layout.sequences_within(need, 64, 8) == 1
    assert layout.sequences_within(need - 1, 64, 8) == 0
    f = flag_values(cache_gib=(need - 1) / 2**30)
    with pytest.raises(UserError, match=f"the least is .* \\({need:,} bytes"):
        command.cache_pages(f, layout, 64)
    assert command.cache_pages(flag_values(cache_gib=need / 2**30), layout, 64) == least


# -- the command: 2, 4 and 6 as a user sees them -----------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A finished tiny run on the embedded corpus (as tests/test_server.py's)."""
    from helpers import meshes_on_one_device

    from bov_jax.train import loop
    from configs import quickstart

    workdir = tmp_path_factory.mktemp("served")
    config = quickstart.get_config()
    config.model.update(depth=2, model_dim=128, head_dim=64, seq_len=128)
    config.mesh.update(data=1, fsdp=1, tensor=1)
    config.train.update(
        num_steps=1,
        total_batch_tokens=512,
        device_batch_size=4,
        eval_every=1,
        eval_tokens=512,
        sample_tokens=0,
    )
    with meshes_on_one_device():
        loop.run(config, workdir)
    return workdir


def free_port() -> int:
    with running.bound_socket("127.0.0.1", 0) as sock:
        return sock.getsockname()[1]


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "bov_jax.serve", *flags]


def files_of(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")}


def test_the_command_says_ready_after_warm_up_and_drains_on_sigterm(workdir, tmp_path):
    port, url = free_port(), ""
    before = files_of(workdir)
    process = subprocess.Popen(
        serve_command(f"--workdir={workdir}", f"--port={port}", "--max_seqs=2", "--chunk=2")
        + ["--page_size=128", "--drain_s=2", f"--compilation_cache={tmp_path / 'xla'}"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not (lines and lines[-1].startswith("ready")):
            assert time.monotonic() < deadline and process.poll() is None, "\n".join(lines)
            lines.append(process.stdout.readline().rstrip("\n"))
        assert health(url).status_code == 200
        model = workdir.name
        timings = []
        for _ in range(2):
            start = time.monotonic()
            answer = complete(url, model=model, max_tokens=16)
            assert answer.status_code == 200, answer.text
            timings.append(time.monotonic() - start)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            body = dict(model=model, max_tokens=100)
            started = threading.Semaphore(0)
            streams = [pool.submit(stream_events_of, url, body, i, started) for i in range(6)]
            for _ in range(6):  # each stream's answer began: the engine has its request
                assert started.acquire(timeout=TIMEOUT_S)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            events = [s.result(timeout=TIMEOUT_S) for s in streams]
        out, _ = process.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0 and took < 2 + 5
    assert timings[0] <= 2 * timings[1] + 0.25
    before_ready = lines[:-1]
    assert len(before_ready) <= 10, "\n".join(lines)
    own = ("serving ", "value path:", "device:", "cache:", "group ", "warming up:", "warm-up:")
    assert all(line.startswith(own) for line in before_ready), "\n".join(lines)
    assert "checkpoint step 1 of" in lines[0] and "parameters" in lines[0]
    assert "Traceback" not in out and "SIGTERM: draining" in out and "drained in" in out
    for received in events:
        assert received[-1] == "[DONE]"
        last = json.loads(received[-2])
        assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert files_of(workdir) == before  # nothing written into the served run


def stream_events_of(url: str, body: dict, seed: int, started: threading.Semaphore) -> list[str]:
    """The data of every event of one stream; `started` released once its answer began."""
    body = {**body, "prompt": PROMPT, "stream": True, "seed": seed, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as s:
        assert s.status_code == 200
        started.release()
        return [line.removeprefix("data: ") for line in s.iter_lines() if line]


def test_a_busy_port_is_named_before_anything_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run(
            serve_command(f"--workdir={tmp_path / 'none'}", f"--port={port}"),
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"error: --port={port}: 127.0.0.1:{port} is in use by another process; "
        "stop it or pick another --port"
    )


def test_a_cache_too_small_is_refused_before_loading_after_the_network_warning(workdir):
    done = subprocess.run(
        serve_command(f"--workdir={workdir}", f"--port={free_port()}", "--host=0.0.0.0")
        + ["--cache_gib=0.0001"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    warning, error = done.stderr.strip().splitlines()
    assert warning.startswith("WARNING: --host=0.0.0.0: this API has no authentication")
    assert error.startswith("error: --cache_gib=0.0001 holds no sequence of 128 tokens")
    assert "the least is" in error


# -- the request path's side of items 1, 5 and 7 ------------------------------------------


def test_a_long_prompt_under_the_limit_is_refused_by_length_while_health_answers(warm):
    url, _ = warm
    body = json.dumps({"model": "tiny", "prompt": "the sea " * 100_000})  # 800 kB
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(
            httpx.post,
            f"{url}/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=TIMEOUT_S,
        )
        waits = []
        while not refused.done():
            start = time.monotonic()
            assert health(url).status_code == 200
            waits.append(time.monotonic() - start)
        error = assert_openai_error(refused.result(), 400, "prompt")
    assert "the context holds 16" in error["message"]
    assert max(waits, default=0) < 0.5


def tokens_per_second(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    return float(re.search(r"^bov:tokens_per_second\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_the_tokens_per_second_gauge_falls_to_zero_when_idle(warm, monkeypatch):
    url, _ = warm
    monkeypatch.setattr(engine_module, "RATE_WINDOW_S", 1.0)
    assert complete(url, prompt="A", max_tokens=12, ignore_eos=True).status_code == 200
    assert tokens_per_second(url) > 0
    time.sleep(1.5)  # idle past the window
    assert tokens_per_second(url) == 0


@pytest.mark.parametrize(
    "field, raw",
    [("top_k", "-2"), ("temperature", "Infinity"), ("temperature", "-1"), ("top_p", "1.5")],
)
def test_sampling_values_out_of_range_are_400_naming_the_field(warm, field, raw):
    url, _ = warm
    body = f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {raw}}}'
    answer = httpx.post(
        f"{url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert_openai_error(answer, 400, field)


def test_what_openais_clients_send_is_taken(warm):
    url, _ = warm
    answer = complete(url, max_tokens=None, seed=2**40)
    assert answer.status_code == 200, answer.text
    assert (
        answer.json()["usage"]["completion_tokens"] <= 16 - answer.json()["usage"]["prompt_tokens"]
    )
    card = httpx.get(f"{url}/v1/models/tiny", timeout=TIMEOUT_S)
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert_openai_error(httpx.get(f"{url}/v1/models/gpt-9", timeout=TIMEOUT_S), 404, "model")
