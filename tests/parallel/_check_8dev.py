"""Sharding checks on 8 CPU devices, run in a subprocess by test_sharding.py.

`python _check_8dev.py OUT.json [check ...]` runs the named checks (all by default) and
writes `{name: {"ok": bool, "detail": str}}`. The device count is set before jax loads, so
it never leaks into the parent test process.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The checkout this file lives in, ahead of any installed jaxrlhf (e.g. another worktree's
# editable install): the subprocess tests the same code as the parent test process.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import _models as M  # noqa: E402
from jaxrlhf import parallel  # noqa: E402
from jaxrlhf.algorithms.common import TrainState  # noqa: E402
from jaxrlhf.models import load_pretrained, random_init, save_pretrained, stack_layers  # noqa: E402
from jaxrlhf.models.transformer import Transformer, init_cache, init_params  # noqa: E402
from jaxrlhf.rollout.continuous import sample_continuous  # noqa: E402
from jaxrlhf.rollout.sampler import cpu_row_blocks, generate  # noqa: E402
from jaxrlhf.runs.checkpointing import Checkpointer  # noqa: E402

MESHES = {"fsdp4_tensor2": "data=1,fsdp=4,tensor=2", "data2_fsdp4": "data=2,fsdp=4,tensor=1"}
CHECKS = {}
MODEL = Transformer(M.LLAMA, "lm_value")  # the model of the init / forward / train checks
_CACHE = {}


def cached(fn):
    def wrapper(*args):
        key = (fn.__name__,) + args
        if key not in _CACHE:
            _CACHE[key] = fn(*args)
        return _CACHE[key]
    return wrapper


@cached
def mesh_of(name):
    return parallel.make_mesh(MESHES[name])


@cached
def sharded_params(name):
    """Born sharded under (fsdp=4, tensor=2) by `init_sharded`; placed by `device_put` under
    the other mesh (one init compilation each for the sharded and the reference params)."""
    if name == "fsdp4_tensor2":
        return parallel.init_sharded(MODEL, jax.random.key(0), mesh_of(name), seq_len=2)
    return jax.device_put(ref_params(), parallel.param_shardings(MODEL, mesh_of(name)))


@cached
def ref_params():
    return jax.jit(lambda r: init_params(MODEL, r, seq_len=2))(jax.random.key(0))


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def expect_raises(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in error message {msg!r}"
        return msg
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


def close(a, b, rtol=1e-5, atol=1e-6, what=""):
    fa, fb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert len(fa) == len(fb), what
    worst = 0.0
    for x, y in zip(fa, fb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=what)
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
    return worst


@check
def mesh_shapes():
    assert jax.device_count() == 8
    m = parallel.make_mesh("data=-1,fsdp=4,tensor=2")
    assert dict(m.shape) == {"data": 1, "fsdp": 4, "tensor": 2}, m.shape
    m = parallel.make_mesh({"fsdp": 4})
    assert dict(m.shape) == {"data": 2, "fsdp": 4, "tensor": 1}, m.shape
    m = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, tensor=2))
    assert m.axis_names == ("data", "fsdp", "tensor")
    expect_raises(ValueError, lambda: parallel.make_mesh("data=3,fsdp=2,tensor=1"), "6", "8")
    expect_raises(ValueError, lambda: parallel.make_mesh("data=-1,fsdp=3"), "divide")
    expect_raises(ValueError, lambda: parallel.make_mesh("data=-1,fsdp=-1"), "at most one")
    return "ok"


@check
def every_param_sharded():
    mesh = parallel.make_mesh(MESHES["fsdp4_tensor2"])
    out = []
    for cfg in (M.LLAMA, M.QWEN3):
        for head in ("lm", "score", "lm_value"):
            model = Transformer(cfg, head)
            sh = parallel.param_shardings(model, mesh)
            shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
            assert jax.tree.structure(sh) == jax.tree.structure(shapes)
            for s in jax.tree.leaves(sh):
                assert isinstance(s, jax.sharding.NamedSharding) and s.mesh == mesh
            out.append(len(jax.tree.leaves(sh)))
    model = Transformer(M.LLAMA, "lm_value")
    sh = parallel.param_shardings(model, mesh)
    attn = sh["layers_0"]["self_attn"]
    assert attn["q_proj"]["kernel"].spec == P("fsdp", "tensor", None), attn["q_proj"]["kernel"].spec
    assert attn["q_proj"]["bias"].spec == P("tensor", None)
    assert attn["o_proj"]["kernel"].spec == P("tensor", None, "fsdp")
    assert sh["layers_0"]["mlp"]["down_proj"]["kernel"].spec == P("tensor", "fsdp")
    assert sh["embed_tokens"]["embedding"].spec == P("tensor", "fsdp")
    assert sh["lm_head"]["kernel"].spec == P("fsdp", "tensor")
    assert sh["value_head"]["kernel"].spec == P("fsdp", None)
    assert sh["norm"]["scale"].spec == P(None)
    return f"params per model: {out}"


@check
def missing_rule_errors():
    mesh = parallel.make_mesh(MESHES["fsdp4_tensor2"])
    rules = tuple(r for r in parallel.DEFAULT_RULES if r[0] != "mlp")
    msg = expect_raises(parallel.MissingRuleError,
                        lambda: parallel.param_shardings(Transformer(M.LLAMA), mesh, rules),
                        "param layers_0/mlp/down_proj/kernel", "'mlp'")
    return msg


@check
def indivisible_errors():
    mesh = parallel.make_mesh(MESHES["fsdp4_tensor2"])
    cfg = M.LLAMA.replace(num_kv_heads=1)  # 1 kv head cannot split over tensor=2
    expect_raises(parallel.IndivisibleError, lambda: parallel.param_shardings(Transformer(cfg), mesh),
                  "layers_0/self_attn/k_proj/", "'kv_heads'", "size 1")
    sh = parallel.param_shardings(Transformer(cfg), mesh, on_indivisible="replicate")
    assert sh["layers_0"]["self_attn"]["k_proj"]["kernel"].spec == P("fsdp", None, None)
    expect_raises(parallel.IndivisibleError, lambda: parallel.shard_batch({"x": np.zeros((6, 3))}, mesh),
                  "batch leaf x", "size 6")
    return "ok"


@check
def bytes_per_device():
    out = []
    for mesh_name in MESHES:
        mesh = mesh_of(mesh_name)
        params = sharded_params(mesh_name)
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            parts = int(np.prod([mesh.shape[a] for ax in x.sharding.spec if ax
                                 for a in ((ax,) if isinstance(ax, str) else ax)]))
            assert len(x.addressable_shards) == 8
            for shard in x.addressable_shards:
                assert shard.data.nbytes * parts == x.nbytes, (path, shard.data.shape, x.shape, parts)
        total = sum(x.nbytes for x in jax.tree.leaves(params))
        per_dev = [0] * 8
        expected = 0
        for x in jax.tree.leaves(params):
            for shard in x.addressable_shards:
                per_dev[shard.device.id] += shard.data.nbytes
            parts = int(np.prod([mesh.shape[a] for ax in x.sharding.spec if ax
                                 for a in ((ax,) if isinstance(ax, str) else ax)]))
            expected += x.nbytes // parts
        assert per_dev == [expected] * 8, (per_dev, expected)
        # the matrices (all but norms, biases and the 1-wide value head) split 8 (resp. 4) ways
        k = params["layers_0"]["mlp"]["gate_proj"]["kernel"]
        assert k.addressable_shards[0].data.nbytes == k.nbytes // (8 if mesh_name == "fsdp4_tensor2" else 4)
        out.append(f"{mesh_name}: total {total} B, per device {max(per_dev)} B")
    return "; ".join(out)


@check
def init_equals_unsharded():
    got = sharded_params("fsdp4_tensor2")
    assert got["lm_head"]["kernel"].sharding.spec == P("fsdp", "tensor")
    close(got, ref_params(), rtol=2e-7, atol=0, what="init_sharded")  # the sharded normal sampler may round differently
    return "equal within 1 ulp"


@check
def forward_equals_unsharded():
    model, params = MODEL, ref_params()
    b = M.batch()
    ref = jax.jit(lambda p, x, m: model.apply({"params": p}, x, m))(params, b["sequences"], b["attention_mask"])
    worst = []
    for spec, name in zip(MESHES.values(), MESHES):
        mesh = mesh_of(name)
        p_sh = parallel.param_shardings(model, mesh)
        ps = jax.device_put(params, p_sh)
        bs = parallel.shard_batch({"x": b["sequences"], "m": b["attention_mask"]}, mesh)
        fwd = jax.jit(lambda p, x, m: model.apply({"params": p}, x, m), in_shardings=(
            p_sh, bs["x"].sharding, bs["m"].sharding))
        out = fwd(ps, bs["x"], bs["m"])
        worst.append(close((out.logits, out.values), (ref.logits, ref.values), rtol=1e-4, atol=1e-5, what=spec))
    return f"max |diff| {worst}"


@check
def gemma2_with_lora_equals_unsharded():
    """A Gemma-2-shaped model (local and global layers, both soft caps, sandwich norms,
    (1 + w) norms, GeGLU, scaled tied embeddings) with LoRA adapters on every projection
    (B random, so they count): logits, values and the adapters' gradients on (fsdp=4,
    tensor=2) equal one device's. Adapters follow their kernels' axes, rank unsharded."""
    from jaxrlhf.models import lora

    cfg = M.LLAMA.replace(model_type="gemma2", num_layers=2, sliding_window=4, qkv_bias=False, o_bias=False,
                          layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=5.0,
                          final_logit_softcapping=3.0, sandwich_norms=True, norm_plus_one=True,
                          scale_embeddings=True, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                          query_pre_attn_scalar=16.0, lora=lora.LoraConfig(rank=4))
    model = Transformer(cfg, "lm_value")
    base = jax.jit(lambda r: init_params(Transformer(cfg.replace(lora=None), "lm_value"), r, seq_len=2))(
        jax.random.key(5))
    params = lora.add_adapters(model, base, jax.random.key(6))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(jax.random.key(len(path)), x.shape) * 0.1
        if "lora_b" in jax.tree_util.keystr(path) else x, params)
    b = M.batch()

    def loss(adapters, p, x, m):
        out = model.apply({"params": lora.with_trainable(p, adapters)}, x, m)
        return jnp.sum(out.logits ** 2) * 1e-3 + jnp.sum(out.values), out

    fn = jax.value_and_grad(loss, has_aux=True)
    (_, want), want_g = jax.jit(fn)(lora.trainable(params), params, b["sequences"], b["attention_mask"])
    mesh = mesh_of("fsdp4_tensor2")
    p_sh = parallel.param_shardings(model, mesh)
    q_proj = p_sh["layers_0"]["self_attn"]["q_proj"]  # kernel [D, N, H]: A [D, r], B [r, N, H]
    a_spec, b_spec = q_proj["lora_a"].spec, q_proj["lora_b"].spec
    assert (a_spec, b_spec) == (P("fsdp", None), P(None, "tensor", None)), (a_spec, b_spec)
    ps = jax.device_put(params, p_sh)
    bs = parallel.shard_batch({"x": b["sequences"], "m": b["attention_mask"]}, mesh)
    (_, got), got_g = jax.jit(fn)(lora.trainable(ps), ps, bs["x"], bs["m"])
    d = close((got.logits, got.values), (want.logits, want.values), rtol=1e-4, atol=1e-5, what="outputs")
    d = max(d, close(got_g, want_g, rtol=1e-4, atol=1e-5, what="adapter gradients"))
    return f"q_proj adapters {a_spec} / {b_spec}, max |diff| {d:.1e}"


@check
def chunked_head_equals_unsharded():
    """The fused LM head (`logprobs_head="chunked"`, ops.linear_logprobs) with the
    vocabulary split over tensor=2: the policy loss and its gradients equal the plain head's
    on one device. Tied embeddings (Qwen3), whose head is `embedding.T`; the untied head
    runs sharded through the same `linear_logprobs` call."""
    mesh = mesh_of("fsdp4_tensor2")
    b = M.batch()
    out = []
    for cfg in (M.QWEN3,):
        plain, chunked = Transformer(cfg), Transformer(cfg.replace(logprobs_head="chunked"))
        params = jax.jit(lambda r: init_params(plain, r, seq_len=2))(jax.random.key(3))
        grad = lambda model: jax.jit(jax.value_and_grad(lambda p, x: M.loss_fn(model, p, x)[0]))
        want = grad(plain)(params, b)
        p_sh = parallel.param_shardings(chunked, mesh)
        head = p_sh["embed_tokens"]["embedding"] if cfg.tie_word_embeddings else p_sh["lm_head"]["kernel"]
        assert "tensor" in head.spec, head.spec
        got = grad(chunked)(jax.device_put(params, p_sh), parallel.shard_batch(b, mesh))
        d = close(got, want, rtol=1e-4, atol=1e-6, what=cfg.model_type)
        out.append(f"{cfg.model_type}: max |diff| {d:.1e}")
    return "; ".join(out)


@cached
def trained(mesh_name, steps=2):
    """`(state, metrics)` after `steps` AdamW steps, single-device for mesh_name None."""
    model, tx = MODEL, M.optimizer()
    step = M.make_step(model, tx)
    if mesh_name is None:
        state = TrainState.create(jax.tree.map(jnp.copy, ref_params()), tx)  # the step donates
        fn = jax.jit(step, donate_argnames=("state",))
        place = lambda b: b
    else:
        mesh = mesh_of(mesh_name)
        # params born sharded; the optimizer state is created from them and placed by path
        params = jax.tree.map(jnp.copy, sharded_params(mesh_name))  # the step donates its state
        state, sh = parallel.place_state(TrainState.create(params, tx),
                                         parallel.param_shardings(model, mesh))
        fn = parallel.jit_step(step, mesh=mesh, state_shardings=sh)
        place = lambda b: parallel.shard_batch(b, mesh)
    metrics = []
    for i in range(steps):
        state, m = fn(state, place(M.batch(i)), jax.random.key(i))
        metrics.append(m)
    return state, metrics


@check
def train_step_equals_unsharded():
    out = []
    ref_state, ref_metrics = trained(None)
    for mesh_name in MESHES:
        mesh = mesh_of(mesh_name)
        state, metrics = trained(mesh_name)
        # the optimizer moments live where their parameters do
        p_spec = state.params["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.spec
        mu = state.opt_state[0].mu["layers_0"]["mlp"]["up_proj"]["kernel"]
        assert mu.sharding.spec == p_spec, (mu.sharding.spec, p_spec)
        assert state.opt_state[0].count.sharding.is_fully_replicated
        assert p_spec == (P("fsdp", "tensor") if mesh.shape["tensor"] > 1 else P("fsdp", None)), p_spec
        d = close(state.params, ref_state.params, rtol=1e-4, atol=1e-5, what=f"{mesh_name} params")
        close(state.opt_state, ref_state.opt_state, rtol=1e-4, atol=1e-6, what=f"{mesh_name} opt")
        close(metrics, ref_metrics, rtol=1e-4, atol=1e-5, what=f"{mesh_name} metrics (loss, grad norm)")
        out.append(f"{mesh_name}: max |dparam| {d:.2e}, loss {float(metrics[-1]['loss']):.4f}")
    return "; ".join(out)


@cached
def qwen3_sampling_params():
    """The sampling checks' Qwen3 params, scaled ×8 for decisive choices (one eager init)."""
    return M.scale_params(init_params(Transformer(M.QWEN3), jax.random.key(5)), 8.0)


