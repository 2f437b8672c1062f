"""The quiet tenant's job: two lines, nothing else."""
print("first line")
print("second line")
