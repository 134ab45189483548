"""Data for every phase from files (`task.name="jsonl"`, `task.kind`): SFT on chats with the
loss on the assistant turns only, DPO and reward-model training on preference pairs (plain,
as message lists, and as whole chats), a TFDS dataset built locally, sources mixed by
weight, and bad rows named by file:line and field. In-process on a tiny random checkpoint
with a real `transformers` tokenizer and chat template saved in its folder."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from jaxrlhf import data
from jaxrlhf.runs import train_and_evaluate
from jaxrlhf.runs.tasks import build_task

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# A template in the character tokenizer's alphabet: "(" opens a user turn, "=" the assistant's, ")" ends a turn.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}){% else %}"
            "({{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}")
SUMS = [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (4, 3)]


def _chat(a, b):
    return [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": f"{a}*{b}"}, {"role": "assistant", "content": str(a * b)}]


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(checkpoint folder, {name: data file})."""
    from jaxrlhf.models import ModelConfig, random_init, save_pretrained

    root = tmp_path_factory.mktemp("files")
    tok = data.CharTokenizer().to_hf()
    tok.chat_template = TEMPLATE
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, model_type="qwen2", qkv_bias=True, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    save_pretrained(*random_init(cfg), root / "ckpt", tokenizer=tok)
    paths = {
        "chats": _write(root / "chats.jsonl", [{"messages": _chat(a, b)} for a, b in SUMS]),
        "pairs": _write(root / "pairs.jsonl", [
            {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "chosen": [{"role": "assistant", "content": str(a + b)}],
             "rejected": [{"role": "assistant", "content": str(a + b + 1)}]} for a, b in SUMS]),
        "implicit": _write(root / "implicit.jsonl", [
            {"chosen": _chat(a, b)[:2], "rejected": [_chat(a, b)[0], {"role": "assistant", "content": "0"}]}
            for a, b in SUMS]),
    }
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths["plain"] = root / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{a}-{b}", "chosen": str(a - b), "rejected": "9 9"}
                                         for a, b in SUMS]), paths["plain"])
    return root / "ckpt", paths


def _config(name, ckpt, path, **task):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    with config.unlocked():
        config.model.path, config.task.path = str(ckpt), str(path)
        config.task.update(task)
        config.train.export = False
    return config


def test_sft_on_chats_learns_exactly_the_assistant_turns(files, tmp_path):
    """Each row's tokens are the template's rendering of the whole chat, and the loss mask
    covers exactly the text the template adds for the assistant turns; the run trains."""
    ckpt, paths = files
    config = _config("hf_sft_messages", ckpt, paths["chats"])
    task = build_task(config.task, model_path=str(ckpt))
    tok = task.tokenizer
    for (a, b), tokens, inputs, loss in zip(SUMS, task.sft["tokens"], task.sft["input_mask"], task.sft["loss_mask"]):
        assert tok.decode(tokens[inputs]) == tok.apply_chat_template(_chat(a, b), tokenize=False)
        assert tok.decode(tokens[loss]) == f"{a + b}){a * b})"  # both assistant turns with their end marker
        assert not loss[:task.prompt_len].any()  # the prompt (up to the first assistant turn) never
    assert tok.decode(task.test_prompts["prompt_ids"][0][task.test_prompts["prompt_mask"][0]]) == "(1+2="
    summary = train_and_evaluate(config, tmp_path / "run")
    assert "after SFT" in summary["stages"]
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(rows[-1]["sft/loss"])


@pytest.mark.heavy  # end to end: a further case of the file sources
def test_dpo_on_message_pairs_and_a_reward_model_on_mixed_sources(files, tmp_path):
    """DPO on TRL's conversational pairs; a reward model on plain Parquet pairs mixed with
    implicit-prompt chats (weights): both train and report held-out pair metrics."""
    ckpt, paths = files
    config = _config("hf_dpo_pairs", ckpt, paths["pairs"])
    task = build_task(config.task, model_path=str(ckpt))
    tok = task.tokenizer
    row = {k: task.pairs[k][0][task.pairs[k.replace("ids", "mask")][0]] for k in ("prompt_ids", "chosen_ids")}
    assert tok.decode(row["prompt_ids"]) == "(1+2=" and tok.decode(row["chosen_ids"]) == "3)"
    summary = train_and_evaluate(config, tmp_path / "dpo")
    assert 0.0 <= summary["dpo_heldout_pairs"]["reward_accuracy"] <= 1.0

    spec = f"{paths['plain']}:1,{paths['implicit']}:3"
    config = _config("hf_dpo_pairs", ckpt, spec)
    with config.unlocked():
        config.algorithm = "reward_model"
    task = build_task(config.task, model_path=str(ckpt))
    prompts = [tok.decode(p[m]) for p, m in zip(task.pairs["prompt_ids"], task.pairs["prompt_mask"])]
    assert sum("-" in p for p in prompts) == 3 and len(prompts) == 12  # 1:3 of the 12 rows
    assert tok.decode(task.pairs["chosen_ids"][0][task.pairs["chosen_mask"][0]]).endswith(")")
    summary = train_and_evaluate(config, tmp_path / "rm")
    assert 0.0 <= summary["reward_model_heldout"]["accuracy"] <= 1.0


