"""Tests of llm.train."""
