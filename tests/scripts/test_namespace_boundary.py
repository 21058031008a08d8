"""Below ``RunConfig.from_args`` nothing takes the parsed flags: a walk over the package.

Every function of ``megatron_bitpipe`` with a parameter annotated ``argparse.Namespace`` (or an
unannotated one named ``args``) must be one of the named exceptions:

* the flag layer, by its names: parsers (``add_*``, ``parse_args``, ``build_parser``), checks
  (``*_problems``, ``validate*``, ``check_*``) and the constructors of typed configs
  (``from_args``, ``*_settings``, ``*_of``), which read the namespace once, before anything runs;
* Megatron-LM's hooks, which must hand megatron-core its own namespace (:data:`MEGATRON_LM_HOOKS`);
* checkpoint metadata: the flags a checkpoint records and compares (:data:`CHECKPOINT_METADATA`);
* the simulator's command line (:data:`SIMULATOR_CLI`), whose namespace is its own config.

:data:`PENDING` lists the functions that still take the namespace below ``from_args``; it only
shrinks: an unlisted function fails the walk, and so does a listed one that no longer takes a
namespace (take it off the list).
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Set

import megatron_bitpipe

PACKAGE = pathlib.Path(megatron_bitpipe.__file__).parent

#: the flag layer's names (parsers, checks, typed-config constructors)
FLAG_LAYER = re.compile(
    r"^(_?add_\w*|parse_args|build_parser|_fill_derived|_?\w*problems?|_?validate\w*|_?check\w*|from_args|_?\w+_settings"
    r"|\w+_of|selected_mode|_positive|_checked_placement|_flag_combination_problem|resolved_schedule|schedule_choice"
    r"|schedule_costs|_with_expert_all_to_alls|microbatches_per_data_parallel_rank|_stage_layers|padded_vocab_size"
    r"|_schedule_rules|_schedule_multiple|count_rule|_initial_count|_moe_shape|model_shape|layer_split_flags|training_memory)$"
)
#: Megatron-LM's hooks and builders: megatron-core's own calls hand them Megatron-LM's namespace
MEGATRON_LM_HOOKS = {
    "megatron_lm/args.py": {"hold_layer_split", "release_layer_split", "configure_optimizer_checkpoints"},
    "megatron_lm/hooks.py": {"setup", "get_megatron_optimizer_config"},
    "megatron_lm/model.py": {"_ddp_config", "_provider_chunk_maker", "build_plan_chunks"},
}
#: the flags a checkpoint records beside its tensors, and their comparison with the run's
CHECKPOINT_METADATA = {
    "training/checkpoint.py": {"_megatron_lm_args", "_saved_args"},
    "training/load_plan.py": {"from_run"},  # the layout flags' values, compared with the saved namespace's
}
#: the schedule command line: its namespace is the simulator's own configuration
SIMULATOR_CLI = {
    "schedules/cli.py": {"layout_search", "cost_model", "recommendation", "_recommend", "_model_step",
                         "_weighed_model", "weighed_layout_search", "weighed_recommendation"},
    "schedules/model_args.py": {"hardware"},
}  # fmt: skip
#: below RunConfig.from_args, still taking the namespace (this list only shrinks)
PENDING = {
    "training/checkpoint.py": {"save_checkpoint", "load_checkpoint"},
    "training/coreset/select.py": {"select", "proxy_trainer", "_select_with_model"},
    "training/loop.py": {"run_training", "__init__"},
}
#: torch's dispatch protocols call their parameter ``args`` (a tuple of operands)
TORCH_PROTOCOLS = {"__torch_dispatch__", "__torch_function__", "_target_device", "_on_cpu", "_audited_move", "_check",
                   "_check_c10d", "with_keyword"}  # fmt: skip


def _takes_namespace(function: ast.FunctionDef) -> bool:
    parameters = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    for parameter in parameters:
        annotation = ast.unparse(parameter.annotation) if parameter.annotation else ""
        if "Namespace" in annotation and "Callable" not in annotation:
            return True
        if parameter.arg == "args" and not annotation:
            return True
    return False


def namespace_functions() -> dict:
    """``{path under the package: {function names taking the parsed flags}}``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names: Set[str] = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in TORCH_PROTOCOLS and _takes_namespace(node)
        }
        if names:
            found[path.relative_to(PACKAGE).as_posix()] = names
    return found


def _named(table: dict, path: str) -> Set[str]:
    return table.get(path, set())


def test_nothing_below_the_run_config_takes_the_flags():
    unexpected = []
    for path, names in namespace_functions().items():
        allowed = _named(MEGATRON_LM_HOOKS, path) | _named(CHECKPOINT_METADATA, path) | _named(SIMULATOR_CLI, path) | _named(PENDING, path)
        unexpected += [f"{path}: {name}" for name in sorted(names) if name not in allowed and not FLAG_LAYER.match(name)]
    assert not unexpected, (
        "these functions take the parsed flags (argparse.Namespace) below RunConfig.from_args; give them the RunConfig "
        "or its sub-config instead:\n  " + "\n  ".join(unexpected)
    )


def test_the_pending_list_only_shrinks():
    found = namespace_functions()
    stale = [f"{path}: {name}" for path, names in PENDING.items() for name in sorted(names) if name not in found.get(path, set())]
    assert not stale, "these no longer take the parsed flags: take them off PENDING\n  " + "\n  ".join(stale)


def test_the_walk_sees_a_namespace_parameter():
    tree = ast.parse("import argparse\ndef f(args: argparse.Namespace): ...\ndef g(run, args): ...\ndef h(run): ...")
    verdicts = {node.name: _takes_namespace(node) for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert verdicts == {"f": True, "g": True, "h": False}
