import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch: no Dynamo cache, no graphs from earlier tests."""
    import megacompile.capture

    torch._dynamo.reset()
    megacompile.capture.COMPILED.clear()
    yield
    torch._dynamo.reset()
    megacompile.capture.COMPILED.clear()
