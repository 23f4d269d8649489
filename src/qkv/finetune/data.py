"""Reading the user's data files: UTF-8 text with one clear error per defect (the file, the line, what is
wrong), CSV / TSV / JSONL records and their columns, and the check that --data and --dev exist before a
model is loaded."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from qkv.config import ConfigError
from qkv.tasks.base import text_lines


def check_data_paths(data: str | Path, dev: str | Path | None, folder: bool, task: str | None) -> None:
    """--data and --dev exist: files, or with `folder` (a recipe that reads a folder of images) folders."""
    what = "folder" if folder else "file"
    for name, path in (("data", data), ("dev", dev)):
        if path is None or (Path(path).is_dir() if folder else Path(path).is_file()):
            continue
        if folder and Path(path).exists():
            raise ConfigError(f"--{name} {path} is a file; --task {task} reads a folder with one "
                              "sub-folder of images per class")
        raise ConfigError(f"{name} {what} not found: {path}")


def read_data_text(path: str | Path, where: str = "{path} line {line}") -> str:
    """The text of a data file, UTF-8, with a leading byte order mark dropped (Windows editors write one; left
    in, it would become part of the first column's name or the first record). Bytes that are not UTF-8 are one
    ConfigError naming the file, line and column (`where` formats the file and line as the reader's other
    errors do)."""
    path = Path(path)
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = raw.rfind(b"\n", 0, e.start) + 1
        at = where.format(path=path, line=raw.count(b"\n", 0, e.start) + 1)
        raise ConfigError(f"{at}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                          f"{e.start - line_start + 1}); "
                          "save the file as UTF-8") from None


def read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of a CSV, TSV or JSONL file; the format follows the file's extension."""
    path = Path(path)
    ext = path.suffix.lower()
    text = read_data_text(path)  # a byte order mark dropped; not UTF-8: the file and line
    if ext in (".jsonl", ".json", ".ndjson"):
        out = []
        for i, line in enumerate(text_lines(text), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {i}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{path} line {i}: expected a JSON object per line")
            out.append((i, rec))
        return out
    if ext not in (".csv", ".tsv", ".tab", ".txt"):
        raise ConfigError(f"{path}: unknown data format {ext!r} (use .csv, .tsv or .jsonl)")
    # the csv module splits the rows itself (a quoted field may hold a line break), at "\n" and "\r" only
    sep = "," if ext == ".csv" else "\t"
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=sep)
    if not reader.fieldnames:
        raise ConfigError(f"{path}: empty file (a header row naming the columns is needed)")
    out = []
    for row in reader:
        # DictReader puts a row's fields beyond the header's under the key None (a list), and gives the
        # missing
        # ones the value None: either way the columns are misaligned, so the row would be read wrongly
        extra, values = row.pop(None, None) or [], list(row.values())
        if not any((v or "").strip() for v in values + extra):
            continue  # a blank row
        if extra or any(v is None for v in values):
            n = sum(v is not None for v in values) + len(extra)
            hint = " (quote texts that contain commas)" if sep == "," and extra else ""
            raise ConfigError(
                f"{path} line {reader.line_num}: {n} fields, the header has {len(values)}{hint}"
            )
        out.append((reader.line_num, row))
    return out


def column(path: str | Path, records: list[tuple[int, dict[str, Any]]], name: str | None, what: str,
           allow_empty: bool = False) -> list[Any]:
    """The values of column `name`, each present and non-empty (one clear error naming the row)."""
    if name is None:
        return [None] * len(records)
    if not records:
        raise ConfigError(f"{path}: no data rows")
    if name not in records[0][1]:
        raise ConfigError(
            f"{path}: no {what} column {name!r} (columns: {', '.join(map(str, records[0][1]))})"
        )
    values = []
    for line, rec in records:
        v = rec.get(name)
        if v is None or (isinstance(v, str) and not v.strip()):
            if allow_empty:
                values.append("")
                continue
            raise ConfigError(f"{path} line {line}: empty {what} ({name!r}); remove or fill the row")
        values.append(v)
    return values


__all__ = ["check_data_paths", "column", "read_data_text", "read_records"]
