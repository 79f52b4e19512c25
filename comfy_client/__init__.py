"""The ComfyUI client behind ``h3-blackwell comfy-run``: runs a workflow on a ComfyUI server over its HTTP API and
websocket, standard library only. Its own package beside ``cli/``: it imports nothing of the runtime, the nodes or
the CLI, and the CLI only parses the command line and calls ``run``.

- ``run``: ``run(args)`` -> exit code (``EXIT_OK`` / ``EXIT_FAILED`` / ``EXIT_USAGE`` / ``EXIT_UNREACHABLE``);
  ``args`` as ``cli/comfy_run.py`` parses them (workflow, server, output, set, timeout, http_timeout,
  poll_interval, no_websocket, client_id, verbose, quiet).
- ``connection``: ``Client`` (HTTP under one deadline), ``WebSocket``, the errors, ``show`` for server text.
- ``workflow``: workflow files, UI graph -> API prompt (``ui_to_api``), ``--set`` overrides.
"""

from .connection import Client, DeadlinePassed, ServerError, WebSocket
from .run import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, run
from .workflow import ConversionError, load_workflow, ui_to_api

__all__ = ["Client", "ConversionError", "DeadlinePassed", "EXIT_FAILED", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE",
           "ServerError", "WebSocket", "load_workflow", "run", "ui_to_api"]
