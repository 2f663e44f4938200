"""The token checkpoint stream's format, shared by its writer and its readers.

The layout and the resume contract are in `pdserve.state.requests`; this module holds
the key names, the entry fields both sides agree on, and the cursor that turns entries
back into what a reader resuming at a token offset gets.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

from redis.exceptions import RedisError

from pdserve.core.errors import CheckpointsLostError, StateUnavailableError
from pdserve.core.phase import RequestPhase


@dataclass(frozen=True, slots=True)
class Keys:
    """The Redis keys of one store, all under `prefix`."""

    prefix: str

    def record(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}:tokens:{request_id}"


def delta_fields(seq: int, offset: int, ids: list[list[int]], texts: list[str]) -> dict:
    """The XADD fields of an entry holding deltas seq, seq + 1, ... from token `offset`."""
    return {
        "seq": seq,
        "offset": offset,
        "ids": json.dumps(ids, separators=(",", ":")),
        "texts": json.dumps(texts, separators=(",", ":")),
    }


def end_fields(seq: int, offset: int, status: RequestPhase) -> dict:
    """The XADD fields of the end entry, after `seq` deltas holding `offset` tokens."""
    return {"seq": seq, "offset": offset, "end": status.value}


@dataclass(slots=True)
class Entry:
    """One stream entry as read back (an end entry has `end` set and no deltas)."""

    seq: int
    offset: int
    ids: list[list[int]]
    texts: list[str]
    end: str  # the terminal status on the end entry, else ""

    @classmethod
    def parse(cls, fields: dict[bytes, bytes]) -> Entry:
        return cls(
            seq=int(fields[b"seq"]),
            offset=int(fields[b"offset"]),
            ids=json.loads(fields.get(b"ids", b"[]")),
            texts=json.loads(fields.get(b"texts", b"[]")),
            end=fields.get(b"end", b"").decode(),
        )


def resume_point(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[int, int, list[bytes]]:
    """Where a writer goes on after a stream's `entries` (XRANGE or XREVRANGE replies, any
    order): (the next delta's seq, the tokens held, the ids of end entries to remove).
    An end entry counts every delta before it; a range written twice counts once."""
    seq = offset = 0
    ends: list[bytes] = []
    for entry_id, fields in entries:
        entry = Entry.parse(fields)
        if entry.end:
            ends.append(entry_id)
        seq = max(seq, entry.seq + len(entry.ids))
        offset = max(offset, entry.offset + sum(len(ids) for ids in entry.ids))
    return seq, offset, ends


@dataclass
class Cursor:
    """Walks a stream's entries in order, keeping what a reader resuming at `offset` gets."""

    offset: int
    next_seq: int = 0  # the first delta not walked past yet
    num_tokens: int = 0  # tokens in the deltas walked past: the offset of delta next_seq

    def take(self, entries: list[Entry]) -> tuple[list[int], list[str], bool]:
        """(token ids, texts of the deltas that hold them, whether the end was reached)."""
        ids: list[int] = []
        texts: list[str] = []
        for entry in entries:
            if entry.seq > self.next_seq:  # deltas are missing
                if entry.offset > self.offset:
                    raise CheckpointsLostError(
                        f"tokens {self.num_tokens} to {entry.offset} of the stream were lost"
                    )
                # All before the reader's offset. (A lost token-less delta at exactly the
                # offset would go unnoticed; the engine emits those only at the end.)
                self.next_seq, self.num_tokens = entry.seq, entry.offset
            if entry.end:
                # A client may hold tokens its router sent before their checkpoint
                # landed: past a failed end, the reader decides (the request may run
                # again and reach the client's offset); past any other, it never will.
                if self.offset > self.num_tokens and entry.end != RequestPhase.FAILED.value:
                    raise ValueError(
                        f"resume_from beyond the stream: {self.offset} > {self.num_tokens} tokens"
                    )
                return ids, texts, True
            skip = self.next_seq - entry.seq  # > 0 for a range written twice
            for delta_ids, text in zip(entry.ids[skip:], entry.texts[skip:], strict=True):
                self._walk(delta_ids, text, ids, texts)
        return ids, texts, False

    def _walk(self, delta_ids: list[int], text: str, ids: list[int], texts: list[str]) -> None:
        start = self.num_tokens
        self.num_tokens += len(delta_ids)
        self.next_seq += 1
        if start >= self.offset or self.num_tokens > self.offset:
            ids.extend(delta_ids[max(0, self.offset - start) :])
            texts.append(text)


@contextlib.contextmanager
def redis_errors() -> Iterator[None]:
    """Re-raise a Redis error as StateUnavailableError (what callers of the store see)."""
    try:
        yield
    except RedisError as exc:
        raise StateUnavailableError(f"request state unavailable: {exc}") from exc


def stream_entries(reply) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of XREAD's reply for one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [item[1] for item in reply]
    return [entry for entries in streams for entry in entries]
