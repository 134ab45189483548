"""The config sections a run is made of, as dataclasses: the schema of every `--config.*`.

A phase's section is its run options (`SFTRun`, `GRPORun`, ...: steps, batch counts, seed,
optimizer) beside its algorithm's library config (`SFTConfig`, `GRPOConfig`, ...), flat:
`--config.grpo.steps` and `--config.grpo.clip_low` sit side by side, and the phase builds
`GRPOConfig` from its section with `options.build` (no translator in between). The other
sections (`train`, `reward`, `model`, `task`, the top level's `mesh` and `rules`) are
dataclasses here too. Each field holds its default, bounds, doc and resume safety
(`jaxrlhf.options.option`); `config_base` makes the sections from them, `validation`
checks a config against them, `workdir` reads which keys may change on resume, and
docs/options.md is generated from them (`python -m jaxrlhf.runs.sections > docs/options.md`).
"""

from __future__ import annotations

import dataclasses
import sys

from jaxrlhf import options
from jaxrlhf.algorithms.common import OptimConfig
from jaxrlhf.algorithms.dpo import DPOConfig
from jaxrlhf.algorithms.grpo_config import GRPOConfig
from jaxrlhf.algorithms.opd import OPDConfig
from jaxrlhf.algorithms.ppo_config import PPOConfig
from jaxrlhf.algorithms.reward_model import RewardModelConfig
from jaxrlhf.algorithms.sft import SFTConfig
from jaxrlhf.monitor import MonitorConfig
from jaxrlhf.options import option
from jaxrlhf.runs import registry
from jaxrlhf.runs.pipeline import PipelineSection

_frozen = dataclasses.dataclass(frozen=True)
PPO_REWARDS = ("model", "task")
PAIR_SOURCES = ("task", "policy", "both")
ENSEMBLE_REDUCE = ("mean", "min")


def _seed():
    return option(0, "the seed of the phase's batch order (and its fresh heads)")


@_frozen
class SFTRun:
    steps: int = option(0, "SFT steps: the warm start of an RL run (0 skips it), or the whole of an SFT run (>= 1)",
                        min=0)
    batch_size: int = option(64, "examples per step", min=1)
    seed: int = _seed()
    optim: OptimConfig = option(doc="the optimizer", factory=lambda: OptimConfig(lr=3e-3, schedule="cosine",
                                                                                warmup_steps=50))


@_frozen
class GRPORun:
    steps: int = option(100, "iterations: a rollout of prompts_per_step prompts and its updates each", min=1)
    prompts_per_step: int = option(16, "prompts per iteration, G responses each (under dynamic sampling: the groups "
                                   "kept)", min=1)
    pool_size: int | None = option(None, "with dynamic_sampling: keep prompts_per_step groups with signal out of a "
                                   "pool of this many prompts; None: the pool is the iteration's own prompts", min=1)
    seed: int = _seed()
    optim: OptimConfig = option(doc="the optimizer (its schedule counts optimizer steps: μ × minibatches per "
                                "iteration)", factory=OptimConfig)
    pipeline: PipelineSection = option(doc="rollout ahead of learning: the staleness bound and the schedule "
                                       "(`runs.pipeline`)", factory=PipelineSection)


@_frozen
class PPORun:
    steps: int = option(100, "iterations: a rollout of prompts_per_step prompts and its epochs of updates", min=1)
    prompts_per_step: int = option(32, "prompts per iteration", min=1)
    seed: int = _seed()
    reward: str = option("model", "'model' (a reward model trained on the task's pairs first: the reward_model "
                         "section) or 'task' (the task's rule-based reward and reward.fns; no reward model)",
                         choices=PPO_REWARDS)
    optim: OptimConfig = option(doc="the actor's optimizer (epochs × minibatches steps per iteration)",
                                factory=OptimConfig)
    critic_optim: OptimConfig = option(doc="the separate critic's optimizer", factory=OptimConfig)
    pipeline: PipelineSection = option(doc="rollout ahead of learning: the staleness bound and the schedule "
                                       "(`runs.pipeline`)", factory=PipelineSection)
    critic_path: str | None = option(None, "a local Hugging Face checkpoint folder the separate critic starts from "
                                     "(any size; its tokenizer must be the policy's): a *ForSequenceClassification "
                                     "folder keeps its score head, a causal LM gets a fresh one; None: a copy of the "
                                     "policy's trunk with a fresh score head")