@check
def sampler_equals_unsharded():
    model, params = Transformer(M.QWEN3), qwen3_sampling_params()
    ids, mask = M.prompts()
    kw = dict(max_new_tokens=6, temperature=0.0, eos_id=None)
    ref = generate(model, params, ids, mask, jax.random.key(0), **kw)
    for spec in (MESHES["fsdp4_tensor2"],):  # kv heads over tensor, rows over fsdp
        mesh = parallel.make_mesh(spec)
        p_sh = parallel.param_shardings(model, mesh)
        out = parallel.generate_sharded(model, jax.device_put(params, p_sh), ids, mask, jax.random.key(0),
                                        mesh=mesh, params_shardings=p_sh, **kw)
        np.testing.assert_array_equal(np.asarray(out.response_ids), np.asarray(ref.response_ids), err_msg=spec)
        close(out.logprobs, ref.logprobs, rtol=1e-4, atol=1e-4, what=spec)
        assert out.response_ids.sharding.spec == parallel.batch_spec(2, mesh, rows=8)
        # Sharded params run as one program: no host-thread row blocks.
        assert cpu_row_blocks(8, jax.device_put(params, p_sh), ids, cpu_threads=4) == 1
        # Sampling too: each row's uniforms do not depend on how the rows are split.
        hot = dict(kw, temperature=1.0)
        want = generate(model, params, ids, mask, jax.random.key(3), **hot)
        got = parallel.generate_sharded(model, jax.device_put(params, p_sh), ids, mask, jax.random.key(3),
                                        mesh=mesh, params_shardings=p_sh, **hot)
        np.testing.assert_array_equal(np.asarray(got.response_ids), np.asarray(want.response_ids), err_msg=spec)
    cache = [jnp.zeros((8, 2, 11, 8))] * 2
    mesh = parallel.make_mesh(MESHES["fsdp4_tensor2"])
    assert parallel.cache_shardings(cache, mesh)[0].spec == P("fsdp", "tensor", None, None)
    one_kv = parallel.cache_shardings([jnp.zeros((8, 1, 11, 8))], mesh)[0].spec
    assert one_kv == P("fsdp", None, None, None), one_kv
    layer = parallel.cache_shardings(init_cache(model.config, 8, 11), mesh)[0]  # k [B,K,H,S], v [B,K,S,H]
    assert (layer.k.spec, layer.v.spec) == (P("fsdp", "tensor", None, None),) * 2, layer
    return f"tokens {np.asarray(ref.response_ids)[0].tolist()}"


