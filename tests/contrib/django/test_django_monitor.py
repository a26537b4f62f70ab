"""The dashboard and the metrics in the example site (``shardkit/`` from
``shardkit.contrib.django.urls``), through Django's test client: the counts that views
move show in the dashboard's API and in ``/shardkit/metrics``; actions need the token."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import F
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

import shardkit.metrics
from videos.models import Video

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")
TOKEN = "a-token-long-enough"


def test_the_dashboard_shows_the_sites_counts(database: str, client: Client) -> None:
    video = Video.objects.create(title="monitored")
    Video.objects.filter(pk=video.pk).update(views=F("views") + 4)
    name = f"videos.video.views:{video.pk}"
    page = client.get("/shardkit/")
    assert page.status_code == 200
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    found = client.get("/shardkit/api/counters", {"prefix": name}).json()["counters"]
    assert [(c["name"], c["kind"], c["value"]) for c in found] == [(name, "sharded", 4)]
    assert client.get("/shardkit/api/counters", {"limit": "x"}).status_code == 400
    assert client.get("/shardkit/api/jobs").json() == {"jobs": []}
    assert client.get("/shardkit/api/jobs/nope").status_code == 404


def test_the_sites_metrics_list_the_configured_counters(
    database: str, client: Client, settings: Any
) -> None:
    video = Video.objects.create(title="measured")
    name = f"videos.video.views:{video.pk}"
    settings.SHARDKIT = {**settings.SHARDKIT, "METRICS_COUNTERS": [name]}
    shardkit.metrics.enable()  # as opening a kit does
    Video.objects.filter(pk=video.pk).update(views=F("views") + 2)
    video.views.incr(3)
    answer = client.get("/shardkit/metrics")
    assert answer.status_code == 200
    assert answer.headers["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.content.decode())
        for sample in family.samples
    }
    assert samples[("shardkit_value", (("counter", name), ("kind", "sharded")))] == 5
    assert samples[("shardkit_monitor_read_ok", ())] == 1
    assert (
        samples[("shardkit_write_seconds_count", (("kind", "sharded"), ("outcome", "applied")))]
        >= 1
    )


def test_actions_need_the_configured_token(database: str, client: Client, settings: Any) -> None:
    url = "/shardkit/api/jobs/some-job/cancel"
    refused = client.post(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert refused.status_code == 403  # read-only: no token configured
    settings.SHARDKIT = {**settings.SHARDKIT, "DASHBOARD_TOKEN": TOKEN}
    assert client.post(url).status_code == 401
    assert client.get(url).status_code == 405
    # Authorised (no CSRF token needed: the header is the credential); no such job.
    assert client.post(url, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
