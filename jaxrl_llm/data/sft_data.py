"""SFT data on disk: prompt/completion conversations as `datasets` data sets, JSON Lines, Parquet or TFDS.

Format (the conversational prompt/completion layout of `anakin87/tictactoe` and `anakin87/tictactoe-filtered`):
ONE ROW PER WHOLE EPISODE.

    prompt:     [{"role": "system", "content": system prompt}, {"role": "user", "content": first env message}]
    completion: [{"role": "assistant", "content": reply 1}, {"role": "user", "content": env message 1}, ...,
                 {"role": "assistant", "content": last reply}, ({"role": "user", "content": final message})]
    info:       anything JSON (an env's teacher writes its own facts: seeds, moves, outcome, ...)

A final message closes the completion when the env has one; it is a user turn, so it carries no loss.
`load_sft_dataset` reads the same layout from a `save_to_disk` folder (a `DatasetDict` gives its `train` split),
a JSON Lines / JSON / Parquet file, a folder of Parquet or JSON files (a downloaded Hub snapshot of the public
dataset), or a TFDS folder written by `export_tfds`; only `prompt` and `completion` are required, other columns
are kept as they are. Rows are made by an env's teacher (`env.demonstrations` with the env's `Teacher`).

Checks on load (`DataError`, one line naming the file and the first bad record): every row, not a sample, must
be a JSON object with `prompt` and `completion` lists of {role, content} messages whose role and content are
strings. A JSON Lines file names the 1-based line (blank lines are allowed and skipped; they hold no row), a
JSON list the 1-based item, Parquet files and `datasets` folders the 1-based row; an empty file or data set is
named as empty. No row is skipped: a file loads whole or is refused.

TFDS (optional, extra `tfds`): `export_tfds` writes the rows with a `tfds.core.GeneratorBasedBuilder` as
`array_record` files; that path needs no TensorFlow (checked with tensorflow-datasets 4.9 and array-record 0.8).
Messages are stored as sequences of {role, content} text features and `info` as JSON text; `load_tfds` reads them
back through `as_data_source()` in the original order.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxrl_base.errors import DataError
from jaxrl_llm import distributed

TFDS_EXTRA_HINT = "pip install 'jaxrl_llm[tfds]'  (tensorflow-datasets and array-record; TensorFlow is not needed)"


# ---------------------------------------------------------------------------------------------------------
# Hugging Face datasets I/O
# ---------------------------------------------------------------------------------------------------------


def rows_to_dataset(rows: Sequence[dict]):
    """List of {prompt, completion, ...} rows -> `datasets.Dataset` (checks the format first; features
    inferred from the rows)."""
    import datasets

    rows = list(rows)
    for i, row in enumerate(rows):
        check_row(row, i)
    try:
        return datasets.Dataset.from_list(rows)
    except Exception as e:  # noqa: BLE001 - Arrow cannot give one column two types (e.g. info a dict, then a list)
        raise DataError(f"the rows cannot form one table: {type(e).__name__}: {str(e).splitlines()[0][:300]}; "
                        "give each column (e.g. info) the same type in every row") from None


FORMAT_HINT = ("each row needs 'prompt' and 'completion': lists of {\"role\": str, \"content\": str} messages "
               "(the conversational prompt/completion format)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_messages(messages: Any, where: str, field: str) -> None:
    if not isinstance(messages, (list, tuple)):
        raise DataError(f"{where}: {field!r} is {type(messages).__name__} {_short(messages)}, not a list of "
                        "{role, content} messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}[{j}] is {type(m).__name__} {_short(m)}, not a {{role, content}} "
                            "message")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: {field}[{j}] has no {key!r} (keys: {sorted(m)}); {FORMAT_HINT}")
            if not isinstance(m[key], str):
                raise DataError(f"{where}: {field}[{j}].{key} is {type(m[key]).__name__} {_short(m[key])}, not a "
                                "string")


def check_row(row: Any, index: int = 0, where: str | None = None) -> None:
    """Raise `DataError` unless `row` is a mapping with `prompt` and `completion` lists of {role, content}
    messages of strings. where: how the message names the row (default "row <index + 1>", 1-based)."""
    where = where or f"row {index + 1}"
    if not isinstance(row, dict):
        raise DataError(f"{where} is a JSON {type(row).__name__} {_short(row)}, not an object; {FORMAT_HINT}")
    for field in ("prompt", "completion"):
        if field not in row:
            raise DataError(f"{where} has no {field!r} (it has {', '.join(map(repr, sorted(row))) or 'no field'}); "
                            f"{FORMAT_HINT}")
        _check_messages(row[field], where, field)


def conversation(row: dict) -> list[dict]:
    """A row's whole conversation: prompt + completion messages ({role, content} only)."""
    return [{"role": m["role"], "content": m["content"]} for m in list(row["prompt"]) + list(row["completion"])]


