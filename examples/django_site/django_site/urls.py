from django.contrib import admin
from django.urls import path

from videos.views import like, video_detail, video_list

urlpatterns = [
    path("", video_list, name="video-list"),
    path("videos/<int:pk>/", video_detail, name="video-detail"),
    path("videos/<int:pk>/like", like, name="video-like"),
    path("admin/", admin.site.urls),
]
