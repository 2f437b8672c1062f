import os
with open(os.path.join(os.environ["RESULT_DIR"], "secret.txt"), "w") as f:
    f.write("team-b private result\n")
print("victim wrote its result")
