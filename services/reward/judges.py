"""Which judge a group may have, and what a failed judge call means for the group.

The judge is called with the deployment's endpoint and API key, so the judge model is the one
thing a group chooses that decides where those credentials go (a litellm model names a provider,
and with it an address and a key). A group may therefore name only a judge on the operator's
allow-list (``ARTERY_REWARD_ALLOWED_JUDGES``, plus the configured judge); nothing else in its
``RulerSpec`` reaches litellm.

A failed call is either an outage, retried (the judge could not be reached, or answered with a
status that says "later": 408, 409, 425, 429, 5xx), or a verdict given at once: the request never
left this process (missing credentials, an unknown provider, a model string litellm cannot read) or
the judge refused it for good (401, 403, 404, 400, 422). litellm reports some of the former as a
500 of its own making ("Missing credentials" is an ``InternalServerError``), so the decision reads
the causes litellm chains to its exception, not its class.
"""

from __future__ import annotations

from artery.schemas import RulerSpec

#: Dead-letter kinds of a group the reward service gives up on (also the prefix of the stored error).
FORBIDDEN_JUDGE = "forbidden_judge"  # the group named a judge the operator does not allow
JUDGE_CONFIG = "judge_config"  # the judge cannot be called as configured, or the spec is invalid
JUDGE_UNAVAILABLE = "judge_unavailable"  # the judge stayed unreachable for the allowed deliveries
RULER = "ruler"  # the judge was asked, and the group could not be scored (a malformed answer, ...)
KINDS = frozenset({FORBIDDEN_JUDGE, JUDGE_CONFIG, JUDGE_UNAVAILABLE, RULER})

#: Statuses that say "try again later" (the openai client retries the same ones).
_TRANSIENT_STATUS = frozenset({408, 409, 425, 429})
_NAME_SHOWN = 200  # an agent's judge name is free text: cut it before it reaches logs and rows


class JudgeRefused(Exception):
    """The group cannot be judged as it asks; ``kind`` is one of ``KINDS``."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


def shown(name: str) -> str:
    return name if len(name) <= _NAME_SHOWN else name[:_NAME_SHOWN] + "..."


def chosen_judge(ruler: RulerSpec | None, configured: str, allowed: frozenset[str]) -> str:
    """The litellm model that judges the group: the configured judge unless the group names one,
    which must then be on the allow-list, exactly (no pattern: a provider prefix or a suffix is
    precisely what could send the key elsewhere)."""
    named = ruler.judge_model if ruler else None
    if named is None:
        return configured
    if not named.strip():
        raise JudgeRefused(JUDGE_CONFIG, "the group's ruler spec names an empty judge_model")
    if named not in allowed:
        raise JudgeRefused(
            FORBIDDEN_JUDGE,
            f"judge model {shown(named)!r} is not on the operator's allow-list"
            " (ARTERY_REWARD_ALLOWED_JUDGES)",
        )
    return named


def error_text(kind: str, reason: str) -> str:
    """The stored error (``group_rewards.error``): the kind first, so a redelivery that finds the
    verdict dead-letters it with the same kind."""
    return f"{kind}: {reason}"


def error_kind(error: str) -> tuple[str, str]:
    """(kind, reason) of a stored error; errors stored before kinds were are RULER's."""
    kind, sep, reason = error.partition(": ")
    return (kind, reason) if sep and kind in KINDS else (RULER, error)


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain and len(chain) < 16:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def judge_call_errors() -> tuple[type[BaseException], ...]:
    """What a judge call raises when the judge (not this code) is the problem: litellm's errors
    derive from the openai client's, whatever the provider."""
    import openai

    return (openai.OpenAIError, OSError, TimeoutError)


def failure_kind(exc: BaseException) -> str | None:
    """The dead-letter kind a failed judge call earns at once, or None for an outage (retry)."""
    import httpx
    import litellm
    import openai

    causes = _causes(exc)
    if any(
        isinstance(c, (openai.APIConnectionError, httpx.TransportError, OSError, TimeoutError))
        for c in causes
    ):
        return None  # connection refused or reset, DNS, timeout
    answered = next((c for c in causes if isinstance(c, httpx.HTTPStatusError)), None)
    status: int | None
    if answered is not None:
        status = answered.response.status_code
    elif len(causes) == 1:
        status = getattr(exc, "status_code", None)  # no cause kept: the error's own status is all there is
    else:
        return JUDGE_CONFIG  # nothing was sent: credentials, provider, model string, parameters
    if status is None:
        return JUDGE_CONFIG
    if status in _TRANSIENT_STATUS or status >= 500:
        return None
    if isinstance(exc, (litellm.ContextWindowExceededError, litellm.ContentPolicyViolationError)):
        return RULER  # about this group's conversations, not the deployment
    return JUDGE_CONFIG
