"""How the blocking `Client` turns `AsyncClient`'s methods into its own: the same call,
run on the client's loop and waited for (an async generator becomes a plain iterator),
under the same name, docstring and signature.

It knows the two classes only by what it uses of them (`Host`), so it sits below
`client.py`, which imports it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Host(Protocol):
    """What the blocking client is to its methods (`client.Client`): the async client it
    wraps (`client.AsyncClient`), and the way it runs a call of it on its own loop."""

    _client: Any

    def _wait(self, awaitable: Awaitable[T]) -> T: ...

    def _iterate(self, chunks: AsyncIterator[T]) -> Iterator[T]: ...


def blocking(
    method: Callable[Concatenate[Any, P], Awaitable[T]],
) -> Callable[Concatenate[Host, P], T]:
    """`Client`'s version of an `AsyncClient` coroutine method: the same call, waited for."""

    def call(self: Host, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._wait(method(self._client, *args, **kwargs))

    return _client_method(call, method)


def blocking_iter(
    method: Callable[Concatenate[Any, P], AsyncIterator[T]],
) -> Callable[Concatenate[Host, P], Iterator[T]]:
    """`Client`'s version of an `AsyncClient` async generator method: a plain iterator."""

    def iterate(self: Host, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._iterate(method(self._client, *args, **kwargs))

    return _client_method(iterate, method, returns="Iterator[Chunk]")


def _client_method(wrapper: Callable, method: Callable, returns: str | None = None) -> Callable:
    """Give `wrapper` the name, docstring and signature of `method`, as a `Client` method."""
    functools.update_wrapper(wrapper, method)
    wrapper.__qualname__ = f"Client.{method.__name__}"
    if returns is not None:
        wrapper.__signature__ = inspect.signature(method).replace(return_annotation=returns)
    return wrapper
