"""Command-line entry points (the ``scripts/*.py`` wrappers call their ``main``)."""
