"""The admin's page of counters, as a staff user uses it: every counter with its kind and
value; "Reset selected counters to 0" asks, then resets each through the kit (an id
allocator refused, and said so); Django's "Delete selected" deletes through the kit."""

from __future__ import annotations

import html
import uuid
from typing import Any

import pytest

from backends import NEVER
from shardkit.contrib.django import kit
from shardkit.store.base import CounterInfo

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

URL = "/admin/shardkit/counter/"


def info(name: str) -> CounterInfo | None:
    return kit().store.counter(name)


def test_the_admin_lists_resets_and_deletes_counters(database: str, admin_client: Any) -> None:
    stem = f"admin-{uuid.uuid4().hex[:8]}"
    votes, hits, sequence, order = (f"{stem}:{kind}" for kind in ("votes", "hits", "seq", "ids"))
    the_kit = kit()
    the_kit.sharded(votes).incr(5)
    the_kit.buffered(hits, interval=NEVER).incr(3)
    the_kit.monotonic(sequence).incr(9)
    the_kit.ids(order, block=10).take(2)
    page = admin_client.get(URL, {"q": stem})
    assert page.status_code == 200
    shown = html.unescape(page.content.decode())
    for name, kind, value in ((votes, "sharded", 5), (hits, "buffered", 3)):
        assert name in shown
        assert f'<td class="field-kind">{kind}</td>' in shown
        assert f'<td class="field-value">{value}</td>' in shown
    assert '<td class="field-value">9</td>' in shown  # the monotonic counter
    assert '<td class="field-value">10</td>' in shown  # the allocator's mark
    assert "Reset selected counters to 0" in shown

    selected = [votes, hits, sequence, order]
    before = {name: info(name) for name in selected}
    asked = admin_client.post(URL, {"action": "reset_selected", "_selected_action": selected})
    assert asked.status_code == 200
    assert "Reset these counters to 0?" in asked.content.decode()
    assert {name: info(name) for name in selected} == before  # nothing yet
    done = admin_client.post(
        URL,
        {"action": "reset_selected", "_selected_action": selected, "post": "yes"},
        follow=True,
    )
    told = html.unescape(done.content.decode())
    assert "Reset 3 counters." in told
    assert f"Not reset: '{order}' is an id allocator: a reset would hand its ids out" in told
    assert the_kit.values([votes], fresh=True) == {votes: 0}
    assert the_kit.parts([hits])[hits].total == 0
    assert the_kit.monotonic(sequence).incr() == 1
    for name in (votes, hits, sequence):
        now, was = info(name), before[name]
        assert now is not None
        assert was is not None
        assert (now.kind, now.shards) == (was.kind, was.shards)
        assert now.incarnation != was.incarnation
    assert info(order) == before[order]

    confirm = admin_client.post(URL, {"action": "delete_selected", "_selected_action": [votes]})
    assert "Are you sure" in confirm.content.decode()
    assert info(votes) is not None
    admin_client.post(
        URL, {"action": "delete_selected", "_selected_action": [votes, order], "post": "yes"}
    )
    assert (info(votes), info(order)) == (None, None)
    assert the_kit.ids(order, block=10).next() == 11  # above every id it handed out
    assert info(hits) is not None


def test_counters_are_read_only_in_the_admin(database: str, admin_client: Any) -> None:
    name = f"admin-{uuid.uuid4().hex[:8]}"
    kit().sharded(name).incr()
    assert admin_client.get(f"{URL}add/").status_code == 403
    page = admin_client.get(f"{URL}{name}/change/")
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()  # a view, no form to save
