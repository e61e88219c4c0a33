"""Adopting a library for serving, and rolling it back.

A refresh name serves one library: the files ``promoted.json`` (reference: what serving prompts read),
``promoted.seed.json`` (ids and next id) and ``promoted.txt`` in its work dir. Every promotion is a new
version ``n`` (1, 2, ...): its library is kept as ``backups/promoted.v<n>.seed.json`` and the served files are
replaced atomically (written to a temporary file, fsynced, then ``os.replace``d), so a reader sees the old
library or the new one, never a mix. A rollback puts an earlier version back the same way. Both are rows of
``library_adoptions`` (who, when, from which version to which), which also say what the next refresh starts
from.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from clgrpo.experience.library import ExperienceLibrary, LibraryFormatError
from clgrpo.storage.connection import StoreError
from clgrpo.storage.store import Store, parse_library_ref
from schemas.records import LibraryAdoption, utcnow
from schemas.stages import Stage

log = logging.getLogger("clgrpo.adopt")

SERVED_FILES = (("promoted.seed.json", "seed"), ("promoted.txt", "text"), ("promoted.json", "reference"))


def _umask() -> int:
    """This process's umask, read from /proc (setting it to read it back would race other threads); elsewhere
    set and restored at once."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        current = os.umask(0)
        os.umask(current)
        return current


class RollbackError(StoreError):
    """A rollback that cannot be done (nothing promoted, no earlier version, unknown version)."""


def write_atomically(path: Path, text: str) -> Path:
    """Replace ``path`` with ``text`` so that readers see the old content or the new, never part of it. The file
    gets the mode any file this process creates gets (0666 less the umask; ``mkstemp`` alone would leave 0600,
    and a model server running as another user could not read the library it serves)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
    return path


def export_served(folder: Path, library: ExperienceLibrary) -> list[Path]:
    """The served files, each replaced atomically; ``promoted.json`` (what serving reads) last."""
    return [
        write_atomically(folder / name, library.dumps(fmt) + ("\n" if fmt != "text" else ""))
        for name, fmt in SERVED_FILES
    ]


def backup_path(folder: Path, version: int) -> Path:
    return folder / "backups" / f"promoted.v{version}.seed.json"


def adoptions(store: Store, name: str) -> list[LibraryAdoption]:
    return store.library_adoptions(name)


def current(history: list[LibraryAdoption]) -> LibraryAdoption | None:
    return history[-1] if history else None


def _record(store: Store, adoption: LibraryAdoption) -> LibraryAdoption:
    store.write_stage(adoption.name, adoption.seq, Stage.ADOPT, {LibraryAdoption: [adoption]})
    return adoption


def adopt(
    store: Store,
    name: str,
    folder: Path,
    library: ExperienceLibrary,
    library_ref: str,
    refresh_id: str,
    actor: str,
    reason: str = "",
) -> LibraryAdoption:
    """Promote ``library`` (stored in DuckDB as ``library_ref``) as the next version of ``name``: backup file,
    served files, then the row. A refresh promotes once: run again, it re-exports its version."""
    history = adoptions(store, name)
    done = [a for a in history if a.action == "promote" and a.refresh_id == refresh_id]
    if done:
        export_served(folder, library)
        return done[-1]
    previous = current(history)
    version = max((a.version for a in history), default=0) + 1
    write_atomically(backup_path(folder, version), library.dumps("seed") + "\n")
    export_served(folder, library)
    return _record(
        store,
        LibraryAdoption(
            name=name,
            seq=len(history),
            action="promote",
            version=version,
            from_version=previous.version if previous else None,
            refresh_id=refresh_id,
            library_ref=library_ref,
            content_hash=library.content_hash(),
            folder=str(folder.resolve()),
            actor=actor,
            reason=reason,
        ),
    )


def _version_row(history: list[LibraryAdoption], version: int) -> LibraryAdoption:
    rows = [a for a in history if a.action == "promote" and a.version == version]
    if not rows:
        known = ", ".join(str(a.version) for a in history if a.action == "promote")
        raise RollbackError(f"version {version} was never promoted (promoted versions: {known or 'none'})")
    return rows[0]


def rollback_target(history: list[LibraryAdoption], to_version: int | None) -> LibraryAdoption:
    """The promotion to restore: ``to_version``, else the latest promoted version below the one in place."""
    now = current(history)
    if now is None:
        raise RollbackError("nothing was promoted yet: there is nothing to roll back")
    if to_version is not None:
        if to_version == now.version:
            raise RollbackError(f"version {to_version} is already in place")
        return _version_row(history, to_version)
    earlier = [a for a in history if a.action == "promote" and a.version < now.version]
    if not earlier:
        raise RollbackError(f"version {now.version} is the first promoted version: there is no earlier one")
    return earlier[-1]


def restore_library(store: Store, folder: Path, target: LibraryAdoption) -> ExperienceLibrary:
    """The library of a promoted version: its backup file when it is intact, else from DuckDB."""
    backup = backup_path(folder, target.version)
    try:
        library = ExperienceLibrary.load(backup)
        if library.content_hash() == target.content_hash:
            return library
        why = "its content differs from the promoted version's"
    except (OSError, LibraryFormatError) as exc:
        why = str(exc)
    log.warning(
        "backup %s not used (%s): version %d restored from DuckDB (%s)", backup, why, target.version, target.library_ref
    )
    return store.load_library(*parse_library_ref(target.library_ref))


def rollback(store: Store, name: str, actor: str, to_version: int | None = None, reason: str = "") -> LibraryAdoption:
    """Serve an earlier promoted version again (default: the one before the version in place), recorded."""
    history = adoptions(store, name)
    target = rollback_target(history, to_version)
    folder = Path(history[-1].folder)
    library = restore_library(store, folder, target)
    export_served(folder, library)
    return _record(
        store,
        target.model_copy(
            update={
                "seq": len(history),
                "action": "rollback",
                "from_version": history[-1].version,
                "actor": actor,
                "folder": str(folder),
                "reason": reason or f"rolled back from version {history[-1].version}",
                "adopted_at": utcnow(),
            }
        ),
    )


def describe_adoption(a: LibraryAdoption) -> str:
    """One line: ``2026-11-22 02:14 promote v2 (from v1) nightly-2026-11-22-train:2 by refresh: reason``."""
    change = f"v{a.version}" + (f" (from v{a.from_version})" if a.from_version else "")
    reason = f": {a.reason}" if a.reason else ""
    return f"{a.adopted_at:%Y-%m-%d %H:%M} {a.action} {change} {a.library_ref} by {a.actor}{reason}"
