"""``specd`` with the fake engine: the real CLI, server and gateway, so process-level gateway tests do
not depend on the model. Usage: ``python tests/serving/fake_specd.py STEP_DELAY_S [specd serve flags]``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fake_engine import FakeEngine  # noqa: E402

from specd.__main__ import cmd_serve  # noqa: E402

if __name__ == "__main__":
    delay = float(sys.argv[1])
    sys.exit(cmd_serve(sys.argv[2:], engine_factory=lambda cfg: FakeEngine(cfg.max_model_len or 256, delay)))
