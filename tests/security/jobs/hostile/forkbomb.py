"""Start sleeping processes until the machine says no; print how many got started, and the uid they run as."""
import os

started = 0
try:
    while started < 100_000:
        os.posix_spawn("/bin/sleep", ["sleep", "300"], {})
        started += 1
except OSError as e:
    print(f"FORKBOMB stopped after {started} processes: {e.strerror} (uid {os.getuid()})", flush=True)
else:
    print(f"FORKBOMB never stopped: {started} processes", flush=True)
