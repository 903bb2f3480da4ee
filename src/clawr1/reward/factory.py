"""Choosing the judge from the config (`reward.judge`), always behind the rules."""

from __future__ import annotations

import logging

from clawr1.core.config import Config
from clawr1.engine.base import Engine
from clawr1.reward.backends import engine_backend, openai_backend
from clawr1.reward.classifier import ClassifierJudge
from clawr1.reward.embed import PIP_NAME, model_dir
from clawr1.reward.judge import LLMJudge, RuleFirstJudge
from clawr1.reward.types import Judge

log = logging.getLogger(__name__)

# With the `Score:` answer prefix the embedded model's vote is its next 1-3 tokens; a longer budget
# only buys rambling. Hints need room for a sentence or two, not more (each token is a decode step
# shared with serving traffic).
EMBEDDED_VOTE_TOKENS = 6
EMBEDDED_HINT_TOKENS = 48


def votes_for(config: Config) -> int:
    """m: `reward.prm_m`, else 3 for rl/combine and 1 for opd."""
    if config.reward.prm_m is not None:
        return config.reward.prm_m
    return 1 if config.trainer.method == "opd" else 3


def classifier_available() -> bool:
    return model_dir() is not None


def llm_judge(config: Config, engine: Engine | None) -> LLMJudge:
    """The LLM judge: `judge_url` when set, else the embedded engine with the adapter off."""
    r = config.reward
    if r.judge_url:
        return LLMJudge(openai_backend(r.judge_url, r.judge_api_key, r.judge_model), name=f"llm({r.judge_model})",
                        temperature=r.judge_temperature, vote_max_tokens=r.judge_max_tokens,
                        hint_max_tokens=r.judge_max_tokens, hint_min_chars=r.hint_min_chars)
    if engine is None:
        raise ValueError("the LLM judge needs reward.judge_url or the embedded engine")
    return LLMJudge(engine_backend(engine), name="llm(embedded)", temperature=r.judge_temperature,
                    vote_max_tokens=min(EMBEDDED_VOTE_TOKENS, r.judge_max_tokens),
                    hint_max_tokens=min(EMBEDDED_HINT_TOKENS, r.judge_max_tokens), hint_min_chars=r.hint_min_chars)


def make_judge(config: Config, engine: Engine | None) -> Judge:
    """Rules first, then the judge `reward.judge` names. `auto` = the LLM at `judge_url` when set,
    else the classifier when its package is installed, else the LLM on the embedded model. An
    explicit `classifier` without its package is an error, not a silent switch."""
    choice = config.reward.judge
    if choice == "auto":
        if config.reward.judge_url:
            choice = "llm"
        elif classifier_available():
            choice = "classifier"
        else:
            log.warning("reward.judge=auto: %s is not installed, judging with the embedded LLM", PIP_NAME)
            choice = "llm"
    if choice == "classifier":
        return RuleFirstJudge(ClassifierJudge.load(config.reward.hint_min_chars))
    return RuleFirstJudge(llm_judge(config, engine))
