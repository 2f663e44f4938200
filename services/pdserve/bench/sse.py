"""Server-sent events read from bytes as they arrive: what an OpenAI-compatible server
streams (`data: {...}` events, then `data: [DONE]`).

The WHATWG rules, the part a client of these servers needs: a line ends at `\\r\\n`, `\\n`
or `\\r`; a blank line ends an event; `data:` lines (one space after the colon dropped)
are joined with `\\n`; a line starting with `:` is a comment (a keep-alive); other fields
(`event`, `id`, `retry`) are not used here. Bytes may be cut anywhere, inside a line or
between the `\\r` and `\\n` of one line end: a `\\r` last in what arrived ends its line at
once, and a `\\n` first in the next bytes is then that same line end's. An event the
stream never ended (no blank line after it) is not one.
"""

from __future__ import annotations

import re

_LINE_END = re.compile(rb"\r\n|\n|\r")
_DATA = b"data"


class EventStream:
    """Feed the bytes of one response as they come; get each event's data once it ends."""

    def __init__(self) -> None:
        self._rest = b""  # after the last whole line
        self._data: list[bytes] = []  # the current event's data lines
        self._after_cr = False  # the bytes so far ended with a `\r`: a line's end

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event that `chunk` ended, in order (often none or one)."""
        if not chunk:
            return []
        if self._after_cr and chunk.startswith(b"\n"):  # the rest of a `\r\n`
            chunk = chunk[1:]
        buffer = self._rest + chunk
        self._after_cr = buffer.endswith(b"\r")
        *lines, self._rest = _LINE_END.split(buffer)
        events = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode())
                    self._data = []
            elif not line.startswith(b":"):  # a comment (keep-alive) otherwise
                name, _, value = line.partition(b":")
                if name == _DATA:
                    self._data.append(value.removeprefix(b" "))
        return events
