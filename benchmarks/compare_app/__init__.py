"""The Django app of ``compare_driver.py``'s ``django`` path: one model with a count, made
with ``migrate --run-syncdb`` (no migrations, so that every revision makes it the same)."""

SHARDS = 32
"""The shards of every sharded counter the comparison writes (the Django count's too)."""
