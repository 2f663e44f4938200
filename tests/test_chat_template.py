"""Chat templates render as transformers' `apply_chat_template` does (the oracle), for
templates in the style of the Llama 3, Qwen2 and Mistral families and the demo model's,
read from `tokenizer_config.json` (a string or named templates) or `chat_template.jinja`."""

from __future__ import annotations

import json
import shutil

import pytest
import tokenizers

from pdserve.core.errors import InvalidRequestError, ModelLoadError
from pdserve.gateways.chat_template import ChatTemplate

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('after the system message, roles are user or assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n' }}
    {%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# no whitespace control: trim_blocks and lstrip_blocks make the layout
MISTRAL_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
    {% set system_message = messages[0]['content'] %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set loop_messages = messages %}
{% endif %}
{{ bos_token }}
{% set ns = namespace(turn=0) %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (ns.turn % 2 == 0) %}
        {{ raise_exception('roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.last and system_message is defined %}
[INST] {{ system_message }}

{{ message['content'] }}[/INST]
        {% else %}
[INST] {{ message['content'] }}[/INST]
        {% endif %}
    {% else %}
        {% generation %}
 {{ message['content'] + eos_token }}
        {% endgeneration %}
    {% endif %}
    {% set ns.turn = ns.turn + 1 %}
{% endfor %}
"""

# name: (template, special tokens added to the tokenizer, tokenizer_config fields, where)
FAMILIES = {
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "config",
    ),
    "qwen2": (
        QWEN2_TEMPLATE,
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "jinja",
    ),
    "mistral": (
        MISTRAL_TEMPLATE,
        [],
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken"}},
        "named",
    ),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "  You answer briefly.  "},
        {"role": "user", "content": "Où est la gare? <b>&</b>"},
    ],
    [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another?", "name": "ada"},
    ],
]


def write_checkpoint(out, demo_model_dir, family: str):
    """A model directory's tokenizer files, with the family's template and tokens."""
    template, special_tokens, fields, where = FAMILIES[family]
    out.mkdir()
    tokenizer = tokenizers.Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(special_tokens)
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    config.update(fields)
    if where == "config":
        config["chat_template"] = template
    elif where == "named":
        config["chat_template"] = [
            {"name": "default", "template": template},
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        ]
    else:
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=[*sorted(FAMILIES), "demo"])
def checkpoint(request, tmp_path_factory, demo_model_dir):
    if request.param == "demo":
        return demo_model_dir
    return write_checkpoint(
        tmp_path_factory.mktemp("chat") / request.param, demo_model_dir, request.param
    )


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_tokenizes_as_transformers(
    checkpoint, hf_tokenizer, conversation, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    template = ChatTemplate.load(checkpoint)
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    if add_generation_prompt:  # what the gateway sends: no special tokens added to it
        expected_ids = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert template.prompt_ids(messages) == expected_ids


def test_a_template_that_refuses_the_roles_is_an_invalid_request_naming_messages(
    tmp_path, demo_model_dir
):
    template = ChatTemplate.load(write_checkpoint(tmp_path / "m", demo_model_dir, "mistral"))
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate") as caught:
        template.render(twice)
    assert caught.value.field == "messages"


def test_templates_run_sandboxed(tmp_path, demo_model_dir):
    model = shutil.copytree(demo_model_dir, tmp_path / "m")
    (model / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    template = ChatTemplate.load(model)
    with pytest.raises(InvalidRequestError) as caught:
        template.render([{"role": "user", "content": "hi"}])
    assert caught.value.field == "messages"


def test_chat_template_jinja_beats_the_config_field(tmp_path, demo_model_dir):
    model = shutil.copytree(demo_model_dir, tmp_path / "m")
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert ChatTemplate.load(model).render([{"role": "user", "content": "hi"}]) == "hi!"


def test_a_model_without_a_template_has_none(tmp_path, demo_model_dir):
    model = shutil.copytree(demo_model_dir, tmp_path / "m")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(model) is None


def test_a_malformed_template_fails_the_load_naming_the_line(tmp_path, demo_model_dir):
    model = shutil.copytree(demo_model_dir, tmp_path / "m")
    (model / "chat_template.jinja").write_text("ok\n{% for m in messages %}")
    with pytest.raises(ModelLoadError, match="line 2"):
        ChatTemplate.load(model)
