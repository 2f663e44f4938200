"""How the blocking `Client` turns `AsyncClient`'s methods into its own: the same call,
run on the client's loop and waited for (an async generator becomes a plain iterator),
under the same name, docstring and signature."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:
    from pdserve.client import AsyncClient, Client

P = ParamSpec("P")
T = TypeVar("T")


def blocking(
    method: Callable[Concatenate[AsyncClient, P], Awaitable[T]],
) -> Callable[Concatenate[Client, P], T]:
    """`Client`'s version of an `AsyncClient` coroutine method: the same call, waited for."""

    def call(self: Client, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._wait(method(self._client, *args, **kwargs))

    return _client_method(call, method)


def blocking_iter(
    method: Callable[Concatenate[AsyncClient, P], AsyncIterator[T]],
) -> Callable[Concatenate[Client, P], Iterator[T]]:
    """`Client`'s version of an `AsyncClient` async generator method: a plain iterator."""

    def iterate(self: Client, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._iterate(method(self._client, *args, **kwargs))

    return _client_method(iterate, method, returns="Iterator[Chunk]")


def _client_method(wrapper: Callable, method: Callable, returns: str | None = None) -> Callable:
    """Give `wrapper` the name, docstring and signature of `method`, as a `Client` method."""
    functools.update_wrapper(wrapper, method)
    wrapper.__qualname__ = f"Client.{method.__name__}"
    if returns is not None:
        wrapper.__signature__ = inspect.signature(method).replace(return_annotation=returns)
    return wrapper
