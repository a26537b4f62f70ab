"""No models: shardkit's tables are the store's own (see ``schema``). This module makes
Django send the app ``post_migrate``, which it sends only to apps with a models module."""
