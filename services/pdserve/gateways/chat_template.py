"""A model's chat template, rendered as Hugging Face's `apply_chat_template` renders it.

The template comes from the model directory: `chat_template.jinja` if present, else the
`chat_template` field of `tokenizer_config.json` (a string, or a list of named templates
of which `default` is used); from a GGUF, its `tokenizer.chat_template`. Templates
come from model hubs, so they are untrusted code: they run in Jinja2's immutable sandbox,
with the environment transformers gives them (`trim_blocks`, `lstrip_blocks`, loop
controls, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`) and
the special tokens' strings (`bos_token`, `eos_token`, ...) as variables. The prompt is
then tokenized with no special tokens added, as transformers does: the template writes
them itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.core.checkpoint import find_gguf
from pdserve.core.errors import InvalidRequestError, ModelLoadError
from pdserve.core.gguf_file import GGUFCheckpoint
from pdserve.engine.tokenizer import Tokenizer, read_json_object

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_TEMPLATE_NAME = "default"
# The special tokens transformers passes to every template (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _raise_exception(message: str):
    """What a template calls to refuse a conversation (roles out of order, ...)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; chat templates want the plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GuardedNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot reach dunders."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _GuardedNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _GuardedNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _DictFactory:
    """`dict(...)` for templates, without the type itself (no attribute hacks on it)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks):
    rendered as its body, as transformers renders it when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _GuardedNamespace
    env.globals["dict"] = _DictFactory()
    return env


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled chat template, its special tokens, and the tokenizer for its prompts."""

    source: str  # the template's text
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ... as the template sees them
    template: jinja2.Template
    tokenizer: Tokenizer

    @classmethod
    def load(cls, model: str | Path, tokenizer: Tokenizer | None = None) -> ChatTemplate | None:
        """The template of what `--model` names (a GGUF file or a Hugging Face directory),
        tokenizing with `tokenizer` (the router's; None: the model's own, loaded here);
        None when the model has no template.

        Raises:
            ModelLoadError: a template file or field that is malformed (naming it).
        """
        gguf = find_gguf(model)
        if gguf is None:
            config = read_json_object(Path(model) / TOKENIZER_CONFIG_FILE)
            source = _template_source(Path(model), config)
            special_tokens = _special_tokens(config, Path(model))
        else:
            vocab = GGUFCheckpoint.open(gguf).vocab()
            source = vocab.chat_template
            special_tokens = {
                name: vocab.tokens[token_id]
                for name, token_id in (
                    ("bos_token", vocab.bos_token_id),
                    ("eos_token", vocab.eos_token_id),
                    ("unk_token", vocab.unk_token_id),
                    ("pad_token", vocab.pad_token_id),
                )
                if token_id is not None
            }
        if source is None:
            return None
        try:
            template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{model}: chat template line {exc.lineno}: {exc}") from exc
        return cls(source, special_tokens, template, tokenizer or Tokenizer.load(model))

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's prompt text.

        Raises:
            InvalidRequestError: on `messages` when the template refuses them (its
                `raise_exception`) or fails on them.
        """
        try:
            return self.template.render(
                messages=[_without_nulls(message) for message in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:  # SecurityError, UndefinedError too
            raise InvalidRequestError("messages", f"the chat template refused them: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError) as exc:  # a template's own bug
            raise InvalidRequestError("messages", f"the chat template failed: {exc}") from exc

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The rendered prompt's token ids, with no special tokens added to what it says."""
        return self.encode(self.render(messages))

    def encode(self, rendered: str) -> list[int]:
        """A rendered prompt's token ids: the template wrote its special tokens itself."""
        return self.tokenizer.encode(rendered, add_special_tokens=False)


def _without_nulls(message: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers does: templates handle a missing key, and many print a null as "None".
    return {key: value for key, value in message.items() if value is not None}


def _template_source(model_dir: Path, config: dict) -> str | None:
    """chat_template.jinja beats tokenizer_config.json's field, as in transformers."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    field = config.get("chat_template")
    if field is None or isinstance(field, str):
        return field
    where = f"{model_dir / TOKENIZER_CONFIG_FILE}: field chat_template"
    if not isinstance(field, list):
        raise ModelLoadError(f"{where}: expected a string or a list of named templates")
    named = {}
    for entry in field:
        if not isinstance(entry, dict) or not {"name", "template"} <= entry.keys():
            raise ModelLoadError(f"{where}: each entry needs a name and a template")
        named[entry["name"]] = entry["template"]
    return named.get(DEFAULT_TEMPLATE_NAME)  # tools are not supported: never `tool_use`


def _special_tokens(config: dict, model_dir: Path) -> dict[str, str]:
    """The special tokens' strings, from a string or an AddedToken-style `{"content"}`."""
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if token is None:
            continue
        if not isinstance(token, str):
            path = model_dir / TOKENIZER_CONFIG_FILE
            raise ModelLoadError(f"{path}: field {name}: expected a token string, got {token!r}")
        found[name] = token
    return found