@_frozen
class DPORun:
    """The run options of a phase on preference pairs (DPO's; the reward model's add theirs)."""

    steps: int = option(100, "steps of one batch of pairs each", min=1)
    batch_size: int = option(32, "preference pairs per step", min=1)
    seed: int = _seed()
    optim: OptimConfig = option(doc="the optimizer", factory=OptimConfig)


@_frozen
class RewardModelRun(DPORun):
    pairs: str = option("task", "the training pairs: 'task' (the task's synthetic pairs), 'policy' (the policy's "
                        "own samples ranked by the task's reward, `runs.policy_pairs`) or 'both' (the two sets "
                        "together)", choices=PAIR_SOURCES)
    samples_per_prompt: int = option(0, "k samples per prompt from the policy after SFT (also when the reward model "
                                     "has a trunk of its own, sft_steps) for on-policy pairs (>= 2; 0: no on-policy "
                                     "pairs, with pairs='task' only); the held-out prompts' pairs are then evaluated "
                                     "too (eval/policy_pairs/accuracy): with pairs='task' and k > 0 only those are "
                                     "drawn, to measure the synthetic reward model on them", min=0)
    temperature: float = option(1.0, "the temperature of those samples", above=0)
    num_prompts: int = option(0, "the first this many training prompts are sampled (0: all of them); held-out "
                              "prompts never are", min=0)
    ensemble: int = option(1, "K reward models trained alike on the same pairs (member k's head and batch order "
                           "from seed + k; phases reward_model, reward_model_1, ..., each checkpointed and resumed on "
                           "its own); 1: the single reward model. Not with LoRA reward models", min=1)
    ensemble_reduce: str = option("mean", "PPO's reward from the members' scores: 'mean', or 'min' (the "
                                  "conservative one, Coste et al. 2023); their disagreement is "
                                  "reward/reward_model_std", choices=ENSEMBLE_REDUCE)
    sft_steps: int = option(0, "extra SFT steps (the sft section's batch size and optimizer, a fresh schedule, "
                            "batch order from sft.seed + 1) on the reward model's own copy of the policy's trunk "
                            "before it learns from pairs, as phase reward_model_sft; the policy is not changed (0: "
                            "the policy's trunk as it is). Not with model.lora", min=0)


@_frozen
class OPDRun:
    steps: int = option(100, "iterations: a rollout of prompts_per_step prompts, the teacher's scoring and the "
                        "updates", min=1)
    prompts_per_step: int = option(16, "prompts per iteration, sampling.num_samples responses each", min=1)
    seed: int = _seed()
    optim: OptimConfig = option(doc="the optimizer (its schedule counts optimizer steps: μ × minibatches per "
                                "iteration)", factory=OptimConfig)
    pipeline: PipelineSection = option(doc="rollout ahead of learning: the staleness bound and the schedule "
                                       "(`runs.pipeline`)", factory=PipelineSection)
    teacher_path: str = option("", "the teacher (required): a local Hugging Face causal-LM folder of any size, e.g. "
                               "an earlier run's workdir/export; it must share the student's tokenizer (vocabulary "
                               "sizes may differ by padding), frozen; or 'base': a LoRA student's own base "
                               "(model.lora on the opd phase)")


# A phase's section: its run options and its algorithm's config, in the order a run runs them.
PHASE_SECTIONS = {
    "sft": (SFTRun, SFTConfig),
    "reward_model": (RewardModelRun, RewardModelConfig),
    "grpo": (GRPORun, GRPOConfig),
    "ppo": (PPORun, PPOConfig),
    "dpo": (DPORun, DPOConfig),
    "opd": (OPDRun, GRPOConfig, OPDConfig),
}


