"""Structured outputs' grammars, by llguidance: a constraint compiled once (cached by its
digest), a matcher per request that follows its sampled tokens, and the batch's token
masks in one call. Torch-free: the router compiles a request's constraint too, so that a
bad one is refused before any KV is reserved.

Why llguidance (docs/benchmarks/structured-outputs.md): its compile bounds itself by
fuel (a schema that would take long fails with an error instead of stalling a thread),
it needs neither torch nor transformers (xgrammar imports both, 3.3 s, which the router
must not load), and its compile is about 10x faster; xgrammar's masks are faster (0.03
against 0.25 ms for a batch of 16), but both are under 1% of a decode step.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pdserve.core.errors import InvalidRequestError
from pdserve.core.structured_output import Constraint, ConstraintKind, schema_object
from pdserve.engine.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 2.0  # a constraint that takes longer to compile is refused
CACHE_SIZE = 256  # compiled constraints kept, least recently used out first
COMPILE_THREADS = 2  # compiles run here, so a slow one is waited on with a timeout
MASK_THREADS = 2  # llguidance's threads for a batch's masks
MAX_ERROR_CHARS = 400  # of llguidance's message, in the error naming the field
# llguidance's own bounds (its "fuel"): the work of building a grammar's lexer and of one
# token's mask. A schema past them is an error, not a stall.
PARSER_LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000)
# JSON output as the json module and OpenAI write it: ", " and ": ", no free whitespace
# (a small model given free whitespace may spend its tokens on newlines).
JSON_OPTIONS = {"whitespace_flexible": False}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: bit t % 32 of word t // 32 allows token t."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One request's position in its constraint's grammar."""

    __slots__ = ("native",)

    def __init__(self, native: llguidance.LLMatcher):
        self.native = native

    def advance(self, token_id: int) -> bool:
        """Take the sampled token; False if the grammar rejects it (the matcher is then in
        error and stays so)."""
        return self.native.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The output is complete: nothing may follow."""
        return self.native.is_stopped()

    @property
    def error(self) -> str | None:
        return self.native.get_error() if self.native.is_error() else None


class GrammarCompiler:
    """Constraints to matchers for one vocabulary. Thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
    ):
        # Building llguidance's tokenizer takes 0.4 s (SmolLM2's 49k tokens): on first use.
        self._tokenizer_args = (tokenizer, vocab_size, sorted(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self.timeout_s, self.cache_size = timeout_s, cache_size
        # digest -> a matcher at the grammar's start (copied per request), or the error
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)

    def matcher(self, constraint: Constraint, field: str) -> GrammarMatcher:
        """A new matcher at the start of `constraint`'s grammar, compiled once per digest.
        InvalidRequestError naming `field` if it does not compile, or not within
        `timeout_s`."""
        return GrammarMatcher(self._compiled(constraint, field).deep_copy())

    def matcher_after(
        self, constraint: Constraint, tokens: Sequence[int], field: str
    ) -> GrammarMatcher:
        """A matcher that has taken `tokens` (an output so far, from another engine):
        InvalidRequestError naming `field` if the grammar rejects one of them."""
        matcher = self.matcher(constraint, field)
        for i, token in enumerate(tokens):
            if not matcher.advance(token):
                raise InvalidRequestError(
                    field, f"output token {i} ({token}) is outside the constraint"
                )
        return matcher

    def check(self, constraint: Constraint, field: str) -> None:
        """Compile (or find) `constraint`: InvalidRequestError naming `field` if it fails."""
        self._compiled(constraint, field)

    def _compiled(self, constraint: Constraint, field: str) -> llguidance.LLMatcher:
        key = constraint.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
        if found is None:
            tokenizer = self.tokenizer  # built once, outside the bound on compiling
            future = self._pool.submit(self._compile, constraint, tokenizer)
            try:
                found = future.result(timeout=self.timeout_s)
            except FutureTimeout:  # the thread goes on until llguidance's fuel ends it
                raise InvalidRequestError(
                    field, f"took longer than {self.timeout_s * 1e3:.0f} ms to compile"
                ) from None
            with self._lock:
                self._cache[key] = found
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, str):
            raise InvalidRequestError(field, found)
        return found

    def _compile(
        self, constraint: Constraint, tokenizer: llguidance.LLTokenizer
    ) -> llguidance.LLMatcher | str:
        """The grammar's start, its first mask computed (which builds the lexer), or what
        is wrong with the constraint."""
        try:
            grammar = llguidance_grammar(constraint)
        except ValueError as exc:
            return _one_line(str(exc))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            return _one_line(matcher.get_error())
        return matcher

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                ours, vocab_size, eos = self._tokenizer_args
                text = ours.backend_json()
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
            return self._tokenizer


class MaskFiller:
    """Writes a batch's token masks in one llguidance call, on its own threads."""

    def __init__(self, num_threads: int = MASK_THREADS):
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(
        self, rows: Sequence[tuple[GrammarMatcher, int]], address: int, num_rows: int, words: int
    ) -> None:
        """Row r of the int32 [num_rows, words] array at `address` (contiguous, on the CPU)
        gets the mask of the matcher paired with r; rows not named are left as they are."""
        pairs = [(m.native, r) for m, r in rows]
        self._executor.unsafe_compute_mask_ptr(pairs, address, words * 4, num_rows)


def llguidance_grammar(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (ValueError if its text is malformed)."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return _json_grammar({"type": "object"})
    if kind is ConstraintKind.JSON_SCHEMA:
        return _json_grammar(schema_object(constraint.spec, "schema"))
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind is ConstraintKind.CHOICE:
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {literals}")
    try:
        lark = any_to_lark(constraint.spec)  # GBNF becomes Lark; Lark stays as it is
    except GbnfToLarkError as exc:
        raise ValueError(f"not a Lark or GBNF grammar: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exception too
        # ("No 'root' rule found" for a GBNF without one: the fuzz suite sent "a ::= b")
        raise ValueError(f"not a Lark or GBNF grammar: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _json_grammar(schema: dict | bool) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
