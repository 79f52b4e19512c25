"""``h3-blackwell``: generate | forward | make-tiny | quantize | tune-fc2 | comfy-run.

Every refusal ends as one line ``error: what was expected, what was found, what to do`` on stderr and exit
status 2; nothing partial is written. An unexpected exception ends as ``error: internal: ...`` and exit
status 1 (with its traceback only under ``--debug`` or ``H3_DEBUG=1``). Ctrl-C ends as one line and exit
status 130, SIGTERM likewise with exit status 143, during the imports too: the interruption unwinds through
every writer's cleanup, so no temporary file, no partial output and no worker process is left.

Only the standard library is imported at module level: torch and the runtime are imported inside ``main``
(``cli.commands``), so an interrupt or a broken install during those imports takes the same error path.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback

from . import progress

EXIT_INTERNAL, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is: every cleanup an interruption runs
    (temporary files, sequence-parallel workers) runs for it too."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup this starts must not be cut short by a second one
    raise Terminated()


def _interrupt_line(e: BaseException) -> tuple[str, int]:
    if isinstance(e, Terminated):
        return "terminated; nothing was written", EXIT_TERMINATED
    return "interrupted; nothing was written", EXIT_INTERRUPTED


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's error line: usage, then ``error: ...`` as the last line, exit status 2."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds ``(default: X)`` to an option's help unless its default is None/False/empty or already shown."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if "%(default)" in h or not action.option_strings or d is None or d is False or d == [] \
                or d == argparse.SUPPRESS:
            return h
        return h + " (default: %(default)s)"


def _add_lossy_args(g) -> None:
    """generate's LOSSY speed options (sparse attention's settings, the First-Block Cache)."""
    g.add_argument("--sparse-tau", type=float, default=None,
                   help="LOSSY: sparse routing threshold (default 1.3, ComfyUI core's; higher = faster, less exact)")
    g.add_argument("--sparse-start", type=float, default=None,
                   help="LOSSY: fraction of the timestep range that stays dense before sparse starts (default 0.2)")
    g.add_argument("--sparse-extra-tokens", type=int, default=None, choices=[0, 64, 128, 192, 256],
                   help="LOSSY: exact extra tokens per 64-row query block (default 256, core's)")
    g.add_argument("--sparse-min-tokens", type=int, default=None,
                   help="sequences shorter than this stay dense with --attention sparse (default 12288, core's)")
    g.add_argument("--first-block-cache", type=float, default=None, metavar="THRESHOLD",
                   help="LOSSY step reuse: skip blocks 1.. when the first block's residual change is within this "
                        "relative L1 of the last computed step's (off by default; 0 never reuses; peers ~0.05-0.1)")


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample latents (default: the embedded tiny model, random text states)",
                       formatter_class=HelpFormatter)
    g.add_argument("--output", required=True, help="directory for latents.safetensors and report.json (created)")
    g.add_argument("--model", help="H3 DiT checkpoint (.safetensors or sharded .index.json); default: the embedded "
                                   "tiny model")
    g.add_argument("--tiny-seed", type=int, default=0, help="weight seed of the embedded tiny model")
    g.add_argument("--text-states", help="safetensors with text_states [1,L,5120] and optional token_tags [L] "
                                         "(default: random states of --text-tokens tokens)")
    g.add_argument("--text-tokens", type=int, default=32, help="length of the random text states (no --text-states)")
    g.add_argument("--inputs", help="safetensors with video / audio (the LATENT to sample from: its shape is the "
                                    "canvas), text_states [, token_tags] and the tensors --payload names")
    g.add_argument("--payload", help="JSON conditioning with core's field names (keyframes, refs, denoise masks, "
                                     "noise augmentation, seed: default --seed, control); needs --inputs")
    g.add_argument("--control", metavar="CONTROL.safetensors",
                   help="a Fun ControlNet (core's model patch file) applied with the payload's control field "
                        "(hint, strength, sigma window, fades); needs --inputs and --payload")
    g.add_argument("--width", type=int, help="pixels, a multiple of 32 (default: 256 for small models such as the "
                                             "embedded tiny one, 1344 for the full model)")
    g.add_argument("--height", type=int, help="pixels, a multiple of 32 (default: 256 small models, 768 full)")
    g.add_argument("--frames", type=int, help="pixel frames on the 17k+5 grid: 5, 22, 39, ... (default: 22 small "
                                              "models, 124 full)")
    g.add_argument("--snap", action="store_true", help="snap --frames up to the 17k+5 grid")
    g.add_argument("--steps", type=int, help="sampling steps, >= 1 (default: 8 small models, 20 full)")
    g.add_argument("--seed", type=int, default=440420, help="noise seed, 0 .. 2**64-1 (ComfyUI's range)")
    g.add_argument("--sampler", default="res_multistep", choices=["euler", "res_multistep"], help="sampler")
    g.add_argument("--scheduler", default="simple", choices=["simple"], help="sigma schedule")
    g.add_argument("--denoise", type=float, default=1.0, help="fraction of the schedule to run, in (0, 1]")
    g.add_argument("--runs", type=int, default=1, help="measured resident runs (the report gives their median)")
    g.add_argument("--warmup", type=int, default=0, help="resident runs before the measured ones (not reported)")
    g.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default: auto, or H3 options)")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (default: auto: bfloat16 on CUDA, float32 on the CPU)")
    g.add_argument("--attention", default=None, choices=["auto", "sage2", "sage1", "sdpa", "reference", "sparse"],
                   help="attention backend (default: auto, or H3_ATTENTION); sparse = LOSSY training-free sparse "
                        "attention (comfy-kitchen sol_attn; refused with the reason where it cannot run)")
    _add_lossy_args(g)
    g.add_argument("--gemm", default=None, choices=["auto", "native", "emulated", "fp8", "bf16", "reference"],
                   help="NVFP4 linear backend (default: auto, or H3_GEMM)")
    g.add_argument("--act-format", default=None, choices=["auto", "nvfp4", "fp8"],
                   help="block activations: auto (W4A8 where the fp8 GEMM backend runs, else NVFP4), nvfp4, fp8")
    g.add_argument("--fc2", default="on", choices=["on", "off", "strict"],
                   help="guarded cuBLASLt FC2 on CUDA: on (fallback on refusal), off, strict (refusal is an error)")
    g.add_argument("--dense", action="store_true", help="keep dense linears (no NVFP4; the reference stack)")
    g.add_argument("--progress", action="store_true", help="always show the progress bar")
    g.add_argument("--preview", action="store_true",
                   help="also write preview.webp: the final video latent as an animated low-resolution preview "
                        "(core's latent->RGB factors, one pixel per latent pixel; needs Pillow)")
    g.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="split the packed rows over N ranks (Ulysses attention): starts N local workers, one per GPU "
                        "(cuda:0..N-1, NCCL) or CPU processes (gloo); N must divide the head count. Under torchrun "
                        "the ranks come from its environment")
    g.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH[:MODE]",
                   help="apply a LoRA after loading (repeat to stack); MODE merge (default: into the weights, "
                        "NVFP4 re-quantized) or side (bf16 low-rank path per step)")
    g.set_defaults(fn="cmd_generate")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="h3-blackwell", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--debug", action="store_true", help="print the traceback of an internal error (or H3_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True)
    _generate_parser(sub)

    f = sub.add_parser("forward", help="one model evaluation (t2va, or core's conditioning with --payload)",
                       formatter_class=HelpFormatter)
    f.add_argument("--model", required=True, help="H3 DiT checkpoint (.safetensors or sharded .index.json)")
    f.add_argument("--inputs", required=True, help="safetensors: video [1,C,T,H,W], audio [1,Ca,2,Ta], text_states "
                                                   "[1,L,text_dim], sigma [1], optional token_tags [L], and the "
                                                   "tensors the payload names")
    f.add_argument("--payload", help="JSON conditioning with core's field names (keyframes, refs, denoise_mask, "
                                     "audio_denoise_mask, sample_sigmas, *_cond_noise_aug, seed)")
    f.add_argument("--control", metavar="CONTROL.safetensors",
                   help="a Fun ControlNet (core's model patch file) applied with the payload's control field")
    f.add_argument("--out", required=True, help="safetensors file for the video and audio velocities")
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    f.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    f.add_argument("--dense", action="store_true",
                   help="the reference evaluation (the default): dense linears, exact attention")
    f.add_argument("--fast", action="store_true",
                   help="run the fast block stack (NVFP4/W4A8 linears, fast attention) instead of the reference")
    f.set_defaults(fn="cmd_forward")

    t = sub.add_parser("make-tiny", help="write a tiny random H3 checkpoint in ComfyUI naming",
                       formatter_class=HelpFormatter)
    t.add_argument("out", help="the .safetensors file to write")
    t.add_argument("--seed", type=int, default=0, help="weight seed (the same seed writes the same bytes)")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of the weights (fp32 islands stay fp32, as in the release)")
    t.set_defaults(fn="cmd_make_tiny")

    q = sub.add_parser("quantize", help="convert an H3 checkpoint to NVFP4 (comfy_quant format)",
                       formatter_class=HelpFormatter)
    q.add_argument("input", help="H3 checkpoint: ComfyUI, diffusers or release naming; .safetensors or .index.json")
    q.add_argument("output", help="the NVFP4 .safetensors file to write (replaced atomically)")
    q.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the block linears are quantized "
                                                                            "(the bytes are the same)")
    q.add_argument("--progress", action="store_true", help="always show the progress bar")
    q.set_defaults(fn="cmd_quantize")

    sub.add_parser("tune-fc2", help="sweep cuBLASLt configurations for FC2 on this GPU", add_help=False)
    sub.add_parser("comfy-run", help="submit a workflow to a running ComfyUI server", add_help=False)
    return p


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "tune-fc2":
        from .tune_fc2 import main as tune_main

        return int(tune_main(argv[1:]) or 0)
    if argv and argv[0] == "comfy-run":
        from .comfy_run import main as run_main

        return int(run_main(argv[1:]) or 0)
    a = build_parser().parse_args(argv)
    return getattr(_import_commands(), a.fn)(a)


def _exit_interrupted(signum, frame) -> None:
    """SIGINT or SIGTERM while torch and the runtime are being imported: nothing has been written yet, and
    import code of other packages may swallow a KeyboardInterrupt (a bare ``except``), so end the process here,
    at once."""
    line, code = _interrupt_line(Terminated() if signum == signal.SIGTERM else KeyboardInterrupt())
    progress.end_line()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)


def _import_commands():
    """cli.commands (torch and the runtime), imported under :func:`_exit_interrupted` where this is the main
    thread (only it receives signals); the previous SIGINT handler is back before any command runs."""
    if threading.current_thread() is not threading.main_thread():
        from . import commands

        return commands
    prev = signal.signal(signal.SIGINT, _exit_interrupted)
    prev_term = signal.signal(signal.SIGTERM, _exit_interrupted)
    try:
        from . import commands
    finally:
        signal.signal(signal.SIGINT, prev)
        signal.signal(signal.SIGTERM, prev_term)
    return commands


def _one_line(e: BaseException) -> str:
    return " | ".join(line.strip() for line in str(e).strip().splitlines() if line.strip()) or type(e).__name__


def _refusal_types() -> tuple:
    """The exceptions that are the user's to fix (exit 2): H3Error and the OS's file errors."""
    try:
        from ..runtime import H3Error
    except Exception:  # a broken install: everything is internal then
        return (OSError, MemoryError)
    return (H3Error, OSError, MemoryError, NotImplementedError)


def _is_out_of_memory(e: BaseException) -> bool:
    try:
        from ..runtime import is_out_of_memory
    except Exception:  # a broken install
        return isinstance(e, MemoryError)
    return is_out_of_memory(e)


def _report(e: Exception, debug: bool) -> int:
    progress.end_line()
    try:
        from ..runtime import Interrupted
    except Exception:
        Interrupted = ()
    if isinstance(e, Interrupted):
        print(f"interrupted: {_one_line(e)}; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    oom = _is_out_of_memory(e)  # CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, MemoryError, ...
    if debug:
        traceback.print_exc(file=sys.stderr)
        details = getattr(e, "details", None)  # a sequence-parallel worker's own traceback (WorkerFailed)
        if isinstance(details, str) and details.strip():
            sys.stderr.write(f"the worker's traceback:\n{details.rstrip()}\n")
    if oom:
        print(f"error: out of memory ({_one_line(e)}); lower --width/--height/--frames or use a device with more "
              "memory", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, _refusal_types()):
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"error: internal: {type(e).__name__}: {_one_line(e)} (run with --debug or H3_DEBUG=1 for the "
          "traceback and report it)", file=sys.stderr)
    return EXIT_INTERNAL


def _handle_sigterm():
    """SIGTERM raises :class:`Terminated` in the main thread while a command runs; returns what puts the previous
    handler back (nothing to do off the main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    prev = signal.signal(signal.SIGTERM, _raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, prev)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 internal error, 2 refused, 130 interrupted, 143
    terminated)."""
    debug = False
    restore = _handle_sigterm()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = "--debug" in argv or os.environ.get("H3_DEBUG", "").strip() not in ("", "0")
        if argv and argv[0] not in ("tune-fc2", "comfy-run"):
            argv = [x for x in argv if x != "--debug"]
        return _dispatch(argv)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
        progress.end_line()
        line, code = _interrupt_line(e)
        print(line, file=sys.stderr)
        return code
    except SystemExit as e:  # argparse: --help (0) or a usage error already printed as "error: ..." (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except Exception as e:
        return _report(e, debug)
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
