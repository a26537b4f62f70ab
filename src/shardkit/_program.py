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
the core's ``Blocking`` form and a coroutine method of its ``Awaiting`` form. A rule
whose work, on some path, is one call may return that ``Call`` (a *step*: ``Steps``),
with what its result and its errors become (``Call.then``), rather than a program of
that one call: the form's method makes the call itself, with no generator run around
it, so that such a rule costs its caller what the call costs::

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

        @rule
        def cached(self) -> Steps[int]:
            return call(Cache.get, self.key).then(lambda value: value or 0)

    class Counter(Core, Blocking): ...  # counter.value() -> int
    class AsyncCounter(Core, Awaiting): ...  # await counter.value() -> int

Sync and async backends of one role have methods of the same names and meanings.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable, Coroutine, Generator
from typing import (
    Any,
    Concatenate,
    Generic,
    NoReturn,
    ParamSpec,
    Protocol,
    TypeVar,
    final,
    overload,
)

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
T = TypeVar("T", bound=type)


@final  # so that ``type(step) is Call`` tells a step from a program
class Call(Generic[R]):
    """A call of ``method`` (a role's method, such as ``Cache.get``) on whatever plays
    the role, with ``args``: yielded by a program to its runner, or returned by a rule
    as all it does (a step, which the runner carries out). Made as ``call(...)``."""

    __slots__ = ("args", "done", "failed", "find", "kwargs", "name", "role")

    def __init__(
        self, method: Callable[Concatenate[Any, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> None:
        try:  # ``find``: roles -> the method of the backend playing the role
            self.role, self.name, self.find = _METHODS[method]
        except KeyError:
            raise TypeError(f"{method.__qualname__} is not a method of a role") from None
        self.args = args
        self.kwargs = kwargs
        self.done: Callable[[Any], R] | None = None
        self.failed: Callable[[Exception], Exception | None] | None = None

    def then(
        self,
        done: Callable[[R], S],
        failed: Callable[[Exception], Exception | None] | None = None,
    ) -> Call[S]:
        """This call, its result made into ``done(result)``; with ``failed``, an
        exception it raises is made into ``failed(exc)``, raised in its place (from it)
        unless None."""
        self.done = done  # type: ignore[assignment]  # R is S from here on
        self.failed = failed
        return self  # type: ignore[return-value]  # what it returns is done's now

    def __iter__(self) -> Generator[Call[Any], Any, R]:
        """``result = yield from call(...)``: the result, typed as the method's."""
        try:
            result = yield self
        except Exception as exc:
            if self.failed is None:
                raise
            self.fail(exc)
        return result if self.done is None else self.done(result)

    def fail(self, exc: Exception) -> NoReturn:
        """Raise ``exc``, which the call raised, or what ``failed`` makes of it."""
        turned = None if self.failed is None else self.failed(exc)
        if turned is None:
            raise exc
        raise turned from exc

    def __repr__(self) -> str:
        return f"<Call {self.role}.{self.name}>"


Program = Generator[Call[Any], Any, R]
"""A generator of calls that returns an ``R`` once the calls have been carried out."""

Steps = Program[R] | Call[R]
"""What a rule returns: its program, or the one call that is all it does (a step)."""

# method -> (role, name, roles -> the backend's method)
_METHODS: dict[Callable[..., Any], tuple[str, str, Callable[[Any], Any]]] = {}
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
            _METHODS[method] = name, attr, operator.attrgetter(f"{name}.{attr}")
        _ROLES[name] = tuple(methods)
        _NAMES[protocol] = name
        return protocol

    return mark


call = Call
"""``call(Cache.get, key)``: the ``Call`` of a role's method, typed as it returns."""


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


def run(program: Steps[R], roles: Roles) -> R:
    """Carry out ``program``'s calls (or the step ``program``: a rule's form carries its
    own out itself) on the blocking backends ``roles``; its result."""
    if type(program) is Call:
        program = iter(program)
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value = error = None
        try:
            value = step.find(roles)(*step.args, **step.kwargs)
        except Exception as exc:
            error = exc
        except BaseException:  # interrupted: the program's ``finally`` blocks run now
            program.close()
            raise


# Deliberately ``run`` line for line but for the await: one runner for both would cost
# every blocking call an awaitable check.
async def arun(program: Steps[R], roles: Roles) -> R:
    """Carry out ``program``'s calls (or the step ``program``) on the backends ``roles``,
    awaiting what they return that is awaitable (a backend that never blocks, such as
    the in-process cache, may answer at once); its result."""
    if type(program) is Call:
        program = iter(program)
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value = error = None
        try:
            value = step.find(roles)(*step.args, **step.kwargs)
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

    def _carry_out(self, program: Steps[R]) -> R:
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

    def _carry_out(self, program: Steps[R]) -> Coroutine[Any, Any, R]:
        """Run ``program`` on the instance's ``roles``, awaited."""
        return arun(program, self.roles)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, found in _rules(cls):
            setattr(cls, name, _awaitable(found.program))


class rule(Generic[S, P, R]):
    """A program (or a function returning its program or a step: ``Steps``) that is a
    public method of its core's forms: blocking on a ``Blocking`` form, a coroutine on
    an ``Awaiting`` one (typed so; the forms hold plain functions). Within the core,
    ``Core.name.program`` is the function itself."""

    def __init__(self, program: Callable[Concatenate[S, P], Steps[R]]) -> None:
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


# A rule's step is carried out by its form's method itself, so that a rule that is one
# call costs what that call costs: no runner called, no generator made.
def _blocking(program: Callable[Concatenate[Any, P], Steps[R]]) -> Callable[..., R]:
    @functools.wraps(program)
    def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        steps = program(self, *args, **kwargs)
        if type(steps) is not Call:
            return run(steps, self.roles)
        try:
            value = steps.find(self.roles)(*steps.args, **steps.kwargs)
        except Exception as exc:
            steps.fail(exc)
        return value if steps.done is None else steps.done(value)

    return method


def _awaitable(
    program: Callable[Concatenate[Any, P], Steps[R]],
) -> Callable[..., Coroutine[Any, Any, R]]:
    @functools.wraps(program)
    async def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        steps = program(self, *args, **kwargs)
        if type(steps) is not Call:
            return await arun(steps, self.roles)
        try:
            value = steps.find(self.roles)(*steps.args, **steps.kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            steps.fail(exc)
        return value if steps.done is None else steps.done(value)

    return method
