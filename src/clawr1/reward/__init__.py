"""The reward stage's judging core: rule evidence, an LLM judge (m votes + hints), a classifier
judge, all pure with respect to the pool. `make_judge(config, engine)` picks one."""

from clawr1.reward.factory import classifier_available, make_judge, votes_for
from clawr1.reward.judge import LLMJudge, NoJudge, RuleFirstJudge
from clawr1.reward.rules import Evidence, rule_evidence
from clawr1.reward.types import HintResult, HintSource, Judge, Judgement

__all__ = [
    "Evidence", "HintResult", "HintSource", "Judge", "Judgement", "LLMJudge", "NoJudge", "RuleFirstJudge",
    "classifier_available", "make_judge", "rule_evidence", "votes_for",
]