@_frozen
class TrainConfig:
    """The loop: logging, held-out evaluation, early stopping, checkpoints, the update guard,
    export, the health monitor (`runs.loop`, `runs.evaluation`, `runs.stopping`,
    `runs.health`)."""

    log_every: int = option(10, "steps between metrics rows", min=1, safe=True)
    eval_every: int = option(0, "steps between held-out evaluations of each phase (greedy eval/accuracy and "
                             "eval/reward, plus the sampled metrics with eval_samples); 0: only the summary's rows",
                             min=0, safe=True)
    checkpoint_every: int = option(100, "steps between checkpoints of each phase", min=1, safe=True)
    checkpoint_every_s: float | None = option(None, "also save a checkpoint whenever this many seconds passed since "
                                              "the last one (e.g. 1800 on a preemptible machine; checkpoint_every "
                                              "still applies); None: off", above=0, safe=True)
    hooks: str | None = option(None, "your hooks in every phase's loop, comma-separated import paths "
                               "'pkg.mod:Hook,other.mod:make_hook' (a class or factory is called with no arguments; "
                               "`runs.hooks` lists their moments and order); None: none", safe=True)
    keep_checkpoints: int = option(2, "checkpoints kept per phase (the newest)", min=1, safe=True)
    progress: bool = option(True, "a progress bar with live metrics", safe=True)
    tensorboard: bool = option(True, "also write TensorBoard events", safe=True)
    show_samples: int = option(5, "held-out sample outputs printed under the summary table", min=0, safe=True)
    export: bool = option(True, "write the final policy (or reward model) as a Hugging Face folder "
                          "workdir/export", safe=True)
    eval_batch_size: int = option(512, "sequences per evaluation batch (a sampled batch holds eval_batch_size // n "
                                  "prompts)", min=1, safe=True)
    eval_samples: int = option(0, "n > 0: also sample n responses per held-out prompt at eval_temperature at "
                               "every evaluation and report mean@n, pass@k and maj@k; 0: greedy only", min=0,
                               safe=True)
    eval_k: str = option("1,4,8", "the k of pass@k and maj@k, comma-separated, each in [1, eval_samples] (else an "
                         "error naming the field)", safe=True)
    eval_temperature: float = option(1.0, "the temperature τ of the sampled evaluation (no top-k / top-p)", above=0,
                                     safe=True)
    eval_slots: int = option(0, "S > 0 decodes each evaluation batch by continuous batching over S slots (the "
                             "same tokens, faster where lengths spread); 0: one static batch", min=0, safe=True)
    stop_metric: str | None = option(None, "an evaluation metric to stop on, without the eval/ prefix: 'accuracy', "
                                     "'reward', with sampled evaluation 'pass@4' etc.; DPO also "
                                     "'pairs/reward_accuracy' etc.; the reward-model phase its held-out pair "
                                     "metrics ('accuracy' there is pair accuracy). Needs eval_every > 0; None: no "
                                     "early stopping")
    stop_mode: str = option("max", "'max' (higher is better) or 'min' (lower is better: a loss)",
                            choices=("max", "min"))
    stop_patience: int = option(0, "end the phase (as finished) after this many evaluations in a row without a "
                                "new best (0: never; the best is still recorded, and kept with keep_best)", min=0)
    stop_min_delta: float = option(0.0, "an evaluation is a new best when it beats the best by more than this (a "
                                   "tie is not, so the earlier step is kept; a NaN never is)", min=0)
    keep_best: bool = option(False, "end the phase with the parameters of its best evaluation, not the last ones: "
                             "the next phase, the summary's 'after' row and export/ use them (one more device copy "
                             "of the policy; each checkpoint holds it too)")
    stop_phases: str | None = option(None, "the phases the rule applies to, comma-separated ('sft,ppo'); None: the "
                                     "run's own phase (config.algorithm), which leaves the SFT warm start (it "
                                     "evaluates too) and PPO's reward model alone")
    max_param_norm_change: float | None = option(1.0, "after every update the new state must be finite and the "
                                                 "trained parameters' global norm may change by at most this "
                                                 "fraction (1.0: may not double, nor drop to 0, in one update), "
                                                 "checked before the state can be saved; None: no bound "
                                                 "(finiteness is still checked)", above=0, safe=True)
    time_split: bool = option(True, "run each GRPO/PPO step as three timed programs (rollout, scoring, update) and "
                              "report time/rollout_s, time/scoring_s, time/update_s, time/tokens_per_s (+0.5–1.4 % "
                              "wall time, docs/benchmarks.md); False: a JAX reward's step is one untimed program",
                              safe=True)
    wandb: bool = option(False, "also log every metrics row to Weights & Biases (pip install jaxrlhf[wandb])",
                         safe=True)
    wandb_project: str = option("jaxrlhf", "the Weights & Biases project", safe=True)
    wandb_mode: str | None = option(None, "'online' or 'offline'; None: online when WANDB_API_KEY is set, else "
                                    "offline (kept under workdir/wandb; upload later with wandb sync)",
                                    choices=(None, "online", "offline"), safe=True)
    log_completions_every: int = option(0, "every N steps of a GRPO/PPO phase write the first sampled responses "
                                        "(prompt, completion, token ids, each reward component, the total and the "
                                        "advantage) to workdir/completions.jsonl (and a wandb table); 0: off",
                                        min=0, safe=True)
    monitor: MonitorConfig = option(doc="the health monitor's thresholds (`monitor.MonitorConfig`)",
                                    factory=MonitorConfig, safe=True)


