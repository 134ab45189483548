"""save_pretrained / load_pretrained round trips, head overrides, and bad checkpoints."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrlhf.models import (
    CheckpointError,
    UnsupportedConfigError,
    from_hf_config,
    load_pretrained,
    random_init,
    save_pretrained,
)

from .conftest import hf_config, hf_forward, right_padded_batch, torch, transformers


def _perturbed(params, seed=0):
    """Every leaf random, so that a transposed kernel or a dropped bias shows."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def _logits(model, params, ids, mask):
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)).logits)


@pytest.fixture(scope="module")
def ours():
    """A random llama3 model (biases, llama3 rope, untied) built on the JAX side."""
    config = from_hf_config(hf_config("llama3"))
    model, params = random_init(config, seed=3)
    return model, _perturbed(params)


def test_save_loads_in_transformers_and_back(ours, tmp_path):
    model, params = ours
    out = save_pretrained(model, params, tmp_path / "ckpt")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["LlamaForCausalLM"]
    ids, mask = right_padded_batch(seed=4)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = hf_forward(hf_model, ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(_logits(model, params, ids, mask)[valid], ref[valid], atol=1e-4, rtol=0)
    model2, params2 = load_pretrained(out)
    assert model2.config == model.config and model2.head == "lm"
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_sharded_save_loads_in_both(ours, tmp_path):
    model, params = ours
    out = save_pretrained(model, params, tmp_path / "sharded", max_shard_bytes=40_000)
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    _, params2 = load_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    ids, mask = right_padded_batch(seed=5)
    ref = hf_forward(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(_logits(model, params, ids, mask)[valid], ref[valid], atol=1e-4, rtol=0)


def test_score_head_round_trip(tmp_path):
    config = from_hf_config(hf_config("qwen3"))
    model, params = random_init(config, head="score", seed=1)
    params = _perturbed(params)
    out = save_pretrained(model, params, tmp_path / "rm")
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"] and cfg["num_labels"] == 1
    ids, mask = right_padded_batch(seed=6)
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    ref = hf_forward(hf_model, ids, mask)[:, 0]
    model2, params2 = load_pretrained(out)
    assert model2.head == "score"
    values = model2.apply({"params": params2}, jnp.asarray(ids), jnp.asarray(mask)).values
    last = mask.sum(1) - 1
    np.testing.assert_allclose(np.asarray(values)[np.arange(len(last)), last], ref, atol=1e-4, rtol=0)


def test_head_overrides(hf_store, tmp_path, caplog):
    path, _ = hf_store.get("llama3")
    lm_model, lm_params = load_pretrained(path)
    ids, mask = right_padded_batch(seed=7)
    with caplog.at_level(logging.WARNING, logger="jaxrlhf.models.hf_checkpoint"):
        rm, rm_params = load_pretrained(path, head="score", seed=5)
    assert rm.head == "score" and "lm_head" not in rm_params
    assert "score/kernel" not in caplog.text and "score.kernel" in caplog.text and "lm_head.weight" in caplog.text
    jax.tree.map(np.testing.assert_array_equal, rm_params["layers_1"], lm_params["layers_1"])
    assert 0.005 < float(jnp.std(rm_params["score"]["kernel"])) < 0.05  # fresh N(0, 0.02)

    ac, ac_params = load_pretrained(path, head="lm_value")
    out = ac.apply({"params": ac_params}, jnp.asarray(ids), jnp.asarray(mask))
    assert out.values.shape == ids.shape
    np.testing.assert_array_equal(np.asarray(out.logits), _logits(lm_model, lm_params, ids, mask))
    # lm_value is saved as the plain causal LM: the value head is dropped.
    saved = save_pretrained(ac, ac_params, tmp_path / "ac")
    assert "value_head.weight" not in load_file(os.path.join(saved, "model.safetensors"))
    assert json.load(open(os.path.join(saved, "config.json")))["architectures"] == ["LlamaForCausalLM"]


def test_bf16_checkpoint(hf_store, tmp_path):
    _, hf_model = hf_store.get("qwen2")
    src = tmp_path / "bf16"
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(src, safe_serialization=True)
    model, params = load_pretrained(src, param_dtype="bfloat16")
    assert model.config.param_dtype == model.config.dtype == "bfloat16"
    emb = params["embed_tokens"]["embedding"]
    assert emb.dtype == jnp.bfloat16
    want = hf_model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(emb, np.float32), want)
    _, params32 = load_pretrained(src)  # default param_dtype float32: exact upcast
    assert params32["embed_tokens"]["embedding"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params32["embed_tokens"]["embedding"]), want)
    out = save_pretrained(model, params, tmp_path / "bf16-out")
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"


