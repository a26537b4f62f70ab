"""The admin's page of counters: every counter of the store with its kind, shards and
value; the action "Delete selected counters" (Django's own, with its confirmation page)
and "Reset selected counters to 0" (with one of its own) carried out by the kit
(``Kit.delete``, ``Kit.reset``), so a delete is whole and reaches every process."""

from __future__ import annotations

import contextlib
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from shardkit.errors import CounterNotFound, ShardkitError

from .conf import database, kit
from .models import Counter


@admin.register(Counter)
class CounterAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "kind", "shards", "value")
    list_filter = ("kind",)
    search_fields = ("name",)
    actions = ("reset_selected",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Counter]:
        counters: QuerySet[Counter] = super().get_queryset(request).using(database())
        return counters

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="value")
    def value(self, counter: Counter) -> int:
        """The counter's value: a buffered one's stored and pending parts, a monotonic
        one's cached value, an id allocator's mark."""
        the_kit = kit()
        if counter.kind == "buffered":
            return the_kit.parts([counter.name])[counter.name].total
        if counter.kind == "monotonic":
            return the_kit.monotonic(counter.name).value()
        return the_kit.values([counter.name])[counter.name]

    def delete_model(self, request: HttpRequest, obj: Counter) -> None:
        kit().delete(obj.name)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Counter]) -> None:
        for counter in queryset:
            with contextlib.suppress(CounterNotFound):  # deleted meanwhile
                kit().delete(counter.name)

    @admin.action(description="Reset selected counters to 0", permissions=["delete"])
    def reset_selected(
        self, request: HttpRequest, queryset: QuerySet[Counter]
    ) -> TemplateResponse | None:
        """Ask on a page of its own; once confirmed, reset each selected counter (an id
        allocator is left as it is, and said so: it is never reset)."""
        counters = list(queryset)
        if request.POST.get("post") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Reset counters",
                "counters": counters,
                "opts": self.model._meta,
                "action": "reset_selected",
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            }
            template = "admin/shardkit/counter/reset_selected_confirmation.html"
            return TemplateResponse(request, template, context)
        done = 0
        for counter in counters:
            try:
                kit().reset(counter.name)
                done += 1
            except CounterNotFound:
                pass  # deleted meanwhile
            except ShardkitError as exc:
                self.message_user(request, f"Not reset: {exc}", messages.ERROR)
        self.message_user(request, f"Reset {done} counter{'s' * (done != 1)}.", messages.SUCCESS)
        return None
