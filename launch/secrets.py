"""Secrets never leave the launcher in clear: one `Redactor` for everything it prints or writes.

Hiding values by their name alone misses secrets that travel without a telling name: `--token z` in a
service's arguments, a `user:pass@` URL, `DB_PASS` in `train.env`, the verbatim copy of the launcher YAML.
So the launcher first collects the secret *values* of a run (`collect_secrets`): every value whose name looks
secret (`SECRET_NAME`) in `.env`, `train.env`, a service's `env` and `env_file`, every argument that follows
(or is joined by `=` to) a secret-looking flag or Hydra key in any command, and the password of every URL
with user info; then `Redactor.text` replaces each of those values wherever it appears, and URL passwords
by their pattern. The experiment folder's files (config.yaml, launcher.yaml, command.txt), the launcher's
messages, its dry run and the teed training log all go through it.

Values shorter than `MIN_SECRET_LENGTH` are hidden where their name shows them but not searched for in free
text (replacing every "1" of a log is no protection and ruins it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

SECRET_NAME = re.compile(r"TOKEN(?![a-z])|SECRET|PASS|PWD|CREDENTIAL|APIKEY|(?<![a-z])KEY(?![a-z])", re.IGNORECASE)
"""Names whose values are secret (HF_TOKEN, WANDB_API_KEY, DB_PASS, --api-key, beyond_agent.env.token); KEY
only as a word of its own (not `keyword`), TOKEN not followed by more letters (not `max_tokens_per_turn` or
`TOKENIZERS_PARALLELISM`, whose values were hidden)."""
HIDDEN = "***"
MIN_SECRET_LENGTH = 4
URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][\w+.-]*://[^\s/:@]+):(?P<password>[^\s@/]+)@")
"""scheme://user:password@host: the password part."""


@dataclass(frozen=True)
class Redactor:
    """Replaces a run's secret values (and URL passwords) with `***` in text and in nested data."""

    secrets: frozenset[str] = frozenset()

    def text(self, text: str) -> str:
        """`text` with every known secret value and every URL password hidden."""
        for secret in sorted(self.secrets, key=len, reverse=True):  # a longer secret may contain a shorter one
            text = text.replace(secret, HIDDEN)
        return URL_PASSWORD.sub(rf"\g<head>:{HIDDEN}@", text)

    def data(self, value: Any) -> Any:
        """A copy of nested dicts/lists/strings with every string redacted (`text`)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.data(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(item) for item in value]
        return value


def is_secret_name(name: str) -> bool:
    """Whether a variable, flag or config key names a secret."""
    return bool(SECRET_NAME.search(name))


def redact_by_name(values: dict[str, str]) -> dict[str, str]:
    """A mapping whose secret-named entries read `***` (empty values stay empty)."""
    return {key: HIDDEN if value and is_secret_name(key) else value for key, value in values.items()}


def secrets_in_mapping(values: dict[str, str]) -> set[str]:
    """The values of the secret-named entries."""
    return {str(value) for key, value in values.items() if value and is_secret_name(key)}


def secrets_in_arguments(arguments: Iterable[str]) -> set[str]:
    """Values given to secret-looking flags or keys: `--token z`, `--api-key=z`, `a.b.token=z`, `+x.password=z`."""
    found: set[str] = set()
    arguments = [str(argument) for argument in arguments]
    for index, argument in enumerate(arguments):
        name, joined, value = argument.partition("=")
        if joined and is_secret_name(name.rsplit(".", 1)[-1]) and value:
            found.add(value)
        elif argument.startswith("-") and is_secret_name(argument) and index + 1 < len(arguments):
            found.add(arguments[index + 1])
    return found


def secrets_in_env_file(path: str | None) -> set[str]:
    """Secret-named values of a KEY=VALUE file (a service's `env_file`), when it can be read."""
    if not path or not Path(path).is_file():
        return set()
    found = set()
    for line in Path(path).read_text(errors="replace").splitlines():
        key, joined, value = line.strip().removeprefix("export ").partition("=")
        if joined and is_secret_name(key) and value.strip().strip("'\""):
            found.add(value.strip().strip("'\""))
    return found


def collect_secrets(mappings: Iterable[dict[str, str]], commands: Iterable[Iterable[str]],
                    env_files: Iterable[str | None] = ()) -> Redactor:
    """The redactor of a run: secret values from its env mappings, its commands' arguments and env files."""
    secrets: set[str] = set()
    for mapping in mappings:
        secrets |= secrets_in_mapping(mapping)
    for command in commands:
        secrets |= secrets_in_arguments(command)
    for path in env_files:
        secrets |= secrets_in_env_file(path)
    return Redactor(frozenset(secret for secret in secrets if len(secret) >= MIN_SECRET_LENGTH))
