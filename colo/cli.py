"""The ``colo`` command line.

Exit codes everywhere: 0 success, 1 a failed check or run, 2 bad input or usage.
Each subcommand lives in its own module and is imported only when used, so
``colo replay`` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Sequence

from colo.core.phases import PLANS
from colo.core.errors import EXIT_BAD_INPUT, EXIT_FAILED, ColoError
from colo.transports import REGISTRY as TRANSPORTS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep its message, drop the noise
        self.print_usage(sys.stderr)
        print(f"colo: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


#: the largest amount a flag takes: 1 PiB in its unit (GiB flags) or 1 TiB (MiB flags);
#: beyond that a value is a typo, and 1e308 GiB overflows every byte count
MAX_GIB, MAX_MIB = float(1 << 20), float(1 << 20)
#: the longest phase deadline: 10^7 s (116 days) is already "never"
MAX_DEADLINE_S = 1e7


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text}")
    return value


def _positive(kind, most=None):
    """A number > 0 (and <= ``most``): a float flag also refuses inf and nan."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:  # also int("9" * 5000): Python's digit limit
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:  # nan > 0 is False
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        if (kind is float and not math.isfinite(value)) or (most is not None and value > most):
            raise argparse.ArgumentTypeError(
                f"expected a positive {kind.__name__} of at most {_show(most)}, got {text}" if most is not None
                else f"expected a finite positive {kind.__name__}, got {text}")
        return value
    return parse


def _bounded(kind, least, most):
    """A number in [least, most]; the range check of a flag whose sign its command
    reports itself (``--margin-gib``) keeps only the absurd out."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or not least <= value <= most:
            raise argparse.ArgumentTypeError(f"expected a number in [{_show(least)}, {_show(most)}], got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="colo", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    d = sub.add_parser("demo", help="run a real colocated RL loop on a built-in small model")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    d.add_argument("--steps", type=_positive(int, 10**6), default=8)
    d.add_argument("--plan", choices=PLANS, default="offload-first")
    d.add_argument("--transport", choices=TRANSPORTS, default="packed")
    d.add_argument("--trainer", default="hf", help="hf (transformers), megatron (megatron-core), fsdp (FSDP2)")
    d.add_argument("--model", default="demo", help="demo (tiny, the default) or qwen2-1.5b (Qwen2-1.5B shapes, "
                   "random weights: a trainer that is a real share of one GPU)")
    d.add_argument("--bucket-mib", type=_positive(float, MAX_MIB), default=1.0)
    d.add_argument("--mem-fraction-static", type=_fraction, default=0.8)
    d.add_argument("--device-mem-gib", type=_positive(float, MAX_GIB), default=None,
                   help="simulated device size on the CPU (default: sized for the demo model)")
    d.add_argument("--trace", default=None, help="trace path (default: traces/demo-<plan>.jsonl)")
    d.add_argument("--seed", type=_bounded(int, 0, 2**32 - 1), default=0)
    d.add_argument("--fault", default=None, metavar="KIND@PHASE")
    d.add_argument("--engine-visible-devices", default=None, metavar="DEVICES",
                   help="CUDA_VISIBLE_DEVICES of the engine process only (e.g. a GPU UUID)")
    d.add_argument("--phase-deadline", type=_positive(float, MAX_DEADLINE_S), default=600.0, metavar="SECONDS",
                   help="fail any phase that runs longer than this (default 600)")
    d.add_argument("--gpus", type=_positive(int, 8), default=1, metavar="N",
                   help="ranks, one process per GPU: trainer rank r and engine rank r (TP=N) on GPU r "
                        "(with --device cpu, gloo and simulated devices)")
    d.add_argument("--launcher", choices=("process", "ray"), default="process",
                   help="who starts the --gpus N ranks: worker processes here, or Ray actors (colo[ray])")
    d.add_argument("--address", default=None, help="the Ray cluster to join (default: start a local one)")
    d.add_argument("--verify", choices=("every", "first", "none"), default="every",
                   help="which syncs are verified: the engine's digest against the trainer's and the probe "
                        "logits (default every; timed on its own as verify_s in sync.finished)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(module="colo.apps.demo", func="run_demo")

    r = sub.add_parser("replay", help="check traces against the phase table and invariants")
    r.add_argument("traces", nargs="+")
    r.add_argument("--json", action="store_true")
    r.set_defaults(module="colo.offline.replay", func="run_replay")

    e = sub.add_parser("export", help="Chrome trace JSON that Perfetto opens")
    e.add_argument("trace")
    e.add_argument("-o", "--output", required=True)
    e.set_defaults(module="colo.offline.export", func="run_export")

    t = sub.add_parser("tune", help="recommend mem_fraction_static and a bucket size")
    t.add_argument("traces", nargs="*")
    t.add_argument("--margin-gib", type=_bounded(float, -MAX_GIB, MAX_GIB), default=None)
    t.add_argument("--json", action="store_true")
    t.add_argument("--gpu-gib", type=_positive(float, MAX_GIB), default=None)
    t.add_argument("--model-gib", type=_positive(float, MAX_GIB), default=None)
    t.add_argument("--bucket-mib", type=_positive(float, MAX_MIB), default=None)
    t.add_argument("--plan", choices=PLANS, default=None)
    t.set_defaults(module="colo.offline.tune", func="run_tune")

    b = sub.add_parser("bench", help="sync throughput and peak memory, transport against transport")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    b.add_argument("--model", default="demo")
    b.add_argument("--transports", nargs="+", default=None)
    b.add_argument("--out", default=None)
    b.add_argument("--gpus", type=_positive(int, 8), default=None, metavar="N",
                   help="trainer TP=N and engine TP=N, one rank per GPU (colo.apps.bench_multi; "
                        "--model qwen2-7b|tiny|qwen3-30b-a3b|qwen3-moe-tiny; a MoE's trainer adds EP=N)")
    b.add_argument("--bucket-mib", type=_positive(float, MAX_MIB), default=512.0)
    b.add_argument("--reps", type=_positive(int, 100), default=3)
    b.set_defaults(module="colo.apps.bench", func="run_bench")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.gpus is not None:  # many ranks: its own benchmark
        args.module, args.func = "colo.apps.bench_multi", "run_bench_multi_cli"
    try:
        module = importlib.import_module(args.module)
    except ModuleNotFoundError as e:
        if e.name == args.module:
            print(f"colo {args.command}: not available in this build", file=sys.stderr)
            return EXIT_FAILED
        raise
    try:
        return int(getattr(module, args.func)(args) or 0)
    except ColoError as e:
        # every planned refusal carries its exit code; anything else is a bug
        # and keeps its traceback
        print(f"colo {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def _exit(code: int) -> int:
    """``code``, or the process ends with it here when a GPU command loaded the memory
    saver (whose teardown at interpreter exit would turn any status into 1)."""
    if "torch_memory_saver" in sys.modules:
        from colo.device.cuda_memory import exit_past_the_saver

        return exit_past_the_saver(code)
    return code


def run() -> None:
    """The ``colo`` command (main() is what tests call in-process, and it returns)."""
    sys.exit(_exit(main()))


if __name__ == "__main__":
    run()
