"""Reading the learner's output: lines, endings, bad bytes, and lines too long to keep."""
import io

from learner_agent.learner import TRUNCATED_MARK, iter_lines


def lines(data, **kwargs):
    return list(iter_lines(io.BufferedReader(io.BytesIO(data)), **kwargs))


def test_it_splits_lines_and_strips_their_endings():
    assert lines(b"a\nb\r\n\nlast without newline") == ["a", "b", "", "last without newline"]


def test_it_replaces_bytes_that_are_not_utf8():
    assert lines(b"caf\xc3\xa9 \xff\n") == ["caf\u00e9 \ufffd"]


def test_it_truncates_long_lines_and_keeps_the_next_one():
    assert lines(b"a\n" + b"x" * 70_000 + b"\nb\n", max_bytes=64 * 1024) == [
        "a", "x" * 64 * 1024 + TRUNCATED_MARK, "b"]


def test_it_keeps_a_line_of_exactly_the_limit():
    assert lines(b"x" * 10 + b"\n" + b"y" * 11, max_bytes=10) == ["x" * 10, "y" * 10 + TRUNCATED_MARK]
