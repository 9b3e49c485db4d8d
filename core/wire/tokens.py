"""Bearer tokens shared by agents and the client.

A token file holds one token per line. A bare line grants every call; a line
may instead name a role, ``read:<token>`` (describe, capture, stream) or
``act:<token>`` (everything, including the state-changing calls that later
versions add). Blank lines and ``#`` comments are ignored, so a file can say
whose token is whose. ``RANKSCOPE_TOKEN`` in the environment holds one such
line and is used when no ``--token-file`` is given.

The agent compares a presented token against every configured one in constant
time (``hmac.compare_digest``, no early exit), so timing tells nothing about
how much of a guess was right.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rankscope.contract.errors import RankscopeError

ENV_VAR = "RANKSCOPE_TOKEN"
MIN_LENGTH = 16
MAKE_TOKEN = 'python -c "import secrets; print(secrets.token_hex(16))" > rankscope.token && chmod 600 rankscope.token'


class Role(StrEnum):
    """What a token may do. ACT includes READ."""

    READ = "read"
    ACT = "act"


@dataclass(frozen=True, slots=True)
class Token:
    secret: str
    role: Role

    def grants(self, needed: Role) -> bool:
        return self.role is Role.ACT or needed is Role.READ

    def __repr__(self) -> str:  # never print the secret into a log
        return f"Token(role={self.role.value}, secret=<{len(self.secret)} chars>)"


@dataclass(frozen=True, slots=True)
class TokenSet:
    """The tokens an agent accepts."""

    tokens: tuple[Token, ...]

    def role_of(self, presented: str | None) -> Role | None:
        """The strongest role of a matching token, or None; compares against all of them."""
        if not presented:
            return None
        given = presented.encode("utf-8", "replace")
        best: Role | None = None
        for token in self.tokens:
            if hmac.compare_digest(given, token.secret.encode("utf-8")) and best is not Role.ACT:
                best = token.role
        return best

    def allows(self, presented: str | None, needed: Role) -> bool:
        role = self.role_of(presented)
        return role is not None and Token("", role).grants(needed)


def parse_line(line: str, where: str) -> Token:
    """One token line: ``<token>``, ``read:<token>`` or ``act:<token>``."""
    text = line.strip()
    role = Role.ACT  # a bare token grants everything (one token for all calls)
    if ":" in text:
        prefix, _, secret = text.partition(":")
        try:
            role = Role(prefix.strip().lower())
        except ValueError:
            raise RankscopeError(
                f"{where}: unknown token role {prefix.strip()!r}",
                "write each token as a bare line, or as 'read:<token>' or 'act:<token>'",
            ) from None
        text = secret.strip()
    if len(text) < MIN_LENGTH or not text.isascii() or any(c.isspace() for c in text):
        raise RankscopeError(
            f"{where}: a token must be at least {MIN_LENGTH} ASCII characters without spaces",
            f"make one with: {MAKE_TOKEN}",
        )
    return Token(text, role)


def parse_tokens(text: str, source: str) -> TokenSet:
    tokens = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        tokens.append(parse_line(stripped, f"{source}:{number}"))
    if not tokens:
        raise RankscopeError(f"{source}: holds no token", f"make one with: {MAKE_TOKEN}")
    return TokenSet(tuple(tokens))


def _read(path: str | Path) -> str:
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RankscopeError(f"token file {p} does not exist", f"check --token-file, or make one with: {MAKE_TOKEN}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RankscopeError(f"cannot read token file {p}: {exc}", "check the path and its permissions") from None


def private_file_problem(path: str | Path, what: str, flag: str) -> RankscopeError | None:
    """A refusal when other users can read or write the secret at ``path`` (a token file, a TLS key), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # reading it says what is wrong
    if mode & 0o077:
        return RankscopeError(f"{what} {path} can be read or written by other users (mode {mode & 0o777:o})",
                              f"chmod 600 {path}, then start again (check {flag})")
    return None


def load_tokens(token_file: str | Path | None, env: Mapping[str, str] | None = None, *,
                private: bool = False) -> TokenSet | None:
    """The agent's accepted tokens: --token-file, else $RANKSCOPE_TOKEN, else None (no token configured).

    ``private``: refuse a file other users can read (the agent's own tokens; anyone who reads them can act)."""
    environ = os.environ if env is None else env
    if token_file is not None:
        problem = private_file_problem(token_file, "token file", "--token-file") if private else None
        if problem is not None:
            raise problem
        return parse_tokens(_read(token_file), str(token_file))
    value = environ.get(ENV_VAR, "").strip()
    if value:
        return parse_tokens(value, f"${ENV_VAR}")
    return None


def load_client_token(
    token_file: str | Path | None, env: Mapping[str, str] | None = None, *, role: Role = Role.READ
) -> str | None:
    """The token the client sends: the first one in the file (or env) that grants ``role``."""
    tokens = load_tokens(token_file, env)
    if tokens is None:
        return None
    for token in tokens.tokens:
        if token.grants(role):
            return token.secret
    raise RankscopeError(
        f"{token_file or '$' + ENV_VAR} holds no token with the {role.value!r} role",
        f"add a line 'act:<token>' with a token the agents accept for {role.value} calls",
    )
