"""EngineConfig: the continuous-batching Engine's settings in one validated dataclass (engine.py reads it).

    Engine(model, cfg, config=EngineConfig(block_size=16, max_batch_size=32))
    Engine(model, cfg, block_size=16, max_batch_size=32)        # the same: keywords build an EngineConfig

Each field is declared once, with its help text and bounds in its metadata (qkv.config.setting): validate(),
the `qkv serve` flags (qkv.cli.flags) and the docs read it. This module imports only the standard library and
qkv.config, so that the CLI can build its flags without loading torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from qkv.config import ConfigError, check_fields, setting

PREEMPTION = ("least_work", "newest")  # victim policies (scheduler.py)
PROMPT_LOOKUP = "prompt-lookup"  # EngineConfig.speculative's drafter without a second model


@dataclass
class EngineConfig:
    block_size: int = setting(16, "positions per KV-cache block", ge=1)
    num_blocks: int | None = setting(None, "KV-cache blocks", ge=1,
                                     none="max_batch_size sequences of the context")
    max_batch_size: int = setting(32, "requests decoded together", ge=1)
    prefill_chunk: int | None = setting(1024, "prompt tokens fed per engine step", ge=1, none="whole prompts",
                                        flag_none=0)
    prefix_caching: bool = setting(True, "share the cached blocks of common prompt prefixes (off: "
                                         "recompute them)")
    preemption: str = setting("least_work", "which request gives its blocks back when the pool runs out",
                              choices=PREEMPTION)
    # "auto": None where the paged step reads K/V in place, else 4096 (Engine resolves it on its cache)
    split_cost: int | str | None = setting(
        "auto", "cost of one more decoding forward, in rows x positions gathered, when the batch is cut "
        "into groups of similar length (None: one forward)", flag=False)
    max_model_len: int | None = setting(
        None, "most prompt + output tokens a request may ask for", ge=1,
        none="the model's configured context (max_position_embeddings: RoPE / ALiBi have no hard limit)")
    speculative: str | None = setting(
        None, "speculative decoding of every request: prompt-lookup drafts the tokens that followed the last "
        "n-gram's first occurrence in the request's prompt + output; MODEL, a small model folder of the same "
        "tokenizer, drafts them (loaded as the model is; its keys/values in a paged cache of its own, one "
        "sequence per request); checked in "
        "the request's decoding step's forward (the same tokens as without it when greedy, the same "
        "distribution when sampling; docs/serving.md)", none="off", metavar="prompt-lookup|MODEL")
    speculative_tokens: int = setting(10, "tokens a request drafts per decoding step with --speculative",
                                      ge=1, le=64)
    image_cache: int = setting(32, "projected image embeddings kept by content hash, so a repeated image "
                               "skips the vision tower (0: none kept)", ge=0, le=4096)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_fields(self, "")
        s = self.split_cost
        if not (s is None or s == "auto" or (isinstance(s, int) and not isinstance(s, bool))):
            raise ConfigError(f"must be an int, None or 'auto', got {s!r}", "split_cost")
        spec = self.speculative
        if spec is not None and not (isinstance(spec, str) and spec.strip()):
            raise ConfigError(f"must be None, {PROMPT_LOOKUP!r} or a draft model folder, got {spec!r}",
                              "speculative")

    @classmethod
    def merged(cls, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
        """`config` (default: the defaults) with the options that name its fields over it; those options are
        taken out of `options` (Engine's other keywords are generation settings)."""
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        names = {f.name for f in fields(cls)}
        mine = {k: options.pop(k) for k in list(options) if k in names}
        base = config if config is not None else cls()
        return dataclasses.replace(base, **mine) if mine else base
