"""The sections every config file in `configs/` is assembled from, with their defaults.

A config file picks sections, changes what its task needs, and `lock()`s the result, so
that `--config.optim.lr=1e-6` works and `--config.optim.lrr=1e-6` is an error naming `lr`.
"""

from __future__ import annotations

import ml_collections as mlc


def parallel(c: mlc.ConfigDict, *, mesh: str = "data=-1", rules: str = "fsdp_tp") -> mlc.ConfigDict:
    """Top-level `mesh` and `rules` of config `c`: the device mesh every phase runs on and
    the sharding rules of every role's parameters (policy, reference, critic, reward model).

    `mesh` is a `parallel.make_mesh` spec over all devices of all processes, e.g.
    "data=-1" (the default: the batch split over every device, parameters replicated) or
    "fsdp=4,tensor=2"; `rules` a preset of `jaxrlhf.parallel.PRESETS` ("fsdp_tp": FSDP on
    the model dimension plus tensor parallelism, "fsdp", "replicated"; checked when the
    run starts). Override with `--config.mesh=fsdp=2,tensor=2 --config.rules=fsdp`.
    """
    c.mesh = mesh
    c.rules = rules
    return c


def task(**kw) -> mlc.ConfigDict:
    """The built-in addition task. `partial_credit`: weight of the per-digit reward beside
    exact match; `length_bonus`: weight of a reward for the fraction of `max_new_tokens`
    used — a deliberately wrong reward, to see the monitor's `[length_hacking]` warning."""
    return mlc.ConfigDict(dict(dict(
        name="addition", num_digits=2, reverse_answer=False, num_train=8000, num_test=500, num_pairs=0,
        partial_credit=0.0, length_bonus=0.0, seed=0), **kw))


def jsonl_task(**kw) -> mlc.ConfigDict:
    """Rows from local JSONL/Parquet files and TFDS datasets (`tasks.jsonl`).
    `kind`: "prompts" (GSM8K-style prompt + reference answer, for GRPO/PPO), "sft"
    (`messages_key` chats learnt on their assistant turns, or `prompt_key` / `completion_key`
    pairs) or "pairs" (`prompt_key` / `chosen_key` / `rejected_key`, strings or message
    lists, for DPO and reward models). `path` / `test_path`: a source spec,
    "a.jsonl:0.7,tfds:name/split:0.3" (`data.sources`: weights optional, TFDS datasets read
    from `data_dir`, mixed with `seed`). `stop_tokens`: more tokens that end a response
    besides the tokenizer's EOS and the checkpoint's `generation_config.json`
    `eos_token_id`s (token strings or ids, comma-separated, e.g. "<|endoftext|>";
    `tasks.text_stop_ids`). `stop_strings`: text that ends a response, comma-separated
    ("</answer>,\\n\\n") or a JSON list when one holds a comma; each response is cut on the
    host after the first token at which its text contains one (`rollout.stop_strings`).
    `chat_template_kwargs`: a JSON object of extra chat-template variables for every
    rendering ('{"enable_thinking": false}'). `chat_template_timeout`: the seconds one
    rendering of the chat template may take (default 10; 0 = no limit): a template that
    loops past it stops the run, naming the template and the row (`data.chat`). `long_prompts`: a prompt over
    `max_prompt_tokens` is "drop"ped (counted as too_long) or "left_truncate"d to its last
    `max_prompt_tokens` tokens (counted); `data.records`. `sft_path` / `pairs_path`: source
    specs of the run's other phases' rows, read as kind "sft" / "pairs" with the same
    field names: the SFT warm start's examples and the reward model's pairs of a GRPO or PPO
    run on prompts (SFT -> reward model -> PPO, all from files). `max_row_bytes`: a row
    (JSONL line, Parquet/TFDS row's text) of more bytes is bad (`row_too_long`: skipped or
    an error by `on_error`), found after reading at most this + 1 bytes of it, before it is
    parsed or tokenized (default 1 MiB); `max_file_bytes`: a larger file is refused
    (default 10 GiB); 0 = no limit (`data.jsonl`)."""
    return mlc.ConfigDict(dict(dict(
        name="jsonl", kind="prompts", path="", test_path="", data_dir="", seed=0, tokenizer_path="",
        prompt_key="question", answer_key="answer", messages_key="messages", completion_key="completion",
        chosen_key="chosen", rejected_key="rejected", max_prompt_tokens=256, max_response_tokens=512,
        max_new_tokens=256, chat_template=True, system_prompt="", on_error="skip", stop_tokens="", stop_strings="",
        chat_template_kwargs="", chat_template_timeout=10.0, long_prompts="drop", sft_path="", pairs_path="",
        max_row_bytes=2**20, max_file_bytes=10 * 2**30), **kw))  # `records.MAX_ROW_BYTES`, `jsonl.MAX_FILE_BYTES`