@check
def continuous_equals_unsharded():
    """Continuous batching (3 slots, a queue of 16 rows) with params under (fsdp=4, tensor=2)
    and the prompt rows over fsdp samples what the static sampler samples on one device."""
    model, params = Transformer(M.QWEN3), qwen3_sampling_params()
    embed = params["embed_tokens"]["embedding"]
    params = dict(params, embed_tokens={"embedding": embed.at[2].multiply(3.0)})  # tied head: EOS likelier
    ids, mask = M.prompts()
    kw = dict(max_new_tokens=5, temperature=1.0, eos_id=2, num_samples=2)
    ref = generate(model, params, ids, mask, jax.random.key(4), cpu_threads=1, **kw)
    mesh = mesh_of("fsdp4_tensor2")
    p_sh = parallel.param_shardings(model, mesh)
    rows = jax.sharding.NamedSharding(mesh, parallel.batch_spec(2, mesh, rows=8))
    fn = jax.jit(lambda p, i, m, r: sample_continuous(model, p, i, m, r, slots=3, **kw))
    out = fn(jax.device_put(params, p_sh), jax.device_put(ids, rows), jax.device_put(mask, rows), jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(out.response_ids), np.asarray(ref.response_ids))
    close(out.logprobs, ref.logprobs, rtol=1e-4, atol=1e-4, what="logprobs")
    lengths = np.asarray(ref.lengths)
    assert len(set(lengths.tolist())) > 1, lengths
    return f"lengths {lengths.tolist()}"


