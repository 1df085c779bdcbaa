"""The TieredPrefixCache API as data: the pydantic types of each version (v1alpha1/) and
the field grammars they share (rules, quantities, cron schedules, durations).

This layer imports nothing else of kvtier (an import-linter contract in pyproject.toml
holds it to that): checks that need an engine's knowledge live in validation/.
"""
