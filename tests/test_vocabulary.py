"""One word for a scoring rule (issue #33): *rule*, in the library, the model families and
the runner, in identifiers, messages, help texts, docstrings and comments alike.

The concept had three names: "policy" (`Policy`, `make_policy`, `--policy`), "method" (the
runner's `--methods`, `Cell.method`, the report's "method" column) and "rule" (the package
`dge_jax/rules/`, `ScoringRule`). The two old words may appear only on the lines of
`KEPT`: the old names that scripts and run folders still use. Python's `classmethod` and
`staticmethod` are not the word.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dge_jax", "experiments", "models")
OLD_WORDS = re.compile(r"polic(y|ies)|methods?", re.IGNORECASE)
# (file, line): the old names kept on purpose, each for what still uses it.
KEPT = {
    # config.json's identity key, hashed into run ids and prediction keys: earlier folders
    # resume only if it keeps its spelling
    ("experiments/run_folder.py", 'RULE_OPTIONS_KEY = "policy_options"'),
    # InfiniteBench's code_debug prompt, verbatim (a Python method, not a scoring rule)
    ("experiments/suites/infinitebench.py",
     '"code_debug": "Following is a Python code where exactly one of the functions/methods has '
     'a "'),
}


def old_words(text: str) -> list[tuple[int, str]]:
    """(line number, stripped line) of every line that names the concept by an old word."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if OLD_WORDS.search(re.sub(r"(class|static)method", "", line)):
            found.append((number, line.strip()))
    return found


def test_the_scan_finds_every_old_spelling():
    """The check can fail: identifiers, flags, keys, messages and comments in either word,
    any case; the decorators pass."""
    for text in ("x = make_policy('snapkv')", "POLICIES", "class Policy(Protocol):",
                 "observation.for_policy(ev.policy, obs)", "rules, policies = 1, 2",
                 'flags.DEFINE_list("methods", ...)', "c.method != 'full'",
                 'header = ["method", "timing"]', "# the policy's scores",
                 "f'unknown Method {name!r}'"):  # fmt: skip
        assert old_words(text) == [(1, text)], text
    assert old_words("@classmethod\ndef of(cls):\n@staticmethod\ndef rule(): ...") == []
    assert old_words("@classmethod\ndef method(cls): ...") == [(2, "def method(cls): ...")]


def test_one_word_for_a_scoring_rule():
    """No module of the library, the families or the runner calls a scoring rule a policy or
    a method, apart from the old names kept for scripts and run folders (`KEPT`)."""
    seen, stray = set(), []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            for number, line in old_words(path.read_text()):
                if (name, line) in KEPT:
                    seen.add((name, line))
                else:
                    stray.append(f"{name}:{number}: {line}")
    assert not stray, "say rule (or scorer, for a rule's scoring function):\n" + "\n".join(stray)
    assert seen == KEPT, f"KEPT lists lines that are gone: {sorted(KEPT - seen)}"


def test_the_command_lines_say_rule():
    """`python -m dge_jax generate --help` and the runner's flag help name rules only; the
    runner's old --methods flag is gone."""
    from dge_jax import cli
    from experiments.run_config import FLAGS

    generate = cli.build_parser()._subparsers._group_actions[0].choices["generate"]
    assert not old_words(generate.format_help()), generate.format_help()
    assert "--rule " in generate.format_help()
    helps = {name: FLAGS[name].help for name in FLAGS if name in ("rules", "methods")}
    assert "methods" not in helps
    assert not old_words(helps["rules"]) and "scoring rules" in helps["rules"]