def test_a_tfds_dataset_built_locally_is_read_by_name(files, tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")

    class TinyPairs(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {k: tfds.features.Text() for k in ("question", "answer")}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, (a, b) in enumerate(SUMS):
                yield i, {"question": f"{a}+{b}=", "answer": f"#### {a + b}"}

    TinyPairs(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    ckpt, _ = files
    config = _config("hf_dpo_pairs", ckpt, "tfds:tiny_pairs/train", kind="prompts", prompt_key="question",
                     chat_template=False, data_dir=str(tmp_path))
    task = build_task(config.task, model_path=str(ckpt))
    assert sorted(task.prompts["answer"]) == sorted(f"#### {a + b}" for a, b in SUMS)  # TFDS shuffles
    with config.unlocked():
        config.task.path = "tfds:tiny_pairs/train:1,tfds:tiny_pairs/train:1"
        config.task.seed = 3
    twice = build_task(config.task, model_path=str(ckpt))
    assert sorted(twice.prompts["answer"]) == sorted(2 * list(task.prompts["answer"]))


def test_a_bad_row_names_its_file_line_and_field(files, tmp_path):
    ckpt, paths = files
    bad = _write(tmp_path / "bad.jsonl", [{"messages": _chat(1, 2)}, {"prompt": "1+1"}])
    config = _config("hf_sft_messages", ckpt, bad, on_error="raise")
    with pytest.raises(data.DataError, match=rf"{bad}:2: field 'completion': missing"):
        build_task(config.task, model_path=str(ckpt))
    config = _config("hf_dpo_pairs", ckpt, f"{paths['pairs']}:1,{paths['plain']}")
    with pytest.raises(ValueError, match="task.path=.*give a weight to every source or to none"):
        build_task(config.task, model_path=str(ckpt))


@pytest.mark.heavy  # end to end; each phase from files: this file
def test_sft_then_reward_model_then_ppo_all_from_files(files, tmp_path):
    """`configs/hf_rlhf_files.py:tiny`, the RLHF pipeline on a user's files: PPO on a
    prompts file, warm-started by SFT on a chats file (`task.sft_path`), scored by a reward
    model trained on a pairs file (`task.pairs_path`); all prompts share one padded width.
    A kind's own path is refused as an extra path."""
    ckpt, paths = files
    prompts = _write(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in SUMS])
    config = _config("hf_rlhf_files", ckpt, prompts, sft_path=str(paths["chats"]), pairs_path=str(paths["pairs"]))
    task = build_task(config.task, model_path=str(ckpt))
    tok = task.tokenizer
    assert task.sft["tokens"].shape[0] == len(SUMS) and task.pairs["chosen_ids"].shape[0] == len(SUMS)
    width = max(task.sft["input_mask"][:, :task.prompt_len].sum(1).max(), task.prompts["prompt_mask"].sum(1).max())
    assert task.prompt_len == width and task.pairs["prompt_ids"].shape[1] == task.prompt_len
    assert tok.decode(task.pairs["prompt_ids"][0][task.pairs["prompt_mask"][0]]) == "(1+2="
    summary = train_and_evaluate(config, tmp_path / "run")
    assert {"after SFT", "after PPO"} <= set(summary["stages"])
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"sft/loss", "reward_model/loss", "ppo/reward/mean"} <= {k for r in rows for k in r}
    with config.unlocked():
        config.task.update(kind="sft", path=str(paths["chats"]))
    with pytest.raises(ValueError, match=r"task.sft_path=.*this task's own rows are sft"):
        build_task(config.task, model_path=str(ckpt))
