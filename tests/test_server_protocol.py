"""vLLM's protocol as clients send it, against the server on 127.0.0.1: echo and prompt
logprobs (lm-evaluation-harness's loglikelihood request) against the full forward, list
prompts and n, the sampling extensions, stream_options, chat, the tokenize endpoints and the
latency histograms. Every server here is bounded in time and stopped by its fixture."""

import concurrent.futures
import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from test_server import CONFIG, PROMPT, TIMEOUT_S, TOKENIZER, client, metric, served_model

from bov_jax.inference.engine import Engine
from bov_jax.inference.sampling import SamplingParams
from bov_jax.serve.chat import render
from bov_jax.serve.protocol import ChatMessage
from bov_jax.serve.running import running_server
from bov_jax.serve.tokens import ServedTokenizer

SERVED = ServedTokenizer(TOKENIZER)
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def server():
    """(base URL, the served engine, the model, a reference engine over the same model)."""
    model = served_model()
    engine = Engine(model, CONFIG, TOKENIZER)
    with running_server(engine, TOKENIZER, "tiny") as url:
        yield url, engine, model, Engine(model, CONFIG, TOKENIZER)


LONG_S = TIMEOUT_S * 4  # a request that compiles new step shapes on a busy machine


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=LONG_S)


def completion(url: str, **body) -> dict:
    answer = post(url, "/v1/completions", {"model": "tiny", **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def full_logprobs(model, ids: list[int]) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(model(jnp.asarray([ids]))[0], axis=-1))


def test_lm_eval_loglikelihood_requests_get_the_full_forwards_prompt_logprobs(server):
    """lm-evaluation-harness's request as it sends it (batched token-id prompts, echo,
    logprobs 1, max_tokens 1): prompts of 1-4 chunks, two batches at once beside three long
    generations that outgrow the pages, so sequences are preempted and recomputed; each prompt
    token's logprob is the full forward's."""
    url, engine, model, _ = server
    prompts = [RNG.integers(10, 2000, size=n).tolist() for n in (45, 30, 60, 7)]
    preempted = engine.stats()["preemptions"]
    batches = [prompts, prompts[::-1]]

    def ask(batch):
        return completion(
            url, prompt=batch, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
        )

    def long(seed):
        return completion(url, prompt=PROMPT, max_tokens=120, ignore_eos=True, seed=seed)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        background = [pool.submit(long, seed) for seed in (1, 2, 3)]
        answers = list(pool.map(ask, batches, timeout=LONG_S))
        assert all(f.result(LONG_S)["choices"][0]["finish_reason"] for f in background)
    assert engine.stats()["preemptions"] > preempted
    for batch, answer in zip(batches, answers, strict=True):
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == list(range(len(batch)))
        for prompt, choice in zip(batch, choices, strict=True):
            lp = choice["logprobs"]
            want = full_logprobs(model, prompt)
            assert len(lp["token_logprobs"]) == len(prompt) + 1 == len(lp["tokens"])
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            got = np.array(lp["token_logprobs"][1:-1])
            expected = want[np.arange(len(prompt) - 1), prompt[1:]]
            np.testing.assert_allclose(got, expected, rtol=0, atol=5e-5)
            # lm-eval's greedy test: the token's logprob equals its top's largest exactly
            for j, (value, top) in enumerate(
                zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1])
            ):
                greedy = int(np.argmax(want[j])) == prompt[j + 1]
                assert (value == max(top.values())) == greedy
            assert choice["text"].startswith(TOKENIZER.decode(prompt))
            offsets = lp["text_offset"]
            assert offsets == sorted(offsets) and offsets[0] == 0
    assert metric(url, "bov:pages_used") == 0


def test_echo_of_a_string_prompt_counts_bos_and_max_tokens_0_scores_only(server):
    url, _, model, _ = server
    ids = [TOKENIZER.bos_id, *TOKENIZER.encode_one(PROMPT)]
    answer = completion(url, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    [choice] = answer["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert answer["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
    }
    lp = choice["logprobs"]
    assert lp["tokens"][0] == "<|bos|>" and len(lp["tokens"]) == len(ids)
    want = full_logprobs(model, ids)
    got = np.array(lp["token_logprobs"][1:])
    np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=5e-5, rtol=0)
    # without BOS (add_special_tokens false) the first token is the text's
    bare = completion(url, prompt=PROMPT, echo=True, max_tokens=0, add_special_tokens=False)
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1 and bare["choices"][0]["text"] == PROMPT


