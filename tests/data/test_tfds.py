"""TFDS loading without TensorFlow: a local array_record builder, and the error paths."""

import numpy as np
import pytest

from jaxrlhf.data import tfds as data_tfds
from jaxrlhf.data.char_tokenizer import BOS_ID, CharTokenizer
from jaxrlhf.data.records import DataError

tfds = pytest.importorskip("tensorflow_datasets")


class TinyMath(tfds.core.GeneratorBasedBuilder):
    """Three GSM8K-shaped records, generated locally (no download)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "question": tfds.features.Text(), "answer": tfds.features.Text(),
            "level": tfds.features.Scalar(dtype=np.int32)}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i, (q, a) in enumerate([("1+2=", "#### 3"), ("", "#### 0"), ("4+5=", "#### 9")]):
            yield i, {"question": q, "answer": a, "level": i}


def test_local_builder_reads_without_tensorflow(tmp_path):
    builder = TinyMath(data_dir=str(tmp_path), file_format="array_record")
    records = list(data_tfds.load_records(builder=builder, split="train", download=True))
    assert records[0] == ("tfds:tiny_math/train:1", {"question": "1+2=", "answer": "#### 3", "level": 0})
    data = data_tfds.load_prompts(builder=builder, tokenizer=CharTokenizer(), split="train", on_error="skip")
    assert data.prompt_ids == [[BOS_ID] + CharTokenizer().encode("1+2="), [BOS_ID] + CharTokenizer().encode("4+5=")]
    assert data.answer == ["#### 3", "#### 9"]
    assert dict(data.skipped.counts) == {"empty": 1}

    # rows 1 and 3 hold 4 + 6 bytes of text, row 2 6: over max_row_bytes=9, before decoding
    records = list(data_tfds.load_records(builder=builder, split="train", max_row_bytes=9))
    assert [r.reason if isinstance(r, DataError) else r["answer"] for _, r in records] == [
        "row_too_long", "#### 0", "row_too_long"]
    assert str(records[0][1]) == ("tfds:tiny_math/train:1: field 'answer': the row has 10 bytes of text "
                                  "(6 in this field), more than max_row_bytes=9")


def test_missing_tensorflow_names_what_to_install(monkeypatch):
    def needs_tf(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")

    monkeypatch.setattr(tfds, "data_source", needs_tf)
    with pytest.raises(data_tfds.TensorFlowRequiredError, match="pip install tensorflow-cpu"):
        data_tfds.load_records("gsm8k", split="train", data_dir="/nonexistent")


def test_unknown_dataset_is_a_short_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not_a_real_dataset") as info:
        data_tfds.load_records("not_a_real_dataset", split="train", data_dir=str(tmp_path))
    assert len(str(info.value)) < 300


def test_dataset_not_prepared_as_array_record(tmp_path):
    # A registered dataset with nothing prepared: TFDS assumes TFRecord, which needs TF.
    with pytest.raises(data_tfds.TensorFlowRequiredError, match="download=True"):
        data_tfds.load_records("mnist", split="train", data_dir=str(tmp_path))
