import gc

import pytest

from llm.utils.memory import collector_paused


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_in_the_block_and_as_it_was_after(enabled):
    """Paused inside (as a context manager and as a decorator), and left as it was after, an
    exception included."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled

        @collector_paused()
        def fails():
            assert not gc.isenabled()
            raise ValueError("inside")

        for _ in range(2):  # a decorator pauses at each call
            with pytest.raises(ValueError, match="inside"):
                fails()
            assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
