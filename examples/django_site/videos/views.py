from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from videos.models import Video


def video_list(request: HttpRequest) -> HttpResponse:
    videos = Video.objects.with_counts().order_by("title")[:50]
    return render(request, "videos/video_list.html", {"videos": videos})
