"""What the repository ships: the packages the wheel installs, for the tests that check rules over
all of their modules."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("portal", "tenants", "jobs", "notifications", "gpu_scheduler", "learner_agent", "trainyard")
