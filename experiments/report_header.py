"""What a run's results.md opens with, before any table: the run's header, read from the
folder's config.json (identity and history) and its prediction lines."""

from __future__ import annotations

from dge_jax.checkpoints.tokenizer import RAW_PROMPT
from experiments import protocol


def header(scores: dict, config: dict | None, rows: list[dict], plot_files: list[str]) -> str:
    """What results.md opens with, before any table: model, suite and datasets, n, how the
    prompts were cut and formatted, run id, run dates, dge_jax version and the commands that
    wrote the folder (config.json), and the plot files written beside it."""
    import dge_jax

    ident = (config or {}).get("identity", {})
    history = (config or {}).get("history", [])
    unknown = "unknown"
    model, suite = ident.get("model"), ident.get("suite")
    lines = [f"# Results: {model or 'unknown model'}"
             + (f" on the {suite} suite" if suite else ""), ""]
    if not ident:
        lines += ["The folder has no config.json of this runner: what only it records "
                  "(model, suite, dates, commands) is unknown.", ""]
    lines.append(f"- model: `{model}`" if model else f"- model: {unknown}")
    datasets = sorted(scores["datasets"])
    lines.append(f"- suite: {suite or unknown}; datasets: {', '.join(datasets)}")
    lines.append(f"- n: {_samples_per_dataset(scores)}")
    lines.append(_truncation(rows, ident.get("max_length")))
    lines.append(prompt_format_line(ident, history, datasets))
    ids = sorted({r["run_id"] for r in rows if "run_id" in r})
    run_id = (config or {}).get("run_id") or (ids[0] if len(ids) == 1 else None)
    lines.append(f"- run id: `{run_id}`" if run_id else f"- run id: {unknown}")
    dates = list(dict.fromkeys(h["at"][:10] for h in history if h.get("at")))
    lines.append(f"- run date{'s' if len(dates) > 1 else ''}: {', '.join(dates)} (UTC)"
                 if dates else f"- run dates: {unknown}")
    mine = dge_jax.__version__
    ran = ident.get("dge_jax")
    lines.append(f"- dge_jax: {ran}" + (f" (this report written by {mine})" if ran != mine
                                         else "") if ran else
                 f"- dge_jax: {mine} (this report's; the run's is not recorded)")
    commands = [h for h in history if h.get("command")]
    if commands:
        lines.append(f"- command{'s' if len(commands) > 1 else ''} (config.json history):")
        lines += [f"  - `{_command_text(h['command'])}` ({h.get('at', 'time unknown')})"
                  for h in commands]
    else:
        lines.append(f"- commands: {unknown}")
    lines.append("- plots beside this file: " + (", ".join(f"`{f}`" for f in plot_files)
                                                 if plot_files else "none"))
    return "\n".join(lines) + "\n\n"


def _truncation(rows: list[dict], max_length: int | None) -> str:
    """How many samples' prompts were cut in the middle to the run's max length, per dataset
    where any was (the lines' `truncated`): a default length set by one task's long answers
    shortens every task's prompts."""
    cut: dict[str, set] = {}
    seen: dict[str, set] = {}
    for r in rows:
        seen.setdefault(r["dataset"], set()).add(r["sample_id"])
        if r.get("truncated"):
            cut.setdefault(r["dataset"], set()).add(r["sample_id"])
    length = f"max length {max_length} tokens; " if max_length else ""  # older folders
    if not cut:
        return f"- prompts: {length}none was cut"
    per = ", ".join(f"{d} {len(cut[d])} of {len(seen[d])}" for d in sorted(cut))
    total = sum(map(len, cut.values()))
    return (f"- prompts: {length}{total} of {sum(map(len, seen.values()))} cut in the middle "
            f"to the max length ({per})")


def _samples_per_dataset(scores: dict) -> str:
    """"3 samples per dataset", or each dataset's count when they differ; cells with fewer
    are left to the table's n column."""
    most = {d: max(per.values()) for d, per in sorted(scores["counts"].items())}
    fewer = any(n < most[d] for d, per in scores["counts"].items() for n in per.values())
    text = (f"{next(iter(most.values()))} samples per dataset" if len(set(most.values())) == 1
            else "samples per dataset: " + ", ".join(f"{d} {n}" for d, n in most.items()))
    return text + (" (fewer for some cells: the table's n column)" if fewer else "")


def _command_text(command: str) -> str:
    """A history command as one would type it: older runners stored sys.argv, whose first
    word is the path of experiments/longbench.py when run with `python -m`."""
    first, _, rest = command.partition(" ")
    if first.replace("\\", "/").endswith("experiments/longbench.py"):
        return f"python -m experiments.longbench {rest}".rstrip()
    return command


def prompt_format_line(ident: dict, history: list[dict], datasets: list[str]) -> str:
    """How the prompts were formatted: the raw prompt of a model without a chat template (the
    identity says so), else the chat template the runs recorded (folders from before they
    did were all run with the model's chat template), with the suite's answer prefix after
    it and the tasks the suite feeds without a template named."""
    if not ident:
        return "- prompt format: unknown"
    prefix = (" + the suite's answer prefix" if ident.get("answer_prefix", True)
              else ", no answer prefix (--noanswer_prefix)")
    if ident.get("prompt_format") == RAW_PROMPT:
        return f"- prompt format: {RAW_PROMPT}{prefix} (the model has no chat template)"
    recorded = [h["prompt_format"] for h in history if h.get("prompt_format")]
    used = recorded[-1] if recorded else "the model's chat template"
    raw = [d for d in datasets if not protocol.uses_chat_template(d)]
    return (f"- prompt format: {used}{prefix}"
            + (f"; {', '.join(raw)}: {RAW_PROMPT} (the suite's rule)" if raw else ""))
