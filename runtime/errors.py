"""Error types. Every message says what was expected, what was found and what to do."""


class H3Error(ValueError):
    """Base of the runtime's user-facing errors (bad input, bad checkpoint, bad geometry)."""


class Interrupted(RuntimeError):
    """A run was interrupted between steps (by the user or the host). The model stays usable."""
