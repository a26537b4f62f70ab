"""``path("shardkit/", include("shardkit.contrib.django.urls"))``: the dashboard and the
metrics (see ``views``)."""

from django.urls import path

from . import views

app_name = "shardkit"
urlpatterns = [
    path("", views.page, name="dashboard"),
    path("api/info", views.info, name="info"),
    path("api/counters", views.counters, name="counters"),
    path("api/jobs", views.jobs, name="jobs"),
    path("api/jobs/<str:job>", views.job, name="job"),
    path("api/jobs/<str:job>/<str:action>", views.act, name="act"),
    path("metrics", views.metrics, name="metrics"),
]
