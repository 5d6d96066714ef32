"""Training data for the predictor: text files -> tokens -> fixed-length chunks -> a seeded, resumable stream.

  paths = expand_paths(["books/*.txt"])           # globs expanded; a pattern matching nothing is an error
  ids = tokenize_files(tokenizer, paths)         # i32[N]: every file's tokens, EOS between files
  chunks = pack_chunks(ids, seq_len, prefix)     # i32[S, seq_len]: non-overlapping windows, each prefix + body
  stream = ChunkStream(chunks, batch_size, seed)
  stream.batch(step)                             # i32[batch_size, seq_len], a pure function of (seed, step)

The stream is a pure function of its position: sample i (= step * batch_size + row) is chunk
`perm_e[i mod S]` of epoch e = i // S, where perm_e is a permutation drawn from `default_rng([seed, e])`. A run
that resumes at step s therefore reads exactly the batches an uninterrupted run would have read from step s on;
the checkpoint stores the position and `ChunkStream.fingerprint()` (a digest of the chunks) to refuse resuming
on other data.
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Sequence

import numpy as np


class DataError(ValueError):
    """Training data that is missing, empty or too short (names the file or the sizes)."""


def expand_paths(patterns: Sequence[str]) -> list[str]:
    """Expands glob patterns (`**` matches any depth of folders) and plain paths into a sorted list of files,
    each file once (by its real path: a file reached through a link is read once). An existing file is taken as
    it is, even when its name holds glob characters ('notes[1].txt').

    Raises:
      DataError: no pattern given, a folder, or a path that is not a regular file (a device or pipe).
      FileNotFoundError: a plain path that does not exist, or a pattern that matches no file.
    """
    if not patterns:
        raise DataError("no training data given: expected one or more text files (--data FILE...)")
    out: list[str] = []
    for pattern in patterns:
        if os.path.isfile(pattern):
            out.append(pattern)
        elif glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"--data pattern {pattern!r} matches no file")
            out += found
        elif os.path.isdir(pattern):
            raise DataError(f"--data {pattern!r} is a folder: expected text files (a glob such as "
                            f"'{os.path.join(pattern, '*.txt')}' works)")
        elif os.path.exists(pattern):
            raise DataError(f"--data {pattern!r} is not a regular file (a device, pipe or socket): expected text "
                            "files")
        else:
            raise FileNotFoundError(f"training data file {pattern!r} does not exist")
    return sorted(dict.fromkeys(os.path.realpath(p) for p in out))


def read_text(path: str) -> str:
    """A UTF-8 text file's content; DataError when it cannot be read (no permission, a folder), holds no text, or
    binary data (`eval.ppl.not_text`); FileNotFoundError when it is gone."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"training data file {path!r} is not UTF-8 text: {e}") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"training data file {path!r} does not exist") from None
    except OSError as e:
        raise DataError(f"training data file {path!r} cannot be read ({e.strerror or e}): expected a readable UTF-8 "
                        "text file") from None
    if not text.strip():
        raise DataError(f"training data file {path!r} is empty: expected UTF-8 text")
    from eval.ppl import not_text

    if (why := not_text(text)) is not None:
        raise DataError(f"training data file {path!r} {why}: expected UTF-8 text")
    return text


def tokenize_files(tokenizer, paths: Sequence[str], separator: int | None = None) -> np.ndarray:
    """i32[N]: the files' tokens in order, `separator` (e.g. EOS) between files when given; each file encoded
    whole, as the model meets text (`eval.ppl.tokenize_corpus`; until 2026-12-04 paragraph by paragraph with
    "\n\n" added back, which changed the tokens of every paragraph break)."""
    from eval.ppl import tokenize_corpus

    if not paths:
        raise DataError("no training data files given")
    ids: list[int] = []
    for i, path in enumerate(paths):
        file_ids = tokenize_corpus(tokenizer, read_text(path)).tolist()
        if not file_ids:
            raise DataError(f"training data file {path!r} produced no tokens")
        if i and separator is not None:
            ids.append(int(separator))
        ids += file_ids
    return np.asarray(ids, np.int32)


def pack_chunks(ids: np.ndarray, seq_len: int, prefix: Sequence[int] = (), source: str = "the training data"
                ) -> np.ndarray:
    """i32[S, seq_len]: consecutive non-overlapping windows of `ids`, each `prefix` (e.g. BOS) + body tokens.

    Args:
      source: what the tokens are, for the error when there are too few (`describe_files`: the files' paths).
    Raises:
      DataError: seq_len too small for the prefix, or fewer tokens than one chunk needs.
    """
    prefix = np.asarray(list(prefix), np.int32)
    body = seq_len - len(prefix)
    if body < 2:
        raise DataError(f"seq_len={seq_len}: expected at least {len(prefix) + 2} tokens per chunk")
    n = len(ids) // body
    if n == 0:
        raise DataError(f"{source} has {len(ids)} tokens, fewer than the {body} one chunk of "
                        f"seq_len={seq_len} needs: give more text or a shorter --seq-len")
    rows = np.asarray(ids[: n * body], np.int32).reshape(n, body)
    if len(prefix):
        rows = np.concatenate([np.broadcast_to(prefix, (n, len(prefix))), rows], axis=1)
    return np.ascontiguousarray(rows, np.int32)


def describe_files(paths: Sequence[str], shown: int = 3) -> str:
    """The training data as errors name it: its file's path, or the first `shown` paths and how many more."""
    if len(paths) == 1:
        return f"training data file {paths[0]!r}"
    listed = ", ".join(repr(p) for p in paths[:shown])
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return f"the training data ({len(paths)} files: {listed}{more})"


class ChunkStream:
    """Seeded batches of chunks, an epoch-wise shuffle, addressable by step (see the module docstring)."""

    def __init__(self, chunks: np.ndarray, batch_size: int, seed: int = 0):
        chunks = np.asarray(chunks, np.int32)
        if chunks.ndim != 2 or chunks.shape[0] < 1:
            raise DataError(f"chunks must be i32[S >= 1, T], got shape {chunks.shape}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size={batch_size!r}: expected a positive integer")
        self.chunks = chunks
        self.batch_size = batch_size
        self.seed = int(seed)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_chunks(self) -> int:
        return self.chunks.shape[0]

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_chunks)
        return self._perms[epoch]

    def sample_ids(self, step: int) -> np.ndarray:
        """i64[batch_size]: the chunk index of every row of batch `step`."""
        i = step * self.batch_size + np.arange(self.batch_size)
        epochs, offsets = np.divmod(i, self.num_chunks)
        return np.array([self._perm(int(e))[o] for e, o in zip(epochs, offsets)], np.int64)

    def batch(self, step: int) -> np.ndarray:
        """i32[batch_size, T]: the chunks of batch `step` (step >= 0)."""
        if step < 0:
            raise ValueError(f"step={step}: expected >= 0")
        return self.chunks[self.sample_ids(step)]

    def position(self, step: int) -> int:
        """Samples consumed before batch `step`."""
        return step * self.batch_size

    def fingerprint(self) -> str:
        """A digest of the chunks (shape and tokens): resuming on other data is refused."""
        h = hashlib.sha256(str(self.chunks.shape).encode())
        h.update(self.chunks.tobytes())
        return h.hexdigest()[:16]
