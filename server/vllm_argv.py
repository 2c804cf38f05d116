"""vLLM's spellings of `vllm serve` arguments, rewritten to Ember's before argparse reads them (vLLM's
FlexibleArgumentParser): ``--foo_bar`` for ``--foo-bar``, switches given ``true``/``false``, dotted JSON flags
(``--speculative-config.method ngram``) and a YAML ``--config`` file. Each takes the `ember serve` parser, to read its
flags and to report errors in its one-line style."""
from __future__ import annotations

import argparse
import json
from typing import Any


def flag_names(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's spellings of flag names rewritten to Ember's: ``--foo_bar`` is ``--foo-bar`` (the name only, up to a
    ``.`` or ``=``); a switch given a value (``--x=True``, ``--x false``) is the switch or its negation (`_switch`)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            return out + argv[i - 1:]
        if not arg.startswith("--"):
            out.append(arg)
            continue
        key, eq, value = arg.partition("=")
        base, dot, keys = key.partition(".")
        key = "--" + base[2:].replace("_", "-") + dot + keys
        if not isinstance(parser._option_string_actions.get(key), _SWITCHES):
            out.append(key + eq + value)
            continue
        if not eq and i < len(argv) and argv[i].lower() in ("true", "false"):
            value, eq = argv[i], "="
            i += 1
        if eq and value.lower() not in ("true", "false"):
            parser.error(f"argument {key}: {value!r} is not true or false")
        out += _switch(parser, key, not eq or value.lower() == "true")
    return out


_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def _switch(parser: argparse.ArgumentParser, flag: str, on: bool) -> list[str]:
    """The spelling of switch ``flag`` given as true or false: the flag itself, or a flag that sets its setting to
    the other value (``--no-x`` for ``--x``, ``--x`` for ``--no-x``), so that an explicit false overrides a
    ``--config`` file's true."""
    if on:
        return [flag]
    action = parser._option_string_actions[flag]
    value = not _switch_value(action, flag)
    for option, other in parser._option_string_actions.items():
        if other.dest == action.dest and option.startswith("--") and _switch_value(other, option) is value:
            return [option]
    parser.error(f"argument {flag}: cannot be given false")


def _switch_value(action: argparse.Action, option: str) -> bool | None:
    """The value switch ``option`` (of ``action``) gives its setting; None for a flag that is no switch."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return not option.startswith("--no-")
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return bool(action.const)
    return None


def add_negations(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--no-x`` spelling (its switches are ``BooleanOptionalAction``s) for every ``--x`` switch of
    ``parser`` that has none: ``--x`` off, as ``--x false`` is."""
    for action in list(parser._actions):
        if not isinstance(action, argparse._StoreTrueAction):
            continue
        for option in action.option_strings:
            negation = "--no-" + option[2:]
            if option.startswith("--") and negation not in parser._option_string_actions:
                parser.add_argument(negation, dest=action.dest, action="store_false", default=argparse.SUPPRESS,
                                    help=argparse.SUPPRESS)


def fold_dotted(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's dotted JSON flags folded into their JSON flag: ``--speculative-config.method ngram`` is
    ``--speculative-config '{"method": "ngram"}'``, several keys of one flag merged (into the flag's own JSON object
    where it is given too, which it replaces), ``--x.key+ a,b`` appending to the list at ``key``. A value is JSON,
    else a human-readable integer (``8k``), else a string. A flag Ember does not know is left as given (reported
    unknown)."""
    from ember.engine.args import parse_human_int

    folded: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    rest = iter(argv)
    for arg in rest:
        key, eq, text = arg.partition("=")
        base, dot, path = key.partition(".")
        if not (arg.startswith("--") and dot and base in parser._option_string_actions):
            out.append(arg)
            if arg == "--":
                out += rest
            continue
        if not eq:
            text = next(rest, None)
            if text is None:
                parser.error(f"argument {key}: expected one argument")
        append = path.endswith("+")
        keys = path.removesuffix("+").split(".")
        if not all(keys):
            parser.error(f"argument {key}: an empty key")
        value: Any
        if append:
            value = text.split(",")
        else:
            try:
                value = json.loads(text)
            except ValueError:
                try:
                    value = parse_human_int(text)
                except ValueError:
                    value = text
        node = folded.setdefault(base, {})
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        last = keys[-1]
        node[last] = node[last] + value if append and isinstance(node.get(last), list) else value
    for base, value in folded.items():
        given = [i for i, a in enumerate(out) if a == base or a.startswith(base + "=")]
        if given:
            i = given[-1]
            own = out[i].partition("=")[2] if "=" in out[i] else out[i + 1] if i + 1 < len(out) else ""
            try:
                merged = json.loads(own)
            except ValueError:
                merged = None
            if isinstance(merged, dict):
                _merge(merged, value)
                value = merged
                del out[i:i + (1 if "=" in out[i] else 2)]
        out += [base, json.dumps(value)]
    return out


def _dotted_base(arg: str) -> str | None:
    """The flag of a dotted argument (``--x.key=v`` or ``--x.key``), else None."""
    key = arg.partition("=")[0]
    base, dot, _ = key.partition(".")
    return base if arg.startswith("--") and dot else None


def with_config_dotted(cli: list[str], config: list[str]) -> list[str]:
    """``cli`` after the ``--config`` file's dotted keys (``config``, as `config_argv` writes them) of each flag the
    command line gives dotted keys of too, so that `fold_dotted` merges both into one object, the command line's
    keys winning, as vLLM merges them (else the command line's object would replace the file's whole)."""
    bases = {b for b in map(_dotted_base, cli) if b is not None}
    return [a for a in config if _dotted_base(a) in bases] + cli


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """``update`` set over ``into``, dict by dict (lists appended, as vLLM merges dotted flags)."""
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k] = into[k] + v
        else:
            into[k] = v


def config_file(argv: list[str], parser: argparse.ArgumentParser) -> tuple[str | None, list[str]]:
    """vLLM's ``--config FILE`` taken out of ``argv``: (the file or None, the rest)."""
    found = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if "--" in argv:
        found = [i for i in found if i < argv.index("--")]
    if not found:
        return None, argv
    if len(found) > 1:
        parser.error("argument --config: given twice; one YAML file is read")
    i = found[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            parser.error("argument --config: expected one argument")
        return argv[i + 1], argv[:i] + argv[i + 2:]
    return argv[i].partition("=")[2], argv[:i] + argv[i + 1:]


def config_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags of vLLM's YAML config file: each key (dashes or underscores, leading ``--`` optional) is a flag;
    true gives a switch, false its ``--no-`` form, a list the flag's values (one flag with them all, or
    the flag repeated for a flag that takes one), a mapping its JSON, null nothing."""
    try:
        import yaml
    except ImportError:
        parser.error(f"argument --config: Ember reads no YAML config here (PyYAML is not installed); give the "
                     f"flags of {path} on the command line")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"argument --config: cannot read {path}: {' '.join(str(e).split())}")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"argument --config: {path} is not a mapping of flag names to values")
    out: list[str] = []
    for name, value in data.items():
        flag = "--" + str(name).lstrip("-")
        if flag == "--config":
            parser.error(f"argument --config: {path} names another config file ({value}); Ember reads one, as vLLM")
        if value is None:
            continue
        if "." in flag:
            out.append(f"{flag}={json.dumps(value)}")       # a key of a JSON flag: its JSON value
        elif isinstance(value, bool):
            out.append(f"{flag}={'true' if value else 'false'}")
        elif isinstance(value, list):
            action = parser._option_string_actions.get(flag.partition(".")[0].replace("_", "-"))
            if action is not None and action.nargs in ("+", "*"):
                out += [flag, *map(_yaml_text, value)] if value else []
            else:
                for item in value:
                    out.append(f"{flag}={_yaml_text(item)}")
        else:
            out.append(f"{flag}={_yaml_text(value)}")
    return out


def _yaml_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
