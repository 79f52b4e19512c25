"""The ``h3-blackwell`` command line: its commands and flags (``build_parser``), with the help a user reads.

The runtime's choices (``runtime.CHOICES``: backends, dtypes, activation formats, ...) and defaults (core's sparse
settings) are written once, in ``runtime/options.py``; the flags read them from there. They are read only when
argparse needs them (checking a value, printing a command's help), so building the parser imports no torch and
``h3-blackwell --help`` answers at once.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

EXIT_USAGE = 2  # a refused request or a usage error

DESCRIPTION = """\
Run the MiniMax H3 audio+video diffusion transformer headless: NVFP4 weights, fast attention, the guarded
cuBLASLt FC2 path, a JSON report of every run.

examples:
  h3-blackwell generate --output out/tiny                   the embedded tiny model (seconds on a CPU)
  h3-blackwell generate --model h3.safetensors --output out/run --width 1344 --height 768 --frames 124
  h3-blackwell generate ... --inputs in.safetensors --payload payload.json   core's conditioning (README)
  h3-blackwell quantize h3_bf16.safetensors h3_nvfp4.safetensors
  h3-blackwell COMMAND --help                                every flag of one command
"""

EPILOG = """\
Backend flags override the H3_* environment variables (README, "The CLI"). Exit status: 0 done, 1 internal
error (--debug shows the traceback), 2 refused (one "error:" line says what was expected, what was found and
what to do; nothing is written), 129 hung up (SIGHUP), 130 interrupted, 143 terminated. A closed standard
output (| head) does not stop a command: what it would still print there is dropped.
"""


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+(e[-+]?\d+)?$", re.IGNORECASE)  # a negative number is a value, not a flag


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's error line: usage, then ``error: ...`` as the last line, exit status 2. An unknown
    option is one line naming it, the nearest known option and the help of the command it was given to (argparse
    would report it from the top-level parser, or first complain about a required flag the typo stood for)."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        cmd, i = self._command(args)
        for parser, tokens in ((self, args[:i]), (cmd, args[i + 1:])):
            for token in tokens if parser is not None else ():
                if token == "--":
                    break
                if parser._unknown(token):
                    parser._unknown_option(token.split("=", 1)[0])
        return super().parse_args(args, namespace)

    def _command(self, args: list[str]):
        """(the subcommand's parser, its index in args), or (None, len(args)) where no command is named."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for i, token in enumerate(args):
                    if token in action.choices:
                        return action.choices[token], i
                    if not token.startswith("-"):
                        break
        return None, len(args)

    def _unknown(self, token: str) -> bool:
        """True for a flag this parser does not know, not even as an unambiguous prefix (argparse's
        abbreviations)."""
        if not token.startswith("-") or token == "-" or _NUMBER.match(token):
            return False
        flag = token.split("=", 1)[0]
        known = self._option_string_actions
        return flag not in known and not (flag.startswith("--") and any(k.startswith(flag) for k in known))

    def _unknown_option(self, flag: str):
        known = sorted(k for k in self._option_string_actions if k.startswith("--"))
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        hint = f"; did you mean {near[0]}?" if near else ""
        self.exit(EXIT_USAGE, f"error: {self.prog}: unknown option {flag}{hint} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds ``(default: X)`` to an option's help unless its default is None/False/empty or already shown."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if "%(default)" in h or not action.option_strings or d is None or d is False or d == [] \
                or d == argparse.SUPPRESS:
            return h
        return h + " (default: %(default)s)"


class OptionChoices:
    """The values of one runtime choice (``runtime.CHOICES[name]``; ``fc2``: ``runtime.FC2_MODES``;
    ``sparse_extra_tokens``: its allowed counts), read from the runtime the first time argparse asks."""

    def __init__(self, name: str):
        self.name = name

    def values(self) -> tuple:
        from ..runtime import CHOICES, FC2_MODES, SPARSE_EXTRA_TOKENS_CHOICES, SPARSE_METHODS, SPARSE_SINKS

        extra = {"fc2": tuple(FC2_MODES), "sparse_extra_tokens": SPARSE_EXTRA_TOKENS_CHOICES,
                 "sparse_method": SPARSE_METHODS, "sparse_sinks": SPARSE_SINKS}
        return extra[self.name] if self.name in extra else CHOICES[self.name]

    def __iter__(self):
        return iter(self.values())

    def __contains__(self, value) -> bool:
        return value in self.values()

    def __len__(self) -> int:
        return len(self.values())


class OptionDefault:
    """A RuntimeOptions default as help text (``%(runtime_default)s``), read from the runtime when shown."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        from ..runtime import RuntimeOptions

        return str(getattr(RuntimeOptions, self.name))


def _runtime_arg(g, flag: str, name: str, help: str, metavar: str, **kw) -> None:
    """A flag whose values come from the runtime's choice ``name`` (None: the H3_* variable or the default).
    ``help`` may use %(choices)s and %(runtime_default)s."""
    action = g.add_argument(flag, default=None, choices=OptionChoices(name), metavar=metavar, help=help, **kw)
    action.runtime_default = OptionDefault(name) if name != "fc2" else "on"


def _backend_args(g) -> None:
    """generate's backend and precision choices (each overrides its H3_* variable)."""
    _runtime_arg(g, "--dtype", "dtype", "compute dtype: %(choices)s (default: auto: bfloat16 on CUDA, float32 on "
                                        "the CPU)", "DTYPE")
    _runtime_arg(g, "--attention", "attention", "attention backend: %(choices)s (default: auto, the fastest that "
                 "passes its check and probe here; or H3_ATTENTION); sparse = LOSSY training-free sparse attention "
                 "(comfy-kitchen sol_attn; refused with the reason where it cannot run)", "BACKEND")
    _runtime_arg(g, "--gemm", "gemm", "NVFP4 linear backend: %(choices)s (default: auto, or H3_GEMM)", "BACKEND")
    _runtime_arg(g, "--act-format", "act_format", "block activations: %(choices)s (default: auto: W4A8 where the "
                 "fp8 GEMM backend runs, else NVFP4; or H3_ACT_FORMAT)", "FORMAT")
    _runtime_arg(g, "--act-scale", "act_scale", "NVFP4 activations' global scale: %(choices)s (default: "
                 "%(runtime_default)s, or H3_NVFP4_ACT_SCALE; calibrated = the checkpoint's input_scale)", "SCALE")
    _runtime_arg(g, "--precision", "precision", "%(choices)s (default: %(runtime_default)s, or H3_PRECISION): fast "
                 "= Hopper's fast fp8 accumulation and the hardware-exp2 silu; exact = fp32 accumulation, the "
                 "bit-exact silu", "MODE")
    _runtime_arg(g, "--fc2", "fc2", "guarded cuBLASLt FC2 on CUDA: %(choices)s (default: %(runtime_default)s, or "
                 "H3_NVFP4_FC2_LT_SPLITK1 / H3_NVFP4_FC2_LT_STRICT): on falls back on a refusal, strict makes it an "
                 "error", "MODE")


def _lossy_args(g) -> None:
    """generate's LOSSY speed options (sparse attention's settings, the First-Block Cache)."""
    for flag, name, kind, help in (
            ("--sparse-tau", "sparse_tau", float, "LOSSY: sparse routing threshold (default %(runtime_default)s, "
                                                  "ComfyUI core's; higher = faster, less exact)"),
            ("--sparse-start", "sparse_start", float, "LOSSY: fraction of the timestep range that stays dense before "
                                                      "sparse starts (default %(runtime_default)s)"),
            ("--sparse-min-tokens", "sparse_min_tokens", int, "sequences shorter than this stay dense with "
                                                              "--attention sparse (default %(runtime_default)s, "
                                                              "core's)"),
            ("--sparse-keep-percent", "sparse_keep_percent", float, "LOSSY, sla / vsa: percent of key blocks each "
                                                                    "query block keeps (default "
                                                                    "%(runtime_default)s, core's; FastH3: 10)"),
            ("--sparse-end", "sparse_end", float, "LOSSY: fraction of the timestep range after which attention "
                                                  "is dense again (default %(runtime_default)s)"),
            ("--dense-blocks", "sparse_dense_blocks", str, "blocks that always run dense with --attention sparse, "
                                                           "e.g. '0, 1, 47-49' (default: none, core's)")):
        action = g.add_argument(flag, dest=name, type=kind, default=None, help=help)
        action.runtime_default = OptionDefault(name)
    _runtime_arg(g, "--sparse-method", "sparse_method", "LOSSY, --attention sparse: core's Model Sparse "
                 "Attention method: %(choices)s (default %(runtime_default)s; sla for SLA LoRAs, vsa for FastH3)",
                 "METHOD")
    _runtime_arg(g, "--sparse-sinks", "sparse_sinks", "LOSSY: core's sink_conditioning: %(choices)s (default "
                 "%(runtime_default)s)", "MODE")
    _runtime_arg(g, "--sparse-extra-tokens", "sparse_extra_tokens", "LOSSY: exact extra tokens per 64-row query "
                 "block: %(choices)s (default %(runtime_default)s, core's)", "N", type=int)
    g.add_argument("--first-block-cache", type=float, default=None, metavar="THRESHOLD",
                   help="LOSSY step reuse: skip blocks 1.. when the first block's residual change is within this "
                        "relative L1 of the last computed step's (off by default; 0 never reuses; peers ~0.05-0.1)")


def _generate_inputs_args(g) -> None:
    g.add_argument("--output", "--out", dest="output", required=True,
                   help="directory for latents.safetensors and report.json (created)")
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
    g.add_argument("--pipeline", metavar="DIR", help="a local diffusers MiniMax H3 folder: its conditioner encodes "
                   "--prompt, its VAEs decode; the output gets video.mp4 and decoded.safetensors too (needs --prompt); "
                   "without --model, its transformer/ weights run on our runtime")
    g.add_argument("--prompt", help="the prompt, encoded by --pipeline's Qwen3-VL conditioner")
    g.add_argument("--first-frame", metavar="IMG", help="an image the video starts from (fl2va; needs --prompt)")
    g.add_argument("--last-frame", metavar="IMG", help="an image the video ends on (fl2va; needs --prompt)")


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample latents (default: the embedded tiny model, random text states)",
                       formatter_class=HelpFormatter)
    _generate_inputs_args(g)
    g.add_argument("--steps", type=int, help="sampling steps, >= 1 (default: 8 small models, 20 full)")
    g.add_argument("--seed", type=int, default=440420, help="noise seed, 0 .. 2**64-1 (ComfyUI's range)")
    g.add_argument("--sampler", default="res_multistep", choices=["euler", "res_multistep"], help="sampler")
    g.add_argument("--preset", default=None, choices=["fasth3"],
                   help="a distilled checkpoint's settings, for the flags not given: fasth3 = 4 steps, euler, shifts "
                        "12 / 3, --attention sparse --sparse-method vsa --sparse-keep-percent 10 (FastH3, trained "
                        "with VSA)")
    g.add_argument("--scheduler", default="simple", choices=["simple"], help="sigma schedule")
    g.add_argument("--denoise", type=float, default=1.0, help="fraction of the schedule to run, in (0, 1]")
    g.add_argument("--runs", type=int, default=1, help="measured resident runs (the report gives their median)")
    g.add_argument("--warmup", type=int, default=0, help="resident runs before the measured ones (not reported)")
    g.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default: auto, or H3 options)")
    g.add_argument("--cpu-threads", default=None, metavar="N|auto",
                   help="torch threads of a CPU run (default: auto, or H3_CPU_THREADS / OMP_NUM_THREADS): one thread "
                        "for small work, where a pool only waits on itself and on other busy processes; else the "
                        "cores that are free")
    g.add_argument("--vram-budget", default=None, metavar="GB|auto",
                   help="device-memory budget of the run in GB (1 GB = 1e9 bytes), or auto (default, or "
                        "H3_VRAM_BUDGET): the free device memory less a margin. Blocks that do not fit stream from "
                        "pinned host memory while the others compute; the plan prints its decision and estimate and "
                        "refuses a budget too small, naming the smallest that works")
    g.add_argument("--host-budget", default=None, metavar="GB|auto",
                   help="host memory the model may keep in GB, or auto (default, or H3_HOST_BUDGET): the available "
                        "host memory. Where the streamed blocks and the full-form AdaLN weights do not fit it, AdaLN "
                        "stays in the checkpoint file and each run reads it block by block")
    g.add_argument("--load-behind", default=None, choices=("auto", "on", "off"),
                   help="run the checkpoint's load behind the first step (default: auto, or H3_LOAD_BEHIND: on "
                        "CUDA): each block is used as soon as its tensors are loaded and checked, and a merged LoRA "
                        "goes into each block as it arrives; off: the whole load before the first step")
    _backend_args(g)
    _lossy_args(g)
    g.add_argument("--dense", action="store_true", help="keep dense linears (no NVFP4; the reference stack)")
    g.add_argument("--progress", action="store_true",
                   help="redraw the progress line in place even when stderr is not a terminal")
    g.add_argument("--preview", action="store_true",
                   help="also write preview.webp: the final video latent as an animated low-resolution preview "
                        "(core's latent->RGB factors, one pixel per latent pixel; needs Pillow: run_tiny.sh or "
                        "pip install h3-blackwell[preview] brings it)")
    g.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="split the packed rows over N ranks (Ulysses attention): starts N local workers, one per GPU "
                        "(cuda:0..N-1, NCCL) or CPU processes (gloo); N must divide the head count. Under torchrun "
                        "the ranks come from its environment")
    g.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH[:MODE]",
                   help="apply a LoRA after loading (repeat to stack); MODE merge (default: into the weights, "
                        "NVFP4 re-quantized) or side (bf16 low-rank path per step); key forms: README")
    g.set_defaults(fn="cmd_generate")


def _forward_parser(sub) -> None:
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
    f.add_argument("--out", "--output", dest="out", required=True,
                   help="safetensors file for the video and audio velocities")
    f.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    f.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    f.add_argument("--dense", action="store_true",
                   help="the reference evaluation (the default): dense linears, exact attention")
    f.add_argument("--fast", action="store_true",
                   help="run the fast block stack (NVFP4/W4A8 linears, fast attention) instead of the reference")
    f.set_defaults(fn="cmd_forward")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="h3-blackwell", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--debug", action="store_true", help="print the traceback of an internal error (or H3_DEBUG=1)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    _generate_parser(sub)
    _forward_parser(sub)

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
    q.add_argument("--progress", action="store_true",
                   help="redraw the progress line in place even when stderr is not a terminal")
    q.set_defaults(fn="cmd_quantize")

    sub.add_parser("tune-fc2", help="sweep cuBLASLt configurations for FC2 on this GPU (tune-fc2 --help)",
                   add_help=False)
    sub.add_parser("comfy-run", help="submit a workflow to a running ComfyUI server (comfy-run --help)",
                   add_help=False)
    return p