@_frozen
class RewardSection:
    """Python rewards and a reward-model folder beside the task's own reward
    (`runs.tasks.with_python_rewards`, `runs.reward_folder`)."""

    fns: str = option("", "comma-separated import paths 'pkg.module:function' of functions in TRL's reward_funcs "
                      "convention, fn(prompts=[...], completions=[...], **row_fields) -> list[float | bool | None] "
                      "(a bool is 0/1; None: no score for that response, left out of that function's term; a row "
                      "no weighted reward scores is dropped from the update and counted)")
    weights: str = option("", "one weight per function, comma-separated ('': 1.0 each)")
    task_weight: float = option(1.0, "the task's own reward's weight (0: train on yours alone; it is still the "
                                "held-out accuracy)")
    timeout: float | None = option(300.0, "seconds each call of a function may take: each runs in a worker "
                                   "process of its own (`reward_workers.Clocked`) with a progress line while one "
                                   "runs long, and a call past it is abandoned (the worker killed); None: no limit, "
                                   "the functions run in the run's own process", above=0, safe=True)
    on_timeout: str = option("error", "'error' (stop the run naming the function) or 'zero' (score that batch 0 "
                             "for that function, warn naming it, count it in reward/<name>/timeouts: 1 in a step whose call "
                             "timed out)",
                             choices=("error", "zero"), safe=True)
    max_abs_score: float | None = option(1e6, "a score above this in absolute value is an error naming the function "
                                         "and the row; None: finite is enough", above=0, safe=True)
    model_path: str = option("", "a Hugging Face *ForSequenceClassification folder whose score of prompt ⧺ response "
                             "joins the reward of GRPO (and PPO with ppo.reward='task') at model_weight, frozen; its "
                             "tokenizer must encode like the task's ('': none)")
    model_weight: float = option(1.0, "the weight of that model's score")


@_frozen
class LoRASection:
    """LoRA adapters (`models.lora`) in every phase: SFT, GRPO, DPO, PPO's actor and critic,
    the reward model; a policy's reference is then the base without them."""

    rank: int = option(0, "0: off (all weights trained); r > 0: only rank-r adapters A [in, r], B [r, out] are "
                       "(and a critic's or reward model's new head), the rest frozen", min=0)
    alpha: float = option(16.0, "the scale's numerator: s = alpha / r (alpha / sqrt(r) with rslora)", above=0)
    targets: str = option("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                          "comma-separated regexes, each searched in the projection paths 'self_attn/q_proj', "
                          "'self_attn/k_proj', 'self_attn/v_proj', 'self_attn/o_proj', 'mlp/gate_proj', "
                          "'mlp/up_proj', 'mlp/down_proj' and (untied heads only) 'lm_head'; each pattern must match "
                          "one, and every layer gets the same adapters ('q_proj,v_proj', 'self_attn', "
                          "'proj|lm_head')")
    rslora: bool = option(False, "rank-stabilised scaling alpha / sqrt(r)")
    dropout: float = option(0.0, "p of the adapters' input in training losses only (PEFT's lora_dropout)", min=0,
                            below=1)
    phases: str = option("", "the phases that train adapters, comma-separated ('': all; 'grpo' or "
                         "'reward_model,ppo': the SFT warm start trains all weights); each starts with fresh ones, "
                         "those of the phase before merged, so its reference is the policy it starts from, as "
                         "without LoRA")
    quantize: str = option("none", "QLoRA: the frozen base's layer projections stored quantised from the first "
                           "adapter phase on (`models.quant`)", choices=("none", "int8", "nf4"))