def test_list_prompts_and_n_give_a_choice_each_seeded_as_vllm(server):
    url, _, _, reference = server
    texts = [PROMPT, "Once upon a time"]
    answer = completion(url, prompt=texts, n=2, max_tokens=6, temperature=1.0, seed=11)
    choices = answer["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    prompts = [[TOKENIZER.bos_id, *TOKENIZER.encode_one(t)] for t in texts]
    params = [SamplingParams(temperature=1.0, seed=11 + j, max_tokens=6) for j in range(2)]
    want = reference.generate([prompts[i] for i in (0, 0, 1, 1)], [*params, *params])
    by_index = {c["index"]: c["text"] for c in choices}
    assert [by_index[i] for i in range(4)] == [w.text for w in want]
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert answer["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    ids = completion(url, prompt=[prompts[0], prompts[1]], max_tokens=6, temperature=1.0, seed=11)
    assert {c["index"]: c["text"] for c in ids["choices"]} == {0: by_index[0], 1: by_index[2]}


def test_each_sampling_extension_changes_what_it_should(server):
    url, _, _, reference = server
    ids = [TOKENIZER.bos_id, *TOKENIZER.encode_one(PROMPT)]
    base = dict(prompt=ids, temperature=0, ignore_eos=True)
    greedy = reference.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens = greedy[0].token_ids
    base8 = {**base, "max_tokens": 8}
    assert completion(url, **base8)["choices"][0]["text"] == greedy[0].text
    # logit_bias: a large bias forces a token
    forced = completion(url, **base8, logit_bias={"300": 100.0}, logprobs=0)
    assert forced["choices"][0]["logprobs"]["tokens"] == [SERVED.piece(300)] * 8
    # stop_token_ids: stops before the third greedy token, which is no output
    stopped = completion(url, **base8, stop_token_ids=[tokens[2]])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == tokens[2]
    assert stopped["text"] == TOKENIZER.decode(tokens[:2]) or tokens[2] in tokens[:2]
    # min_tokens: the first greedy token as a stop token cannot end it at once
    held = completion(url, **base8, stop_token_ids=[tokens[0]], min_tokens=2, logprobs=0)
    assert held["choices"][0]["logprobs"]["tokens"][0] != SERVED.piece(tokens[0])
    # min_p = 1 keeps only the likeliest token: sampling at temperature 1 is greedy
    sharp = completion(url, **{**base8, "temperature": 1.0, "seed": 3}, min_p=1.0)
    assert sharp["choices"][0]["text"] == greedy[0].text
    # penalties: what the engine gives for the same parameters (their formulas: test_sampling)
    for name, value in (
        ("repetition_penalty", 3.0),
        ("frequency_penalty", 2.0),
        ("presence_penalty", 2.0),
    ):
        got = completion(url, **base, **{name: value}, max_tokens=24)["choices"][0]["text"]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **{name: value})
        assert got == reference.generate([ids], params)[0].text, name
    # stop strings: any number; include_stop_str_in_output keeps the one that matched
    text = greedy[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    many = ["zzqx1", "zzqx2", "zzqx3", "zzqx4", "zzqx5", stop]
    cut = completion(url, **base8, stop=many)["choices"][0]
    kept = completion(url, **base8, stop=many, include_stop_str_in_output=True)["choices"][0]
    assert cut["stop_reason"] == stop and kept["text"] == cut["text"] + stop


def test_stream_options_say_when_usage_comes(server):
    url, _, _, _ = server

    def chunks(**extra) -> list[dict]:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True, **extra}
        body["ignore_eos"] = True
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=LONG_S) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    plain = chunks()
    assert all("usage" not in c for c in plain)
    with_usage = chunks(stream_options={"include_usage": True})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in c for c in with_usage[:-1])
    continuous = chunks(stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in continuous[:-1]]
    assert counts == sorted(counts) and counts[-1] == 5
    # echo in a stream: the first chunk starts with the prompt
    echoed = chunks(echo=True)
    assert echoed[0]["choices"][0]["text"].startswith(PROMPT)


