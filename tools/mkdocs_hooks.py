"""Reference tables the documentation site takes from the code (MkDocs hooks): a page's
``<!-- options -->`` becomes the table of the kit's options, ``<!-- errors -->`` the tree
of the errors the library raises."""

from __future__ import annotations

from typing import Any, get_type_hints

import griffe

import shardkit.errors
from shardkit.options import DEFAULTS, KitOptions


def options_table() -> str:
    """One row per ``KitOptions`` key: its type, default and docstring."""
    module = griffe.load("shardkit.options")
    members = module["KitOptions"].members
    rows = ["| option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, kind in get_type_hints(KitOptions).items():
        docstring = members[name].docstring
        meaning = " ".join(docstring.value.split()) if docstring else ""
        default = DEFAULTS[name]  # type: ignore[literal-required]
        rows.append(f"| `{name}` | `{kind.__name__}` | `{default!r}` | {meaning} |")
    return "\n".join(rows)


def error_tree(error: type[BaseException] = shardkit.errors.ShardkitError, depth: int = 0) -> str:
    """A nested list of ``error`` and its subclasses in ``shardkit.errors``, each with its
    docstring's first paragraph."""
    summary = " ".join((error.__doc__ or "").strip().split("\n\n")[0].split())
    lines = [f"{'    ' * depth}- `{error.__name__}`: {summary}"]
    for child in sorted(error.__subclasses__(), key=lambda kind: kind.__name__):
        if child.__module__ == "shardkit.errors":
            lines.append(error_tree(child, depth + 1))
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Put the generated tables where a page asks for them."""
    if "<!-- options -->" in markdown:
        markdown = markdown.replace("<!-- options -->", options_table())
    if "<!-- errors -->" in markdown:
        markdown = markdown.replace("<!-- errors -->", error_tree())
    return markdown
