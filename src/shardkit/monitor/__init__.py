"""Watching shardkit at work: a live web dashboard of counters and mapping jobs
(``shardkit[dashboard]``) and the Prometheus exposition of its metrics
(``shardkit[metrics]``).

* ``Monitor`` — the dashboard's reads and actions, framework-free;
* ``shardkit.monitor.asgi.dashboard(kit)`` — the dashboard as an ASGI app;
* ``shardkit.monitor.exporter`` — ``registry(kit)``, ``serve(kit, port)``;
* ``shardkit.contrib.django.urls`` — both, in a Django project.
"""

from shardkit.monitor.report import CounterView, Monitor, counter_views

__all__ = ["CounterView", "Monitor", "counter_views"]
