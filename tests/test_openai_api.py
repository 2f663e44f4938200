"""The router's OpenAI-compatible API as the official `openai` package meets it, against a
real local cluster (Redis, a prefill and a decode worker, a router with `--http-port`),
with the native gRPC `Generate` of the same request as the oracle."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pdserve.client import AsyncClient, Client, SamplingParams
from pdserve.cluster.load import wait_idle
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.commands.up import api_lines

pytestmark = pytest.mark.cluster

MODEL = "demo-chat"
PROMPT = "The decode worker reads every weight"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Why split prefill and decode?"},
]
NUM_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}
NATIVE_GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    shape = ClusterShape(prefill=1, decode=1)
    run_dir = tmp_path_factory.mktemp("openai-api")
    with LocalCluster(
        str(demo_model_dir), shape, run_dir, http_port=0, served_model_name=MODEL, metrics=True
    ) as local:
        yield local


@pytest.fixture(scope="module")
def live_cluster(demo_model_dir, tmp_path_factory):
    """The same cluster with the router's default placement (`live`: short prompts are
    prefilled on their decode worker when that is faster); `cluster`'s is the suite's,
    `remote`. Only the tests whose answer depends on the path start it."""
    shape = ClusterShape(prefill=1, decode=1)
    run_dir = tmp_path_factory.mktemp("openai-api-live")
    with LocalCluster(
        str(demo_model_dir),
        shape,
        run_dir,
        http_port=0,
        served_model_name=MODEL,
        router_args=["--prefill-placement", "live"],
    ) as local:
        yield local


@pytest.fixture(params=["remote", "live"])
def placed(request) -> tuple[str, LocalCluster]:
    """(the placement, the module's cluster routing with it)."""
    name = "cluster" if request.param == "remote" else "live_cluster"
    return request.param, request.getfixturevalue(name)


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.openai_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def native(cluster):
    with Client(cluster.router_address) as c:
        yield c


@pytest.fixture(scope="module")
def chat_prompt_ids(demo_model_dir) -> list[int]:
    """MESSAGES as transformers renders and tokenizes them (the oracle of the template)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    return tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_pdserve_up_prints_the_base_url_the_openai_package_takes(cluster):
    [line] = api_lines(cluster)
    assert line == f"openai http://127.0.0.1:{cluster.router.http_address.split(':')[1]}/v1"
    base_url = line.removeprefix("openai ")
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        assert [model.id for model in client.models.list().data] == [MODEL]


def test_models_lists_the_served_name_and_health_and_version_answer(client, cluster):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "pdserve"
    root = cluster.openai_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    assert httpx.get(f"{root}/version").json()["version"]


def test_completion_whole_and_streamed_equal_the_native_generate(client, native):
    expected = native.generate(PROMPT, NATIVE_GREEDY)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY))
    assert whole.choices[0].text == expected.text
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
    assert whole.usage.completion_tokens == NUM_TOKENS
    assert whole.usage.total_tokens == expected.usage.prompt_tokens + NUM_TOKENS
    assert whole.model == MODEL and whole.id.startswith("cmpl-")
    # the id is the router's request id: the native API knows the request by it
    assert native.get_request(whole.id.removeprefix("cmpl-")).status == "finished"


async def test_chat_whole_and_streamed_equal_the_native_generate(cluster, chat_prompt_ids):
    async with AsyncClient(cluster.router_address) as native_client:
        expected = await native_client.generate(chat_prompt_ids, NATIVE_GREEDY)
    async with openai.AsyncOpenAI(
        base_url=cluster.openai_url, api_key="unused", max_retries=0
    ) as client:
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [chunk async for chunk in stream]
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(chat_prompt_ids)
    assert whole.usage.completion_tokens == NUM_TOKENS
    *content, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == len(chat_prompt_ids)
    assert last.usage.completion_tokens == NUM_TOKENS
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(chunk.usage is None for chunk in content)
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content for chunk in content) == expected.text
    reasons = [chunk.choices[0].finish_reason for chunk in content]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}


def test_a_stream_on_the_wire_is_data_events_then_usage_then_done(cluster, native):
    expected = native.generate(PROMPT, NATIVE_GREEDY)
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, "ignore_eos": True}
    body |= {"temperature": 0.0, "max_tokens": NUM_TOKENS}
    body["stream_options"] = {"include_usage": True}
    url = f"{cluster.openai_url}/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    *events, done, rest = raw.split(b"\n\n")
    assert (done, rest) == (b"data: [DONE]", b"")  # every event ends in a blank line
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events)
    *chunks, last = [json.loads(e.removeprefix(b"data: ")) for e in events]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == NUM_TOKENS
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in chunks)
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks + [last]}) == 1
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected.text
    # one event per token delta (a slow reader may get several tokens in one)
    assert 1 <= len(chunks) <= NUM_TOKENS


def test_a_repeated_prompt_reports_its_cached_tokens_in_either_placement(placed):
    placement, local = placed
    long_prompt = PROMPT * 8  # several full KV blocks: the second run finds them cached
    with (
        openai.OpenAI(base_url=local.openai_url, api_key="unused", max_retries=0) as client,
        Client(local.router_address) as native,
    ):
        [block_size] = {worker.block_size for worker in native.list_workers()}
        first = client.completions.create(model=MODEL, prompt=long_prompt, **GREEDY)
        again = client.completions.create(model=MODEL, prompt=long_prompt, **GREEDY)
        streamed = list(
            client.completions.create(
                model=MODEL,
                prompt=long_prompt,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
        )
        info = native.get_request(again.id.removeprefix("cmpl-"))
    assert first.choices[0].text == again.choices[0].text
    # every full block but the one holding the last token (the model computes that one)
    cacheable = (first.usage.prompt_tokens - 1) // block_size * block_size
    assert cacheable > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == cacheable
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cacheable
    # live: this short prompt was prefilled on its idle decode worker, from its cache
    colocated = info.prefill_worker == info.decode_worker
    assert colocated == (placement == "live"), info


def test_seeded_sampling_is_reproducible_and_n_choices_are_indexed(client):
    sampled = {"temperature": 1.0, "max_tokens": 16, "seed": 7, "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **sampled)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **sampled)
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, **sampled)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert [choice.message.content for choice in again.choices] == texts
    assert single.choices[0].message.content == texts[0]  # choice 0 samples with the seed
    assert len(set(texts)) == 3  # each choice its own seed
    assert first.usage.completion_tokens == 3 * 16
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once


def test_streamed_choices_each_end_once_and_equal_the_whole_ones(client):
    sampled = {"temperature": 1.0, "max_tokens": 10, "seed": 3, "n": 2}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **sampled)
    texts, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **sampled):
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        reasons[choice.index].append(choice.finish_reason)
    assert [texts[0], texts[1]] == [choice.text for choice in whole.choices]
    for index in (0, 1):
        assert reasons[index][-1] is not None and set(reasons[index][:-1]) <= {None}


def test_several_prompts_are_indexed_prompt_major(client, native):
    prompts = [PROMPT, "Tokens stream back via the router"]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY)
    expected = [native.generate(prompt, NATIVE_GREEDY).text for prompt in prompts]
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in whole.choices] == [expected[0]] * 2 + [expected[1]] * 2


@pytest.mark.parametrize("as_list", [False, True])
def test_a_stop_string_ends_the_text_before_it(client, as_list):
    free = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    stop = free[4:8]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, stop=[stop] if as_list else stop, **GREEDY
    )
    assert stopped.choices[0].text == free[: free.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_vllm_sampling_fields_reach_the_engine(client, native):
    extra = {"top_k": 5, "min_p": 0.02, "repetition_penalty": 1.5, "min_tokens": 4}
    sampled = {"temperature": 1.0, "max_tokens": NUM_TOKENS, "seed": 11, "ignore_eos": True}
    expected = native.generate(PROMPT, SamplingParams(**sampled, **extra)).text
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=1.0,
        max_tokens=NUM_TOKENS,
        seed=11,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        user="a-user",
        extra_body={"ignore_eos": True, **extra},
    )
    assert got.choices[0].text == expected
    assert expected != native.generate(PROMPT, SamplingParams(**sampled)).text  # they told


def test_logit_bias_reaches_the_engine(client, native):
    free = native.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS))
    # OpenAI's shape: token ids as string keys; +100 on a token greedy would not pick
    favoured = next(t for t in range(10, 100) if t not in free.token_ids)
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0.0,
        max_tokens=NUM_TOKENS,
        logit_bias={str(favoured): 100},
    )
    expected = native.generate(
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logit_bias={favoured: 100.0}),
    )
    assert expected.token_ids == [favoured] * NUM_TOKENS
    assert got.choices[0].text == expected.text


def test_chat_logprobs_are_the_engines(client, native, chat_prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    expected = native.generate(chat_prompt_ids, params)
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = got.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(
        [position.logprob for position in expected.logprobs]
    )
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)


def test_completion_logprobs_have_the_legacy_shape(client):
    got = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, **GREEDY)
    logprobs = got.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == NUM_TOKENS
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets


def test_a_disconnect_mid_stream_cancels_the_request_and_frees_every_kv_block(
    client, native, cluster
):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=3000,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [next(stream) for _ in range(3)]
    stream.close()  # the connection goes: the client left mid-stream
    request_id = chunks[0].id.removeprefix("chatcmpl-")
    deadline = time.monotonic() + 10
    while native.get_request(request_id).status != "cancelled":
        assert time.monotonic() < deadline, native.get_request(request_id)
        time.sleep(0.02)
    for worker in cluster.children:
        if worker is not cluster.router:
            load = wait_idle(worker.address, worker.role)
            assert load.free_blocks == load.total_blocks and not load.running, worker.name


def test_metrics_are_the_routers_prometheus_text(client, cluster):
    client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    root = cluster.openai_url.removesuffix("/v1")
    served = httpx.get(f"{root}/metrics")
    assert served.headers["content-type"].startswith("text/plain")
    assert f'pdserve:request_success_total{{finished_reason="length",model_name="{MODEL}"' in (
        served.text
    )
    native_endpoint = httpx.get(f"http://{cluster.router.metrics_address}/metrics").text
    names = {line.split("{")[0] for line in native_endpoint.splitlines() if line[:1] != "#"}
    assert names == {line.split("{")[0] for line in served.text.splitlines() if line[:1] != "#"}
