"""Fill a folder as fast as the disk takes it: `python3 disk_fill.py results|checkpoints|work [MiB]`.

Writes files of 8 MiB (so no one file reaches a per-file limit first), printing its progress, and stops
at the given size (default 300 MiB) so that a platform without a cap does not fill the test machine."""
import os
import sys

FOLDERS = {"results": os.environ.get("RESULT_DIR"), "checkpoints": os.environ.get("CHECKPOINT_DIR"), "work": "."}
folder, limit = FOLDERS[sys.argv[1]], int(sys.argv[2]) if len(sys.argv) > 2 else 300
chunk = b"\xff" * 2**20
written = 0
while written < limit:
    with open(os.path.join(folder, f"fill-{written // 8}.bin"), "wb") as f:
        for _ in range(8):
            f.write(chunk)
            written += 1
        f.flush()
        os.fsync(f.fileno())
    print(f"DISKFILL {written} MiB in {sys.argv[1]}", flush=True)
print(f"DISKFILL wrote all {written} MiB", flush=True)
