"""The example site as ``benchmarks/django_site.py`` serves it: its settings and URLs."""
