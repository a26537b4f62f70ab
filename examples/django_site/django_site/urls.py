from django.contrib import admin
from django.urls import path

from videos.views import video_list

urlpatterns = [
    path("", video_list, name="video-list"),
    path("admin/", admin.site.urls),
]
