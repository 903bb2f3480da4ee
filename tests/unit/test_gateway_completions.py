"""`/v1/completions`: token-id prompts in, exact sampled ids out, recorded like chat turns."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway_helpers import live_gateway, steps_of


@pytest.fixture
def server(engine, tmp_path):
    with live_gateway(engine, tmp_path) as served:
        yield served


def test_token_id_prompt_returns_and_records_the_sampled_ids(server, engine):
    base, pool = server
    prompt = engine.tokenizer.encode("The sea is")
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 4, "logprobs": 0,
            "return_token_ids": True}
    reply = httpx.post(f"{base}/sess/grp/v1/completions", json=body).json()
    [choice] = reply["choices"]
    [step] = steps_of(pool, 1)
    assert choice["prompt_token_ids"] == prompt == step.prompt_ids
    assert choice["token_ids"] == step.token_ids and choice["logprobs"]["token_logprobs"] == step.logprobs
    assert choice["text"] == engine.tokenizer.decode(step.token_ids, skip_special_tokens=True)
    assert (step.session_id, step.prompt_id, step.messages) == ("sess", "grp", [])
    assert reply["usage"]["completion_tokens"] == len(step.token_ids)


def test_openai_client_text_prompts_n_and_streaming(server, engine):
    base, pool = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    reply = client.completions.create(model="m", prompt=["Once upon", "A cat"], n=2, max_tokens=5, temperature=1.0,
                                      seed=1)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    steps = steps_of(pool, 4)
    assert len({(s.session_id, s.turn_index) for s in steps}) == 2  # one turn per prompt, n samples each
    chunks = list(client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1  # one envelope for the stream
    streamed = [s for s in steps_of(pool, 5) if s.prompt_ids == engine.tokenizer.encode("Hello")]
    assert text == engine.tokenizer.decode(streamed[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": [10**9]}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "m", "prompt": ["a", "b"], "stream": True}, "prompt"),
])
def test_bad_completions_store_nothing(server, body, param):
    base, pool = server
    response = httpx.post(f"{base}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert pool.stats()["steps"] == 0