@_frozen
class ModelSection:
    """A fresh model of these sizes, or `path` a local Hugging Face checkpoint folder (its
    config.json then gives the sizes); the runtime options apply to both."""

    path: str = option("", "a local Hugging Face checkpoint folder ('': a fresh model of the sizes below)")
    hidden_size: int = option(128, "a fresh model's width", min=1)
    intermediate_size: int = option(384, "a fresh model's MLP width", min=1)
    num_layers: int = option(2, "a fresh model's layers", min=1)
    num_heads: int = option(4, "a fresh model's attention heads", min=1)
    num_kv_heads: int = option(4, "a fresh model's key/value heads (grouped-query attention below num_heads)", min=1)
    head_dim: int = option(32, "a fresh model's head width", min=1)
    max_position_embeddings: int = option(64, "a fresh model's longest sequence", min=1)
    tie_word_embeddings: bool = option(False, "a fresh model's LM head is its embedding")
    dtype: str = option("float32", "the dtype of activations", choices=("float32", "bfloat16", "float16"))
    param_dtype: str = option("float32", "the dtype of the parameters", choices=("float32", "bfloat16", "float16"))
    remat: str = option("none", "what each layer keeps for the backward pass: 'none', 'full', 'dots', 'offload' "
                        "(`models.config.REMAT_POLICIES`)", choices=("none", "full", "dots", "offload"), safe=True)
    scan_layers: bool = option(False, "run the layer stack as one scan (a shorter first compile)")
    attention: str = option("auto", "the attention implementation (`models.attention`)", safe=True)
    cache_dtype: str | None = option(None, "the KV cache's dtype; None: dtype")
    matmul_dtype: str | None = option(None, "the dtype of the projections' matmuls; None: dtype")
    logprobs_head: str = option("auto", "how response log-probs leave the LM head: 'auto', 'plain' or 'chunked' "
                                "(never the whole [N, T, V] logits)", choices=("auto", "plain", "chunked"))
    lora: LoRASection = option(doc="LoRA adapters", factory=LoRASection)


@_frozen
class Parallel:
    """The top level's device mesh and sharding rules (`runs.sharding`)."""

    mesh: str = option("data=-1", "a `parallel.make_mesh` spec over all devices of all processes: 'data=-1' (the "
                       "batch split over every device, parameters replicated), 'fsdp=4,tensor=2', 'data=2,fsdp=4', "
                       "'fsdp=-1', ...", safe=True)
    rules: str = option("fsdp_tp", "the sharding rules of every role's parameters, a preset of "
                        "`parallel.PRESETS`: 'fsdp_tp', 'fsdp' or 'replicated'", safe=True)


@_frozen
class AdditionTask:
    """The built-in addition task (`data.arithmetic`): 'a+b=' → the sum's digits."""

    name: str = option("addition", "the task: 'addition', 'jsonl', 'word_problems', 'calculator' or 'env'")
    num_digits: int = option(2, "digits of each operand", min=1)
    reverse_answer: bool = option(False, "the sum's digits written last to first")
    num_train: int = option(8000, "training questions", min=1)
    num_test: int = option(500, "held-out questions", min=1)
    num_pairs: int = option(0, "synthetic preference pairs (a right and a wrong sum) for DPO and reward models",
                            min=0)
    partial_credit: float = option(0.0, "weight of the per-digit reward beside exact match", min=0)
    length_bonus: float = option(0.0, "weight of a reward for the fraction of max_new_tokens used: a deliberately "
                                 "wrong reward, to see the monitor's [length_hacking] warning", min=0)
    seed: int = option(0, "the seed of the generated questions")


def _stop_tokens():
    """`task.stop_tokens` of the tasks with a Hugging Face tokenizer (`_TextTask`, `EnvTask`)."""
    return option("", "more tokens that end a response (an episode's policy turn) besides the tokenizer's EOS and "
                  "the checkpoint's generation_config.json eos_token_ids (token strings or ids, comma-separated: "
                  "'<|im_end|>')")