def word_problems_task(**kw) -> mlc.ConfigDict:
    """Generated one-digit arithmetic questions in words for a Hugging Face chat model
    (`data.make_word_problems`); reward = exact answer + format_weight × "#### <n>" format;
    `stop_tokens`, `stop_strings`, `chat_template_kwargs`, `chat_template_timeout`, `long_prompts` as in
    `jsonl_task`."""
    return mlc.ConfigDict(dict(dict(
        name="word_problems", tokenizer_path="", num_train=4000, num_test=200, seed=0, max_prompt_tokens=128,
        max_new_tokens=48, chat_template=True, system_prompt="Answer with '#### <number>'.", format_weight=0.0,
        stop_tokens="", stop_strings="", chat_template_kwargs="", chat_template_timeout=10.0,
        long_prompts="drop"), **kw))


def reward(**kw) -> mlc.ConfigDict:
    """Python rewards beside the task's own (`runs.tasks.with_python_rewards`): `fns`,
    comma-separated import paths "pkg.module:function" of functions in TRL's `reward_funcs`
    convention, `fn(prompts=[...], completions=[...], **row_fields) -> list[float]`;
    `weights`, one per function ("" = 1.0 each); `task_weight`, the task's own reward's
    weight (0 = train on yours alone; it is still the held-out `accuracy`).
    `timeout`: seconds each call of a function may take (default 300): each runs in a
    worker process of its own (`reward_workers.Clocked`), a progress line every
    min(30 s, timeout / 4) while one runs long, and a call past the timeout is abandoned
    (the worker killed, a fresh one started for the next call); 0 (or None) = no limit,
    the functions run in the run's own process. `on_timeout`: "error" (stop the run naming the
    function) or "zero" (score that batch 0 for that function, warn, and count it in
    `reward/<name>/timeouts`). `max_abs_score`: a score above this in absolute value is an
    error naming the function and the row (0 = finite is enough). A score may be a
    bool (0/1) or None (no score for that response: left out of that function's term and
    of its mean; a row no weighted reward scores is an error).
    `model_path`: a Hugging Face `*ForSequenceClassification` folder whose score of prompt ⧺
    response (at its last valid token) joins the reward of GRPO and of PPO with
    `ppo.reward="task"`, at `model_weight`, frozen and compiled into the step
    (`runs.reward_folder`); its tokenizer must encode like the task's."""
    return mlc.ConfigDict(dict(dict(fns="", weights="", task_weight=1.0, timeout=300.0, on_timeout="error",
                                    max_abs_score=1e6, model_path="", model_weight=1.0), **kw))


def model(**kw) -> mlc.ConfigDict:
    """A fresh model of these sizes, or `path=` a local Hugging Face checkpoint folder.
    `lora`: train low-rank adapters instead of all weights (`lora()`)."""
    return mlc.ConfigDict(dict(dict(
        path="", hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32,
        max_position_embeddings=64, tie_word_embeddings=False, dtype="float32", param_dtype="float32",
        remat="none", scan_layers=False, attention="auto", cache_dtype=mlc.config_dict.placeholder(str),
        matmul_dtype=mlc.config_dict.placeholder(str), logprobs_head="auto", lora=lora()), **kw))