@check
def checkpoint_restores_into_other_mesh():
    model = MODEL
    mesh_b = mesh_of("data2_fsdp4")
    state, _ = trained("fsdp4_tensor2")  # saved under (fsdp=4, tensor=2), restored into (data=2, fsdp=4)
    with tempfile.TemporaryDirectory() as d:  # the run's one orbax wrapper, `runs.checkpointing`
        saving = Checkpointer(os.path.join(d, "ckpt"))
        saving.save(1, state, {"step": 1})
        saving.close()  # waits for the asynchronous save
        sh_b = parallel.state_shardings(jax.eval_shape(lambda: state), parallel.param_shardings(model, mesh_b))
        restoring = Checkpointer(os.path.join(d, "ckpt"))
        step, restored, meta = restoring.restore(parallel.abstract_state(state, sh_b))
        restoring.close()
    assert (step, meta) == (1, {"step": 1}), (step, meta)
    close(restored, state, rtol=0, atol=0, what="restored")
    k = restored.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert k.sharding.mesh == mesh_b and k.sharding.spec == P("fsdp", None, None), k.sharding
    assert restored.opt_state[0].mu["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec == k.sharding.spec
    return "ok"


@check
def hf_load_sharded_equals_whole():
    out = []
    for cfg in (M.LLAMA, M.QWEN3.replace(tie_word_embeddings=False)):
        model, params = random_init(cfg, seed=7)
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(model, params, d, overwrite=True, max_shard_bytes=40_000)  # several files
            _, whole = load_pretrained(d)
            for spec in MESHES.values():
                mesh = parallel.make_mesh(spec)
                m2, sharded = parallel.load_pretrained_sharded(d, mesh)
                close(sharded, whole, rtol=0, atol=0, what=f"{cfg.model_type} {spec}")
                want = parallel.param_shardings(m2, mesh)
                for x, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(want)):
                    assert x.sharding == s, (x.sharding, s)
        out.append(cfg.model_type)
    return f"exact for {out}"


