from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from videos.models import Account, Video


@admin.register(Video)
class VideoAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("title", "views", "likes")
    readonly_fields = ("views", "likes")

    def get_queryset(self, request: HttpRequest) -> Any:
        return super().get_queryset(request).with_counts()  # a page's counts at once


admin.site.register(Account)
