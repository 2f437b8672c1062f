"""Write 1 MiB blocks to the results, checkpoint and work folders in turn, up to FILL_MIB (default 512)
each, then sleep: a job that takes all the disk it is given."""
import os
import time

limit = int(os.environ.get("FILL_MIB", "512"))
block = b"\xff" * 2**20
for folder in (os.environ["RESULT_DIR"], os.environ["CHECKPOINT_DIR"], os.getcwd()):
    with open(os.path.join(folder, "fill.bin"), "wb") as f:
        for written in range(limit):
            f.write(block)
    print(f"FILL wrote {limit} MiB to {folder}", flush=True)
time.sleep(300)
