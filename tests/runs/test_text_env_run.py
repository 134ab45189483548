"""A text environment from the command line, end to end: `python -m jaxrlhf.train
--config=configs/env_grpo.py:tiny --config.task.name=env --config.env.cls=pkg.mod:Env
--config.task.path=rows.jsonl --config.model.path=<HF folder>`, the environment a user's
module on PYTHONPATH, wrapped in `envs.ChatEpisode` with the folder's tokenizer and chat
template (the Qwen2.5 fixture); and tools from the command line (`env.tools`), handed to an
`envs.ToolEnv` subclass.

The checkpoint is a tiny "bigram" model: its layers add nothing to the residual stream, so
each next token depends on the last one only, and its weights are set so that after the
generation prompt's last token ("\\n") it writes either a whole tool call (one added token of
the tokenizer; 43 % of the time, the rms norm scaling the logits by 32 ** 0.5) or the answer
"5" (greedy's choice), then `<|im_end|>`, which ends the turn only because the folder's
generation config says so (its tokenizer's EOS is `<|endoftext|>`, as Qwen2.5 base models').
Episodes of the tool environment thus call tools through the template's own format, for 1
to 3 turns."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import _xla

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "envs"))
from _tiny_chat import tiny_tokenizer  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

ENVS = '''
from jaxrlhf import envs


class Twice:
    """A plain text environment: every answer is asked for twice; the second is scored."""

    def reset(self, row):
        self.row, self.turns = row, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return envs.Step([{"role": "user", "content": "Are you sure? Answer again."}], 0.0, False)
        return envs.Step([], float(text.strip() == str(self.row["answer"])), True)


class Arithmetic(envs.ToolEnv):
    format = "hermes"
    system_prompt = "Use the tools."

    def answer_reward(self, row, text):
        return float(text.strip() == str(row["answer"]))


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiplies two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b
'''


def _bigram_folder(path: Path) -> Path:
    """The tiny checkpoint folder (module docstring): the Qwen2.5 fixture's tokenizer with
    `CALL` as an added token, a generation config whose `eos_token_id` lists `<|im_end|>`
    and `<|endoftext|>` (Qwen2.5-Instruct's), and bigram weights."""
    from transformers import AutoTokenizer

    from jaxrlhf.models import ModelConfig, random_init, save_pretrained

    tiny_tokenizer("qwen2.5").save_pretrained(path / "tok")  # a copy: the fixture is cached
    tok = AutoTokenizer.from_pretrained(path / "tok")
    tok.add_tokens([CALL])
    tok.eos_token = "<|endoftext|>"  # as Qwen2.5's base models: <|im_end|> ends a turn by the generation config
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, model_type="qwen2", qkv_bias=True,
                      pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), bos_token_id=None,
                      eos_token_id=tok.eos_token_id)
    model, params = random_init(cfg)
    params = {k: dict(v) for k, v in params.items()}
    layer = {k: dict(v) for k, v in params["layers_0"].items()}
    layer["self_attn"]["o_proj"] = {"kernel": np.zeros_like(layer["self_attn"]["o_proj"]["kernel"])}
    layer["mlp"]["down_proj"] = {"kernel": np.zeros_like(layer["mlp"]["down_proj"]["kernel"])}
    params["layers_0"] = layer
    ids = dict(newline=tok.convert_tokens_to_ids("Ċ"), call=tok.convert_tokens_to_ids(CALL),
               five=tok.convert_tokens_to_ids("5"), end=tok.convert_tokens_to_ids("<|im_end|>"))
    rng = np.random.default_rng(0)
    embed = rng.normal(size=(len(tok), 32)).astype(np.float32)
    embed[:, :3] = 0.0  # dims 0-2: the three tokens the bigram reads
    for dim, name in enumerate(("newline", "call", "five")):
        embed[ids[name]] = 0.0
        embed[ids[name], dim] = 1.0
    head = np.zeros((32, len(tok)), np.float32)
    head[0, ids["call"]], head[0, ids["five"]] = 10.0, 10.05  # "\n" -> the call (43 %) or the answer (greedy)
    head[1, ids["end"]] = head[2, ids["end"]] = 10.0  # either -> <|im_end|>
    params["embed_tokens"] = {"embedding": embed}
    params["lm_head"] = {"kernel": head}
    gen = {"eos_token_id": [ids["end"], tok.convert_tokens_to_ids("<|endoftext|>")]}
    save_pretrained(model, params, path / "ckpt", tokenizer=tok, generation_config=gen)
    return path / "ckpt"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_env")
    (root / "user_envs").mkdir()
    (root / "user_envs" / "my_envs.py").write_text(textwrap.dedent(ENVS))
    rows = [{"prompt": f"What is 2 + 3? ({i})", "answer": 5} for i in range(4)]
    for name in ("train.jsonl", "test.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, _bigram_folder(root)


def _train(root: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXRLHF_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla.flags(None),
               PYTHONPATH=os.pathsep.join([str(root / "user_envs"), str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "jaxrlhf.train", "--config=configs/env_grpo.py:tiny",
                           "--config.task.name=env", f"--config.model.path={root / 'ckpt'}",
                           f"--config.task.path={root / 'train.jsonl'}",
                           f"--config.task.test_path={root / 'test.jsonl'}", *args],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def _grpo_rows(workdir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k[len("grpo/"):]: v for k, v in r.items() if k.startswith("grpo/")} for r in rows
            if "grpo/loss" in r]


def test_a_text_environment_with_tools_from_the_command_line(files, tmp_path):
    root, _ = files
    proc = _train(root, f"--workdir={tmp_path / 'tools'}", "--config.env.cls=my_envs:Arithmetic",
                  "--config.env.tools=my_envs:add,my_envs:mul",
                  "--config.env.tool_timeout=5", "--config.task.max_prompt_tokens=768")  # the tools' schemas: 700 tokens
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _grpo_rows(tmp_path / "tools")
    assert len(rows) == 2
    for r in rows:
        assert r["finite"] == 1 and np.isfinite(r["loss"])
        assert r["reward/mean"] == pytest.approx(r["reward/env"]) == pytest.approx(r["episode/reward"], abs=1e-6)
        assert r["logp_mismatch"] < 1e-4
    # the policy called the tools through the template's format, the tools answered
    assert max(r["episode/tool_calls"] for r in rows) > 0 and max(r["episode/turns"] for r in rows) > 1
    assert max(r["episode/env_tokens"] for r in rows) > 0
    assert all(r.get("episode/tool_errors/unknown_tool", 0) == 0 and r.get("episode/tool_errors/malformed", 0) == 0
               for r in rows)
    assert max(r["reward/env"] for r in rows) > 0  # some episodes answered "5"


@pytest.mark.heavy  # the text path with tools stays in the quick tier
def test_a_plain_text_environment_from_the_command_line(files, tmp_path):
    root, ckpt = files
    proc = _train(root, f"--workdir={tmp_path / 'plain'}", "--config.env.cls=my_envs:Twice")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _grpo_rows(tmp_path / "plain")
    assert len(rows) == 2
    for r in rows:
        assert r["episode/turns"] == pytest.approx(2.0) and r["episode/env_tokens"] > 0
        assert r.get("episode/tool_calls", 0) == 0
        # every turn ended at <|im_end|> (after it, this model writes anything), from the folder's generation config
        assert r["episode/cut/tokens"] == 0 and r["episode/policy_tokens"] == pytest.approx(4.0)
    log = (tmp_path / "plain" / "train.log").read_text()
    assert "responses end at any of the token ids" in log and "'<|im_end|>'" in log
    # greedy held-out episodes: "5", the question again, "5": the environment read the policy's text without
    # its stop token
    summary = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert summary["stages"]["start"]["reward"] == 1.0 and summary["stages"]["start"]["env_tokens"] > 0


def test_what_is_wrong_stops_the_run_before_any_work(files, tmp_path):
    """An `env.cls` that does not import, and a first row whose prompt is over
    `task.max_prompt_tokens`: a last line naming the option, and no workdir."""
    root, _ = files
    for name, args, start, words in [
            ("bad_cls", ["--config.env.cls=no_such_module:Env"], "error: env.cls='no_such_module:Env'",
             "does not import"),
            ("long", ["--config.env.cls=my_envs:Arithmetic", "--config.env.tools=my_envs:add,my_envs:mul"],
             "error: task.path: the first row's prompt", "over task.max_prompt_tokens=160")]:
        proc = _train(root, f"--workdir={tmp_path / name}", *args)
        assert proc.returncode == 1, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(start) and words in last, last
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())


def test_the_env_options_reach_the_environment(files, monkeypatch):
    """`env.tool_timeout` becomes the ToolEnv's `timeout_s` (an error for another class),
    `env.max_env_chars` the ChatEpisode's limit, `task.stop_tokens` a stop id."""
    from transformers import AutoTokenizer

    from jaxrlhf.runs import env_task

    root, ckpt = files
    monkeypatch.syspath_prepend(str(root / "user_envs"))
    tok = AutoTokenizer.from_pretrained(ckpt)
    make, stops = env_task.make_env_factory({"cls": "my_envs:Arithmetic", "tools": "my_envs:add,my_envs:mul",
                                              "tool_timeout": 2.5, "max_env_chars": 300}, tokenizer=tok)
    episode = make()
    assert stops is None and episode.max_env_chars == 300
    assert episode.env.timeout_s == 2.5 and [t.name for t in episode.env.tools] == ["add", "mul"]
    with pytest.raises(ValueError, match="env.tool_timeout=2.5: env.cls='my_envs:Twice' is not an envs.ToolEnv"):
        env_task.make_env_factory({"cls": "my_envs:Twice", "tool_timeout": 2.5}, tokenizer=tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end not in env_task.text_stop_ids(tok, "", "") and end in env_task.text_stop_ids(tok, "", "<|im_end|>")
