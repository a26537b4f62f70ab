"""The runners of programs (``shardkit._program``), on their own: ``run`` and ``arun``
send each call's result back in, throw a failing call's exception in at the call, and,
when a call is interrupted (a ``KeyboardInterrupt``, a cancelled task), close the
program (it sees ``GeneratorExit``, and its ``finally`` blocks run) and pass the
interruption on."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import mypy.api
import pytest

from shardkit._program import (
    Awaiting,
    Blocking,
    Call,
    Program,
    Roles,
    arun,
    call,
    playing,
    role,
    rule,
    run,
)


@role("backend")
class Backend:
    """A role's backend: answers ``double``, fails ``fail``, and records what it was
    asked, in order."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, Any]] = []

    def double(self, n: int) -> int:
        self.asked.append(("double", n))
        return 2 * n

    def fail(self, error: BaseException) -> None:
        self.asked.append(("fail", type(error).__name__))
        raise error


class SlowBackend(Backend):
    """The async form: ``double`` awaits ``gate`` first; ``fail`` answers at once (a
    backend may return a plain value under ``arun``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def double(self, n: int) -> int:  # type: ignore[override]
        self.waiting.set()
        await self.gate.wait()
        return super().double(n)


@dataclasses.dataclass(frozen=True, slots=True)
class Playing(Roles):
    backend: Backend


class Trace:
    """What a program did: the values it got, the errors it caught, its ``finally``."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.caught: list[BaseException] = []
        self.finished = False


def doubling(trace: Trace, n: int) -> Program[int]:
    try:
        first = yield from call(Backend.double, n)
        trace.got.append(first)
        second = yield from call(Backend.double, first)
        trace.got.append(second)
        return second
    finally:
        trace.finished = True


def falling_back(trace: Trace, error: Exception) -> Program[str]:
    """Catches the failing call's exception and goes on with another call."""
    try:
        yield from call(Backend.fail, error)
    except Exception as exc:
        trace.caught.append(exc)
    value = yield from call(Backend.double, 21)
    trace.got.append(value)
    return "fell back"


def guarded(trace: Trace, first: Call[Any]) -> Program[None]:
    """Makes ``first``; what the program sees of an interruption is recorded: a closed
    program sees ``GeneratorExit``, not the interruption itself."""
    try:
        yield from first
    except Exception as exc:  # pragma: no cover - reached only if the runner is wrong
        trace.caught.append(exc)
        yield from call(Backend.double, 0)
    except BaseException as exc:
        trace.caught.append(exc)
        raise
    finally:
        trace.finished = True


RUNNERS = ["run", "arun"]


def carry_out(runner: str, program: Program[Any], backend: Backend) -> Any:
    if runner == "run":
        return run(program, Playing(backend))
    return asyncio.run(arun(program, Playing(backend)))


@pytest.mark.parametrize("runner", RUNNERS)
def test_each_result_is_sent_back_in_and_the_return_value_is_the_result(runner: str) -> None:
    trace, backend = Trace(), Backend()
    assert carry_out(runner, doubling(trace, 5), backend) == 20
    assert trace.got == [10, 20]
    assert backend.asked == [("double", 5), ("double", 10)]
    assert trace.finished


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_failing_call_is_thrown_in_where_it_was_made(runner: str) -> None:
    trace, backend, error = Trace(), Backend(), LookupError("gone")
    assert carry_out(runner, falling_back(trace, error), backend) == "fell back"
    assert trace.caught == [error]  # the very exception, caught at the call
    assert trace.got == [42]
    assert backend.asked == [("fail", "LookupError"), ("double", 21)]


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_failure_the_program_does_not_catch_reaches_the_caller_after_its_finally(
    runner: str,
) -> None:
    trace, error = Trace(), ValueError("refused")

    def program() -> Program[None]:
        try:
            yield from call(Backend.fail, error)
        finally:
            trace.finished = True

    with pytest.raises(ValueError, match="refused") as raised:
        carry_out(runner, program(), Backend())
    assert raised.value is error
    assert trace.finished


