"""Command line: ``python -m dpoptim <command> ...`` (also installed as ``dpoptim``).

Commands
--------
``epsilon``  epsilon spent by a run::

    python -m dpoptim epsilon --noise-multiplier 1.1 --sample-rate 0.004 --steps 10000 --delta 1e-5

``demo``     DP-SGD and non-private training side by side on the bundled digits::

    python -m dpoptim demo

``noise``    noise multiplier that spends a target epsilon::

    python -m dpoptim noise --target-epsilon 3 --delta 1e-5 --sample-rate 0.004 --epochs 40

Without ``--accountant`` both accountants are shown side by side; ``--json`` prints one
JSON object instead (infinite values as ``null``). Bad arguments, whether caught by the
parser or by the library, print a message on stderr and exit with status 2.

Adding a command is one entry in :data:`COMMANDS`: a help line, a function that adds the
command's arguments to its parser, and a function that runs it and returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import NamedTuple

from dpoptim.accounting import ACCOUNTANTS, calibrate_noise, epsilon
from dpoptim.accounting.ledger import check_count, check_sample_rate
from dpoptim.data import batches_per_epoch

__all__ = ["COMMANDS", "Command", "build_parser", "main"]

_ADJACENCY = "Poisson-subsampled Gaussian mechanism, add/remove-one adjacency"


class Command(NamedTuple):
    """One subcommand: its help line, how to declare its arguments, how to run it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --- shared arguments ---------------------------------------------------------------


def _add_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sample-rate", type=float, required=True, metavar="Q",
                        help="probability that an example joins a batch, in (0, 1]")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=_step_count, metavar="N",
                        help="number of training steps (an integer; 1e6 style accepted)")
    length.add_argument("--epochs", type=float, metavar="E",
                        help="number of epochs; steps = ceil(E * round(1 / sample rate)), the Poisson loader's epoch")
    parser.add_argument("--delta", type=float, required=True, metavar="D",
                        help="target delta, in (0, 1); choose it below 1 / dataset size")


def _step_count(text: str) -> int:
    """``--steps``: what the library accepts, integral floats such as ``1e3`` included."""
    try:
        value = float(text) if not text.strip().lstrip("+-").isdigit() else int(text)
        return check_count(value, "steps")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer such as 1000 or 1e3, got {text!r}") from None


#: Library argument names and the flags that set them, so that errors name the flag.
_FLAGS = {
    "noise_multiplier": "--noise-multiplier",
    "sample_rate": "--sample-rate",
    "target_epsilon": "--target-epsilon",
    "steps": "--steps",
    "epochs": "--epochs",
    "delta": "--delta",
}


def _flag_message(error: ValueError) -> str:
    message = str(error)
    for name, flag in _FLAGS.items():
        if message.startswith(name + " ") or message.startswith(f"{name}="):
            return f"argument {flag}: {message}"
    return message


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--accountant", choices=sorted(ACCOUNTANTS), default=None,
                        help="accountant to use (default: all of them, side by side)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _steps(args: argparse.Namespace) -> int:
    if args.epochs is None:
        return args.steps
    sample_rate = check_sample_rate(args.sample_rate)
    epochs = args.epochs
    if not (epochs >= 0 and math.isfinite(epochs)):
        raise ValueError(f"epochs must be a finite number >= 0, got {epochs!r}")
    # An epoch of Poisson sampling is round(1/q) batches, as in dpoptim.data.poisson_loader.
    return math.ceil(epochs * batches_per_epoch(sample_rate))


def _accountants(args: argparse.Namespace) -> list[str]:
    return [args.accountant] if args.accountant else list(ACCOUNTANTS)


def _json_number(value: float):
    return value if math.isfinite(value) else None


def _number(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else "inf"


def _print_header(rows: list[tuple[str, str]]) -> None:
    print(_ADJACENCY)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")
    print()


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _schedule_rows(args: argparse.Namespace, steps: int) -> list[tuple[str, str]]:
    shown = str(steps) if args.epochs is None else f"{steps} ({args.epochs:g} epochs)"
    return [("sample rate", f"{args.sample_rate:g}"), ("steps", shown), ("delta", f"{args.delta:g}")]


# --- epsilon ------------------------------------------------------------------------


def _epsilon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise-multiplier", type=float, required=True, metavar="SIGMA",
                        help="noise standard deviation divided by the clipping norm")
    _add_schedule_arguments(parser)
    _add_output_arguments(parser)


def _epsilon_run(args: argparse.Namespace) -> int:
    steps = _steps(args)
    results = {
        name: epsilon(args.noise_multiplier, args.sample_rate, steps, args.delta, accountant=name)
        for name in _accountants(args)
    }
    if args.json:
        print(json.dumps({
            "command": "epsilon",
            "noise_multiplier": args.noise_multiplier,
            "sample_rate": args.sample_rate,
            "steps": steps,
            "delta": args.delta,
            "epsilon": {name: _json_number(value) for name, value in results.items()},
        }))
        return 0
    _print_header([("noise multiplier", f"{args.noise_multiplier:g}"), *_schedule_rows(args, steps)])
    _print_table(["accountant", "epsilon"], [[name, _number(value)] for name, value in results.items()])
    return 0


# --- noise --------------------------------------------------------------------------


def _noise_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target-epsilon", type=float, required=True, metavar="EPS",
                        help="privacy budget to spend over the whole run")
    _add_schedule_arguments(parser)
    _add_output_arguments(parser)


def _noise_run(args: argparse.Namespace) -> int:
    steps = _steps(args)
    results = {}
    for name in _accountants(args):
        sigma = calibrate_noise(args.target_epsilon, args.delta, args.sample_rate, steps, accountant=name)
        results[name] = (sigma, epsilon(sigma, args.sample_rate, steps, args.delta, accountant=name))
    if args.json:
        print(json.dumps({
            "command": "noise",
            "target_epsilon": args.target_epsilon,
            "sample_rate": args.sample_rate,
            "steps": steps,
            "delta": args.delta,
            "noise_multiplier": {name: sigma for name, (sigma, _) in results.items()},
            "epsilon": {name: _json_number(eps) for name, (_, eps) in results.items()},
        }))
        return 0
    _print_header([("target epsilon", f"{args.target_epsilon:g}"), *_schedule_rows(args, steps)])
    _print_table(
        ["accountant", "noise multiplier", "epsilon"],
        [[name, _number(sigma), _number(eps)] for name, (sigma, eps) in results.items()],
    )
    return 0


#: Subcommand name -> Command. Register a new command by adding one entry.
def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from dpoptim import demo

    demo.add_arguments(parser)


def _demo_run(args: argparse.Namespace) -> int:
    from dpoptim import demo

    return demo.run(args)


COMMANDS: dict[str, Command] = {
    "demo": Command("train on the bundled digits, private and non-private side by side",
                    _demo_arguments, _demo_run),
    "epsilon": Command("epsilon spent by a run (noise multiplier, sample rate, steps)",
                       _epsilon_arguments, _epsilon_run),
    "noise": Command("noise multiplier that spends a target epsilon",
                     _noise_arguments, _noise_run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpoptim",
        description="Differentially private training with dpoptim: a demo and privacy accounting.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad arguments (2)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"dpoptim {args.command}: error: {_flag_message(error)}", file=sys.stderr)
        return 2