@check
def scanned_stack_sharded():
    """A scanned 2-layer model loaded sharded from an unrolled HF folder: stacked params
    keep their layer axis whole, the forward and greedy sampling (with a 5-D cache) equal
    the unrolled model's unsharded ones."""
    mesh = mesh_of("fsdp4_tensor2")
    cfg = M.LLAMA.replace(num_layers=2)
    model_u, params_u = random_init(cfg, seed=9)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model_u, params_u, d, overwrite=True, max_shard_bytes=40_000)  # layers in several files
        model, params = parallel.load_pretrained_sharded(d, mesh, scan_layers=True)
    close(params, stack_layers(params_u), rtol=0, atol=0, what="stacked load")
    assert params["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert params["layers"]["mlp"]["down_proj"]["kernel"].sharding.spec == P(None, "tensor", "fsdp")
    assert params["layers"]["input_layernorm"]["scale"].sharding.spec == P(None, None)
    b = M.batch()
    ref = jax.jit(lambda p, x, m: model_u.apply({"params": p}, x, m))(params_u, b["sequences"], b["attention_mask"])
    bs = parallel.shard_batch({"x": b["sequences"], "m": b["attention_mask"]}, mesh)
    out = jax.jit(lambda p, x, m: model.apply({"params": p}, x, m))(params, bs["x"], bs["m"])
    worst = close(out.logits, ref.logits, rtol=1e-4, atol=1e-5, what="scanned sharded forward")
    cache = parallel.cache_shardings(init_cache(model.config, 8, 11), mesh)  # k [B, n, K, H, S]
    assert (cache.k.spec, cache.v.spec) == (P("fsdp", None, "tensor", None, None),) * 2, cache
    ids, mask = M.prompts()
    kw = dict(max_new_tokens=5, temperature=0.0, eos_id=None)
    want = generate(model_u, params_u, ids, mask, jax.random.key(0), **kw)
    got = parallel.generate_sharded(model, params, ids, mask, jax.random.key(0), mesh=mesh,
                                    params_shardings=parallel.param_shardings(model, mesh), **kw)
    np.testing.assert_array_equal(np.asarray(got.response_ids), np.asarray(want.response_ids))
    return f"forward max |diff| {worst:.1e}; tokens {np.asarray(want.response_ids)[0].tolist()}"


@check
def splash_shard_map_equals_dense():
    """The splash kernel (Pallas interpreter) per device of a (data 2, fsdp 2, tensor 2)
    mesh under the default rules equals dense attention, values and gradients; each device
    sees B/4 rows and K/2 kv heads, and "auto" on TPU takes splash only inside the context."""
    from jaxrlhf.models import _kernels, attention

    rng = np.random.default_rng(0)
    b, l, n, kh, h = 4, 40, 6, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, l, n, h), (b, kh, l, h), (b, kh, l, h)))
    valid = np.ones((b, l), bool)
    valid[0, :5] = False   # left padding
    valid[1, 30:] = False  # right padding
    valid[2, 3:9] = False  # a hole
    valid[3] = False       # nothing real
    valid = jnp.asarray(valid)
    mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
    seen = []
    local = _kernels._splash_local

    def spy(q_, *args, **kw):
        seen.append(q_.shape)
        return local(q_, *args, **kw)

    big = dict(num_queries=4096, num_keys=4096, num_groups=3, queries_are_keys=True, platform="tpu")
    assert attention.choose("auto", **big) == "chunked"
    _kernels._splash_local = spy
    try:
        with parallel.kernel_mesh(mesh, parallel.DEFAULT_RULES):
            assert attention.choose("auto", **big) == "splash"
            km = attention.current_kernel_mesh()
            fn = lambda q, k, v: _kernels.splash(q, k, v, valid, scale=0.3, window=None, interpret=True, mesh=km)
            cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
            got, vjp = jax.vjp(jax.jit(fn), q, k, v)
            got_grads = vjp(cot)
    finally:
        _kernels._splash_local = local
    assert seen and all(s == (b // 4, l, n // 2, h) for s in seen), seen
    mask = attention.AttentionMask(valid, jnp.arange(l, dtype=jnp.int32))
    want, want_vjp = jax.vjp(lambda q, k, v: attention.dense(q, k, v, mask, scale=0.3), q, k, v)
    worst = close(got, want, rtol=0, atol=1e-5, what="values")
    worst = max(worst, close(got_grads, want_vjp(cot), rtol=0, atol=1e-5, what="gradients"))
    return f"per-device q {seen[0]}, max |diff| {worst:.1e}"


def _algo_batch(seed=0):
    b = M.batch(seed)
    r = np.random.default_rng(seed + 100)
    b["ref_logp"] = b["old_logp"] + 0.05 * r.standard_normal(b["old_logp"].shape).astype(np.float32)
    b["old_values"] = r.standard_normal(b["old_logp"].shape).astype(np.float32)
    b["returns"] = r.standard_normal(b["old_logp"].shape).astype(np.float32)
    return b


def _compare_update(name, update, state, batch, place):
    """Run `update` single-device and sharded on both meshes; the states and metrics agree."""
    copy = lambda t: jax.tree.map(jnp.copy, t)
    rng = jax.random.key(11)
    ref_state, ref_metrics = jax.jit(update)(copy(state), batch, rng)
    out = []
    for mesh_name in MESHES:
        mesh = mesh_of(mesh_name)
        sharded, sh = place(copy(state), mesh)
        fn = parallel.jit_step(update, mesh=mesh, state_shardings=sh)
        new, metrics = fn(sharded, parallel.shard_batch(batch, mesh), rng)
        d = close(new, ref_state, rtol=1e-4, atol=1e-5, what=f"{name} {mesh_name} state")
        close(metrics, ref_metrics, rtol=1e-4, atol=1e-5, what=f"{name} {mesh_name} metrics")
        out.append(f"{mesh_name}: max |dstate| {d:.1e}")
    return "; ".join(out)


@check
def grpo_update_equals_unsharded():
    import functools

    from jaxrlhf.algorithms import grpo
    from jaxrlhf.algorithms.experience import SamplingConfig

    model, tx = Transformer(M.LLAMA), M.optimizer()
    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=M.T_LEN, num_samples=2), beta=0.04,
                          num_minibatches=2, clip_high=0.28)
    params = jax.jit(lambda r: init_params(model, r, seq_len=2))(jax.random.key(2))
    state = grpo.init_state(params, tx, ref_params=jax.tree.map(jnp.copy, params))
    b = _algo_batch()
    batch = grpo.Batch(sequences=b["sequences"], attention_mask=b["attention_mask"],
                       response_mask=b["response_mask"], advantages=b["advantages"], old_logp=b["old_logp"],
                       ref_logp=b["ref_logp"])
    update = functools.partial(grpo.update, model=model, tx=tx, cfg=cfg)
    # policy params, their optimizer state and the reference all follow the model's rules
    place = lambda st, mesh: parallel.place_state(st, parallel.param_shardings(model, mesh))
    return _compare_update("grpo", update, state, batch, place)