def test_an_interrupted_call_closes_the_program_and_goes_on_to_the_caller() -> None:
    trace, backend = Trace(), Backend()
    with pytest.raises(KeyboardInterrupt):
        run(guarded(trace, call(Backend.fail, KeyboardInterrupt())), Playing(backend))
    assert [type(seen) for seen in trace.caught] == [GeneratorExit]  # closed, not thrown in
    assert trace.finished
    assert backend.asked == [("fail", "KeyboardInterrupt")]  # nothing called after it


def test_a_cancelled_call_closes_the_program_and_the_cancellation_goes_on() -> None:
    trace, backend = Trace(), SlowBackend()

    async def scenario() -> None:
        program = guarded(trace, call(Backend.double, 1))
        task = asyncio.create_task(arun(program, Playing(backend)))
        await backend.waiting.wait()  # the first call is being awaited
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(scenario())
    assert [type(seen) for seen in trace.caught] == [GeneratorExit]  # closed, not thrown in
    assert trace.finished
    assert backend.asked == []  # the awaited call never answered


def test_arun_takes_plain_values_and_awaitables_alike() -> None:
    trace, backend = Trace(), SlowBackend()

    async def scenario() -> str:
        backend.gate.set()
        return await arun(falling_back(trace, KeyError("x")), Playing(backend))

    assert asyncio.run(scenario()) == "fell back"  # fail: plain; double: awaited
    assert trace.got == [42]


class DoublerCore:
    """A core with its rule written once, for both forms."""

    def __init__(self, backend: Backend) -> None:
        self.roles = Playing(backend)

    @rule
    def twice(self, n: int) -> Program[int]:
        """Double ``n`` twice."""
        return doubling(Trace(), n)


class Doubler(DoublerCore, Blocking):
    pass


class AsyncDoubler(DoublerCore, Awaiting):
    pass


def test_blocking_and_awaiting_forms_run_the_one_rule() -> None:
    backend = Backend()
    assert Doubler(backend).twice(3) == 12
    pending: Awaitable[int] = AsyncDoubler(backend).twice(3)
    assert asyncio.run(pending) == 12  # type: ignore[arg-type]
    assert backend.asked == [("double", 3), ("double", 6)] * 2
    assert Doubler.twice.__doc__ == AsyncDoubler.twice.__doc__ == "Double ``n`` twice."
    assert not asyncio.iscoroutinefunction(Doubler.twice)
    assert asyncio.iscoroutinefunction(AsyncDoubler.twice)


def test_a_core_that_is_neither_form_has_no_method_of_its_rule() -> None:
    with pytest.raises(TypeError, match="neither Blocking nor Awaiting"):
        DoublerCore(Backend()).twice  # noqa: B018


def test_roles_refuse_a_backend_that_cannot_play_its_role_when_made() -> None:
    class Halfway:
        def double(self, n: int) -> int:
            return n

    with pytest.raises(TypeError, match="cannot play the role 'backend': it has no fail"):
        Playing(Halfway())  # type: ignore[arg-type]


def test_a_role_played_by_none_is_an_ability_the_backends_lack() -> None:
    """A field that is None is not checked (its programs check before they call it)."""
    assert Playing(None).backend is None  # type: ignore[arg-type]


def test_only_the_methods_of_a_role_can_be_called() -> None:
    with pytest.raises(TypeError, match=r"Trace\.__init__ is not a method of a role"):
        call(Trace.__init__)


