"""Records from local files: jsonl/json, parquet, arrow (IPC file or stream) and `datasets.save_to_disk` folders.

Every bad input is one DataError line naming the file (and record): a missing field, a wrong type, an empty
file, an unknown extension. Records are read lazily, one file at a time (`iter_records`), so `data prepare`
streams files larger than memory; the training sources hold the tokenized records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from meshforge.errors import DataError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _arrow_batches(path: Path):
    import pyarrow as pa

    for opener in (pa.ipc.open_file, pa.ipc.open_stream):
        try:
            reader = opener(pa.memory_map(str(path)))
        except pa.ArrowInvalid:
            continue
        if opener is pa.ipc.open_file:
            return (reader.get_batch(i) for i in range(reader.num_record_batches))
        return iter(reader)
    raise DataError(f"data.paths: {path} is not an Arrow IPC file or stream")


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def text_bytes(path: Path, key: str = "data.paths") -> bytes:
    """A text file's bytes, checked: one DataError line naming the file (and the line) when it cannot be read,
    holds a NUL byte (a binary file; byte-level data also ends each document with NUL) or is not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise DataError(f"{key}: {path} cannot be read ({err.strerror or type(err).__name__})") from None
    if (nul := data.find(b"\0")) >= 0:
        raise DataError(f"{key}: {path} is a binary file, not text (a NUL byte on line {_line_of(data, nul)}): "
                        "leave it out of the inputs")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{key}: {path} is not UTF-8 text (line {_line_of(data, err.start)}, byte {err.start}): "
                        "convert it to UTF-8 or leave it out") from None
    return data


def _utf8_lines(f, path: Path) -> Iterator[str]:
    """The lines of a file opened in binary, decoded one by one, so an error names the line it is on."""
    for n, raw in enumerate(f, 1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"data.paths: {path} is not UTF-8 text (line {n}, byte {err.start} of the line)") \
                from None


def _iter_file(path: Path) -> Iterator[dict]:
    if path.is_dir():
        if not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
            raise DataError(f"data.paths: {path} is a folder but not a `datasets` save_to_disk folder")
        try:
            import datasets
        except ImportError:
            raise DataError("data.paths: reading a saved dataset needs `datasets`: pip install 'meshforge[data]'") \
                from None
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as err:
            raise DataError(f"data.paths: cannot load the saved dataset {path}: {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"data.paths: {path} is a DatasetDict without a 'train' split "
                                f"(splits: {', '.join(ds)}); point data.paths at one split's folder")
            ds = ds["train"]
        yield from ds
    elif path.suffix in (".jsonl", ".json"):
        try:
            f = open(path, "rb")
        except OSError as err:
            raise DataError(f"data.paths: {path} cannot be read ({err.strerror or type(err).__name__})") from None
        with f:
            for n, line in enumerate(_utf8_lines(f, path), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"data.paths: {path} line {n} is not JSON ({err.msg}); expected one JSON "
                                    "object per line") from None
                except RecursionError:
                    raise DataError(f"data.paths: {path} line {n} is nested too deeply to be a record") from None
                if not isinstance(rec, dict):
                    raise DataError(f"data.paths: {path} line {n} is a {type(rec).__name__}, not a JSON object")
                yield rec
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(str(path))
        except Exception as err:
            raise DataError(f"data.paths: {path} is not a parquet file ({err})") from None
        try:
            for batch in pf.iter_batches(batch_size=1024):
                yield from batch.to_pylist()
        except OSError as err:
            raise DataError(f"data.paths: {path}: cannot read the parquet data ({err})") from None
    elif path.suffix == ".arrow":
        for batch in _arrow_batches(path):
            yield from batch.to_pylist()
    else:
        raise DataError(f"data.paths: {path} has an unknown extension; data.source=dataset reads "
                        f"{', '.join(RECORD_SUFFIXES)} files and `datasets` save_to_disk folders")


def iter_records(paths: list[Path]) -> Iterator[tuple[str, dict]]:
    """(where, record) for every record of every file, in order; `where` names the file and record for errors."""
    for path in paths:
        empty = True
        for i, rec in enumerate(_iter_file(path)):
            empty = False
            yield f"{path} record {i}", rec
        if empty:
            raise DataError(f"data.paths: {path} holds no records")


def field(rec: dict, name: str, where: str, kind: type = str):
    if name not in rec:
        raise DataError(f"data: {where} has no field {name!r} (fields: {', '.join(map(str, rec)) or 'none'})")
    value = rec[name]
    if not isinstance(value, kind):
        raise DataError(f"data: {where} field {name!r} is a {type(value).__name__}, expected {kind.__name__}")
    return value


def documents(files: Iterable[Path], text_field: str | None = None) -> Iterator[str]:
    """Each document's text, in order: the one reader behind data.source=text, dataset format=text, streaming and
    `data prepare`. With `text_field`, a record file (jsonl/json, parquet, arrow) or saved dataset folder gives
    one document per record; any other file is one document of UTF-8 text."""
    return (text for _, _, text in positioned_documents(files, text_field))


def positioned_documents(files: Iterable[Path], text_field: str | None, file: int = 0, record: int = 0
                         ) -> Iterator[tuple[int, int, str]]:
    """`documents` as (file index, record index, text), from document `record` of file `file` on (the records
    before it are read, not returned: a streaming resume)."""
    for fi, f in enumerate(files):  # any iterable of paths (`data prepare` passes its progress tracker)
        if fi < file:
            continue
        if text_field is not None and (f.suffix in RECORD_SUFFIXES or f.is_dir()):
            for ri, (where, rec) in enumerate(iter_records([f])):
                if fi > file or ri >= record:
                    yield fi, ri, field(rec, text_field, where)
            continue
        yield fi, 0, text_bytes(f).decode("utf-8")
