"""Removing a folder tree a learner wrote, however deep.

A learner can nest its folders as deep as it likes (`mkdir d; cd d`, thousands of times). Python
3.11's shutil.rmtree recurses once per level (a RecursionError past about a thousand, which
ignore_errors does not catch), and past PATH_MAX a path no longer reaches what lies below. GNU rm
walks by descriptor and removes any depth, never following a link and staying on one filesystem.

Stdlib only: the agent imports this (and the local backend, for an agent killed first).
"""
import os
import subprocess


def remove(path):
    """Remove `path` and everything under it (a link: only the link). Returns whether it is gone;
    what could not be removed stays for a later try."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return not os.path.lexists(path)
