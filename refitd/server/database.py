"""The controller's durable state: embedded SQLite in WAL mode under the data dir.

Holds the registry (models, workers, agents, slots), the version log and the refit history,
so a controller restart loses nothing: versions continue, slot ids stay, and workers and
agents that re-register find their entries. One connection guarded by a lock; every write
is its own transaction (the controller writes a few rows per refit, never tensor bytes).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
  name TEXT PRIMARY KEY, epoch INTEGER NOT NULL, committed_version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
  worker_id TEXT PRIMARY KEY, model TEXT NOT NULL, pool TEXT NOT NULL, rank INTEGER NOT NULL,
  request BLOB NOT NULL, slot INTEGER NOT NULL, registered_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS agents (
  agent_id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL,
  registered_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS slots (
  slot_id INTEGER PRIMARY KEY, host TEXT NOT NULL, device TEXT NOT NULL, agent_id TEXT,
  UNIQUE (host, device));
CREATE TABLE IF NOT EXISTS versions (
  model TEXT NOT NULL, version INTEGER NOT NULL, refit_id INTEGER NOT NULL,
  committed_at REAL NOT NULL, bytes INTEGER NOT NULL, seconds REAL NOT NULL,
  PRIMARY KEY (model, version));
CREATE TABLE IF NOT EXISTS refits (
  refit_id INTEGER PRIMARY KEY, model TEXT NOT NULL, version INTEGER NOT NULL,
  state TEXT NOT NULL, reason TEXT NOT NULL, started_at REAL NOT NULL, ended_at REAL,
  bytes INTEGER NOT NULL, seconds REAL NOT NULL, detail TEXT NOT NULL);
"""

# A refit committed when its version is in the version log under its refit_id (v.refit_id).
REFITS_WITH_LOG = (
    "FROM refits r LEFT JOIN versions v ON v.model = r.model AND v.version = r.version"
)


@dataclass(frozen=True, slots=True)
class RefitRecord:
    """One row of the refit history."""

    refit_id: int
    model: str
    version: int
    state: str
    reason: str
    started_at: float
    ended_at: float | None
    bytes: int
    seconds: float
    detail: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {
            "refit_id": self.refit_id,
            "model": self.model,
            "version": self.version,
            "state": self.state,
            "reason": self.reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gbps": gbps,
            **self.detail,
        }


@dataclass(frozen=True, slots=True)
class RefitOutcome:
    """How one refit ended (or that it still runs), as the database knows it."""

    refit_id: int
    model: str
    version: int
    state: str  # a refits.state value; "committed" when its version is logged under it
    reason: str
    wrote: bool  # weights may have been written in place