def _template_timeout():
    """`task.chat_template_timeout` of the tasks with a Hugging Face tokenizer."""
    return option(10.0, "the seconds one rendering of the chat template may take: a template that loops past it "
                  "stops the run, naming the template and the row (`data.chat`); None: no limit", above=0)


@_frozen
class _TextTask:
    """The options every task of a Hugging Face tokenizer has."""

    tokenizer_path: str = option("", "the tokenizer's folder ('': model.path's)")
    max_prompt_tokens: int = option(256, "a longer prompt follows long_prompts", min=1)
    max_new_tokens: int = option(256, "the held-out evaluation's response tokens", min=1)
    chat_template: bool = option(True, "prompts through the tokenizer's chat template")
    system_prompt: str = option("", "a system turn before every prompt ('': none)")
    stop_tokens: str = _stop_tokens()
    stop_strings: str = option("", "text that ends a response, comma-separated ('</answer>,\\n\\n') or a JSON list "
                               "when one holds a comma; each response is cut on the host after the first token at "
                               "which its text contains one (`rollout.stop_strings`)")
    chat_template_kwargs: str = option("", "a JSON object of extra chat-template variables for every rendering "
                                       "('{\"enable_thinking\": false}')")
    chat_template_timeout: float | None = _template_timeout()
    long_prompts: str = option("drop", "a prompt over max_prompt_tokens is 'drop'ped (counted as too_long) or "
                               "'left_truncate'd to its last max_prompt_tokens tokens (counted)",
                               choices=("drop", "left_truncate"))


@_frozen
class JsonlTask(_TextTask):
    """Rows from local JSONL/Parquet files and TFDS datasets (`runs.tasks`, `data.sources`)."""

    name: str = option("jsonl", "the task: 'addition', 'jsonl', 'word_problems', 'calculator' or 'env'")
    kind: str = option("prompts", "'prompts' (prompt + reference answer, for GRPO/PPO), 'sft' (messages_key chats "
                       "learnt on their assistant turns, or prompt_key / completion_key pairs) or 'pairs' "
                       "(prompt_key / chosen_key / rejected_key, for DPO and reward models)",
                       choices=("prompts", "sft", "pairs"))
    path: str = option("", "the training rows: a source spec 'a.jsonl:0.7,tfds:name/split:0.3' (weights "
                       "optional, mixed with seed)")
    test_path: str = option("", "the held-out rows, a source spec")
    data_dir: str = option("", "where TFDS datasets are read from")
    seed: int = option(0, "the seed of the sources' mixing")
    prompt_key: str = option("question", "the prompt's field")
    answer_key: str = option("answer", "the reference answer's field")
    messages_key: str = option("messages", "the chat's field (kind 'sft')")
    completion_key: str = option("completion", "the completion's field (kind 'sft')")
    chosen_key: str = option("chosen", "the chosen response's field (kind 'pairs')")
    rejected_key: str = option("rejected", "the rejected response's field (kind 'pairs')")
    max_response_tokens: int = option(512, "an SFT completion or a pair's response is cut to this", min=1)
    on_error: str = option("skip", "a bad row is 'skip'ped (counted, file:line logged) or stops the run ('raise')",
                           choices=("skip", "raise"))
    sft_path: str = option("", "a source spec of the run's SFT warm start's rows, read as kind 'sft' with the same "
                           "field names")
    pairs_path: str = option("", "a source spec of the reward model's pairs, read as kind 'pairs' (SFT -> reward "
                             "model -> PPO, all from files)")
    max_row_bytes: int | None = option(2**20, "a row (JSONL line, Parquet/TFDS row's text) of more bytes is bad "
                                       "(row_too_long: skipped or raised by on_error), found after reading at "
                                       "most this + 1 bytes of it, before it is parsed or tokenized; None: no "
                                       "limit", min=1)
    max_file_bytes: int | None = option(10 * 2**30, "a larger file is refused; None: no limit", min=1)