def lora(**kw) -> mlc.ConfigDict:
    """LoRA adapters (`jaxrlhf.models.lora`; every phase: SFT, GRPO, DPO, PPO's actor and
    critic, the reward model). rank: 0 = off (all weights trained), r > 0 = only rank-r
    adapters are (and a critic's or reward model's new head), the rest frozen, and the
    reference of GRPO/PPO/DPO is the base without them. alpha: scale alpha / r (alpha /
    sqrt(r) with `rslora`). targets: comma-separated regexes searched in the projection paths
    ("self_attn/q_proj", ..., "mlp/down_proj", "lm_head" when untied). phases: the phases
    that train adapters, comma-separated ("" = all; "grpo": the SFT warm start trains all
    weights); each starts with fresh ones, those of the phase before merged. quantize:
    QLoRA, "none" | "int8" | "nf4": the frozen base's layer projections stored quantised
    from the first adapter phase on (`jaxrlhf.models.quant`). dropout: p in [0, 1) of the
    adapters' input in training losses only (PEFT's `lora_dropout`; 0 = off)."""
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # `models.lora.DEFAULT_TARGETS`
    return mlc.ConfigDict(dict(dict(rank=0, alpha=16.0, targets=targets, rslora=False, dropout=0.0, phases="",
                                    quantize="none"),
                               **kw))


def optim(**kw) -> mlc.ConfigDict:
    return mlc.ConfigDict(dict(dict(
        lr=1e-5, schedule="constant", warmup_steps=0, decay_steps=0, end_lr_ratio=0.0, b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.0, max_grad_norm=1.0), **kw))


def sampling(**kw) -> mlc.ConfigDict:
    """How the RL phases sample (`algorithms.experience.SamplingConfig`); `min_new_tokens`:
    the task's EOS cannot be drawn before that many response tokens (0 = off); `slots`:
    0 = one static batch, S > 0 = continuous batching with S rows decoded at once."""
    return mlc.ConfigDict(dict(dict(max_new_tokens=8, min_new_tokens=0, temperature=1.0, top_k=0, top_p=1.0,
                                    num_samples=8, slots=0), **kw))


def sft(**kw) -> mlc.ConfigDict:
    """Supervised phase (the warm start of RL runs; `steps=0` skips it)."""
    opt = kw.pop("optim", {})
    return mlc.ConfigDict(dict(dict(
        steps=0, batch_size=64, seed=0,
        optim=optim(**dict(dict(lr=3e-3, schedule="cosine", warmup_steps=50), **opt))), **kw))


def addition_warm_start() -> mlc.ConfigDict:
    """The addition configs' SFT warm start: 600 steps of a 900-step cosine schedule at lr
    1e-3, stopping with the policy still wrong on a quarter of held-out sums (0.78 / 0.75 /
    0.63 exact match for seeds 0 / 1 / 2) for the RL phase to work on. At lr 3e-3 the end
    point was bimodal (0.12 to 0.94 by seed and even by float rounding)."""
    return sft(steps=600, batch_size=64, optim=dict(lr=1e-3, schedule="cosine", warmup_steps=50,
                                                    decay_steps=900, end_lr_ratio=0.1))


def grpo(**kw) -> mlc.ConfigDict:
    """GRPO family; see `jaxrlhf.algorithms.grpo.GRPOConfig` for each field (0 = off).
    `kl_in`: "loss" or "reward" (the KL's placement); `kl_target` > 0 adapts β.
    `guide_coef` > 0: add that times the NLL of the reference completion of every prompt
    whose group's best score is below `guide_below` (`algorithms.guide`; the task must have
    reference completions: the addition task has)."""
    opt = kw.pop("optim", {})
    samp = kw.pop("sampling", {})
    return mlc.ConfigDict(dict(dict(
        steps=100, prompts_per_step=16, pool_size=0, seed=0, sampling=sampling(**samp),
        advantage="grpo", adv_eps=1e-6, beta=0.0, kl_estimator="k3", kl_in="loss", kl_target=0.0,
        kl_horizon=10000, clip_low=0.2, clip_high=0.0, dual_clip=0.0,
        agg="token-mean", norm_len=0, entropy_coef=0.0, num_iterations=1, num_minibatches=1, num_microbatches=1,
        ratio_level="token", dynamic_sampling=False, overlong_max_len=0, overlong_cache=0, track_kl=False,
        guide_coef=0.0, guide_below=1.0, optim=optim(**opt)), **kw))


