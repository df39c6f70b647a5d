"""Which sample killed the decoding process: a small journal a preprocessor keeps on its node's disk.

A media file can crash FFmpeg itself (a segfault in native code), which kills the preprocessor's
whole process; Ray restarts it, and the rank's fetch is retried against the new process. Without a
memory of what was being decoded, the new process decodes the same file, dies again, and the restarts
run out: the run ends with "preprocessor gone" instead of skipping one sample. So before a decode the
preprocessor writes the sample's id into the journal and removes it after; a restarted process (the
same actor, same journal path) reads what its predecessor was decoding when it died:

- several in flight: each becomes a *suspect*, decoded alone (no other decode runs beside it) the next
  time it is asked for: it either decodes (cleared) or kills the process alone;
- one sample in flight: a strike against it; it stays a suspect. At ``STRIKES`` deaths decoding alone it
  is *condemned*: every later fetch of it (any step, any epoch) answers a ``decoder_crash`` bad sample
  naming its files, without decoding. (Two, not one: a process killed from outside - the OOM killer,
  Ray's memory monitor - while an innocent sample decodes alone must not condemn it.)
- none in flight: a crash the journal cannot attribute (killed from outside, out of memory). After
  ``MAX_UNATTRIBUTED`` of those the preprocessor refuses to start and the ranks get a clear error.

Every crash thus either condemns a sample, narrows the suspects, or counts towards that bound, so
restarts cannot loop. Writes are atomic (temp file + rename); the journal is plain JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_UNATTRIBUTED = 4
STRIKES = 2


class PreprocessorCrashLoop(RuntimeError):
    """The preprocessor keeps dying outside any decode; raised by its constructor on restart."""


class CrashJournal:
    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.in_flight: dict[str, list[str]] = {}  # sample id -> media paths being decoded now
        self.suspects: dict[str, list[str]] = {}
        self.condemned: dict[str, list[str]] = {}
        self.strikes: dict[str, int] = {}  # deaths while decoding alone
        self.unattributed = 0
        self.restarts = 0
        if self.path is None:
            return
        if self.path.exists():  # a restart: what was the last process doing?
            state = json.loads(self.path.read_text())
            self.suspects = state["suspects"]
            self.condemned = state["condemned"]
            self.strikes = state["strikes"]
            self.unattributed = state["unattributed"]
            self.restarts = state["restarts"] + 1
            died_decoding: dict[str, list[str]] = state["in_flight"]
            if len(died_decoding) == 1:
                (sample_id, paths), = died_decoding.items()
                self.strikes[sample_id] = self.strikes.get(sample_id, 0) + 1
                if self.strikes[sample_id] >= STRIKES:
                    self.condemned[sample_id] = paths
                    self.suspects.pop(sample_id, None)
                else:
                    self.suspects[sample_id] = paths
            elif died_decoding:
                self.suspects.update(died_decoding)
            else:
                self.unattributed += 1
        self._write()
        if self.unattributed > MAX_UNATTRIBUTED:
            raise PreprocessorCrashLoop(
                f"the preprocessor died {self.unattributed} times while decoding nothing (out of memory? killed?); "
                f"not restarting it (journal {self.path})")

    def verdict(self, sample_id: str) -> str | None:
        """``"condemned"``, ``"suspect"`` or None."""
        if sample_id in self.condemned:
            return "condemned"
        return "suspect" if sample_id in self.suspects else None

    def crash_detail(self, sample_id: str) -> str:
        files = ", ".join(self.condemned.get(sample_id, [])) or "its media"
        return (f"the decoding process died {STRIKES} times decoding {files} alone (a crash in the decoder "
                "itself); the preprocessor was restarted and this sample is no longer decoded")

    def start(self, sample_id: str, paths: list[str]) -> None:
        self.in_flight[sample_id] = paths
        self._write()

    def finish(self, sample_id: str) -> None:
        """The decode returned (data or a Python-level error): the sample did not kill the process."""
        self.in_flight.pop(sample_id, None)
        self.suspects.pop(sample_id, None)
        self.strikes.pop(sample_id, None)
        self._write()

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        if self.path is None:
            return
        state = {"in_flight": self.in_flight, "suspects": self.suspects, "condemned": self.condemned,
                 "strikes": self.strikes, "unattributed": self.unattributed, "restarts": self.restarts}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)
