"""Errors raised by plan generation, validation and simulation."""


class PlanError(ValueError):
    """A plan is malformed or cannot execute (missing action, order, deadlock).

    The message names the rank, the action and the missing dependency.
    """


class ScheduleConfigError(ValueError):
    """A schedule was asked for with arguments it does not support.

    The message names the command-line flag (e.g. ``--num-microbatches``) and the rule.
    """


PP_FLAG = "--pipeline-model-parallel-size"
MICROBATCH_FLAG = "--num-microbatches"
VP_FLAG = "--virtual-pipeline-model-parallel-size"