def monitor(**kw) -> mlc.ConfigDict:
    """The health monitor's thresholds (`jaxrlhf.monitor.MonitorConfig`; 0 = off).

    kl_target: warn when the KL to the reference passes kl_factor × this (GRPO: the
      per-token mean, nats; PPO: nats per response, and its adaptive controller's
      `ppo.kl_target` when this is 0). For GRPO with β = 0 a target keeps the reference
      model to measure the KL (`grpo.track_kl`). clipfrac_max / clipfrac_patience: warn when
      the clip fraction stays above the first for that many steps. length_window /
      length_growth: warn when over the window the reward rose while the mean response
      length grew by more than that fraction.
    """
    return mlc.ConfigDict(dict(dict(
        kl_target=0.0, kl_factor=3.0, clipfrac_max=0.3, clipfrac_patience=5, length_window=10,
        length_growth=0.5), **kw))


def train(**kw) -> mlc.ConfigDict:
    """The loop: logging, evaluation, checkpoints, export, the health monitor.

    Held-out evaluation (every `eval_every` steps of each phase, 0 = only the summary's
    rows) decodes greedily (`eval/accuracy`, `eval/reward`) and, with `eval_samples` = n > 0,
    also samples n responses per prompt at `eval_temperature` and reports `mean@n` and, for
    each k of `eval_k` ("1,4,8": each k in [1, n]), `pass@k` and `maj@k` (`runs.evaluation`).
    `eval_batch_size` counts sequences: a sampled batch holds eval_batch_size // n prompts.
    `eval_slots` = S > 0 decodes each evaluation batch (greedy and sampled) by continuous
    batching over S slots (`rollout.continuous`: the same tokens, faster where response
    lengths spread; 0 = one static batch).

    Stopping on a held-out metric (`runs.stopping`; needs `eval_every` > 0):
    stop_metric: an evaluation metric to watch, without the `eval/` prefix (e.g. "accuracy",
      "pass@4"; "" = off). stop_mode: "max" (higher is better) or "min". An evaluation is a
      new best when it beats the best so far by more than stop_min_delta. stop_patience: end
      the phase (as a finished phase) after that many evaluations in a row without a new
      best (0 = never; the best is still recorded). keep_best: end the phase with the
      parameters of its best evaluation, not the last ones (the next phase, the summary's
      "after" row and the export use them; costs one device copy of the policy's parameters,
      and each checkpoint holds them too). stop_phases: the phases the rule applies to,
      comma-separated (e.g. "sft,ppo"; "" = the run's own phase, `config.algorithm`).

    max_param_norm_change: after every update of every phase the new state is checked
      before it can be saved (`runs.health`): all of it finite, and the global norm of the
      trained parameters changed by at most this fraction of its value (1.0: the norm may
      not double, nor drop to 0, in one update; the shipped configs change it by at most
      ~0.001 per update). A blow-up stops the run at that step with the reason, keeping the
      checkpoints before it. 0 = no bound (finiteness is still checked).

    wandb: also log every metrics row to Weights & Biases (`pip install jaxrlhf[wandb]`),
      project `wandb_project`, mode `wandb_mode` ("online" | "offline"; "" = online when
      WANDB_API_KEY is set, else offline: the run is kept under `<workdir>/wandb`, upload it
      later with `wandb sync`).

    log_completions_every: every N steps of a GRPO/PPO phase (0 = off) write the first
      `runs.completions.ROWS` sampled responses of the step (prompt, completion, their token
      ids, each reward component, the total and the advantage) to
      `<workdir>/completions.jsonl`, and with `wandb` as a `completions` table.

    hooks: the user's hooks of every phase's loop, comma-separated import paths
      "pkg.mod:Hook,other.mod:make_hook" (a class or factory is called with no arguments;
      "" = none). `runs.hooks` lists their moments (on_start, on_step, on_eval, on_save,
      on_end) and order. checkpoint_every_s: also save a checkpoint whenever this many
      seconds passed since the last one (e.g. 1800 on a preemptible machine; 0 = off;
      `checkpoint_every` still applies).

    time_split: run each GRPO/PPO step as three programs (rollout, scoring, update), each
      waited for, and report where the time goes: `time/rollout_s`, `time/scoring_s`,
      `time/update_s`, `time/tokens_per_s` (`algorithms.timing`). On by default: against
      the one fused program it cost +1.4 % (GRPO) and +0.5 % (PPO) wall time per step on
      the reference workload, less than the run-to-run noise on the default configs' steps
      (docs/benchmarks.md, `benchmarks/bench_time_split.py`). False: a JAX reward's step is
      one program again, untimed (a host reward's is split all the same).
    """
    mon = kw.pop("monitor", {})
    return mlc.ConfigDict(dict(dict(
        log_every=10, eval_every=0, checkpoint_every=100, keep_checkpoints=2, progress=True, tensorboard=True,
        show_samples=5, export=True, eval_batch_size=512, eval_samples=0, eval_k="1,4,8", eval_temperature=1.0,
        eval_slots=0,
        stop_metric="", stop_mode="max", stop_patience=0, stop_min_delta=0.0, keep_best=False, stop_phases="",
        max_param_norm_change=1.0, time_split=True, wandb=False, wandb_project="jaxrlhf", wandb_mode="",
        log_completions_every=0, hooks="", checkpoint_every_s=0.0,
        monitor=monitor(**mon)), **kw))


