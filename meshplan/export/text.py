"""Printable exports: `export_text` (a shell command for Megatron-LM, TOML for torchtitan,
`key=value` override lines for NeMo 2 / Megatron-Bridge) and the small writers it uses (`to_toml`,
override values, shell quoting, the comment header naming the plan, version and notes).
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from meshplan.errors import ConfigError, UnknownNameError
from meshplan.export.megatron import megatron_export
from meshplan.export.nemo import nemo_export
from meshplan.export.torchtitan import torchtitan_constraints, torchtitan_export
from meshplan.export.view import FORMATS, Export
from meshplan.ir.precision import Precision

__all__ = ["export_text", "to_toml", "export_constraints"]


def _toml_value(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, str):
        return json.dumps(x)   # a JSON string is a valid TOML basic string
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_toml_value(e) for e in x) + "]"
    raise ConfigError(f"cannot write {type(x).__name__} value {x!r} as TOML")


def to_toml(data: Mapping[str, Any], _prefix: str = "") -> str:
    """A minimal TOML writer for nested dicts of scalars and lists (no None values)."""
    lines, tables = [], []
    for k, val in data.items():
        if isinstance(val, Mapping):
            tables.append((k, val))
        elif val is not None:
            lines.append(f"{k} = {_toml_value(val)}")
    out = []
    if _prefix and lines:
        out.append(f"[{_prefix}]")
    out += lines
    for k, sub in tables:
        block = to_toml(sub, f"{_prefix}.{k}" if _prefix else k)
        if block:
            out += ([""] if out else []) + [block]
    return "\n".join(out)


def _override_value(x: Any, hydra: bool) -> str:
    """A value as NeMo-Run's CLI parser (Python literals) or Hydra's override grammar reads it."""
    if x is None:
        return "null" if hydra else "None"
    if isinstance(x, bool):
        return ("true" if x else "false") if hydra else repr(x)
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, str):
        return x if re.fullmatch(r"[A-Za-z0-9_.\-]+", x) else json.dumps(x)
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(json.dumps(e) if isinstance(e, str) else _override_value(e, hydra) for e in x) + "]"
    raise ConfigError(f"cannot write {type(x).__name__} value {x!r} as an override")


def _shell_word(w: str) -> str:
    return w if re.fullmatch(r"[A-Za-z0-9_.,=/:+\-]+", w) else "'" + w.replace("'", "'\\''") + "'"


def _header(plan: Any, exp: Export, comment: str) -> list[str]:
    lay = plan.layout
    lines = [f"{comment} meshplan plan for {plan.model} on {plan.world_size} GPUs: {lay.short()}, "
             f"seq {plan.seq_len}, global batch {plan.global_batch}, {plan.precision}",
             f"{comment} names checked against {exp.version}"]
    if exp.target:
        lines.append(f"{comment} written for {exp.target}")
    lines += [f"{comment} NOTE: {n}" for n in exp.notes]
    return lines


def export_text(plan: Any, fmt: str, model: Any = None) -> str:
    """Printable export: `megatron` a shell-ready flag list (one flag per line, `\\` continued),
    `torchtitan` a TOML job config, `nemo` / `megatron-bridge` one `key=value` override per line."""
    if fmt == "megatron":
        exp = megatron_export(plan, model)
        pairs: list[str] = []
        args = list(exp.args)
        i = 0
        while i < len(args):   # a flag and its values on one line
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            pairs.append(" ".join(_shell_word(w) for w in args[i:j]))
            i = j
        env = "".join(f"{k}={val} " for k, val in exp.env.items())
        body = [f"{env}torchrun --nproc-per-node <gpus-per-node> pretrain_gpt.py \\"]
        body += [f"    {p} \\" for p in pairs[:-1]] + [f"    {pairs[-1]}"]
        return "\n".join(_header(plan, exp, "#") + body)
    if fmt == "torchtitan":
        exp = torchtitan_export(plan, model)
        return "\n".join(_header(plan, exp, "#")) + "\n\n" + to_toml(exp.data)
    if fmt in ("nemo", "megatron-bridge"):
        exp = nemo_export(plan, model, flavor=fmt)
        how = ("# pass as overrides: nemo llm pretrain --factory <recipe> key=value ..." if fmt == "nemo" else
               "# pass as Hydra-style overrides to a Megatron-Bridge recipe script: key=value ...")
        lines = _header(plan, exp, "#") + [how]
        lines += [_shell_word(f"{k}={_override_value(val, fmt == 'megatron-bridge')}") for k, val in exp.data.items()]
        return "\n".join(lines)
    raise UnknownNameError("export format", fmt, list(FORMATS))


def export_constraints(fmt: str, model: Any,
                       precision: Precision | str = Precision.BF16) -> tuple[dict[str, Any], list[str]]:
    """Layout keys the target fixes for `model` beyond what its stack offers (for torchtitan, e.g.
    cp=1 for models it runs with FlexAttention), with one reason per key; `meshplan plan --export`
    plans with them unless --fix sets them. Empty for targets without such limits."""
    if fmt not in FORMATS:
        raise UnknownNameError("export format", fmt, list(FORMATS))
    if fmt == "torchtitan":
        return torchtitan_constraints(model, precision)
    return {}, []