@_frozen
class WordProblemsTask(_TextTask):
    """Generated one-digit arithmetic questions in words for a Hugging Face chat model
    (`data.make_word_problems`); reward = exact answer + format_weight × the '#### <n>' format."""

    name: str = option("word_problems", "the task: 'addition', 'jsonl', 'word_problems', 'calculator' or 'env'")
    num_train: int = option(4000, "training questions", min=1)
    num_test: int = option(200, "held-out questions", min=1)
    seed: int = option(0, "the seed of the generated questions")
    max_prompt_tokens: int = option(128, "a longer prompt follows long_prompts", min=1)
    max_new_tokens: int = option(48, "the held-out evaluation's response tokens", min=1)
    system_prompt: str = option("Answer with '#### <number>'.", "a system turn before every prompt ('': none)")
    format_weight: float = option(0.0, "the weight of the '#### <n>' format reward", min=0)


@_frozen
class CalculatorTask:
    """The built-in multi-turn tool task (`data.calculator`): 'a+b+c=' answered with
    calculator calls '[a+b]' in episodes (the `env` section's limits), then the sum."""

    name: str = option("calculator", "the task: 'addition', 'jsonl', 'word_problems', 'calculator' or 'env'")
    num_terms: int = option(3, "numbers per sum", min=2, max=8)
    num_digits: int = option(3, "digits of each number", min=1, max=6)
    memory_rate: float = option(0.0, "the share of problems with a first number below half its range that the "
                                "demonstrating expert answers from memory, without the calculator (an imperfect "
                                "demonstrator, for RL to improve on); 0: it always calls it", min=0, max=1)
    num_train: int = option(4000, "training problems (and SFT demonstrations)", min=1)
    num_test: int = option(200, "held-out problems", min=1)
    seed: int = option(0, "the seed of the generated problems")


@_frozen
class EnvSection:
    """The episodes of a task that runs them (task.name='calculator' or 'env'): the environment
    and the limits of every episode (`rollout.episodes.run_episodes`)."""

    cls: str = option("", "the import path 'pkg.mod:Class' of the environment, made once per episode: a token "
                      "environment (`envs.TokenEnv`: step(action_ids, cut)) or a text one (`envs.Env`: "
                      "step(assistant_text), run through the task tokenizer's chat template, "
                      "`envs.ChatEpisode`); '': the task's own (task.name='calculator': `data.calculator:CalculatorEnv`; required with "
                      "task.name='env')")
    tools: str = option("", "comma-separated import paths 'pkg.mod:fn' of tool functions handed to env.cls as "
                        "cls(tools=[...]) (an `envs.ToolEnv` subclass, `envs.import_tools`); '': the class's own")
    max_turns: int = option(4, "policy turns per episode at most; an episode not done after them is cut (and "
                            "gets cut_reward)", min=1)
    max_turn_tokens: int = option(16, "tokens of one policy turn at most (a turn cut there ends without a stop "
                                  "token)", min=1)
    max_total_tokens: int = option(48, "tokens of an episode after its prompt at most, policy and environment "
                                   "together (the trained sequence's response length)", min=2)
    max_env_tokens: int = option(16, "tokens of one environment reply at most (a longer one cuts the episode)",
                                 min=1)
    cut_reward: float = option(0.0, "the reward of an episode cut by a limit")
    max_env_chars: int | None = option(100_000, "characters of one text environment reply at most (the summed "
                                       "content of a step's new messages): a longer one is not rendered nor "
                                       "tokenised and cuts the episode like max_env_tokens (`envs.ChatEpisode`); "
                                       "None: no limit", min=1)
    tool_timeout: float | None = option(None, "seconds one tool call may take, for an `envs.ToolEnv` env.cls (its "
                                        "timeout_s; a call past it is a 'timeout' observation); None: the class's "
                                        "own (ToolEnv's default: 10 s)", above=0)


