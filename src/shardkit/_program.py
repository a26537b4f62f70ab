"""Logic written once, run blocking or on an event loop (sans-I/O).

A counter's or a store's logic is a *program*: a generator that yields ``Call``s — "call
method ``name`` of the backend playing ``role``, with these arguments" — and is sent
each call's result (or has its error thrown in). It never does I/O itself. A runner
carries the calls out: ``run`` on blocking backends, ``arun`` on asyncio ones (awaiting
what they return). A call interrupted by a ``BaseException`` (a cancelled task, a
``KeyboardInterrupt``) closes the program at once, so its ``finally`` blocks run then
(they must not call anything), and the interruption goes on to the caller.

A *role* is a protocol marked with ``@role("name")``: the backends a program runs on are
a ``Roles`` dataclass whose field ``name`` plays it, checked when it is made. A *rule*
is a program that is a public method: written once on a core, it is a blocking method of
the core's ``Blocking`` form and a coroutine method of its ``Awaiting`` form::

    @role("cache")
    class Cache(Protocol):
        def get(self, key: str) -> int | None: ...

    @dataclass(frozen=True, slots=True)
    class CounterRoles(Roles):
        cache: Cache

    class Core:
        roles: CounterRoles

        @rule
        def value(self) -> Program[int]:
            cached = yield from call(Cache.get, self.key)  # typed: int | None
            ...

    class Counter(Core, Blocking): ...  # counter.value() -> int
    class AsyncCounter(Core, Awaiting): ...  # await counter.value() -> int

Sync and async backends of one role have methods of the same names and meanings.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T", bound=type)


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

_METHODS: dict[Callable[..., Any], tuple[str, str]] = {}  # method -> (role, name)
_ROLES: dict[str, tuple[str, ...]] = {}  # role -> the names of its methods
_NAMES: dict[object, str] = {}  # protocol -> its role


def role(name: str) -> Callable[[T], T]:
    """Mark a protocol as the role ``name``: its methods may be called by programs, on
    the field ``name`` of the ``Roles`` they run on."""

    def mark(protocol: T) -> T:
        methods = {
            attr: value
            for attr, value in vars(protocol).items()
            if inspect.isfunction(value) and (attr == "__call__" or not attr.startswith("_"))
        }
        for attr, method in methods.items():
            _METHODS[method] = name, attr
        _ROLES[name] = tuple(methods)
        _NAMES[protocol] = name
        return protocol

    return mark


def call(method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Call[R]:
    """A call of ``method`` (a role's method, such as ``Cache.get``) on whatever plays
    the role, with ``args``."""
    try:
        name, attr = _METHODS[method]
    except KeyError:
        raise TypeError(f"{method.__qualname__} is not a method of a role") from None
    return Call(name, attr, args, kwargs)


@role("clock")
class Clock(Protocol):
    """The role that waits: the ``time`` module, or ``asyncio``."""

    def sleep(self, seconds: float) -> Any: ...


class Roles:
    """The backends a core's programs run on: a frozen dataclass whose fields are named
    as the roles they play. Making one checks that each field's backend has the role's
    methods, so a backend that cannot play its role fails where the kit is built, not on
    the one path that calls it. A field that is None plays no role: an ability the
    backends lack, which the programs check for before they call it."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for part in dataclasses.fields(self):  # type: ignore[arg-type]
            backend = getattr(self, part.name)
            if backend is not None:
                _check(backend, part.name)


def _check(backend: object, name: str) -> None:
    """Raise ``TypeError`` unless ``backend`` has every method of the role ``name``."""
    missing = [m for m in _ROLES.get(name, ()) if not hasattr(backend, m)]
    if missing:
        raise TypeError(f"{backend!r} cannot play the role {name!r}: it has no {missing[0]}")


def playing(backend: object, role: Callable[..., R]) -> R:
    """``backend``, an asyncio backend, typed as ``role``, the protocol marked with
    ``@role`` that it plays (typing reads the class as what it makes). Its methods have
    the role's names and return awaitables of what the role's return, which ``arun``
    awaits: typing has no way to say "the awaited form of a protocol", so this is where
    a backend is declared to be one. ``TypeError`` if ``role`` is no role, or
    ``backend`` lacks one of its methods."""
    name = _NAMES.get(role)
    if name is None:
        raise TypeError(f"{role!r} is not a role")
    _check(backend, name)
    return backend  # type: ignore[return-value]  # the awaited form: see above


def run(program: Program[R], roles: Roles) -> R:
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
            value = getattr(getattr(roles, step.role), step.name)(*step.args, **step.kwargs)
        except Exception as exc:
            error = exc
        except BaseException:  # interrupted: the program's ``finally`` blocks run now
            program.close()
            raise


# Deliberately ``run`` line for line but for the await: one runner for both would cost
# every blocking call an awaitable check.
async def arun(program: Program[R], roles: Roles) -> R:
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
            value = getattr(getattr(roles, step.role), step.name)(*step.args, **step.kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            error = exc
        except BaseException:  # cancelled: the program's ``finally`` blocks run now
            program.close()
            raise


class Blocking:
    """The sync form of a core: each of the core's ``rule``s is a method that runs its
    program on the instance's ``roles`` with ``run``."""

    roles: Any

    def _carry_out(self, program: Program[R]) -> R:
        """Run ``program`` on the instance's ``roles``."""
        return run(program, self.roles)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, found in _rules(cls):
            setattr(cls, name, _blocking(found.program))


class Awaiting:
    """The async form of a core: each of the core's ``rule``s is a coroutine method that
    runs its program on the instance's ``roles`` with ``arun``."""

    roles: Any

    def _carry_out(self, program: Program[R]) -> Coroutine[Any, Any, R]:
        """Run ``program`` on the instance's ``roles``, awaited."""
        return arun(program, self.roles)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, found in _rules(cls):
            setattr(cls, name, _awaitable(found.program))


class rule(Generic[S, P, R]):
    """A program that is a public method of its core's forms: blocking on a ``Blocking``
    form, a coroutine on an ``Awaiting`` one (typed so; the forms hold plain functions).
    Within the core, ``Core.name.program`` is the program itself."""

    def __init__(self, program: Callable[Concatenate[S, P], Program[R]]) -> None:
        self.program = program
        functools.update_wrapper(self, program)  # type: ignore[arg-type]

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> rule[S, P, R]: ...
    @overload
    def __get__(self, obj: Awaiting, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __get__(self, obj: Blocking, owner: type[Any]) -> Callable[P, R]: ...
    def __get__(self, obj: object, owner: type[Any]) -> Any:
        if obj is None:
            return self
        raise TypeError(f"{owner.__name__} is neither Blocking nor Awaiting: no method")


def _rules(form: type) -> list[tuple[str, rule[Any, ..., Any]]]:
    """The rules ``form`` inherits that it holds no method for yet."""
    found = {}
    for klass in reversed(form.__mro__):
        for name, value in vars(klass).items():
            found[name] = value
    return [(name, value) for name, value in found.items() if isinstance(value, rule)]


def _blocking(program: Callable[Concatenate[Any, P], Program[R]]) -> Callable[..., R]:
    @functools.wraps(program)
    def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return run(program(self, *args, **kwargs), self.roles)

    return method


def _awaitable(
    program: Callable[Concatenate[Any, P], Program[R]],
) -> Callable[..., Coroutine[Any, Any, R]]:
    @functools.wraps(program)
    async def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await arun(program(self, *args, **kwargs), self.roles)

    return method
