"""Loading datasets through TensorFlow Datasets without requiring TensorFlow.

`tfds.data_source` reads datasets prepared in the array_record format with numpy only
(random access, no `tf.data`). Datasets that only exist as TFRecord, or whose preparation
runs TensorFlow code, do need TensorFlow: then `TensorFlowRequiredError` says what to
install. `tensorflow_datasets` is imported on first use (importing it is slow).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from jaxrlhf.data.records import MAX_ROW_BYTES, PromptData, check_row_bytes, prompts_from_records

_INSTALL_HINT = (
    "install TensorFlow (`pip install tensorflow-cpu`), or prepare the dataset in the "
    "array_record format on a machine that has it, so that `tfds.data_source` can read it "
    "here without TensorFlow")


class TensorFlowRequiredError(ImportError):
    """The requested TFDS operation needs TensorFlow, which is not installed."""


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(f"loading TFDS datasets needs tensorflow-datasets: pip install tensorflow-datasets ({e})") from None
    return tfds


def _is_missing_tensorflow(error: BaseException) -> bool:
    return isinstance(error, ImportError) and "tensorflow" in str(error).lower() and (
        getattr(error, "name", None) in (None, "tensorflow") or "no module named 'tensorflow'" in str(error).lower())


def _to_python(value: Any) -> Any:
    """TFDS numpy values -> plain Python: bytes -> str, numpy scalars -> int/float/bool."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else [_to_python(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    return value


def load_records(
    name: str | None = None,
    *,
    split: str,
    data_dir: str | None = None,
    download: bool = False,
    builder: Any = None,
    max_row_bytes: int | None = MAX_ROW_BYTES,
) -> Iterator[tuple[str, dict]]:
    """An iterator of ("tfds:name/split:i", record), records as plain Python dicts (i from 1);
    a record with more than `max_row_bytes` bytes of text is a `row_too_long` DataError in
    its place, measured before it is decoded (`records.check_row_bytes`; None: no limit).

    The dataset is opened eagerly, so a missing dataset or TensorFlow raises here.

    Pass a registered dataset `name`, or a `builder` object (e.g. a local
    `tfds.core.GeneratorBasedBuilder`). With `download=True` a missing dataset is
    downloaded and prepared as array_record; nothing is ever downloaded otherwise.
    """
    tfds = _import_tfds()
    if (name is None) == (builder is None):
        raise ValueError("pass exactly one of name, builder")
    label = name if name is not None else builder.name
    try:
        if builder is None:
            source = tfds.data_source(
                name, split=split, data_dir=data_dir, download=download,
                builder_kwargs={"file_format": "array_record"} if download else None)
        else:
            if download:
                builder.download_and_prepare()
            source = builder.as_data_source(split=split)
    except tfds.core.registered.DatasetNotFoundError as e:
        first_line = str(e).splitlines()[0] if str(e) else repr(e)
        raise ValueError(f"TFDS: {first_line} (check the name, e.g. with `tfds.list_builders()`)") from None
    except NotImplementedError as e:  # TFDS: "Random access data source ... TFRECORD ..."
        raise TensorFlowRequiredError(
            f"TFDS dataset {label!r} ({split}) is not prepared as array_record under "
            f"{data_dir or 'the default data_dir'}: pass download=True to prepare it that way "
            f"(needs network), or, to read a TFRecord copy, {_INSTALL_HINT}") from e
    except ImportError as e:
        if _is_missing_tensorflow(e):
            raise TensorFlowRequiredError(f"TFDS dataset {label!r} ({split}) needs TensorFlow: {_INSTALL_HINT}") from e
        raise
    return _iterate(source, f"tfds:{label}/{split}", max_row_bytes)


def _iterate(source: Any, prefix: str, max_row_bytes: int | None) -> Iterator[tuple[str, dict]]:
    for i in range(len(source)):
        location, raw = f"{prefix}:{i + 1}", source[i]
        yield location, check_row_bytes(raw, location, max_row_bytes) or _to_python(raw)


def load_prompts(
    name: str | None = None,
    tokenizer: Any = None,
    *,
    split: str,
    prompt_key: str = "question",
    answer_key: str | None = "answer",
    data_dir: str | None = None,
    download: bool = False,
    builder: Any = None,
    max_prompt_tokens: int | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    on_error: str = "raise",
    max_row_bytes: int | None = MAX_ROW_BYTES,
) -> PromptData:
    """Prompts and answers from a TFDS dataset (defaults fit GSM8K's question/answer fields)."""
    if tokenizer is None:
        raise ValueError("a tokenizer is required")
    return prompts_from_records(
        load_records(name, split=split, data_dir=data_dir, download=download, builder=builder,
                     max_row_bytes=max_row_bytes),
        tokenizer, prompt_key=prompt_key, answer_key=answer_key,
        max_prompt_tokens=max_prompt_tokens, chat_template=chat_template,
        system_prompt=system_prompt, on_error=on_error, source=f"tfds:{name or builder.name}/{split}")
