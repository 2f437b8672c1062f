"""Print 60 KB lines as fast as the pipe takes them, for FLOOD_SECONDS (default 30)."""
import os
import sys
import time

line = "x" * 60_000 + "\n"
deadline = time.monotonic() + float(os.environ.get("FLOOD_SECONDS", "30"))
while time.monotonic() < deadline:
    sys.stdout.write(line)
