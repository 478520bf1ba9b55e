"""Files ``swapkit train`` writes: checked before the first step, written atomically, never half there.

Note [Atomic writes]
Metrics and checkpoints are written to a temporary file in the target's folder (same file system),
flushed, fsync'ed and renamed over the target with ``os.replace``, which is atomic on POSIX: a
reader sees the old file or the new one, never a mix. If the write fails (a full disk, a quota, an
I/O error, Ctrl-C) the temporary file is removed before the error goes on, so a failed save leaves
the folder as it was. Only ``kill -9`` (or a power cut) can leave a temporary file behind; its name
(``.NAME.<random>.tmp``) never matches a checkpoint, and the next run removes it
(:func:`remove_stale_temporaries`).
"""
from __future__ import annotations

import glob
import logging
import os
import tempfile
from pathlib import Path
from typing import IO, Callable

from swapkit.config.errors import ConfigError, Problem, clip
from swapkit.train.errors import RunFailed

logger = logging.getLogger(__name__)

TEMPORARY_SUFFIX = ".tmp"


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through ``write(file)`` atomically; Note [Atomic writes].

    Raises:
        RunFailed: the file could not be written (the message names it and the reason).
    """
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX)
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise RunFailed(f"cannot write {clip(str(path), 200)}: {err.strerror or err}; nothing was left "
                            "behind (free disk space or choose another folder, then run again)") from err
        raise


def remove_stale_temporaries(folder: Path, target_glob: str) -> None:
    """Remove temporary files a killed run left for targets matching ``target_glob`` (Note [Atomic writes])."""
    for stale in folder.glob(f".{target_glob}.*{TEMPORARY_SUFFIX}"):
        if stale.is_file():
            stale.unlink(missing_ok=True)
            logger.warning("removed %s, a temporary file left by an interrupted save", stale)


def check_output_file(path: Path, key: str, problems: list[Problem], config: str | Path | None = None) -> None:
    """``path`` can be written as a file: its folder exists and is writable, it is not a folder, and it is
    not the run's own ``config`` file (writing there would replace it, and its comments, for good)."""
    shown = clip(str(path), 200)
    if config is not None and path.resolve() == Path(config).resolve():
        other = path.with_name(f"{path.stem}.out{path.suffix or '.json'}")
        problems.append(Problem(key, f"got {shown}, the config file of this run; writing there would replace it "
                                     f"and its comments: write to another file, such as {clip(str(other), 200)}"))
        return
    if path.is_dir():
        example = "planned.yaml" if key == "--out" else "metrics.json"  # --out: swapkit plan --budget's YAML
        problems.append(Problem(key, f"got {shown}, which is a directory; expected a file path such as "
                                     f"{clip(str(path / example), 200)}"))
        return
    if path.exists() and not path.is_file():  # replacing /dev/null or a FIFO with a file would be a disaster
        problems.append(Problem(key, f"got {shown}, which is not a regular file (a device, FIFO or socket); "
                                     "expected a file path"))
        return
    parent = path.parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        problems.append(Problem(key, f"got {shown}; its folder {clip(str(parent), 200)} {what}. "
                                     "Create the folder or choose another path"))
        return
    if _probe_writable(parent, key, shown, problems):
        remove_stale_temporaries(parent, glob.escape(path.name))


def prepare_output_dir(path: Path, key: str, target_glob: str, problems: list[Problem]) -> None:
    """``path`` is (or is created as) a writable folder; stale temporary files in it are removed."""
    shown = clip(str(path), 200)
    if path.exists() and not path.is_dir():
        problems.append(Problem(key, f"got {shown}, which is a file; expected a folder for checkpoints"))
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        problems.append(Problem(key, f"got {shown}; cannot create the folder: {err.strerror or err}. "
                                     "Choose a folder you can write to"))
        return
    if _probe_writable(path, key, shown, problems):
        remove_stale_temporaries(path, target_glob)


def _probe_writable(folder: Path, key: str, shown: str, problems: list[Problem]) -> bool:
    """Try to create a file in ``folder`` (``os.access`` says yes to root even on a read-only mount)."""
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".swapkit-probe.", suffix=TEMPORARY_SUFFIX)
    except OSError as err:
        problems.append(Problem(key, f"got {shown}; cannot write in {clip(str(folder), 200)}: "
                                     f"{err.strerror or err}. Choose a folder you can write to"))
        return False
    os.close(handle)
    os.unlink(probe)
    return True


def raise_problems(problems: list[Problem], source: str | None) -> None:
    if problems:
        raise ConfigError(problems, source)
