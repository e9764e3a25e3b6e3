import sys
from pathlib import Path

# The seed-command extractor is a plain module next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
