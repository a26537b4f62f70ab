"""The README's Django usage, after ``manage.py migrate``: counting updates through the
ORM. Prints the counts (JSON)."""

import json
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
django.setup()

from django.db.models import F  # noqa: E402  (after django.setup())

from videos.models import Video  # noqa: E402

video = Video.objects.create(title="README")
pk = video.pk
for _ in range(3):
    Video.objects.filter(pk=pk).update(views=F("views") + 1)
video.views.incr()
video.views.decr(2)
Video.objects.filter(pk=pk).update(likes=F("likes") + 4, title="counted")
page = [(video.title, int(video.views)) for video in Video.objects.with_counts("views")[:50]]
print(
    json.dumps(
        {
            "views": Video.objects.get(pk=pk).views.value(fresh=True),
            "likes": video.likes.value(),
            "page": page,
        }
    )
)
