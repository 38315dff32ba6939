"""Where a `.tg` file's imports are looked for: the elaborator's rule, which the code
cache's keys follow too (`tgc.pipeline`), so both resolve a name alike."""
from __future__ import annotations

from pathlib import Path


def import_folders(filename: str | Path, import_dirs=()) -> list[Path]:
    """The folders an import in the file `filename` is looked for in, in order: the
    file's own folder, then each -I folder; a relative name resolves against the
    working directory (so the same name may mean other files elsewhere)."""
    return [Path(filename).parent.resolve()] + [Path(d).resolve() for d in import_dirs]
