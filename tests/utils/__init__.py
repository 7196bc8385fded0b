"""Tests of llm.utils."""
