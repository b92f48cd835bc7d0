"""Merge the winners of a GPU tune (a `winners.db` fetched from $OUT) into the bundled tuning_db/winners.db.

    python tools/bundle_winners.py FETCHED.db [FETCHED.db ...]

A fetched row replaces the bundled row of the same key; every other bundled row is kept."""
import shutil
import sys
import tempfile
from pathlib import Path

from kernelgen.db import BUNDLED_DB_PATH, KEY_COLUMNS, TuningDB, write_bundled_db


def _rows(path):
    # read from a scratch copy: opening a DB may write to it (WAL, schema), and fetched files are read-only
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "copy.db"
        shutil.copyfile(path, copy)
        db = TuningDB(copy)
        rows = db.rows()
        db.close()
    return rows


def main(paths):
    rows = {tuple(r[c] for c in KEY_COLUMNS): r for r in _rows(BUNDLED_DB_PATH)}
    for path in paths:
        for r in _rows(path):
            rows[tuple(r[c] for c in KEY_COLUMNS)] = r
    write_bundled_db(BUNDLED_DB_PATH, rows.values())
    for r in rows.values():
        print(r["role"], r["backend"], r["bucket"], r["spec_key"][:60], r["median_ms"], r["config"])


if __name__ == "__main__":
    main(sys.argv[1:])
