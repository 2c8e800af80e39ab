"""`SentHome`: what a copy of an object ended with in another process, sent back to the object it was copied from.

Lightning's `ddp_spawn` pickles the Trainer, its callbacks included, into rank processes it starts; the fit runs
there, and the callbacks the user holds in the parent process never run. Lightning carries back only the
weights, `trainer.state` and `trainer.callback_metrics` (its launcher's `get_extra_results`, which a user
changes by subclassing the launcher), and the parent calls no callback after the ranks end: a callback has no
route of the framework's own to the object the user reads. So the copy writes a file that the object at home
reads: when the object is pickled in its home process for a process that `multiprocessing` starts (spawn or
forkserver, as `ddp_spawn` starts its ranks), that process's private directory is claimed (`PROCESS_DIRECTORY`,
which kineto's exports use too: mode 0700, removed when the process exits, swept by a later one if it died)
and the copy carries its path and a random file name; the copy writes the file atomically when its fit ends,
and reading at home takes the values and removes the file. A copy made without pickling (a fork), or by a
pickle that starts no process (`copy.deepcopy`, a checkpoint), knows no directory and sends nothing: none is
claimed for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import secrets
from multiprocessing.context import get_spawning_popen
from typing import Any

from hookprof._runtime.atomic_file import atomic_write
from hookprof._runtime.private_dir import PROCESS_DIRECTORY

log = logging.getLogger(__name__)



class SentHome:
    """One object's channel home: `send` in a copy in another process, `received` in the object's own."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._name = f"{secrets.token_hex(8)}.pickle"
        self._directory: str | None = None  # claimed when the object is first pickled at home for another process
        self._received: dict[str, Any] = {}

    @property
    def away(self) -> bool:
        """Whether this is a copy in another process than the one that made the object."""
        return os.getpid() != self._pid

    def __getstate__(self) -> dict[str, Any]:
        # (multiprocessing pickles a process's arguments with its spawning `Popen` set: only that copy runs elsewhere)
        if not self.away and self._directory is None and get_spawning_popen() is not None:
            try:
                self._directory = PROCESS_DIRECTORY.path()
            except OSError as error:  # (no temporary directory: the copy sends nothing, the home reads its own)
                log.debug("No directory for values sent home: %s", error)
        return {**self.__dict__, "_received": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not self.away:  # (a copy made in the object's own process, `copy.deepcopy`: a file of its own)
            self._name = f"{secrets.token_hex(8)}.pickle"

    def send(self, values: dict[str, Any]) -> None:
        """From a copy in another process: `values` for the object at home (replacing any sent before). Each
        value is pickled on its own; one that does not pickle is left out (the home reads its own). A failure
        to write is logged, never raised: the fit that sends has ended its work."""
        if not self.away or self._directory is None:
            return
        parts = {}
        for key, value in values.items():
            try:
                parts[key] = pickle.dumps(value)
            except Exception as error:  # (whatever a value's pickling raises)
                log.debug("%s is not sent home: %s", key, error)
        try:
            with atomic_write(os.path.join(self._directory, self._name)) as f:
                pickle.dump(parts, f)
        except OSError as error:
            log.warning("hookprof could not send this rank's results to the process that started it (%s): there, "
                        "the callbacks' saved_paths and counters stay empty; the files are on disk.", error)

    def received(self) -> dict[str, Any]:
        """At home: the values the latest copy sent (taken from its file, which is removed), else {}."""
        if self._directory is None or self.away:
            return self._received
        path = os.path.join(self._directory, self._name)
        try:
            with open(path, "rb") as f:
                parts = pickle.load(f)
        except FileNotFoundError:
            return self._received
        except Exception as error:  # (a file cut short: whatever unpickling raises)
            log.warning("hookprof could not read what a rank process sent back (%s): %s", path, error)
            parts = {}
        with contextlib.suppress(OSError):
            os.unlink(path)
        received = {}
        for key, data in parts.items():
            try:
                received[key] = pickle.loads(data)
            except Exception as error:  # (a class this process cannot import)
                log.debug("%s sent home does not unpickle here: %s", key, error)
        self._received = received
        return received

    def forget(self) -> None:
        """At home, a fit begins in this process: its own values count again, not what a copy sent before."""
        if self.away:
            return
        self._received = {}
        if self._directory is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self._directory, self._name))
