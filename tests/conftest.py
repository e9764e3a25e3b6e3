import sys
from pathlib import Path

import pytest

# The seed-command extractor is a plain module next to the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama and its tokenizer saved as a model directory (the driver checks for config.json)."""
    from rlhf_core.testing.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_model"))
