"""A Griffe extension for the API reference: a core's rules (``@rule`` programs, typed
``-> Program[X]``) are shown on the sync and async forms as those forms' methods are
called — returning ``X`` (awaited, on an async form), with a generic core's type
parameters replaced by the form's own (``Kit.sharded`` returns a ``ShardedCounter``)."""

from __future__ import annotations

import copy
from typing import Any

import griffe

_FORMS = {"Blocking": False, "Awaiting": True}  # a form's base, and whether it awaits


def _is_rule(function: griffe.Function) -> bool:
    return any(str(decorator.value) == "rule" for decorator in function.decorators)


def _called(returns: Any, names: dict[str, str]) -> str | None:
    """``Program[X]`` as the form returns it: ``X``, its type parameters replaced."""
    if not isinstance(returns, griffe.ExprSubscript) or str(returns.left) != "Program":
        return None
    shown = str(returns.slice)
    for parameter, argument in names.items():
        shown = shown.replace(parameter, argument)
    return shown


def _elements(expression: Any) -> list[Any]:
    """The elements of a subscript's slice: ``A, B`` or ``A``."""
    return expression.elements if isinstance(expression, griffe.ExprTuple) else [expression]


def _parameters(cls: griffe.Class) -> dict[str, str]:
    """The type parameters of the generic classes ``cls`` subscripts, and its arguments."""
    names: dict[str, str] = {}
    for base in cls.bases:
        if not isinstance(base, griffe.ExprSubscript):
            continue
        try:
            generic = cls.modules_collection[base.left.canonical_path]
        except (KeyError, AttributeError):
            continue
        arguments = _elements(base.slice)
        for own in generic.bases:
            if isinstance(own, griffe.ExprSubscript) and str(own.left) == "Generic":
                pairs = zip(_elements(own.slice), arguments, strict=True)
                names.update({str(parameter): str(argument) for parameter, argument in pairs})
    return names


def _classes(module: griffe.Module) -> list[griffe.Class]:
    """The classes defined in ``module`` and its submodules, each once. An alias (a
    re-export) is never followed: modules that re-export each other would have the walk
    go round them for ever (``tests/docs/test_griffe_rules.py``)."""
    found = []
    for member in module.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Module):
            found += _classes(member)
        elif isinstance(member, griffe.Class):
            found.append(member)
    return found


class RulesAsCalled(griffe.Extension):
    """Give each sync or async form its rules as methods returning what a call returns."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            try:
                awaits = [_FORMS[base.name] for base in cls.mro() if base.name in _FORMS]
            except ValueError:  # a base outside the package
                continue
            if not awaits:
                continue
            names = _parameters(cls)
            for name, member in list(cls.all_members.items()):
                target = member.final_target if member.is_alias else member
                if not isinstance(target, griffe.Function) or not _is_rule(target):
                    continue
                returns = _called(target.returns, names)
                if returns is None:
                    continue
                method = copy.copy(target)
                method.returns = returns
                method.labels = {*target.labels, "async"} if awaits[0] else set(target.labels)
                method.parent = cls
                cls.set_member(name, method)
