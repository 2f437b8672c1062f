"""Fill /tmp (a tmpfs: memory) far beyond the job's memory limit, stopping at 4x it so a sandbox that
does not count it cannot take the machine's RAM."""
import os

limit = int(os.environ.get("FILL_MIB", "1024"))
written = 0
with open("/tmp/fill", "wb") as f:
    while written < limit:
        f.write(b"\xff" * 2**20)
        f.flush()
        written += 1
        if written % 64 == 0:
            print(f"TMPFILL {written} MiB in /tmp", flush=True)
print(f"TMPFILL wrote all {written} MiB", flush=True)
