"""The ``colo`` command line.

Exit codes everywhere: 0 success, 1 a failed check or run, 2 bad input or usage.
Each subcommand lives in its own module and is imported only when used, so
``colo replay`` never pays for torch. A flag that needs an optional extra that
is not installed is refused before anything starts, with the line that
installs it.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
from collections.abc import Sequence

from colo.core.config import MIN_BUCKET_MIB, MIN_MODEL_GIB, MIN_PHASE_DEADLINE_S
from colo.core.phases import PLANS
from colo.core.errors import EXIT_BAD_INPUT, EXIT_FAILED, ColoError
from colo.engine import ENGINES, LAYOUTS
from colo.transports import REGISTRY as TRANSPORTS

#: choices the parser lists without importing what they name (torch, transformers); the
#: engines and the transports are their registries (read when the parser is built: an
#: engine registered before then is a choice too)
TRAINERS = ("hf", "megatron", "fsdp")
DEMO_SIZES = ("demo", "qwen2-1.5b")
BENCH_MODELS = ("demo", "qwen2-1b", "qwen2-1.5b", "qwen2-7b")


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


#: what a number on colo's command line is written as: ASCII digits, an optional sign, for a
#: float a point and an exponent. Python's int() and float() also take surrounding spaces,
#: underscores and any script's digits (' 3', '1_0', '١'): a flag accepted so says one number
#: and means another to whoever reads the command line or the trace's config
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _number(kind, text: str):
    """``kind(text)`` for a number written as :data:`_INT` or :data:`_FLOAT` says; ValueError else."""
    if not (_INT if kind is int else _FLOAT).fullmatch(text):
        raise ValueError(text)
    return kind(text)


def _fraction(text: str) -> float:
    try:
        value = _number(float, text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text}")
    return value


def _positive(kind, most=None, least=None):
    """A number > 0 (and <= ``most``, and >= ``least``, a size below which the flag makes no sense):
    a float flag also refuses inf and nan."""
    def parse(text: str):
        try:
            value = _number(kind, text)
        except ValueError:  # also int("9" * 5000): Python's digit limit
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__} in ASCII digits, got {text!r}") \
                from None
        if not value > 0:  # nan > 0 is False
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        if least is not None and value < least:
            raise argparse.ArgumentTypeError(
                f"expected a {kind.__name__} of at least {_show(least)}" + (f" and at most {_show(most)}" if most else "")
                + f", got {text}")
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
            value = _number(kind, text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or not least <= value <= most:
            raise argparse.ArgumentTypeError(f"expected a number in [{_show(least)}, {_show(most)}], got {text}")
        return value
    return parse


DESCRIPTION = ("colo: the colocated RL trainer/engine GPU handoff as an explicit, traced state machine. "
               "Run a colocated RL loop, check and export its trace, tune the engine's memory, "
               "benchmark the weight sync.")


class _Help(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it (a default
    that is computed) or the flag is a switch; the lines keep their width."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def _fault_help() -> str:
    from colo.testing.faults import KINDS, POSSIBLE

    kinds = "; ".join(f"{k} (at {', '.join(POSSIBLE[k]) if len(POSSIBLE[k]) < 8 else 'any phase'})" for k in KINDS)
    return f"fail one phase once on purpose and recover (needs --verify every): KIND@PHASE, KIND one of {kinds}"


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a shortened flag is refused, never taken for another
    # (``--engine`` must not silently mean ``--engine-visible-devices``)
    p = _Parser(prog="colo", description=DESCRIPTION, formatter_class=_Help, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description, formatter_class=_Help,
                              allow_abbrev=False)

    d = command("demo", "run a real colocated RL loop on a built-in small model",
                "A real colocated RL loop: a trainer in this process, colo's engine in another, weights handed "
                "over through --transport in the order of --plan, every sync verified. Prints a per-phase "
                "summary and the reward per step; writes the trace.")
    d.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the trainer and the engine run (cpu: a simulated device of --device-mem-gib)")
    # DemoConfig.steps: enough for the reward to rise well above chance
    d.add_argument("--steps", type=_positive(int, 10**6), default=20, help="RL steps (cycles) to run")
    d.add_argument("--plan", choices=PLANS, default="offload-first", help="the order of the phases after train")
    d.add_argument("--transport", choices=list(TRANSPORTS), default=None,
                   help="how the weights travel in a sync (default: the engine's first, packed for colo and vllm, "
                        "sglang for sglang)")
    d.add_argument("--engine", choices=list(ENGINES), default="colo",
                   help="the rollout engine: " + "; ".join(e.summary for e in ENGINES.values()))
    d.add_argument("--vllm-processes", action="store_true",
                   help="with --engine vllm: vLLM's own engine-core and worker processes (else one process)")
    d.add_argument("--trainer", choices=TRAINERS, default="hf",
                   help="hf (transformers), megatron (megatron-core: colo-rl[megatron]), fsdp (FSDP2)")
    d.add_argument("--lora-rank", type=_positive(int, 512), default=None, metavar="R",
                   help="train only a LoRA adapter of rank R (PEFT: colo-rl[lora]) on the frozen model, and sync "
                        "the adapter: staged beside the version serving, activated once verified (--engine vllm)")
    d.add_argument("--keep-adapters", type=_positive(int, 64), default=2, metavar="K",
                   help="with --lora-rank: adapter versions the engine keeps loaded, the serving one included "
                        "(requests still in flight may use the older ones)")
    d.add_argument("--trainer-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the trainer's parameters (bfloat16: fp32 master weights in the optimizer; default: "
                        "the engine's dtype on a GPU, float32 on a CPU)")
    d.add_argument("--model", choices=DEMO_SIZES, default="demo",
                   help="demo (2.9 M parameters) or qwen2-1.5b (Qwen2-1.5B shapes, random weights: a GPU's size)")
    d.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="train a local Hugging Face checkpoint instead of a --model size: a directory with "
                        "config.json and *.safetensors, a Qwen2, Qwen3 or Llama (nothing is downloaded)")
    d.add_argument("--bucket-mib", type=_positive(float, MAX_MIB, MIN_BUCKET_MIB), default=1.0, metavar="MIB",
                   help=f"sync bucket size (at least {MIN_BUCKET_MIB:g})")
    d.add_argument("--mem-fraction-static", type=_fraction, default=0.8, metavar="F",
                   help="the engine's static share of the device (weights + KV pool), as SGLang's flag")
    d.add_argument("--device-mem-gib", type=_positive(float, MAX_GIB), default=None, metavar="GIB",
                   help="simulated device size on the CPU (default: 0.25, sized for the demo model)")
    d.add_argument("--trace", default=None, metavar="PATH", help="trace path (default: traces/demo-<plan>.jsonl)")
    d.add_argument("--engine-log", default=None, metavar="PATH",
                   help="the engine processes' own log lines (default: beside the trace, <trace>.engine.log; "
                        "- for the console)")
    d.add_argument("--seed", type=_bounded(int, 0, 2**32 - 1), default=0, help="seed of the model, prompts and sampling")
    d.add_argument("--fault", default=None, metavar="KIND@PHASE", help=_fault_help())
    d.add_argument("--verify", choices=("every", "first", "none"), default="every",
                   help="which syncs are verified: the engine's digest against the trainer's and the probe "
                        "logits (timed on its own as verify_s in sync.finished)")
    d.add_argument("--phase-deadline", type=_positive(float, MAX_DEADLINE_S, MIN_PHASE_DEADLINE_S), default=600.0,
                   metavar="SECONDS", help=f"fail any phase that runs longer than this (at least {MIN_PHASE_DEADLINE_S:g})")
    d.add_argument("--engine-visible-devices", default=None, metavar="DEVICES",
                   help="CUDA_VISIBLE_DEVICES of the engine process only (a GPU index or UUID)")
    d.add_argument("--gpus", type=_positive(int, 8), default=1, metavar="N",
                   help="ranks, one process per GPU: trainer rank r and engine rank r (TP=N) on GPU r "
                        "(with --device cpu: gloo and simulated devices)")
    d.add_argument("--engine-layout", choices=list(LAYOUTS), default=None,
                   help="with --gpus N: " + "; ".join(f"{k}, {v}" for k, v in LAYOUTS.items())
                        + " (default: the engine's first: tp for colo, replicas for vllm)")
    d.add_argument("--launcher", choices=("process", "ray"), default="process",
                   help="who starts the --gpus N ranks: worker processes here, or Ray actors (colo-rl[ray])")
    d.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="the Ray cluster to join (default: start a local one)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(module="colo.apps.demo", func="run_demo")

    r = command("replay", "check traces against the phase table and invariants",
                "Re-run traces through the phase table and the invariants the scheduler checks live. "
                "Exit 0 valid, 1 on the first violation (line N: ...), 2 on unreadable input.")
    r.add_argument("traces", nargs="+", metavar="TRACE", help="colo.trace/1 files (the ranks of one run together)")
    r.add_argument("--json", action="store_true", help="print {valid, violations: [{line, message}], ...}")
    r.set_defaults(module="colo.offline.replay", func="run_replay")

    e = command("export", "write Chrome trace JSON that Perfetto opens",
                "Convert a trace to Chrome trace JSON: phases, bucket stages and memory counters, for ui.perfetto.dev.")
    e.add_argument("trace", metavar="TRACE", help="a colo.trace/1 file")
    e.add_argument("-o", "--output", required=True, metavar="OUT.json", help="where the JSON goes")
    e.add_argument("--lenient", action="store_true",
                   help="export a trace that colo replay rejects (a cut-off or damaged run, to look at); "
                        "without it such a trace is refused, naming its first violation")
    e.set_defaults(module="colo.offline.export", func="run_export")

    t = command("tune", "recommend mem_fraction_static and a bucket size",
                "From traces (or the what-if flags alone): the largest mem_fraction_static that keeps every phase "
                "within the device, a bucket size, and the phase that binds, with the arithmetic.")
    t.add_argument("traces", nargs="*", metavar="TRACE", help="traces of runs on the device to tune for")
    t.add_argument("--margin-gib", type=_bounded(float, -MAX_GIB, MAX_GIB), default=None, metavar="GIB",
                   help="headroom to keep free (default: 2%% of the device, at most 1 GiB)")
    t.add_argument("--json", action="store_true", help="print {mem_fraction_static, bucket_mib, binding_phase, ...}")
    t.add_argument("--gpu-gib", type=_positive(float, MAX_GIB), default=None, metavar="GIB",
                   help="what-if: the device size (with --model-gib, no trace needed)")
    t.add_argument("--model-gib", type=_positive(float, MAX_GIB, MIN_MODEL_GIB), default=None, metavar="GIB",
                   help=f"what-if: the engine's weights (at least {MIN_MODEL_GIB:g})")
    t.add_argument("--bucket-mib", type=_positive(float, MAX_MIB, MIN_BUCKET_MIB), default=None, metavar="MIB",
                   help=f"what-if: the sync bucket size (at least {MIN_BUCKET_MIB:g})")
    t.add_argument("--plan", choices=PLANS, default=None, help="what-if: the plan")
    t.add_argument("--adapter-mib", type=_positive(float, MAX_MIB), default=None, metavar="MIB",
                   help="what-if: a LoRA run (colo demo --lora-rank) whose adapter is this size: a sync moves it "
                        "alone, the engine keeps its base weights, the optimizer holds the adapter's moments")
    t.set_defaults(module="colo.offline.tune", func="run_tune")

    b = command("bench", "time the sync, transport against transport, on this machine",
                "Whole syncs from a trainer's copy into colo's engine in another process, for each transport, "
                "beside the link's limits measured in the same run; writes the result as JSON.")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the engine runs")
    b.add_argument("--model", default="demo", metavar="NAME[,NAME]",
                   help=f"one of {', '.join(BENCH_MODELS)}, a comma-separated list, or all")
    b.add_argument("--engine", choices=list(ENGINES), default="colo",
                   help="another engine than colo's (vllm, sglang): the same syncs into it beside colo's engine, "
                        "and their ratio")
    b.add_argument("--transports", nargs="+", default=None, metavar="T",
                   help=f"transports to time, of {', '.join(TRANSPORTS)} (default: ipc packed broadcast disk on cpu, "
                        "ipc packed on cuda)")
    b.add_argument("--bucket-mib", type=_positive(float, MAX_MIB, MIN_BUCKET_MIB), default=None, metavar="MIB",
                   help=f"bucket size, at least {MIN_BUCKET_MIB:g} (default: the model's own: 1 for demo, 64 for qwen2-1b, "
                        "512 for the rest)")
    b.add_argument("--reps", type=_positive(int, 100), default=None, metavar="N",
                   help="timed syncs per transport after one warm-up (default: the model's own, 3-5); for the "
                        "real trainers, cycles of each kind")
    b.add_argument("--trainers", default=None, metavar="NAME[,NAME]",
                   help="the real trainers' rows too (hf, megatron, fsdp, a comma-separated list, all or none; "
                        "default: all on cuda, none on cpu): each trainer's sync under every plan and every "
                        "transition of the cycle, in a process of its own")
    b.add_argument("--lora-rank", type=_positive(int, 512), default=None, metavar="R",
                   help="also time adapter syncs of rank R on every dense linear (each a new version, staged "
                        "and activated as colo demo --lora-rank does) beside the full sync of the same model")
    b.add_argument("--out", default=None, metavar="PATH",
                   help="result JSON (default: bench/results/<device>-sync-<date>.json, never replacing one)")
    b.set_defaults(module="colo.apps.bench", func="run_bench")
    return p


#: (command, flag, value) -> (module it needs, the extra that installs it, what it is); an
#: engine's extra is its registry entry's (:meth:`colo.engine.EngineEntry.missing`)
EXTRAS = {
    ("demo", "trainer", "megatron"): ("megatron.core", "megatron", "megatron-core"),
    ("demo", "launcher", "ray"): ("ray", "ray", "Ray"),
}
#: the commands whose --engine starts an engine
ENGINE_COMMANDS = ("demo", "bench")


def missing_extra(args: argparse.Namespace) -> str | None:
    """The refusal for a flag whose optional extra is not installed, or None."""
    import importlib.util

    if args.command in ENGINE_COMMANDS and getattr(args, "engine", None) in ENGINES:
        refusal = ENGINES[args.engine].missing()
        if refusal is not None:
            return refusal
    for (command, flag, value), (module, extra, what) in EXTRAS.items():
        if args.command != command or getattr(args, flag, None) != value:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that is missing or hidden
            found = False
        if not found:
            return (f"--{flag.replace('_', '-')} {value} needs {what}, an optional extra that is not installed: "
                    f"pip install 'colo-rl[{extra}]'")
    return None


def launch_refusal(args: argparse.Namespace) -> str | None:
    """The refusal for a transport that needs a launcher this command does not run it under
    (``rdt``: a rank's two Ray actors), or None: before anything starts, not at its first sync."""
    from colo.transports import LAUNCHERS, launcher_refusal

    if args.command == "demo":
        return launcher_refusal(args.transport, args.launcher if args.gpus > 1 else None)
    if args.command == "bench":
        # colo bench times syncs into an engine process of its own: it starts no ranks
        for name in args.transports or ():
            if name in LAUNCHERS:
                return (f"--transports {name} needs --launcher {LAUNCHERS[name][0]}, and colo bench starts no "
                        f"ranks: python -m bench.{name} times it beside packed")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    refusal = missing_extra(args) or launch_refusal(args)
    if refusal is not None:
        print(f"colo {args.command}: {refusal}", file=sys.stderr)
        return EXIT_BAD_INPUT
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


def _console_errors(err: UnicodeError) -> tuple[str | bytes, int]:
    """How the console writes what its encoding cannot: a file name's byte that is not valid in
    the locale's encoding (Python keeps it as a lone surrogate, U+DC80-U+DCFF) is written back as
    that byte, as the name is on disk; any other character is written escaped (``\\xe9``). A
    strict console (PYTHONIOENCODING=ascii, utf-8:strict) ended a run with a UnicodeEncodeError
    traceback at its report's ``trace:`` line."""
    if not isinstance(err, UnicodeEncodeError):
        raise err
    c = ord(err.object[err.start])
    if 0xDC80 <= c <= 0xDCFF:
        return bytes([c - 0xDC00]), err.start + 1
    return (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"), err.start + 1


def _console() -> None:
    import codecs

    codecs.register_error("colo.console", _console_errors)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="colo.console")
        except (AttributeError, ValueError, OSError):  # not a text stream of its own (a test's capture)
            pass


def _exit(code: int) -> int:
    """``code``, or the process ends with it here when a GPU command loaded the memory
    saver (whose teardown at interpreter exit would turn any status into 1)."""
    if "torch_memory_saver" in sys.modules:
        from colo.device.cuda_memory import exit_past_the_saver

        return exit_past_the_saver(code)
    return code


def run() -> None:
    """The ``colo`` command (main() is what tests call in-process, and it returns)."""
    _console()
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader of stdout went away (`colo replay T | head -1`): what it wanted it read. No
        # traceback; stdout goes to /dev/null so that the interpreter's own flush at exit is quiet,
        # and the status is 1, as Python's own for EPIPE
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(_exit(code))


if __name__ == "__main__":
    run()
