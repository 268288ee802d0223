"""Ray token authentication for the cluster ``trainctl serve`` starts or joins.

Ray 2.60 refuses to start a head, or to connect a driver, in token mode without a token, and
looks for one only in ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``.
trainctl depends on none of a user's home directory:

* **Its own head** (no ``--ray-address``): the head, the driver and every worker run with
  ``RAY_AUTH_MODE=token``. The token is the user's if they give one (``RAY_AUTH_TOKEN`` or
  ``RAY_AUTH_TOKEN_PATH``); otherwise trainctl writes a random one to
  ``<data_dir>/ray/auth_token``, readable by its owner only, and points
  ``RAY_AUTH_TOKEN_PATH`` at it. The head inherits the environment, and so do the workers.
* **Joining** (``--ray-address``): the token comes from Ray's usual places. Where one is found
  token mode is switched on; where none is found trainctl says so and connects without one.

Call these before Ray is imported: Ray reads the mode once, in its C++ core.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
PATH_ENV = "RAY_AUTH_TOKEN_PATH"
HOME_TOKEN = Path("~/.ray/auth_token")


class StartupError(Exception):
    """A start-up failure the user can fix: one line naming the cause and the fix."""


def _read_token_file(path: Path, named_by: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise StartupError(
            f"{named_by}={path} cannot be read ({e.strerror}); point it at a readable "
            "token file or unset it"
        ) from None
    if not token:
        raise StartupError(f"{named_by}={path} is empty; write the cluster's token into it")
    return token


def _given_token() -> str | None:
    """Where the user gave a token: ``$RAY_AUTH_TOKEN``, or the (readable, non-empty) file
    ``RAY_AUTH_TOKEN_PATH`` names; None when neither is set."""
    if os.environ.get(TOKEN_ENV, "").strip():
        return f"${TOKEN_ENV}"
    if given := os.environ.get(PATH_ENV):
        _read_token_file(Path(given), PATH_ENV)
        return given
    return None


def own_cluster_token(data_dir: Path) -> str:
    """Set up token mode for a head trainctl starts itself; returns where the token is from.

    Leaves ``RAY_AUTH_MODE=disabled`` alone if the user asked for it (and says so).
    """
    mode = os.environ.setdefault(MODE_ENV, "token").lower()
    if mode != "token":
        return f"none ({MODE_ENV}={mode}: anyone who can reach the Ray ports can run code)"
    if (given := _given_token()) is not None:
        return given
    path = (data_dir / "ray" / "auth_token").resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_owner_only(path)
    except OSError as e:
        raise StartupError(
            f"cannot write the Ray auth token to {path} ({e.strerror}); pass a writable "
            "--data-dir, or give a token with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"
        ) from None
    os.environ[PATH_ENV] = str(path)
    return str(path)


def _write_owner_only(path: Path) -> None:
    """A fresh random token in ``path`` (mode 0600), unless a usable one is already there."""
    if path.exists():
        st = path.stat()
        if path.read_text().strip() and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            return  # ours from an earlier start, still private
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def joining_token() -> str | None:
    """Token mode for joining a cluster, from Ray's usual places; None when none is found.

    An explicit ``RAY_AUTH_MODE=token`` with no token anywhere is an error.
    """
    found = _given_token()
    if found is None and HOME_TOKEN.expanduser().is_file():
        _read_token_file(HOME_TOKEN.expanduser(), "the default token file")
        found = str(HOME_TOKEN)
    mode = os.environ.get(MODE_ENV)
    if found is None:
        if mode is not None and mode.lower() == "token":
            raise StartupError(
                f"{MODE_ENV}=token but no Ray auth token was found; set {TOKEN_ENV} or "
                f"{PATH_ENV}, or write the cluster's token to {HOME_TOKEN}"
            )
        return None
    if mode is None:
        os.environ[MODE_ENV] = "token"
    return found


TOKEN_HINT = (
    f", and if the cluster uses token authentication, that {TOKEN_ENV}, {PATH_ENV} or "
    f"{HOME_TOKEN} holds its token"
)
"""Added to a failure to join: Ray reports a refused token as a plain connection failure."""


def missing_token_hint(address: str) -> str:
    """The one-line error for a cluster that refused this driver's credentials."""
    return (
        f"the Ray cluster at {address} refused the connection: it needs token "
        f"authentication; set {TOKEN_ENV} or {PATH_ENV} to its token (or write it to "
        f"{HOME_TOKEN}) and start again"
    )