@check
def ppo_update_equals_unsharded():
    import functools

    from jaxrlhf.algorithms import ppo
    from jaxrlhf.algorithms.experience import SamplingConfig

    actor, critic = Transformer(M.LLAMA), Transformer(M.QWEN3, "score")
    tx_a, tx_c = M.optimizer(), M.optimizer()
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=M.T_LEN), num_ppo_epochs=1, num_minibatches=2,
                        critic="separate")
    init = jax.jit(lambda r: (init_params(actor, r, seq_len=2), init_params(critic, r, seq_len=2)))
    actor_params, critic_params = init(jax.random.key(4))
    state = ppo.init_state(cfg, actor, actor_params, tx_a, critic_model=critic, critic_params=critic_params,
                           tx_critic=tx_c)
    b = _algo_batch(1)
    batch = ppo.Batch(**{k: b[k] for k in ("sequences", "attention_mask", "response_mask", "old_logp", "advantages",
                                          "old_values", "returns")})
    update = functools.partial(ppo.update, actor_model=actor, critic_model=critic, tx_actor=tx_a,
                               tx_critic=tx_c, cfg=cfg)

    def place(st, mesh):  # each role its own rules: the actor FSDP+TP, the critic pure FSDP
        actor_sh = parallel.param_shardings(actor, mesh)
        critic_sh = parallel.param_shardings(critic, mesh, parallel.FSDP_RULES)
        return parallel.place_state(st, roles={"actor": actor_sh, "critic": critic_sh, "ref_params": actor_sh})

    return _compare_update("ppo", update, state, batch, place)


def main():
    out_path, names = sys.argv[1], sys.argv[2:] or list(CHECKS)
    results = {}
    import time
    for name in names:
        t0 = time.time()
        try:
            results[name] = {"ok": True, "detail": str(CHECKS[name]())}
        except Exception:  # reported to the parent test
            results[name] = {"ok": False, "detail": traceback.format_exc()}
        results[name]["seconds"] = round(time.time() - t0, 1)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
