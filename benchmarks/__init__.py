"""Benchmarks: scripts that measure the package against its peers, not part of the installed package.

Run each from the checkout's root as ``.venv/bin/python -m benchmarks.NAME --help``.
"""
