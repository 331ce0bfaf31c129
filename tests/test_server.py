"""The OpenAI-compatible server on 127.0.0.1: the real `openai` client against the engine,
concurrent streams, bad requests, disconnects, and the `python -m bov_jax.serve` command.
Every server here is bounded in time and stopped by the test that started it."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import meshes_on_one_device, randomize, tiny_model

from bov_jax.data.config import EMBEDDED_DIR
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.inference.engine import Engine, EngineConfig
from bov_jax.inference.sampling import SamplingParams
from bov_jax.serve.running import running_server

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = load_tokenizer(EMBEDDED_DIR / "tokenizer")
PROMPT = "The old man looked at the sea and"
CONFIG = EngineConfig(page_size=4, max_seqs=4, chunk=16, max_context=256, pages=(24, 40))
TIMEOUT_S = 120


def served_model():
    model = tiny_model("d12_bov", depth=4, vocab_size=TOKENIZER.vocab_size)
    randomize(model, seed=3)
    return model


@pytest.fixture(scope="module")
def server():
    """(base URL, the served engine, a second engine over the same model for reference)."""
    model = served_model()
    engine = Engine(model, CONFIG, TOKENIZER)
    with running_server(engine, TOKENIZER, "tiny") as url:
        yield url, engine, Engine(model, CONFIG, TOKENIZER)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def pages_used(url: str) -> float:
    return metric(url, "bov:pages_used")


def metric(url: str, name: str, **labels: str) -> float:
    """One sample's value from /metrics, by name and labels (model_name tiny and `labels`)."""
    want = {"model_name": "tiny", **labels}
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text.splitlines():
        found = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if found and found.group(1) == name:
            have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(2) or ""))
            if have == want:
                return float(found.group(3))
    return 0.0


