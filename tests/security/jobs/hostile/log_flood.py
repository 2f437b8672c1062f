"""Print `lines` lines of `size` bytes as fast as the pipe takes them: `python3 log_flood.py LINES SIZE`."""
import sys

lines, size = int(sys.argv[1]), int(sys.argv[2])
for i in range(lines):
    print(f"FLOOD {i:08d} " + "x" * max(0, size - 15), flush=False)
print("FLOOD done", flush=True)
