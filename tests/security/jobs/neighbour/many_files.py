"""A result of MANY_FILES (default 200,000) empty files."""
import os

results = os.environ["RESULT_DIR"]
count = int(os.environ.get("MANY_FILES", "200000"))
for i in range(count):
    folder = os.path.join(results, f"d{i // 1000:04d}")
    if i % 1000 == 0:
        os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"f{i:06d}"), "wb").close()
print(f"MANY wrote {count} files", flush=True)
