"""``h3-blackwell comfy-run WORKFLOW.json --server http://127.0.0.1:8188``: run a workflow on a ComfyUI server.

Steps: read the workflow (API format as is; a UI graph is converted to API format with the server's
``/object_info`` for widget order, or refused with the reason), ``POST /prompt``, follow the run (the ``/ws``
websocket for progress, with ``/history`` polling when it is silent, drops or is refused; only polling under
``--no-websocket``), print node errors, then download every output file (``/view``) into ``--output`` beside
``history.json``.

Exit codes: 0 the prompt ran to success and its outputs were fetched; 1 the server rejected the prompt, a
node failed, the run was interrupted or an output could not be fetched (``/view`` answered an HTTP error); 2 bad
arguments, workflow file (including a UI graph that cannot be converted) or an ``--output`` that cannot be
written; 3 the server could not be reached, is not ComfyUI (it answered something that is not HTTP or not
ComfyUI's JSON API: garbage, a JSON field of the wrong type, an unsafe file name or prompt id), stalled, or the
``--timeout`` ran out. Every failure is one ``error:`` line on stderr.

Time: ``--timeout`` is a deadline for the whole command (connecting, submitting, the run, the downloads);
``--http-timeout`` bounds each socket operation and, in wall-clock time, each request's connect, headers and
JSON body, so a server that trickles bytes cannot stretch either. A download's body is bounded by the deadline
(each read by ``--http-timeout``).

Names the server supplies (the prompt id, output file names, subfolders and types, node ids used in file names)
are checked before they reach a URL or the filesystem. Outputs are written under unique temporary names beside
their targets and renamed into place together once all arrived; ``history.json`` comes last. On any failure
nothing is left but what was there before (a failed run still writes its ``history.json``).

The client itself is the top-level ``comfy_client`` package (``comfy_client.run``: the runner; ``connection``: HTTP,
the websocket, the deadline; ``workflow``: workflow files); this module is its command line only.
"""

from __future__ import annotations

import argparse
import sys

from ..comfy_client import EXIT_OK, EXIT_USAGE, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h3-blackwell comfy-run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workflow", help="workflow JSON: API format, or a UI graph (converted with /object_info)")
    p.add_argument("--server", default="http://127.0.0.1:8188", help="ComfyUI address (default %(default)s)")
    p.add_argument("--output", default="comfy-output", help="folder for fetched outputs and history.json "
                                                            "(default %(default)s)")
    p.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE",
                   help="override an input before submitting (VALUE is JSON, else a string); repeatable")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds for the whole command: connecting, submitting, the run and the downloads "
                        "(default %(default)s)")
    p.add_argument("--http-timeout", type=float, default=30.0,
                   help="seconds for each socket operation, and for each request's connect, headers and JSON body "
                        "(default %(default)s)")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /history polls")
    p.add_argument("--no-websocket", action="store_true", help="poll /history only (no /ws progress)")
    p.add_argument("--client-id", help="client id for /prompt and /ws (default: a random one)")
    p.add_argument("--verbose", action="store_true", help="print node tracebacks")
    p.add_argument("--quiet", action="store_true", help="print only the result line and errors")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help, or an argument error already printed by argparse
        return EXIT_OK if not e.code else EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