def test_playing_declares_an_async_backend_as_its_role_and_checks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``playing`` returns is typed as the role it is given (as mypy reads it), and
    a backend without one of the role's methods, or a class that is no role, is
    refused at once."""
    backend = SlowBackend()
    assert playing(backend, Backend) is backend

    class Halfway:
        async def double(self, n: int) -> int:
            return n

    with pytest.raises(TypeError, match="cannot play the role 'backend': it has no fail"):
        playing(Halfway(), Backend)
    with pytest.raises(TypeError, match="is not a role"):
        playing(backend, Trace)
    source = tmp_path / "played.py"
    source.write_text(
        "from typing import Protocol\n"
        "from shardkit._program import playing, role\n"
        "@role('counting')\n"
        "class Counting(Protocol):\n"
        "    def count(self) -> int: ...\n"
        "reveal_type(playing(object(), Counting))\n"
    )
    # The project's settings and cache (warm once ``mypy`` has checked the package).
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("MYPYPATH", str(root / "src"))
    config, cache = str(root / "pyproject.toml"), str(root / ".mypy_cache")
    out, _, _ = mypy.api.run(["--config-file", config, "--cache-dir", cache, str(source)])
    assert 'Revealed type is "played.Counting"' in out, out


def test_a_role_made_at_run_time_has_its_public_methods_and_call() -> None:
    """``role`` marks the public methods and ``__call__`` (not private ones, nor other
    attributes); programs call them with positional and keyword arguments alike, and a
    ``Roles`` field named as the role, and ``playing``, check a backend for each of
    them."""

    @role("teller")
    class Teller:
        limit = 10  # not a method

        def tell(self, n: int, *, unit: str) -> str:
            return f"{n} {unit}"

        def __call__(self) -> str:
            return "called"

        def _private(self) -> None: ...

    @dataclasses.dataclass(frozen=True, slots=True)
    class Telling(Roles):
        teller: Teller
        other: object  # no role of that name: nothing to check

    made = call(Teller.tell, 3, unit="s")
    assert (made.role, made.name, made.args, made.kwargs) == ("teller", "tell", (3,), {"unit": "s"})
    assert call(Teller.__call__).name == "__call__"
    with pytest.raises(TypeError, match="is not a method of a role"):
        call(Teller._private)

    def telling() -> Program[tuple[str, str]]:
        told = yield from call(Teller.tell, 3, unit="s")
        called = yield from call(Teller.__call__)
        return told, called

    roles = Telling(Teller(), object())
    assert run(telling(), roles) == ("3 s", "called")
    assert asyncio.run(arun(telling(), roles)) == ("3 s", "called")

    class NoCall:
        def tell(self, n: int, *, unit: str) -> str:
            return ""

    class NoTell:
        def __call__(self) -> str:
            return ""

    with pytest.raises(TypeError, match="it has no __call__"):
        Telling(NoCall(), object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="it has no tell"):
        Telling(NoTell(), object())  # type: ignore[arg-type]
    teller = Teller()
    assert playing(teller, Teller) is teller  # an async backend declared as the role
    with pytest.raises(TypeError, match="it has no tell"):
        playing(NoTell(), Teller)


def test_forms_made_at_run_time_hold_every_rule_they_inherit() -> None:
    class Core:
        def __init__(self, backend: Backend) -> None:
            self.roles = Playing(backend)

        @rule
        def once(self, n: int) -> Program[int]:
            """Double ``n``."""
            return (yield from call(Backend.double, n))

        @rule
        def twice(self, n: int) -> Program[int]:
            return doubling(Trace(), n)

    class Tripler(Core):
        @rule
        def twice(self, n: int) -> Program[int]:  # replaced: the form takes this one
            value = yield from call(Backend.double, n)
            return value + n

    class Sync(Tripler, Blocking):
        pass

    class Async(Tripler, Awaiting):
        pass

    assert Tripler.once.program.__name__ == "once"  # the program itself, named as it
    assert Tripler.once.__doc__ == "Double ``n``."
    sync, asynchronous = Sync(Backend()), Async(Backend())
    assert (sync.once(2), sync.twice(2)) == (4, 6)
    assert asyncio.run(asynchronous.once(2)) == 4  # type: ignore[arg-type]
    assert asyncio.run(asynchronous.twice(2)) == 6  # type: ignore[arg-type]
    # Within a form, a program runs on its roles with _carry_out.
    assert sync._carry_out(Core.once.program(sync, 5)) == 10
    assert asyncio.run(asynchronous._carry_out(Core.once.program(asynchronous, 5))) == 10