class StateDB:
    """SQLite state of one controller (path: data_dir/refitd.sqlite3)."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = data_dir / "refitd.sqlite3"
        self._lock = threading.Lock()
        # Created owner-only before SQLite opens it: SQLite gives the -wal and -shm files
        # the mode of the database file.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        self.path.chmod(0o600)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        self.path.chmod(0o600)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def healthy(self) -> bool:
        """True when the database answers a trivial query."""
        try:
            with self._lock:
                self._db.execute("SELECT 1").fetchone()
            return True
        except sqlite3.Error:
            return False

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._lock:
            cur = self._db.execute(sql, params)
            return int(cur.lastrowid or 0)

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # --- models
    def save_model(self, name: str, epoch: int, committed_version: int) -> None:
        self._write(
            "INSERT INTO models(name, epoch, committed_version) VALUES (?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET epoch=excluded.epoch, "
            "committed_version=excluded.committed_version",
            (name, epoch, committed_version),
        )

    def models(self) -> list[tuple[str, int, int]]:
        return [(r[0], r[1], r[2]) for r in self._read("SELECT * FROM models ORDER BY name")]

    # --- workers
    def save_worker(
        self, worker_id: str, model: str, pool: str, rank: int, request: bytes, slot: int
    ) -> None:
        self._write(
            "INSERT OR REPLACE INTO workers VALUES (?,?,?,?,?,?,?)",
            (worker_id, model, pool, rank, request, slot, time.time()),
        )

    def delete_worker(self, worker_id: str) -> None:
        self._write("DELETE FROM workers WHERE worker_id=?", (worker_id,))

    def workers(self) -> list[tuple[str, bytes, int]]:
        """(worker_id, serialized RegisterWorkerRequest, slot), oldest first."""
        rows = self._read("SELECT worker_id, request, slot FROM workers ORDER BY registered_at")
        return [(r[0], bytes(r[1]), r[2]) for r in rows]

    # --- agents and slots
    def save_agent(self, agent_id: str, host: str, pid: int) -> None:
        self._write(
            "INSERT OR REPLACE INTO agents VALUES (?,?,?,?)", (agent_id, host, pid, time.time())
        )

    def agents(self) -> list[tuple[str, str, int]]:
        return [(r[0], r[1], r[2]) for r in self._read("SELECT agent_id, host, pid FROM agents")]

    def slot_id(self, host: str, device: str, agent_id: str) -> int:
        """The slot id of (host, device), created on first sight; owner set to agent_id."""
        with self._lock:
            row = self._db.execute(
                "SELECT slot_id FROM slots WHERE host=? AND device=?", (host, device)
            ).fetchone()
            if row is None:
                cur = self._db.execute(
                    "INSERT INTO slots(host, device, agent_id) VALUES (?,?,?)",
                    (host, device, agent_id),
                )
                return int(cur.lastrowid or 0) - 1
            self._db.execute("UPDATE slots SET agent_id=? WHERE slot_id=?", (agent_id, row[0]))
            return int(row[0]) - 1

    def slots(self) -> list[tuple[int, str, str, str | None]]:
        """(slot id, host, device, agent id) of every known slot (ids start at 0)."""
        rows = self._read("SELECT slot_id, host, device, agent_id FROM slots ORDER BY slot_id")
        return [(r[0] - 1, r[1], r[2], r[3]) for r in rows]

    # --- versions and refits
    def start_refit(self, model: str, version: int, state: str) -> int:
        return self._write(
            "INSERT INTO refits(model, version, state, reason, started_at, bytes, seconds, "
            "detail) VALUES (?,?,?,?,?,?,?,?)",
            (model, version, state, "", time.time(), 0, 0.0, "{}"),
        )

    def mark_refit(self, refit_id: int, state: str) -> None:
        """Record a refit's state while it runs ("transferring": writes may begin), so a
        controller that dies mid-refit knows after its restart whether weights were written."""
        self._write("UPDATE refits SET state=? WHERE refit_id=?", (state, refit_id))

    def interrupt_unfinished(self, reason: str) -> list[int]:
        """At start-up: refits a previous controller left running end as failed (detail
        `wrote`: whether they had begun writing), or committed when their version made it
        into the version log; returns the ids of the failed ones."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT r.refit_id, r.state, r.detail, v.refit_id {REFITS_WITH_LOG} "
                "WHERE r.state NOT IN ('committed', 'failed', 'superseded')"
            ).fetchall()
            failed = []
            for refit_id, state, detail, logged in rows:
                doc = {**json.loads(detail), "wrote": state == "transferring"}
                if logged == refit_id:
                    end, why = "committed", ""
                else:
                    end, why = "failed", f"{reason} (it was {state})"
                    failed.append(refit_id)
                self._db.execute(
                    "UPDATE refits SET state=?, reason=?, ended_at=?, detail=? WHERE refit_id=?",
                    (end, why, time.time(), json.dumps(doc), refit_id),
                )
        return failed

    def refit_outcome(self, refit_id: int) -> RefitOutcome | None:
        """How a refit ended, for a rank it paused: committed when its version is in the
        version log under this refit, else its state and whether it began writing."""
        rows = self._read(
            f"SELECT r.model, r.version, r.state, r.reason, r.detail, v.refit_id {REFITS_WITH_LOG} "
            "WHERE r.refit_id=?",
            (refit_id,),
        )
        if not rows:
            return None
        model, version, state, reason, detail, logged = rows[0]
        if logged == refit_id:
            state = "committed"
        return RefitOutcome(
            refit_id, model, version, state, reason, bool(json.loads(detail).get("wrote"))
        )

    def end_refit(self, record: RefitRecord) -> None:
        self._write(
            "UPDATE refits SET state=?, reason=?, ended_at=?, bytes=?, seconds=?, detail=? "
            "WHERE refit_id=?",
            (
                record.state,
                record.reason,
                record.ended_at,
                record.bytes,
                record.seconds,
                json.dumps(record.detail),
                record.refit_id,
            ),
        )

    def commit_version(
        self, model: str, version: int, refit_id: int, nbytes: int, seconds: float, epoch: int
    ) -> None:
        """Record a committed version and the model's new current version, atomically."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO versions VALUES (?,?,?,?,?,?)",
                    (model, version, refit_id, time.time(), nbytes, seconds),
                )
                self._db.execute(
                    "INSERT INTO models(name, epoch, committed_version) VALUES (?,?,?) "
                    "ON CONFLICT(name) DO UPDATE SET committed_version=excluded.committed_version",
                    (model, epoch, version),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def versions(self, model: str, limit: int = 20) -> list[dict[str, Any]]:
        rows = self._read(
            "SELECT version, refit_id, committed_at, bytes, seconds FROM versions WHERE model=? "
            "ORDER BY version DESC LIMIT ?",
            (model, limit),
        )
        keys = ("version", "refit_id", "committed_at", "bytes", "seconds")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def refits(self, limit: int) -> list[RefitRecord]:
        rows = self._read("SELECT * FROM refits ORDER BY refit_id DESC LIMIT ?", (limit,))
        return [
            RefitRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], json.loads(r[9]))
            for r in rows
        ]

    def max_refit_id(self) -> int:
        row = self._read("SELECT COALESCE(MAX(refit_id), 0) FROM refits")
        return int(row[0][0])
