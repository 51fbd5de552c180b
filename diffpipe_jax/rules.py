"""The vocabulary of the config schema: a `Key` (its default, its rule, what it does, how
diffusion-pipe writes it) and the `Rule`s of what values a key allows. `schema.SHARED` declares
the keys every family shares, a family's `model_keys` its own model keys."""
import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class Rule:
  allowed: str  # what is allowed, as the error says it
  ok: Callable[[Any], bool]


@dataclasses.dataclass(frozen=True)
class DiffusionPipe:
  """How diffusion-pipe's training TOML has a key where it differs from ours (diffusion_pipe.py
  reads it): its `name` there ("": ours), its `default` there (None: ours), and `value`: a value
  there -> ours (None: the same)."""
  name: str = ""
  default: Any = None
  value: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key, declared once. `default`: its value, or a function of the model type;
  `field_type`: the type an override parses as, where the default's own would not do (an int
  that may become a list, a None that stands for a bool)."""
  default: Any
  rule: Rule
  doc: str
  diffusion_pipe: Optional[DiffusionPipe] = None
  field_type: Optional[type] = None


def _is_int(v):
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(low: int) -> Rule:
  return Rule(f"an integer >= {low}", lambda v: _is_int(v) and v >= low)


def number(low: float, *, above: bool = False, below: float | None = None) -> Rule:
  """A number >= low (> low with `above`), and < below if given."""
  words = f"a number {'>' if above else '>='} {low:g}" + (f" and < {below:g}" if below is not None else "")
  return Rule(words, lambda v: _is_number(v) and (v > low if above else v >= low)
              and (below is None or v < below))


def choice(*options) -> Rule:
  return Rule("one of " + ", ".join(map(repr, options)), lambda v: v in options)


def numbers(rule: Rule, length: int | None = None) -> Rule:
  """A non-empty sequence (of `length`, if given) of values that each pass `rule`."""
  count = f"{length} " if length else ""
  return Rule(f"a list of {count}values, each {rule.allowed}",
              lambda v: isinstance(v, (tuple, list)) and len(v) > 0
              and (length is None or len(v) == length) and all(map(rule.ok, v)))


FLAG = Rule("True or False", lambda v: isinstance(v, bool))
TEXT = Rule("a string", lambda v: isinstance(v, str))
PROBABILITY = Rule("a number from 0 to 1", lambda v: _is_number(v) and 0 <= v <= 1)
