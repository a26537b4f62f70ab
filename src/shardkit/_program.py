"""Logic written once, run blocking or on an event loop (sans-I/O).

A counter's or a store's logic is a *program*: a generator that yields ``Call``s — "call
method ``name`` of the backend playing ``role``, with these arguments" — and is sent
each call's result (or has its error thrown in). It never does I/O itself. A runner
carries the calls out: ``run`` on blocking backends, ``arun`` on asyncio ones (awaiting
what they return). A call interrupted by a ``BaseException`` (a cancelled task, a
``KeyboardInterrupt``) closes the program at once, so its ``finally`` blocks run then
(they must not call anything), and the interruption goes on to the caller.

``blocking`` and ``awaitable`` turn a class's programs into the methods of its sync and
async forms, so the rules live in one place and a fix lands in both::

    class Core:
        def _value(self) -> Program[int]:
            cached = yield from call(Cache.get, self.key)  # typed: int | None
            ...

    class Counter(Core):  # sync
        value = blocking(Core._value)

    class AsyncCounter(Core):  # async
        value = awaitable(Core._value)

A role is the name of the class whose method is called (``Cache`` above); the object that
plays it is looked up in the instance's ``roles``. Sync and async backends of one role
have methods of the same names and meanings.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine, Generator, Mapping
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class Call(Generic[R]):
    """One call of a backend method, yielded by a program to its runner."""

    __slots__ = ("args", "kwargs", "name", "role")

    def __init__(self, role: str, name: str, args: Any, kwargs: Any) -> None:
        self.role = role
        self.name = name
        self.args = args
        self.kwargs = kwargs

    def __iter__(self) -> Generator[Call[Any], Any, R]:
        """``result = yield from call(...)``: the result, typed as the method's."""
        result: R = yield self
        return result

    def __repr__(self) -> str:
        return f"<Call {self.role}.{self.name}>"


Program = Generator[Call[Any], Any, R]
"""A generator of calls that returns an ``R`` once the calls have been carried out."""


def call(method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Call[R]:
    """A call of ``method`` (a class's function, such as ``Cache.get``) on whatever plays
    its class's role, with ``args``."""
    try:
        role, name = _NAMES[method]
    except KeyError:
        owner, _, name = method.__qualname__.rpartition(".")
        role = owner.rpartition(".")[2]
        _NAMES[method] = role, name
    return Call(role, name, args, kwargs)


_NAMES: dict[Callable[..., Any], tuple[str, str]] = {}  # method -> (role, name)


def run(program: Program[R], roles: Mapping[str, Any]) -> R:
    """Carry out ``program``'s calls on the blocking backends ``roles``; its result."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value = error = None
        try:
            value = getattr(roles[step.role], step.name)(*step.args, **step.kwargs)
        except Exception as exc:
            error = exc
        except BaseException:  # interrupted: the program's ``finally`` blocks run now
            program.close()
            raise


async def arun(program: Program[R], roles: Mapping[str, Any]) -> R:
    """Carry out ``program``'s calls on the backends ``roles``, awaiting what they return
    that is awaitable (a backend that never blocks, such as the in-process cache, may
    answer at once); its result."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value = error = None
        try:
            value = getattr(roles[step.role], step.name)(*step.args, **step.kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            error = exc
        except BaseException:  # cancelled: the program's ``finally`` blocks run now
            program.close()
            raise


class Driven(Protocol):
    """What ``blocking`` and ``awaitable`` methods run their programs with."""

    @property
    def roles(self) -> Mapping[str, Any]: ...


S = TypeVar("S", bound=Driven)


def blocking(program: Callable[Concatenate[S, P], Program[R]]) -> Callable[Concatenate[S, P], R]:
    """The method that runs ``program`` on the instance's blocking ``roles``."""

    @functools.wraps(program)
    def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return run(program(self, *args, **kwargs), self.roles)

    return method


def awaitable(
    program: Callable[Concatenate[S, P], Program[R]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """The coroutine method that runs ``program`` on the instance's asyncio ``roles``."""

    @functools.wraps(program)
    async def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await arun(program(self, *args, **kwargs), self.roles)

    return method
