"""xgrammar against llguidance on this CPU, on a model's own vocabulary: what the engine's
structured outputs would pay with each (docs/benchmarks/structured-outputs.md).

For each schema: the compile time (a cold compile: each library's own cache is cleared or
bypassed), then a batch of matchers stepped along a valid JSON text token by token, timing
the mask computation of the whole batch (each library's batched call, on its own threads)
and the advance of every matcher by its next token. Times are the process's CPU time (all
its threads: both libraries compute a batch's masks on threads of their own), which a
machine shared with other work stretches far less than the wall clock.

    .venv/bin/python bench/grammar_libs_bench.py            # the default model (SmolLM2)
    .venv/bin/python bench/grammar_libs_bench.py --batch 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.core.checkpoint import default_model
from pdserve.engine.tokenizer import Tokenizer

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested+enum+bounds": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "role": {"enum": ["admin", "editor", "viewer"]},
                    },
                    "required": ["id", "role"],
                },
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["user", "tags", "score"],
        },
        {"user": {"id": 42, "role": "editor"}, "tags": ["a", "bb"], "score": 0.5},
    ),
    "pattern+array of objects": (
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                        "required": ["sku", "qty"],
                    },
                    "minItems": 1,
                },
            },
            "required": ["date", "items"],
        },
        {"date": "2026-12-07", "items": [{"sku": "x1", "qty": 2}, {"sku": "y", "qty": 10}]},
    ),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        backend = tokenizer.backend_json()
        vocab = tokenizer.vocabulary()
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend)
        self.info = xgrammar.TokenizerInfo(
            vocab,
            metadata["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids),
            add_prefix_space=metadata["add_prefix_space"],
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            if not m.accept_token(t):
                raise AssertionError(f"xgrammar refused token {t}")


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_json(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids)
        )
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # builds the lexer: the compile
        if matcher.is_error():
            raise AssertionError(matcher.get_error())
        return grammar

    def matchers(self, compiled, n: int) -> list:
        return [self.llg.LLMatcher(self.tokenizer, compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return torch.full((n, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(pairs)
        )

    def accept(self, matchers: list, tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            if not m.consume_token(t):
                raise AssertionError(f"llguidance refused token {t}: {m.get_error()}")


def measure(lib, tokenizer: Tokenizer, schema: dict, example: dict, batch: int) -> dict:
    started = time.process_time()
    compiled = lib.compile(schema)
    compile_ms = (time.process_time() - started) * 1e3
    tokens = tokenizer.encode(json.dumps(example), add_special_tokens=False)
    matchers = lib.matchers(compiled, batch)
    bitmask = lib.bitmask(batch)
    fill_s, accept_s = [], []
    for token in tokens:
        started = time.process_time()
        lib.fill(matchers, bitmask)
        fill_s.append(time.process_time() - started)
        started = time.process_time()
        lib.accept(matchers, [token] * batch)
        accept_s.append(time.process_time() - started)
    return {
        "compile_ms": compile_ms,
        "mask_ms": statistics.median(fill_s) * 1e3,
        "mask_p90_ms": sorted(fill_s)[int(0.9 * len(fill_s))] * 1e3,
        "accept_ms": statistics.median(accept_s) * 1e3,
        "tokens": len(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model()))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = Tokenizer.load(args.model)
    from pdserve.core.model_config import ModelConfig

    vocab_size = ModelConfig.load(args.model).vocab_size
    for cls in (XGrammar, LLGuidance):
        started = time.process_time()
        lib = cls(tokenizer, vocab_size)
        setup_ms = (time.process_time() - started) * 1e3
        print(f"{lib.name}: tokenizer set-up {setup_ms:.0f} ms")
        for label, (schema, example) in SCHEMAS.items():
            runs = [
                measure(lib, tokenizer, schema, example, args.batch) for _ in range(args.repeats)
            ]
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            print(
                f"  {label:26s} compile {best['compile_ms']:7.1f} ms | batch {args.batch}: "
                f"mask {best['mask_ms']:6.3f} ms (p90 {best['mask_p90_ms']:6.3f}), "
                f"advance {best['accept_ms']:6.3f} ms, over {best['tokens']} tokens"
            )


if __name__ == "__main__":
    main()
