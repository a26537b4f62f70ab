"""Integrations with other frameworks, each importing its framework lazily."""
