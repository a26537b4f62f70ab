"""An executor for tests of what is submitted, not of what runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.executor import Marks


class HeldExecutor:
    """Stands for an executor in other processes: keeps what it is given, runs nothing."""

    url = "held://"

    def __init__(self) -> None:
        self.submitted: list[tuple[str, dict[str, Any]]] = []

    def bind(self, tasks: Mapping[str, Any], marks: Marks) -> None:
        pass

    def submit(
        self,
        task: str,
        args: Mapping[str, Any],
        *,
        delay: float = 0.0,
        dedupe: str | None = None,
        window: float = 60.0,
        merge: str | None = None,
    ) -> bool:
        self.submitted.append((task, dict(args)))
        return True

    def close(self) -> None:
        pass