def test_the_openai_client_gets_the_engines_completion_whole_and_streamed(server):
    url, _, reference = server
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5, max_tokens=24)
    prompt = [TOKENIZER.bos_id, *TOKENIZER.encode_one(PROMPT)]
    [want] = reference.generate([prompt], SamplingParams(**{**params.__dict__, "logprobs": 2}))
    assert want.text and len(want.token_ids) > 3
    ask = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=5,
        extra_body={"top_k": 40},
    )
    whole = client(url).completions.create(**ask, logprobs=2)
    [choice] = whole.choices
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert whole.usage.completion_tokens == len(want.token_ids)
    assert whole.usage.prompt_tokens == len(prompt)
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs])
    for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs, strict=True):
        assert token in top and len(top) in (2, 3)  # the two likeliest and the token, as vLLM
    chunks = list(client(url).completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_sixteen_concurrent_streaming_clients_all_finish(server, monkeypatch):
    url, engine, _ = server
    preempted = engine.stats()["preemptions"]
    # The engine steps once all 16 are queued, whatever the order and time they arrive in (a
    # fast step could otherwise finish each before the next came, and nothing would compete).
    queued, add, step = threading.Semaphore(0), engine.add, engine.step

    def add_then_count(*args, **kwargs):
        add(*args, **kwargs)
        queued.release()

    def step_once_all_queued():
        for _ in range(16):
            assert queued.acquire(timeout=TIMEOUT_S), "16 requests did not reach the engine"
        monkeypatch.setattr(engine, "step", step)
        return step()

    monkeypatch.setattr(engine, "add", add_then_count)
    monkeypatch.setattr(engine, "step", step_once_all_queued)

    def stream(i: int) -> tuple[str, int]:
        chunks = client(url).completions.create(
            model="tiny",
            prompt=f"{PROMPT} {i}",
            max_tokens=30 + i,
            temperature=1.0,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        parts = list(chunks)
        assert not parts[-1].choices and all(p.usage is None for p in parts[:-1])
        return parts[-2].choices[0].finish_reason, parts[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        done = list(pool.map(stream, range(16), timeout=TIMEOUT_S * 4))
    assert done == [("length", 30 + i) for i in range(16)]
    assert engine.stats()["preemptions"] > preempted  # 16 clients, room for fewer
    assert pages_used(url) == 0


BAD = {
    "malformed JSON": ('{"model": "tiny", "prompt": ', None),
    "not an object": ("[1, 2]", None),
    "unknown model": ({"model": "gpt-9", "prompt": "hi"}, "model"),
    "negative max_tokens": ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    "huge max_tokens": ({"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    "prompt past the context": ({"model": "tiny", "prompt": [5] * 300}, "max_tokens"),
    "max_tokens a string": ({"model": "tiny", "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    "temperature a word": ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    "prompt a number": ({"model": "tiny", "prompt": 5}, "prompt"),
    "token id past the vocab": ({"model": "tiny", "prompt": [10**6]}, "prompt"),
    "an unknown field": ({"model": "tiny", "prompt": "hi", "best_of": 2}, "best_of"),
    "no completion": ({"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    "best_of past n": ({"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    "a suffix": ({"model": "tiny", "prompt": "hi", "suffix": "end"}, "suffix"),
    "21 logprobs": ({"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs"),
    "stream_options unstreamed": (
        {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    "logit_bias by word": ({"model": "tiny", "prompt": "hi", "logit_bias": {"a": 1}}, "logit_bias"),
    "logit_bias past the vocab": (
        {"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 1}},
        "logit_bias",
    ),
    "negative min_tokens": ({"model": "tiny", "prompt": "hi", "min_tokens": -1}, "min_tokens"),
    "top_k below -1": ({"model": "tiny", "prompt": "hi", "top_k": -5}, "top_k"),
    "min_p past 1": ({"model": "tiny", "prompt": "hi", "min_p": 2.0}, "min_p"),
    "zero repetition_penalty": (
        {"model": "tiny", "prompt": "hi", "repetition_penalty": 0.0},
        "repetition_penalty",
    ),
    "stop token past the vocab": (
        {"model": "tiny", "prompt": "hi", "stop_token_ids": [99999]},
        "stop_token_ids",
    ),
    "infinite temperature": (
        '{"model": "tiny", "prompt": "hi", "temperature": Infinity}',
        "temperature",
    ),
    "max_tokens 0 without echo": ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "empty prompt list": ({"model": "tiny", "prompt": []}, "prompt"),
    "no model": ({"prompt": "hi"}, "model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_gets_400_and_one_json_error_naming_the_field(server, case):
    url, engine, _ = server
    body, field = BAD[case]
    content = body if isinstance(body, str) else json.dumps(body)
    answer = httpx.post(
        f"{url}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert answer.status_code == 400
    assert "\n" not in answer.text.strip()
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field
    assert error["message"] and (field is None or field in error["message"])
    assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}


def test_a_client_that_leaves_mid_stream_frees_its_pages(server, monkeypatch):
    url, engine, _ = server
    step = engine.step

    def slow_step():  # a slow model: the stream outlives the checks below on any machine
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    before, aborted = pages_used(url), engine.stats()["aborted"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as answer:
        lines = answer.iter_lines()  # held: dropping it would close the connection here
        assert next(lines).startswith("data: ")
        assert pages_used(url) > before  # it holds pages while it streams
        assert engine.stats()["aborted"] == aborted
    deadline = time.monotonic() + TIMEOUT_S
    while engine.stats()["aborted"] == aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats()["aborted"] == aborted + 1
    assert pages_used(url) == before


def test_metrics_are_prometheus_text_named_as_vllms(server):
    url, _, _ = server
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    for name, kind in (
        ("num_requests_running", "gauge"),
        ("num_requests_waiting", "gauge"),
        ("kv_cache_usage_perc", "gauge"),
        ("pages_used", "gauge"),
        ("tokens_per_second", "gauge"),
        ("num_preemptions", "counter"),
        ("time_to_first_token_seconds", "histogram"),
        ("inter_token_latency_seconds", "histogram"),
        ("e2e_request_latency_seconds", "histogram"),
        ("request_queue_time_seconds", "histogram"),
        ("prompt_tokens", "counter"),
        ("generation_tokens", "counter"),
        ("request_success", "counter"),
    ):
        assert re.search(rf"^# TYPE bov:{name}(_total)? {kind}$", text, re.M), name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A finished tiny run on the embedded corpus (its 8192-token tokenizer)."""
    from bov_jax.train import loop
    from configs import quickstart

    workdir = tmp_path_factory.mktemp("served")
    config = quickstart.get_config()  # BoV on the embedded corpus, here 2 steps of 512 tokens
    config.model.update(depth=3, model_dim=128, head_dim=64, seq_len=128)
    config.mesh.update(data=1, fsdp=1, tensor=1)
    config.train.update(
        num_steps=2,
        total_batch_tokens=512,
        device_batch_size=4,
        eval_every=2,
        eval_tokens=512,
        sample_tokens=0,
    )
    with meshes_on_one_device():
        loop.run(config, workdir)
    return workdir


def free_port() -> int:
    from bov_jax.serve.running import bound_socket

    with bound_socket("127.0.0.1", 0) as sock:
        return sock.getsockname()[1]


def test_the_serve_command_serves_a_workdir(workdir):
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "bov_jax.serve", f"--workdir={workdir}", f"--port={port}"]
    process = subprocess.Popen(
        [*command, "--max_seqs=2", "--nowarmup"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": workdir.name, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            out, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
    assert "listening on http://127.0.0.1" in out and "compiled step shapes" in out


def test_the_serve_command_names_a_missing_workdir_in_one_line(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bov_jax.serve", f"--workdir={tmp_path / 'none'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "error:" in done.stderr
    assert "none" in done.stderr
