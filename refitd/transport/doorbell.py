"""Doorbells: how a destination learns that a sender's one-sided writes into it landed.

A doorbell is a small array of 64-bit words in memory the destination polls (a shared-memory
page for the mapped path, refitd.transfer.mapped_path; registered memory for a remote path). Word layout: magic,
generation, entries, reserved, then one word per message the destination receives on a
one-sided path. A sender rings a message's word after each chunk's writes completed (on a
GPU after its stream synchronised) with `value(attempt, chunks)`: the attempt id and the
count of the message's chunks written so far, in one aligned 64-bit store, so a reader never
sees the count of one attempt with the id of another. The destination waits for the count
it needs (with backoff, bounded by the transfer deadline, at once interrupted by an abort).

The generation is a random number written at creation and shown in the descriptor the
senders fetch; a doorbell retired (its plan unloaded or replaced) reads generation 0, so a
sender holding a stale descriptor finds out before it writes.
"""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np

from refitd.transport.errors import TransportError

MAGIC = 0x52464442454C4C31  # "RFDBELL1"
HEADER_WORDS = 4
COUNT_BITS = 20  # chunks of one message: at most 2^20 - 1
ATTEMPT_BITS = 43  # attempt ids are refit_id | attempt << 40: kept modulo 2^43
_COUNT_MASK = (1 << COUNT_BITS) - 1
_ATTEMPT_MASK = (1 << ATTEMPT_BITS) - 1
RETIRED = 0


def value(attempt: int, chunks: int) -> int:
    """The word a sender writes once `chunks` chunks of a message of `attempt` landed."""
    if not 0 < chunks <= _COUNT_MASK:
        raise TransportError(f"a message of {chunks} chunks does not fit a doorbell word")
    return ((attempt & _ATTEMPT_MASK) << COUNT_BITS) | chunks


def new_generation() -> int:
    return secrets.randbits(62) | 1  # never RETIRED


class Doorbell:
    """The words of one doorbell (an int64 view of memory this process can read)."""

    def __init__(self, words: np.ndarray) -> None:
        if words.dtype != np.int64 or words.size < HEADER_WORDS:
            raise TransportError("a doorbell needs at least its header of int64 words")
        self.words = words

    @staticmethod
    def nbytes(entries: int) -> int:
        return 8 * (HEADER_WORDS + entries)

    def init(self, generation: int, entries: int) -> None:
        self.words[HEADER_WORDS : HEADER_WORDS + entries] = 0
        self.words[2] = entries
        self.words[1] = generation
        self.words[0] = MAGIC

    @property
    def generation(self) -> int:
        return int(self.words[1]) if int(self.words[0]) == MAGIC else RETIRED

    @property
    def entries(self) -> int:
        return int(self.words[2])

    def retire(self) -> None:
        self.words[1] = RETIRED

    def ring(self, entry: int, attempt: int, chunks: int) -> None:
        """Chunks [0, chunks) of the message of `entry` landed (the caller's writes are
        complete and visible: CPU stores are ordered, GPU streams synchronised)."""
        self.words[HEADER_WORDS + entry] = value(attempt, chunks)

    def shows(self, entry: int, attempt: int, chunks: int) -> bool:
        """Whether the message of `entry` has `chunks` chunks of `attempt` written (no wait)."""
        floor = value(attempt, chunks) & ~_COUNT_MASK
        return _shows(int(self.words[HEADER_WORDS + entry]), floor, chunks)

    def wait(
        self,
        entry: int,
        attempt: int,
        chunks: int,
        deadline: float,
        abort: threading.Event,
        what: str,
    ) -> None:
        """Block until the message of `entry` has `chunks` chunks of `attempt` written;
        TransportError at the deadline or on abort (naming `what`)."""
        floor = value(attempt, chunks) & ~_COUNT_MASK  # this attempt's id, no count
        word = HEADER_WORDS + entry
        sleep = 0.0
        spins = 0
        while True:
            got = int(self.words[word])
            if _shows(got, floor, chunks):
                return
            if abort.is_set():
                raise TransportError(f"{what}: aborted while waiting for its writes")
            now = time.monotonic()
            if now >= deadline:
                have = got & _COUNT_MASK if (got & ~_COUNT_MASK) == floor else 0
                raise TransportError(
                    f"{what}: {have} of {chunks} chunks written when the wait ended "
                    "(the sender is slow, stuck or gone)"
                )
            spins += 1
            if spins > 64:  # spin briefly, then back off up to 1 ms
                sleep = min(max(sleep * 2, 20e-6), 1e-3, deadline - now)
                time.sleep(sleep)


def _shows(word: int, floor: int, chunks: int) -> bool:
    """A doorbell word holds the attempt of `floor` with at least `chunks` chunks."""
    return (word & ~_COUNT_MASK) == floor and (word & _COUNT_MASK) >= chunks
