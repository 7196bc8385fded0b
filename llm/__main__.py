"""``python -m llm COMMAND ...``: the ``llm`` command (:mod:`llm.cli.main`)."""

from llm.cli.main import launch

launch()
