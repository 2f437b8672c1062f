"""A result of very many empty files: MANY_FILES of them (default 3,000), a thousand per folder."""
import os

results = os.environ["RESULT_DIR"]
count = int(os.environ.get("MANY_FILES", "3000"))
for i in range(count):
    folder = os.path.join(results, f"d{i // 1000:03d}")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"f{i:06d}"), "wb").close()
print(f"MANY wrote {count} files", flush=True)
