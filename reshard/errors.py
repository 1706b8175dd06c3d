"""Error types of the core.

Caller mistakes are `ValueError` subclasses whose message states the rule, the
offending value and what would be valid. The service maps them to gRPC status
codes with the same message.
"""


class ReshardError(Exception):
    """Base of every error reshard raises on purpose."""


class InvalidMeshError(ReshardError, ValueError):
    """A mesh's axes or devices break a rule."""


class InvalidShardingError(ReshardError, ValueError):
    """A sharding spec does not fit its mesh or tensor."""


class InvalidShapeError(ReshardError, ValueError):
    """A tensor shape has a zero, negative or non-integer size."""


class UnknownDtypeError(ReshardError, ValueError):
    """A dtype name reshard does not know."""


class InvalidTopologyError(ReshardError, ValueError):
    """A bandwidth that is not a positive number."""


class PlanValidationError(ReshardError, ValueError):
    """A plan that would not deliver every destination tile exactly once."""


class InvalidJsonError(ReshardError, ValueError):
    """A JSON document that does not parse, or is not standard JSON (NaN, Infinity)."""


class JsonLimitError(InvalidJsonError):
    """A JSON document over its reader's size or nesting limit; the service answers RESOURCE_EXHAUSTED."""


class DtypeComputeError(ReshardError, ValueError):
    """An op that needs arithmetic on a dtype reshard only stores and moves (float8); the message says how to cast."""


class ScaleLayoutError(InvalidShardingError):
    """A block-scale tensor that cannot follow its weight: shapes that are not a weight and its blocks, or weight
    tiles that do not start on block boundaries."""


class InvalidScheduleError(ReshardError, ValueError):
    """A pipeline schedule asked for with an unknown kind, a count that is not a positive integer, or times
    that are not finite seconds."""


class ProgramSizeError(ReshardError, ValueError):
    """A program that would hold more steps than its planner allows (`reshard.plan_many`'s ``max_steps``, the
    planner's ``--max-program-steps``); the service answers RESOURCE_EXHAUSTED."""