def pairs_phase(kind: str, **kw) -> mlc.ConfigDict:
    """Training on preference pairs: kind "reward_model" or "dpo".

    The reward model's `pairs`: "task" (the task's synthetic pairs), "policy" (the policy's
    own samples ranked by the task's reward: `samples_per_prompt` at `temperature` for each
    of the first `num_prompts` training prompts, 0 = all; `runs.policy_pairs`) or "both".
    With `samples_per_prompt` > 0 the held-out prompts' on-policy pairs are evaluated too
    (`eval/policy_pairs/accuracy`), whatever `pairs` is; 0 = no on-policy pairs.

    `ensemble`: K >= 1 reward models trained alike on the same pairs (member k's score head
    and batch order from `seed + k`); PPO's reward is their scores reduced by
    `ensemble_reduce`, "mean" or "min" (the conservative one), and `reward/reward_model_std`
    logs their disagreement. `sft_steps`: extra SFT steps (the `sft` section's batch size
    and optimizer, a fresh schedule, batch order from `sft.seed + 1`) on the reward model's
    own copy of the policy's trunk before it learns from pairs: a trunk that has learnt the
    task further than the policy (0 = the policy's trunk as it is).
    """
    opt = kw.pop("optim", {})
    extra = dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0, nll_coef=0.0) if kind == "dpo" else dict(
        pairs="task", samples_per_prompt=0, temperature=1.0, num_prompts=0, ensemble=1, ensemble_reduce="mean",
        sft_steps=0)
    return mlc.ConfigDict(dict(dict(steps=100, batch_size=32, seed=0, num_microbatches=1, **extra,
                                    optim=optim(**opt)), **kw))


def ppo(**kw) -> mlc.ConfigDict:
    """RLHF-PPO; see `jaxrlhf.algorithms.ppo.PPOConfig` for each field (0 / "" = off).
    `reward`: "model" (a reward model trained on the task's pairs, the `reward_model`
    section) or "task" (the task's rule-based reward; no reward model). `kl_in`: "reward"
    (per-token, before GAE) or "loss" (β·agg(KL) in the actor loss)."""
    opt = kw.pop("optim", {})
    copt = kw.pop("critic_optim", {})
    samp = kw.pop("sampling", {})
    return mlc.ConfigDict(dict(dict(
        steps=100, prompts_per_step=32, seed=0, sampling=sampling(**dict(dict(num_samples=1), **samp)),
        reward="model", kl_estimator="k1", kl_in="reward", kl_coef=0.05, kl_target=0.0, kl_horizon=10000, missing_eos_penalty=0.0,
        reward_whitening="", reward_clip=0.0, gamma=1.0, lam=0.95, whiten_advantages=True, clip=0.2, vf_clip=0.2,
        vf_coef=0.1, ent_coef=0.0, agg="token-mean", num_ppo_epochs=4, num_minibatches=1, num_microbatches=1,
        critic="separate", optim=optim(**opt), critic_optim=optim(**copt)), **kw))
