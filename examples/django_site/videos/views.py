from django.db.models import F
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from videos.models import Video


def video_list(request: HttpRequest) -> HttpResponse:
    videos = Video.objects.with_counts().order_by("title")[:50]
    return render(request, "videos/video_list.html", {"videos": videos})


def video_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A video's page, which counts its views: one statement on a sharded count."""
    if not Video.objects.filter(pk=pk).update(views=F("views") + 1):
        return get_object_or_404(Video, pk=pk)  # raises Http404
    video = Video.objects.with_counts().get(pk=pk)
    return render(request, "videos/video_detail.html", {"video": video})


@require_POST
def like(request: HttpRequest, pk: int) -> HttpResponse:
    """Like a video: a buffered count, taken by the cache when the request commits."""
    get_object_or_404(Video, pk=pk).likes.incr()
    return redirect("video-detail", pk=pk)
