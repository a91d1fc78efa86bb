import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from megacompile.capture.records import recording  # noqa: E402  (after the path entry above)

# Every graph megatrain compiles during the running test, oldest first (tests read it with
# ``from conftest import COMPILED``).
COMPILED: list = []


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch: no Dynamo cache, no graphs from earlier tests."""
    torch._dynamo.reset()
    COMPILED.clear()
    with recording(into=COMPILED):
        yield
    torch._dynamo.reset()
    COMPILED.clear()