def test_chat_completions_render_nanochats_format_and_stream(server):
    url, _, _, reference = server
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    ids = render(SERVED, [ChatMessage(**m) for m in messages])
    specials = SERVED.specials
    assert ids[:2] == [TOKENIZER.bos_id, specials["<|user_start|>"]]
    assert ids[-2:] == [specials["<|user_end|>"], specials["<|assistant_start|>"]]
    assert TOKENIZER.decode(ids) == "Be brief.\n\nName a colour."
    end = specials["<|assistant_end|>"]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(end,))
    [want] = reference.generate([ids], params)
    ask = dict(model="tiny", messages=messages, max_tokens=12, temperature=0)
    whole = client(url).chat.completions.create(**ask)
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    streamed = list(client(url).chat.completions.create(**ask, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text
    with pytest.raises(openai.BadRequestError, match="messages"):
        client(url).chat.completions.create(
            model="tiny", messages=[{"role": "assistant", "content": "hi"}]
        )


def test_tokenize_endpoints_answer_as_vllms(server):
    url, _, _, _ = server
    ids = [TOKENIZER.bos_id, *TOKENIZER.encode_one(PROMPT)]
    got = post(url, "/tokenize", {"model": "tiny", "prompt": PROMPT}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 256
    bare = post(url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:]
    info = httpx.get(f"{url}/tokenizer_info", timeout=TIMEOUT_S).json()
    eos = post(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [TOKENIZER.bos_id]  # lm-eval's remote tokenizer's eos id
    assert post(url, "/detokenize", {"tokens": ids}).json()["prompt"] == "<|bos|>" + PROMPT
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == render(SERVED, [ChatMessage(role="user", content="hi")])
    strs = post(url, "/tokenize", {"prompt": "hi", "return_token_strs": True}).json()
    assert "".join(strs["token_strs"]) == "<|bos|>hi"
    bad = post(url, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    models = httpx.get(f"{url}/v1/models", timeout=TIMEOUT_S).json()
    assert models["data"][0]["max_model_len"] == 256
    assert client(url).models.retrieve("tiny").id == "tiny"


def test_latency_histograms_move_under_a_small_load(server):
    url, _, _, _ = server
    names = ("time_to_first_token", "e2e_request_latency", "request_queue_time")
    before = {n: metric(url, f"bov:{n}_seconds_count") for n in names}
    itl = metric(url, "bov:inter_token_latency_seconds_count")
    done = metric(url, "bov:request_success_total", finished_reason="length")
    generated = metric(url, "bov:generation_tokens_total")
    completion(url, prompt=[PROMPT, "A second one"], max_tokens=4, ignore_eos=True)
    for n in names:
        assert metric(url, f"bov:{n}_seconds_count") == before[n] + 2, n
    assert metric(url, "bov:inter_token_latency_seconds_count") == itl + 6
    assert metric(url, "bov:request_success_total", finished_reason="length") == done + 2
    assert metric(url, "bov:generation_tokens_total") == generated + 8


def test_the_served_chat_template_renders_as_lm_evals_remote_tokenizer_renders_it(server):
    """lm-eval renders /tokenizer_info's template itself (messages and add_generation_prompt
    only) and tokenizes the text with /tokenize: the ids equal the chat route's."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    url, _, _, _ = server
    template = httpx.get(f"{url}/tokenizer_info", timeout=TIMEOUT_S).json()["chat_template"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    text = (
        ImmutableSandboxedEnvironment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True)
    )
    ids = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert ids == render(SERVED, [ChatMessage(**m) for m in messages])
    open_turn = {"messages": messages[:3], "add_generation_prompt": False}
    open_ids = post(url, "/tokenize", {**open_turn, "continue_final_message": True}).json()
    assert open_ids["tokens"][-1] != SERVED.specials["<|assistant_end|>"]


def test_the_remaining_rows_of_the_feature_table(server, caplog):
    """return_tokens_as_token_ids; a field of no protocol accepted with a warning; chat with
    n, logprobs / top_logprobs and max_completion_tokens (guidellm's field)."""
    url, _, _, _ = server
    ids = [TOKENIZER.bos_id, *TOKENIZER.encode_one(PROMPT)]
    answer = completion(
        url, prompt=ids, max_tokens=3, temperature=0, logprobs=2, return_tokens_as_token_ids=True
    )
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)
    with caplog.at_level("WARNING", logger="bov_jax.serve.protocol"):
        extra = completion(url, prompt=ids, max_tokens=2, my_clients_field=1)
    assert extra["choices"][0]["finish_reason"] in ("length", "stop")
    assert "my_clients_field" in caplog.text
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_completion_tokens": 4,
        "n": 2,
        "seed": 5,
        "logprobs": True,
        "top_logprobs": 3,
        "ignore_eos": True,
    }
    chat = post(url, "/v1/chat/completions", body).json()
    assert sorted(c["index"] for c in chat["choices"]) == [0, 1]
    for choice in chat["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 for c in content)
        assert "".join(c["token"] for c in content) == choice["message"]["content"]
    assert chat["usage"]["completion_tokens"] == 8


def test_a_request_cut_by_a_drain_is_a_503_and_an_engine_failure_a_500():
    from bov_jax.serve.engine_loop import ServerStopping
    from bov_jax.serve.errors import failure, stream_error

    assert failure(ServerStopping("the server stopped")) == (503, "the server stopped")
    assert failure(RuntimeError("boom")) == (500, "the engine failed: boom")
    assert stream_error(ServerStopping("stopped"))["code"] == 503
