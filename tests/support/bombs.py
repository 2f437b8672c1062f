"""Inputs that expand far beyond their size, shared by the unit and security tests: a tar bomb for the
agent's unpacking, an alias bomb for the manifest parser. Standard library only, as the agent's tests."""
import tarfile


class Zeros:
    """A readable stream of `size` zero bytes, never held whole in memory."""

    def __init__(self, size):
        self.left = size

    def read(self, size=-1):
        size = self.left if size is None or size < 0 else min(size, self.left)
        self.left -= size
        return bytes(size)


def tar_bomb(path, sizes):
    """A .tar.gz of members of zeros, one per size: about a thousandth of what it unpacks to."""
    with tarfile.open(path, "w:gz", compresslevel=9) as tf:
        for i, size in enumerate(sizes):
            info = tarfile.TarInfo(f"zeros-{i}.bin")
            info.size = size
            tf.addfile(info, Zeros(size))
    return str(path)



def billion_laughs(levels=9):
    lines = ['lol0: &lol0 "lol"']
    for level in range(1, levels + 1):
        lines.append(f"lol{level}: &lol{level} [" + ", ".join([f"*lol{level - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"
