from django.contrib import admin
from django.urls import include, path

from videos.views import like, video_detail, video_list

urlpatterns = [
    path("", video_list, name="video-list"),
    path("videos/<int:pk>/", video_detail, name="video-detail"),
    path("videos/<int:pk>/like", like, name="video-like"),
    path("admin/", admin.site.urls),
    # shardkit's dashboard (shardkit/) and Prometheus metrics (shardkit/metrics): put
    # them behind the site's own access control in production.
    path("shardkit/", include("shardkit.contrib.django.urls")),
]