def test_save_is_atomic_and_refuses_to_clobber(ours, tmp_path):
    model, params = ours
    target = tmp_path / "dest"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        save_pretrained(model, params, target)
    assert os.listdir(target) == ["notes.txt"]
    broken = {k: v for k, v in params.items() if k != "layers_2"}
    with pytest.raises(KeyError, match="layers_2"):
        save_pretrained(model, broken, tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["dest"]  # no half-written folder, no temp sibling
    save_pretrained(model, params, target, overwrite=True, generation_config={"eos_token_id": 2})
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_tokenizer_saved_and_chat_template(ours, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxrlhf.models import encode_prompt, load_tokenizer

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "<|user|>": 4, "<|assistant|>": 5,
             **{f"t{i}": i for i in range(6, 300)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                               eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    model, params = ours
    out = save_pretrained(model, params, tmp_path / "with-tok", tokenizer=tok)
    loaded = load_tokenizer(out)
    assert encode_prompt(loaded, "t17 t200") == [4, 17, 200, 5]
    assert encode_prompt(loaded, "t17 t200", use_chat_template=False) == [17, 200]
    plain = load_tokenizer(out, chat_template=False)
    assert encode_prompt(plain, "t17 t200") == [17, 200]  # no template: plain text
    with pytest.raises(ValueError, match="chat template"):
        encode_prompt(plain, [{"role": "user", "content": "t7"}])


# ----------------------------------------------------------------------------- bad input


@pytest.fixture()
def ckpt(hf_store, tmp_path):
    """A private copy of the llama3 checkpoint to break."""
    path, _ = hf_store.get("llama3")
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst


def _edit_config(ckpt, **changes):
    cfg = json.load(open(ckpt / "config.json"))
    cfg.update(changes)
    json.dump(cfg, open(ckpt / "config.json", "w"))


def _edit_weights(ckpt, fn, fname="model.safetensors"):
    tensors = load_file(ckpt / fname)
    fn(tensors)
    save_file(tensors, ckpt / fname, metadata={"format": "pt"})


def test_no_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"no config.json in {tmp_path}"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="not a local directory"):
        load_pretrained(tmp_path / "missing")


def test_pickle_only_folder_is_refused(ckpt):
    os.remove(ckpt / "model.safetensors")
    (ckpt / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError) as e:
        load_pretrained(ckpt)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "safe_serialization=True" in msg and "save_pretrained" in msg


def test_wrong_shape_names_file_and_tensor(ours, tmp_path):
    model, params = ours
    out = save_pretrained(model, params, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    name = "model.layers.1.self_attn.q_proj.weight"
    fname = index[name]

    def shrink(t):
        t[name] = t[name][:-16]

    _edit_weights(tmp_path / "sharded", shrink, fname)
    with pytest.raises(CheckpointError) as e:
        load_pretrained(out)
    assert str(e.value) == f"{fname}: tensor '{name}' has shape (48, 48), expected (64, 48)"


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_truncated_files_are_named(ckpt, ours, tmp_path):
    """A truncated config.json, model.safetensors, index or shard: a CheckpointError naming
    the file (the shard, through the sharded loader too), not a bare JSONDecodeError or
    SafetensorError."""
    from jaxrlhf.parallel import make_mesh
    from jaxrlhf.parallel.loading import load_pretrained_sharded

    cfg = ckpt / "config.json"
    original = cfg.read_bytes()
    _truncate(cfg)
    with pytest.raises(CheckpointError, match=rf"^{cfg} is truncated or corrupt: it is not valid JSON \("):
        load_pretrained(ckpt)
    cfg.write_bytes(original)
    _truncate(ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"^{ckpt / 'model.safetensors'} is truncated or corrupt: "):
        load_pretrained(ckpt)

    model, params = ours
    out = save_pretrained(model, params, tmp_path / "sharded", max_shard_bytes=40_000)
    shard = os.path.join(out, sorted(f for f in os.listdir(out) if f.startswith("model-"))[1])
    _truncate(tmp_path / "sharded" / os.path.basename(shard))
    with pytest.raises(CheckpointError, match=rf"^{shard} is truncated or corrupt: "):
        load_pretrained_sharded(out, make_mesh("data=1", devices=jax.devices()[:1]))
    _truncate(tmp_path / "sharded" / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is truncated or corrupt"):
        load_pretrained(out)

    from jaxrlhf.data import CharTokenizer
    from jaxrlhf.models import load_tokenizer

    CharTokenizer().to_hf().save_pretrained(tmp_path / "tok")
    _truncate(tmp_path / "tok" / "tokenizer.json")
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'tok' / 'tokenizer.json'} is truncated or corrupt"):
        load_tokenizer(tmp_path / "tok")


def test_a_truncated_generation_config_is_named(tmp_path):
    """A run reads the folder's generation_config.json for its stop ids: a truncated one is a
    CheckpointError naming the file (as for every other file of the folder), not a bare
    JSONDecodeError."""
    from jaxrlhf.data import CharTokenizer
    from jaxrlhf.runs.tasks import text_stop_ids

    tok, gen = CharTokenizer().to_hf(), tmp_path / "generation_config.json"
    gen.write_text('{"eos_token_id": [2, 9]}')
    assert text_stop_ids(tok, str(tmp_path)) == (2, 9)
    _truncate(gen)
    with pytest.raises(CheckpointError, match=rf"^{gen} is truncated or corrupt: it is not valid JSON \("):
        text_stop_ids(tok, str(tmp_path))


def test_missing_tensor(ckpt):
    _edit_weights(ckpt, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: missing tensors \['model.layers.2.mlp.up_proj.weight'\]"):
        load_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # ignorable
        t["model.layers.0.adapter.weight"] = np.ones((2, 2), np.float32)

    _edit_weights(ckpt, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model.layers.0.adapter.weight'\]"):
        load_pretrained(ckpt)


def test_tied_lm_head_must_match(hf_store, tmp_path):
    path, _ = hf_store.get("qwen2")  # tied
    ckpt = tmp_path / "tied"
    shutil.copytree(path, ckpt)
    _edit_weights(ckpt, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    _, params = load_pretrained(ckpt)  # present and identical: tolerated
    assert "lm_head" not in params
    _edit_weights(ckpt, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        load_pretrained(ckpt)


@pytest.mark.parametrize("changes, error, pattern", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), UnsupportedConfigError,
     r"config.json: model_type='gpt2' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                           "original_max_position_embeddings": 64}, rope_scaling=None),
     UnsupportedConfigError, r"config.json: rope_type='yarn' is not implemented"),
    (dict(hidden_act="gelu"), UnsupportedConfigError, r"config.json: hidden_act='gelu'"),
    (dict(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), CheckpointError,
     r"config.json: `auto_map` \['AutoModelForCausalLM'\] asks for the repository's own Python code"),
    (dict(architectures=["LlamaForSequenceClassification"], num_labels=3), CheckpointError,
     r"config.json: LlamaForSequenceClassification has num_labels=3"),
    (dict(architectures=["LlamaForTokenClassification"]), CheckpointError,
     r"architectures=\['LlamaForTokenClassification'\]"),
])
def test_bad_config(ckpt, changes, error, pattern):
    _edit_config(ckpt, **changes)
    with pytest.raises(error, match=pattern):
        load_pretrained(ckpt)


@pytest.mark.parametrize("family, head", [("llama3", "lm_value"), ("qwen3", "score"), ("qwen2", "lm")])
def test_random_init_matches_module_params(family, head):
    from jaxrlhf.models import init_params

    model, params = random_init(from_hf_config(hf_config(family)), head=head, seed=0)
    expected = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype) or pytest.fail(f"{a} vs {b}"),
                 params, expected)
    assert float(params["norm"]["scale"].min()) == 1.0
    assert 0.015 < float(jnp.std(params["embed_tokens"]["embedding"])) < 0.025


def test_config_without_architectures_needs_head(ckpt):
    _edit_config(ckpt, architectures=None)
    with pytest.raises(CheckpointError, match="no `architectures`; pass head='lm'"):
        load_pretrained(ckpt)
    model, _ = load_pretrained(ckpt, head="lm")
    assert model.head == "lm"


def test_load_with_shardings(hf_store):
    path, _ = hf_store.get("qwen3")
    _, params = load_pretrained(path)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, placed = load_pretrained(path, shardings=jax.tree.map(lambda _: sharding, params))
    assert all(x.sharding == sharding for x in jax.tree.leaves(placed))
    jax.tree.map(np.testing.assert_array_equal, placed, params)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_read_block_equals_slice_of_full_tensor(family):
    """Per-device reads (`shardings=`) see exactly `from_hf(whole)[index]` for every tensor."""
    from jaxrlhf.models.hf_checkpoint import _head_tensors, _trunk_tensors

    config = from_hf_config(hf_config(family))
    rng = np.random.default_rng(0)
    for t in _trunk_tensors(config)[:12] + _head_tensors(config, "lm_value"):
        w = rng.standard_normal(t.hf_shape).astype(np.float32)
        full = t.from_hf(w)
        for _ in range(3):
            index = []
            for n in t.shape:
                a, b = sorted(rng.integers(0, n + 1, 2))
                index.append(slice(int(a), int(b) + (a == b and b < n)))
            np.testing.assert_array_equal(t.read_block(w, tuple(index)), full[tuple(index)], err_msg=t.hf_name)