@_frozen
class EnvTask:
    """Episodes of your own environment (`env.cls`) on rows from JSONL files: GRPO on the
    environment's reward; no SFT examples."""

    name: str = option("env", "the task: 'addition', 'jsonl', 'word_problems', 'calculator' or 'env'")
    path: str = option("", "the training rows, a JSONL file (each row is handed to the environment's reset)")
    test_path: str = option("", "the held-out rows, a JSONL file")
    tokenizer_path: str = option("", "the tokenizer's folder ('': model.path's; both '': the calculator task's "
                                 "character tokenizer, for token environments on its vocabulary)")
    chat_template_kwargs: str = option("", "a JSON object of extra chat-template variables for a text "
                                       "environment's renderings ('{\"enable_thinking\": false}')")
    max_prompt_tokens: int = option(256, "the longest first prompt (the environment's reset) an episode may have",
                                    min=1)
    stop_tokens: str = _stop_tokens()
    chat_template_timeout: float | None = _template_timeout()


TASK_SECTIONS = {"addition": AdditionTask, "jsonl": JsonlTask, "word_problems": WordProblemsTask,
                 "calculator": CalculatorTask, "env": EnvTask}
# The sections every run has besides its phases', and the top level's keys (`Parallel`).
RUN_SECTIONS = {"train": (TrainConfig,), "reward": (RewardSection,), "model": (ModelSection,),
                "env": (EnvSection,)}


def schema(config) -> dict[str, tuple[type, ...]]:
    """`{section: its classes}` of `config` (the top level as ""), for the sections it has."""
    out = {"": (Parallel,)}
    phases = {name: spec.sections for name, spec in registry.PHASES.items()}
    for name, classes in {**PHASE_SECTIONS, **phases, **RUN_SECTIONS}.items():
        if name in config:
            out[name] = classes
    if "task" in config:
        kind = config.task.get("name", "addition")
        if kind not in TASK_SECTIONS:
            raise ValueError(f"task.name={kind!r}; expected one of {sorted(TASK_SECTIONS)}")
        out["task"] = (TASK_SECTIONS[kind],)
    return out


def entry(config, key: str) -> options.Entry | None:
    """The option of dotted `key` ("grpo.optim.lr", "mesh") in `config`'s schema; None for a
    key no dataclass declares (e.g. `algorithm`, `seed`)."""
    section, _, rest = key.partition(".")
    sections = schema(config)
    if section not in sections or not rest:
        section, rest = "", key
    for e in options.walk(*sections[section]):
        if e.key == rest:
            return e
    return None


def is_safe(config, key: str) -> bool:
    """Whether `key` may change when a workdir resumes: its field, or a section above it,
    is marked `safe` (e.g. `train.monitor` and every threshold below it)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        e = entry(config, ".".join(parts[:n]))
        if e is not None and e.field.metadata.get("safe"):
            return True
    return False


def markdown() -> str:
    """docs/options.md: every section's options with their default, rule and doc."""
    lines = ["# Every option", "",
             "Generated from the dataclasses that define them (`python -m jaxrlhf.runs.sections > docs/options.md`; "
             "a test checks this file is current). Set any of them with `--config.<section>.<key>=value`; `None` "
             "turns off an option that can be off. *resume-safe*: may change when a workdir resumes "
             "(`--resume_with_changes`); a phase's `steps` may too (docs/training.md).", ""]
    groups = [("Top level", (Parallel,))] + [(f"`{n}`", c) for n, c in PHASE_SECTIONS.items()] + [
        (f"`{n}`", c) for n, c in RUN_SECTIONS.items()] + [(f"`task` (name='{n}')", (c,)) for n, c in
                                                          TASK_SECTIONS.items()]
    for title, classes in groups:
        lines += [f"## {title}", "", "| option | default | rule | resume-safe | what it does |", "|---|---|---|---|---|"]
        for e in options.walk(*classes):
            if options.nested(e.cls, e.field.name):
                continue
            default = e.default
            safe = "yes" if e.field.metadata.get("safe") or _parent_safe(classes, e.key) else ""
            doc = e.field.metadata.get("doc", "").replace("|", "\\|")
            lines.append(f"| `{e.key}` | `{default!r}` | {options.describe_rule(e.field)} | {safe} | {doc} |")
        lines.append("")
    return "\n".join(lines)


def _parent_safe(classes, key: str) -> bool:
    parents = {e.key: e for e in options.walk(*classes)}
    parts = key.split(".")
    return any(parents[".".join(parts[:n])].field.metadata.get("safe") for n in range(1, len(parts))
               if ".".join(parts[:n]) in parents)


if __name__ == "__main__":
    sys.stdout.write(markdown())
