"""A held-out task a random tiny model gets about half right, for the sampled-eval tests.

Seven addition prompts (odd, so a 2-way mesh pads a row); a response is correct when its
first token is not EOS and has the parity `extras["parity"]` of its prompt (p mod 2), its
final answer is that first token. The same rule as a JAX reward and as a host reward whose
tokenizer "decodes" ids to comma-separated numbers; the host reward also checks that the
object extra `tag` (the prompt, "decoded") is repeated alongside its prompt's samples.

`python _sampled_eval_task.py OUT.json` (in a subprocess with 2 CPU devices) writes the
metrics of both rewards on the mesh `fsdp=2` (parameters and rows split) and on one device.
"""

from __future__ import annotations

import dataclasses
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    # this checkout ahead of any installed jaxrlhf
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlhf import data, rewards  # noqa: E402
from jaxrlhf.runs import config_base, held_out, setup, tasks  # noqa: E402
from jaxrlhf.runs.evaluation import SampledEval  # noqa: E402

NUM_PROMPTS = 7
SAMPLED = SampledEval(num_samples=4, ks=(1, 2, 4), temperature=1.0)
BATCH_SIZE = 8  # 2 prompts x 4 samples per sampled batch: 4 batches, the last one short


class IdsTokenizer:
    """`decode(ids) -> "5,17,2"`: the host reward sees the ids themselves."""

    eos_id = data.EOS_ID

    def decode(self, ids, **_):
        return ",".join(str(int(i)) for i in ids)


def correct_rule(first_token_N, parity_N):
    return (first_token_N != data.EOS_ID) & (first_token_N % 2 == parity_N)


def _device(ids, mask, ex):
    return correct_rule(ids[:, 0], ex["parity"]).astype(jnp.float32)


def _host(prompts, responses, ex):
    out = []
    for prompt, response, parity, tag in zip(prompts, responses, ex["parity"], ex["tag"]):
        first = int(response.split(",")[0]) if response else data.EOS_ID
        out.append(float(prompt == tag and bool(correct_rule(first, parity))))
    return out


def build(kind: str):
    """(model, params, task) with the reward `kind` ("device" or "host")."""
    base = tasks.addition(config_base.task(num_train=16, num_test=NUM_PROMPTS, seed=0))
    p = dict(base.test_prompts)
    p["parity"] = (np.arange(NUM_PROMPTS) % 2).astype(np.int32)
    p["tag"] = np.asarray([IdsTokenizer().decode(ids[m]) for ids, m in zip(p["prompt_ids"], p["prompt_mask"])],
                          dtype=object)
    reward = (rewards.jax_reward(_device, name="parity") if kind == "device"
              else rewards.host_reward(_host, IdsTokenizer(), name="parity"))
    task = dataclasses.replace(base, test_prompts=p, reward=reward, extra_keys=("parity", "tag"),
                               final_answer=lambda ids, mask: [int(i) for i in np.asarray(ids)[:, 0]])
    cfg = config_base.model(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                            head_dim=16)
    model, params = setup.build_model(cfg, vocab_size=task.vocab_size, seed=0, pad_id=task.pad_id,
                                      bos_id=task.bos_id, eos_id=task.eos_id)
    return model, params, task


def evaluate(kind: str, placement=None, slots: int = 0) -> dict:
    model, params, task = build(kind)
    if placement is not None:
        params = placement.place_params(model, params)
    accuracy = held_out.make_accuracy_fn(model, task, batch_size=BATCH_SIZE, placement=placement, sampled=SAMPLED,
                                      seed=3, slots=slots)
    return accuracy(params)


def main(out_path: str) -> None:
    import json

    import ml_collections as mlc

    from jaxrlhf.runs.sharding import Placement

    mesh = Placement.from_config(mlc.ConfigDict(dict(mesh="fsdp=2", rules="fsdp_tp")))
    assert mesh.batch_ways == 2, mesh.describe()
    results = {f"{kind}/{where}": evaluate(kind, placement)
               for kind in ("device", "host") for where, placement in (("mesh", mesh), ("local", None))}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