def save_sft_dataset(dataset, path: str | Path) -> None:
    """Save a dataset (or a list of rows) with `datasets`' save_to_disk (process 0 alone in a multi-host run)."""
    if not distributed.is_writer():
        return
    if not hasattr(dataset, "save_to_disk"):
        dataset = rows_to_dataset(dataset)
    dataset.save_to_disk(str(path))


def export_jsonl(dataset, path: str | Path) -> None:
    """Write a dataset (or a list of rows) as JSON Lines, one game a line (process 0 alone in a multi-host run)."""
    if not distributed.is_writer():
        return
    if hasattr(dataset, "to_list"):
        dataset = dataset.to_list()
    with open(path, "w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _is_tfds_dir(folder: Path) -> bool:
    return (folder / "features.json").is_file() and (folder / "dataset_info.json").is_file()


def _find_tfds_dir(folder: Path) -> Path | None:
    if _is_tfds_dir(folder):
        return folder
    found = sorted(p.parent for p in folder.glob("*/*/features.json") if _is_tfds_dir(p.parent))
    return found[0] if len(found) == 1 else None


def load_sft_dataset(path: str | Path, split: str = "train"):
    """Load prompt/completion rows as a `datasets.Dataset` from any supported layout (see the module docstring).

    path: a save_to_disk folder, a .jsonl/.json/.parquet file, a folder of Parquet/JSON files (a Hub snapshot),
    or a TFDS folder from `export_tfds`. `split` picks the split of a DatasetDict / TFDS dataset."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset at {path} (sft.dataset: a .jsonl, .json or .parquet file, a "
                                "save_to_disk folder, a folder of such files or a TFDS folder)")
    if path.is_file():
        return _load_files([path])
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - a damaged or partial save_to_disk folder
            raise DataError(f"{path}: the datasets folder cannot be read ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300] if str(e) else ''}); save it again") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{path} has splits {sorted(ds)}, not {split!r}")
            ds = ds[split]
        return checked_dataset(ds, str(path))
    if (tfds_dir := _find_tfds_dir(path)) is not None:
        rows = load_tfds(tfds_dir, split)
        check_rows(rows, lambda i: f"{tfds_dir} row {i + 1}", str(tfds_dir))
        return rows_to_dataset(rows)
    files = sorted(p for p in path.rglob("*") if p.suffix in (".parquet", ".jsonl", ".json")
                   and p.name not in ("dataset_info.json", "state.json", "dataset_dict.json", "features.json"))
    with_split = [p for p in files if p.name.startswith(split) or p.parent.name == split]
    files = with_split or files
    if not files:
        raise DataError(f"{path}: no save_to_disk dataset, TFDS folder, or Parquet/JSON files found")
    return _load_files(files)


def check_rows(rows: Sequence[Any], where: Callable[[int], str], what: str) -> None:
    """Every row checked (`check_row`, `where(i)` naming row i); an empty sequence is a `DataError` naming
    `what` as empty."""
    if not len(rows):
        raise DataError(f"{what} is empty: it holds no conversation to train on")
    for i, row in enumerate(rows):
        check_row(row, i, where(i))


def checked_dataset(ds, what: str):
    """A `datasets.Dataset` whose every row passed `check_row` (named "<what> row <n>", 1-based); the columns
    first, so that a data set of another layout is named once, not row by row."""
    missing = [field for field in ("prompt", "completion") if field not in ds.column_names]
    if missing and len(ds):
        raise DataError(f"{what} has no {' or '.join(map(repr, missing))} column (columns: {ds.column_names}); "
                        f"{FORMAT_HINT}")
    check_rows(ds, lambda i: f"{what} row {i + 1}", what)
    return ds


def read_jsonl(path: Path) -> list[Any]:
    """The records of a JSON Lines file, parsed with Python's json (exact floats: Arrow's JSON reader rounds some
    doubles in the last digits), each checked with `check_row` and named by its 1-based line. Blank lines hold no
    record and are skipped; an empty file, a line that is not JSON or a bad record is a `DataError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise DataError(f"{path} line {line}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number}: not valid JSON ({e.msg} at column {e.colno}); each line must "
                            "hold one whole JSON object (was the file cut short or hand-edited?)") from None
        check_row(row, where=f"{path} line {number}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path} is empty: it holds no conversation to train on")
    return rows


def read_json_list(path: Path) -> list[Any]:
    """The records of a JSON file holding one list of rows, each checked and named by its 1-based item."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(f"{path} holds a JSON {type(data).__name__}, not a list of rows; {FORMAT_HINT}")
    check_rows(data, lambda i: f"{path} item {i + 1}", str(path))
    return data


def _load_files(files: list[Path]):
    import datasets

    kinds = {p.suffix for p in files}
    if kinds == {".parquet"}:
        empty = [p for p in files if p.stat().st_size == 0]
        if empty:
            raise DataError(f"{empty[0]} is empty (0 bytes): it holds no conversation to train on")
        import pyarrow.parquet as pq

        for p in files:  # before `datasets`, which logs its own traceback for an unreadable file
            try:
                pq.read_schema(p)
            except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file
                raise DataError(f"{p}: not readable as Parquet ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:300] if str(e) else ''}); write the file again") from None
        try:
            ds = datasets.Dataset.from_parquet([str(p) for p in files])
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file
            raise DataError(f"{', '.join(map(str, files[:3]))}: not readable as Parquet ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:300] if str(e) else ''}); write the file again") from None
        return checked_dataset(ds, str(files[0]) if len(files) == 1 else f"the Parquet files of {files[0].parent}")
    if kinds <= {".jsonl", ".json"}:
        rows = []
        for p in files:
            if p.stat().st_size == 0:
                raise DataError(f"{p} is empty (0 bytes): it holds no conversation to train on")
            head = p.read_text(encoding="utf-8", errors="replace").lstrip()[:1]  # a .json file may hold one list
            rows.extend(read_json_list(p) if p.suffix == ".json" and head == "[" else read_jsonl(p))
        return rows_to_dataset(rows)
    raise DataError(f"cannot load a mix of file types {sorted(kinds)}: {[str(p) for p in files]}")


# ---------------------------------------------------------------------------------------------------------
# Optional TFDS export (array_record, no TensorFlow)
# ---------------------------------------------------------------------------------------------------------


def _require_tfds():
    try:
        import array_record  # noqa: F401
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(f"the TFDS export needs the optional 'tfds' extra: {TFDS_EXTRA_HINT} ({e})") from e
    return tfds


TFDS_NAME = "sft_conversations"  # the builder's dataset name (folder under data_dir)


@functools.lru_cache(maxsize=1)
def _builder_class():
    tfds = _require_tfds()
    from etils import epath

    class SftConversations(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """SFT conversations: one example an episode, messages as sequences of {role, content}."""

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "Conversations in the prompt/completion format."}
        # TFDS derives this from the defining package and, for a package installed as a plain folder, then needs
        # the `importlib_resources` backport (not always installed with tensorflow-datasets 4.9): set it directly.
        code_path = epath.Path(__file__)

        def __init__(self, rows: Sequence[dict] = (), split: str = "train", **kwargs):
            self._rows = list(rows)
            self._split = split
            super().__init__(**kwargs)

        def _info(self):
            message = tfds.features.Sequence({"role": tfds.features.Text(), "content": tfds.features.Text()})
            features = tfds.features.FeaturesDict({
                "index": tfds.features.Scalar(dtype=np.int64),
                "prompt": message,
                "completion": message,
                "info": tfds.features.Text(),  # JSON
            })
            return tfds.core.DatasetInfo(builder=self, features=features, description=__doc__)

        def _split_generators(self, dl_manager):
            del dl_manager
            return {self._split: self._generate_examples()}

        def _generate_examples(self):
            for i, row in enumerate(self._rows):
                yield i, {
                    "index": i,
                    "prompt": _columns(row["prompt"]),
                    "completion": _columns(row["completion"]),
                    "info": json.dumps(row.get("info", {}), ensure_ascii=False),
                }

    return SftConversations


def _columns(messages: Sequence[dict]) -> dict:
    return {"role": [m["role"] for m in messages], "content": [m["content"] for m in messages]}


def export_tfds(rows: Iterable[dict], data_dir: str | Path, *, split: str = "train", overwrite: bool = False) -> Path:
    """Write rows (a list or a `datasets.Dataset`) as a TFDS dataset of array_record files, without TensorFlow.

    Returns the dataset's folder `data_dir/tic_tac_toe_sft/1.0.0` (readable with `load_tfds`,
    `tfds.builder_from_directory` or `load_sft_dataset`). ImportError naming the `tfds` extra if it is missing;
    FileExistsError if the folder exists and not overwrite."""
    tfds = _require_tfds()
    rows = list(rows)
    for i, row in enumerate(rows):
        check_row(row, i)
    target = Path(data_dir) / TFDS_NAME / "1.0.0"
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
        shutil.rmtree(target)
    builder = _builder_class()(rows, split, data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return Path(builder.data_dir)


def load_tfds(path: str | Path, split: str = "train") -> list[dict]:
    """Read a TFDS folder written by `export_tfds` back into rows {prompt, completion, info}, in order."""
    tfds = _require_tfds()
    source = tfds.builder_from_directory(str(path)).as_data_source()[split]
    records = sorted((source[i] for i in range(len(source))), key=lambda r: int(r["index"]))

    def messages(cols):
        return [{"role": _str(r), "content": _str(c)} for r, c in zip(cols["role"], cols["content"])]

    return [{"prompt": messages(r["prompt"]), "completion": messages(r["completion"]),
             "info": json.loads(_str(r["info"]))} for r in records]


def _str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
